"""Every shell block of the docs says whether it runs here, on a stack of its own, or needs a cloud or a GPU;
the README stays short; no page points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.docs.blocks import (
    EXPECT_PREFIX,
    MARKS,
    ROOT,
    RUNNABLE_STACK,
    all_blocks,
    doc_files,
    parse,
    runnable_blocks,
)

README_MAX_LINES = 200
MARK_HINT = " or ".join(f"<!-- {mark} -->" for mark in MARKS)
# Commands that start or stop a local stack: a block holding one runs on a stack of its own.
STACK_COMMANDS = re.compile(r"\belastic local (up|down)\b|\bmake (demo|down)\b")
_COMMENT_LINE = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")
_FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})")


def block_problems(root: Path = ROOT) -> list[str]:
    """One line per broken rule, each naming file:line."""
    problems = []
    for block in all_blocks(root):
        if not block.info:
            problems.append(f"{block.where}: fenced block without an info string (text for output, bash for commands)")
            continue
        marks = [c for c in block.comments if not c.startswith(EXPECT_PREFIX)]
        if not block.is_shell:
            if marks or block.expect:
                problems.append(f"{block.where}: a {block.info} block takes no mark (only shell blocks do)")
            continue
        if not marks:
            problems.append(f"{block.where}: shell block is neither runnable nor needs: cloud/gpu; put {MARK_HINT}")
            continue
        if len(marks) > 1:
            problems.append(f"{block.where}: shell block has {len(marks)} marks ({', '.join(marks)}); keep exactly one")
            continue
        if block.mark is None:
            problems.append(f"{block.where}: the mark ({marks[0]}) must be on the line right before the fence")
            continue
        if block.mark not in MARKS:
            problems.append(f"{block.where}: unknown mark <!-- {block.mark} -->; use {MARK_HINT}")
            continue
        if block.expect and not block.runnable:
            problems.append(f"{block.where}: expect lines belong to runnable blocks only")
        if any(not want for want in block.expect):
            problems.append(f"{block.where}: an empty expect line")
        if block.runnable and not block.needs_own_stack and STACK_COMMANDS.search(block.text):
            problems.append(f"{block.where}: starts or stops a stack: mark it <!-- {RUNNABLE_STACK} -->")
    return problems


def stray_mark_problems(root: Path = ROOT) -> list[str]:
    """Mark and expect comments that classify no fence (a blank line or text between them and the block)."""
    problems = []
    for path in doc_files(root):
        lines = path.read_text(encoding="utf-8").splitlines()
        fenced = False
        for number, line in enumerate(lines, 1):
            if _FENCE_LINE.match(line):
                fenced = not fenced
                continue
            comment = _COMMENT_LINE.match(line)
            if fenced or not comment:
                continue
            body = comment["body"]
            if body not in MARKS and not body.startswith(EXPECT_PREFIX):
                continue
            following = number  # index of the next line
            while following < len(lines) and _COMMENT_LINE.match(lines[following]):
                following += 1
            if following >= len(lines) or not _FENCE_LINE.match(lines[following]):
                problems.append(f"{path.relative_to(root).as_posix()}:{number}: <!-- {body} --> is not above a fence")
    return problems


def test_every_shell_block_is_marked_once():
    problems = block_problems()
    assert not problems, "\n".join(problems)


def test_no_mark_is_stray():
    problems = stray_mark_problems()
    assert not problems, "\n".join(problems)


def test_there_are_runnable_blocks():
    assert runnable_blocks(own_stack=False), "no runnable block on the shared stack"
    assert runnable_blocks(own_stack=True), "no block that brings up a stack of its own"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md: {len(lines)} lines, over {README_MAX_LINES}; move it to docs/"


def test_no_doc_points_outside_the_repository():
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{number}"
        for path in doc_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "../shared" in line
    ]
    assert hits == [], f"'../shared' in {hits}: the docs must stand alone"


# The checks themselves, on small doc trees with one thing wrong each.


def write_docs(root: Path, readme: str, page: str = "# Page\n") -> Path:
    (root / "docs").mkdir()
    (root / "README.md").write_text(readme, encoding="utf-8")
    (root / "docs" / "page.md").write_text(page, encoding="utf-8")
    return root


GOOD = """# x

<!-- expect: hello -->
<!-- runnable -->
```bash
echo hello
```

<!-- needs: gpu -->
```sh
nvidia-smi
```

```yaml
a: 1
```

```text
hello
```
"""


def test_a_good_tree_passes(tmp_path):
    root = write_docs(tmp_path, GOOD)
    assert block_problems(root) == []
    assert stray_mark_problems(root) == []
    blocks = parse(root / "README.md")
    assert [(b.line, b.info, b.mark, b.expect) for b in blocks] == [
        (5, "bash", "runnable", ("hello",)),
        (10, "sh", "needs: gpu", ()),
        (14, "yaml", None, ()),
        (18, "text", None, ()),
    ]
    assert blocks[0].text == "echo hello\n"
    assert blocks[0].missing_expectations("$ x\nsay hello there\n") == []
    assert blocks[0].missing_expectations("goodbye\n") == ["hello"]


@pytest.mark.parametrize(
    ("readme", "problem"),
    [
        ("```bash\nls\n```\n", "README.md:1: shell block is neither runnable nor needs: cloud/gpu"),
        ("<!-- runnable -->\n\n```bash\nls\n```\n", "README.md:3: shell block is neither runnable"),
        ("<!-- needs: tpu -->\n```bash\nls\n```\n", "README.md:2: unknown mark <!-- needs: tpu -->"),
        ("<!-- runnable -->\n<!-- needs: gpu -->\n```bash\nls\n```\n", "README.md:3: shell block has 2 marks"),
        ("<!-- runnable -->\n<!-- expect: x -->\n```bash\nls\n```\n", "README.md:3: the mark (runnable) must be"),
        ("<!-- expect: x -->\n<!-- needs: cloud -->\n```bash\nls\n```\n", "README.md:3: expect lines belong"),
        ("```\nls\n```\n", "README.md:1: fenced block without an info string"),
        ("<!-- runnable -->\n```yaml\na: 1\n```\n", "README.md:2: a yaml block takes no mark"),
        ("<!-- runnable -->\n```bash\nelastic local up\n```\n", "README.md:2: starts or stops a stack"),
    ],
)
def test_a_broken_block_is_named(tmp_path, readme, problem):
    root = write_docs(tmp_path, "# x\n\n" + readme)
    line, rest = problem.split(":", 2)[1:]
    expected = f"README.md:{int(line) + 2}:{rest}"
    assert any(p.startswith(expected) for p in block_problems(root)), block_problems(root)


def test_a_broken_block_in_a_page_is_named(tmp_path):
    root = write_docs(tmp_path, "# x\n", "# Page\n\nText.\n\n```console\n$ ls\n```\n")
    assert block_problems(root) == [
        f"docs/page.md:5: shell block is neither runnable nor needs: cloud/gpu; put {MARK_HINT}"
    ]


def test_a_stray_mark_is_named(tmp_path):
    root = write_docs(tmp_path, "# x\n\n<!-- runnable -->\n\nSome text.\n")
    assert stray_mark_problems(root) == ["README.md:3: <!-- runnable --> is not above a fence"]


def test_fences_nest_and_close_as_commonmark_says(tmp_path):
    root = write_docs(
        tmp_path,
        "# x\n\n````text\n```bash\nls\n```\n````\n\n- item\n\n  <!-- needs: cloud -->\n  ```bash\n  ray up\n  ```\n",
    )
    blocks = parse(root / "README.md")
    assert [(b.line, b.info, b.mark) for b in blocks] == [(3, "text", None), (12, "bash", "needs: cloud")]
    assert block_problems(root) == []
