"""The fenced code blocks of the user docs (README.md and docs/*.md), with the marks that classify them.

The rules (docs/development.md, "Docs that run"):

- every fence has an info string: `text` for output, `yaml`/`json`/`python` for examples, `bash` (or `sh`,
  `shell`, `console`) for shell commands;
- the line right before a shell block's opening fence is one HTML comment, its mark: `<!-- runnable -->`,
  `<!-- runnable: stack -->`, `<!-- needs: cloud -->` or `<!-- needs: gpu -->`;
- a runnable block may carry `<!-- expect: TEXT -->` lines right above its mark: TEXT must appear in a line of
  the block's combined output (see `Block.missing_expectations`).

A `runnable` block runs in a fresh bash whose current directory is the repository root and whose PATH starts with
`.venv/bin`, against the stack `elastic local up` made; a `runnable: stack` block starts (or stops) a stack
itself, so it runs separately, on a stack of its own.

This module only parses; tests/unit/docs checks the rules, and an integration test may import it to run the
runnable blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SHELL_INFOS = frozenset({"bash", "sh", "shell", "console"})
RUNNABLE = "runnable"
RUNNABLE_STACK = "runnable: stack"
NEEDS_CLOUD = "needs: cloud"
NEEDS_GPU = "needs: gpu"
MARKS = (RUNNABLE, RUNNABLE_STACK, NEEDS_CLOUD, NEEDS_GPU)
EXPECT_PREFIX = "expect:"

_FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block. `comments` are the bodies of the whole-line HTML comments directly above its opening
    fence (top to bottom, no blank line between them and the fence)."""

    path: Path
    line: int  # 1-based line of the opening fence
    info: str  # the info string's first word ('' when the fence has none)
    comments: tuple[str, ...]
    text: str  # the block's content, without the fences
    root: Path = ROOT  # where names in `where` start

    @property
    def where(self) -> str:
        """file:line, the file relative to the root where it is inside it."""
        try:
            name = self.path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            name = str(self.path)
        return f"{name}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.info in SHELL_INFOS

    @property
    def mark(self) -> str | None:
        """The comment on the line right before the fence, unless it is an expect line (or there is none)."""
        if not self.comments or self.comments[-1].startswith(EXPECT_PREFIX):
            return None
        return self.comments[-1]

    @property
    def expect(self) -> tuple[str, ...]:
        """The texts of the `<!-- expect: TEXT -->` comments above the mark."""
        return tuple(c[len(EXPECT_PREFIX) :].strip() for c in self.comments if c.startswith(EXPECT_PREFIX))

    @property
    def runnable(self) -> bool:
        return self.mark in (RUNNABLE, RUNNABLE_STACK)

    @property
    def needs_own_stack(self) -> bool:
        return self.mark == RUNNABLE_STACK

    def missing_expectations(self, output: str) -> list[str]:
        """The expect texts that appear in no line of `output` (the block's stdout and stderr together)."""
        lines = output.splitlines()
        return [want for want in self.expect if not any(want in line for line in lines)]


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced code block of one Markdown file, in order. An unclosed fence runs to the end of the file, as
    CommonMark reads it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence = opening["fence"]
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        comments: list[str] = []
        j = i - 1
        while j >= 0 and (comment := _COMMENT.match(lines[j])):
            comments.insert(0, comment["body"])
            j -= 1
        info = opening["info"].strip().split(maxsplit=1)
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                info=info[0].lower() if info else "",
                comments=tuple(comments),
                text="\n".join(lines[i + 1 : end]) + ("\n" if end > i + 1 else ""),
                root=root,
            )
        )
        i = end + 1
    return blocks


def all_blocks(root: Path = ROOT) -> list[Block]:
    """Every fenced block of README.md and docs/*.md."""
    return [block for path in doc_files(root) for block in parse(path, root)]


def shell_blocks(root: Path = ROOT) -> list[Block]:
    return [block for block in all_blocks(root) if block.is_shell]


def runnable_blocks(root: Path = ROOT, own_stack: bool | None = None) -> list[Block]:
    """The runnable shell blocks: all of them, or only those that need a stack of their own (own_stack=True), or
    only those that run on the shared one (own_stack=False)."""
    return [
        block
        for block in shell_blocks(root)
        if block.runnable and (own_stack is None or block.needs_own_stack == own_stack)
    ]
