"""Every relative link and image of README.md and docs/*.md resolves to a file of the repository, and every
#anchor to a heading of its target (GitHub's slugs); docs/index.md links every page of the guide."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.unit.docs.blocks import ROOT, doc_files

_FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>[^\s>]+)>?", re.MULTILINE)
_HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"(?P<target>[^\"]*)\"", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)=\"(?P<id>[^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def without_fences(text: str) -> str:
    """The text with its fenced blocks blanked out (their lines kept, empty)."""
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        match = _FENCE_LINE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines[i] = ""
        elif fence is not None:
            if (
                match
                and match.group(1)[0] == fence[0]
                and len(match.group(1)) >= len(fence)
                and not line.strip(fence[0] + " \t")
            ):
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def prose(text: str) -> str:
    """The text with fenced blocks and code spans blanked out (newlines kept, so offsets keep their lines)."""
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), without_fences(text))


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link, image and reference definition outside code."""
    text = prose(path.read_text(encoding="utf-8"))
    found = []
    for pattern in (_INLINE_LINK, _REFERENCE, _HTML_LINK):
        for match in pattern.finditer(text):
            found.append((text.count("\n", 0, match.start("target")) + 1, match["target"]))
    return sorted(found)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered, lowercased, punctuation but '-' and '_' dropped, each
    space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a Markdown file offers: its headings' slugs (repeats get -1, -2, ...) and HTML ids."""
    text = without_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in text.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            slug = github_slug(heading["text"])
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    found.update(m["id"] for m in _HTML_ANCHOR.finditer(text))
    return frozenset(found)


def link_problems(root: Path = ROOT) -> list[str]:
    """One line per broken link, naming file:line and the target."""
    problems = []
    root = root.resolve()
    for path in doc_files(root):
        name = path.relative_to(root).as_posix()
        for line, target in links(path):
            where = f"{name}:{line}: {target or '(empty)'}"
            if _SCHEME.match(target) or target.startswith("//"):
                continue  # http(s), mailto: not checked here
            if not target:
                problems.append(f"{where}: empty link")
                continue
            file_part, _, anchor = target.partition("#")
            if file_part.startswith("/"):
                problems.append(f"{where}: absolute path; link relative to {name}")
                continue
            resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
            if resolved != root and root not in resolved.parents:
                problems.append(f"{where}: points outside the repository")
                continue
            if not resolved.exists():
                problems.append(f"{where}: no such file {resolved.relative_to(root).as_posix()}")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading #{anchor} in {resolved.relative_to(root).as_posix()}")
    return problems


def index_problems(root: Path = ROOT) -> list[str]:
    """The pages of docs/ that docs/index.md does not link."""
    index = root / "docs" / "index.md"
    if not index.exists():
        return ["docs/index.md: missing"]
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index) if target}
    return [
        f"docs/index.md: does not link docs/{page.name}"
        for page in sorted((root / "docs").glob("*.md"))
        if page.name != "index.md" and page.resolve() not in linked
    ]


def test_every_relative_link_resolves():
    problems = link_problems()
    assert not problems, "\n".join(problems)


def test_the_index_links_every_page():
    problems = index_problems()
    assert not problems, "\n".join(problems)


def test_the_docs_have_links():
    assert sum(len(links(path)) for path in doc_files()) > 50


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Will it fit? Checked at submit", "will-it-fit-checked-at-submit"),
        ("gpu_share: auto", "gpu_share-auto"),
        ("Spot-first", "spot-first"),
        ("Models DDP cannot hold: FSDP2", "models-ddp-cannot-hold-fsdp2"),
        ("`elastic report` and the [ledger](x.md)", "elastic-report-and-the-ledger"),
        (
            "Bring your own loop: Ray Train functions and Hugging Face Trainer",
            "bring-your-own-loop-ray-train-functions-and-hugging-face-trainer",
        ),
        ("A & B", "a--b"),
    ],
)
def test_github_slugs(heading, slug):
    assert github_slug(heading) == slug


# The checks themselves, on small doc trees with one thing wrong each.


def write_docs(root: Path, readme: str, pages: dict[str, str]) -> Path:
    (root / "docs").mkdir()
    (root / "README.md").write_text(readme, encoding="utf-8")
    for name, text in pages.items():
        (root / "docs" / name).write_text(text, encoding="utf-8")
    return root


PAGES = {
    "index.md": "# Guide\n\n- [a](a.md)\n- [b](b.md)\n",
    "a.md": "# A\n\n## Verify resume\n\n## Verify resume\n\nSee [b](b.md#b-and-c) and [up](#a).\n",
    "b.md": "# B and `c`\n\n![plot](plot.png)\n\n```text\n[not a link](missing.md)\n```\n\nAnd `[nor this](missing.md)`.\n",
}


def test_a_good_tree_passes(tmp_path):
    root = write_docs(tmp_path, "# x\n\n[a](docs/a.md#verify-resume-1) [web](https://example.com)\n", PAGES)
    (root / "docs" / "plot.png").write_bytes(b"")
    assert link_problems(root) == []
    assert index_problems(root) == []


@pytest.mark.parametrize(
    ("readme", "problem"),
    [
        ("[gone](docs/gone.md)", "README.md:3: docs/gone.md: no such file docs/gone.md"),
        (
            "[a](docs/a.md#verify-resume-2)",
            "README.md:3: docs/a.md#verify-resume-2: no heading #verify-resume-2 in docs/a.md",
        ),
        ("[a](docs/a.md#Verify-Resume)", "README.md:3: docs/a.md#Verify-Resume: no heading"),
        ("![pic](docs/pic.png)", "README.md:3: docs/pic.png: no such file"),
        ("[self](#nowhere)", "README.md:3: #nowhere: no heading #nowhere in README.md"),
        ("[out](../elsewhere/README.md)", "README.md:3: ../elsewhere/README.md: points outside the repository"),
        ("[ref]\n\n[ref]: docs/nope.md", "README.md:5: docs/nope.md: no such file"),
    ],
)
def test_a_broken_link_is_named(tmp_path, readme, problem):
    (tmp_path / "repo").mkdir()
    root = write_docs(tmp_path / "repo", "# x\n\n" + readme + "\n", PAGES)
    (root / "docs" / "plot.png").write_bytes(b"")
    problems = link_problems(root)
    assert any(p.startswith(problem) for p in problems), problems


def test_a_page_missing_from_the_index_is_named(tmp_path):
    root = write_docs(tmp_path, "# x\n", {**PAGES, "c.md": "# C\n"})
    (root / "docs" / "plot.png").write_bytes(b"")
    assert index_problems(root) == ["docs/index.md: does not link docs/c.md"]
