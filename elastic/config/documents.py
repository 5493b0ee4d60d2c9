"""Reading the YAML files users hand us (job, sweep and cluster configs) without being hurt by them.

A file that is not UTF-8, too large, nested too deeply, or a YAML alias bomb ("billion laughs": a few lines whose
aliases expand to billions of nodes) becomes one error line naming the file and the fix, raised as the caller's
`UserError` class. The alias check counts what the document would expand to on the composed node graph, where
an alias is one shared node, so a bomb is refused before anything expands it (json.dumps, pydantic, our
override merge would).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from elastic.errors import SpecError, UserError

MAX_DOCUMENT_BYTES = 1 << 20  # 1 MiB: a spec or cluster config is a page of YAML; data belongs in files it names
MAX_EXPANDED_NODES = 100_000  # far above any real config, far below what hurts memory or time


def read_document(path: Path, what: str, error: type[UserError] = SpecError) -> str:
    """The text of a user's file: exists, is at most MAX_DOCUMENT_BYTES, and is UTF-8."""
    try:
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise error(
                f"{path}: {size / 2**20:.1f} MiB is too large for a {what} (limit {MAX_DOCUMENT_BYTES >> 20} MiB); "
                "keep data in files the job reads, not in the YAML"
            )
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such {what}; check the path") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; give the path of a {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read {what} ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); "
            f"save the {what} as UTF-8"
        ) from None


def load_yaml(text: str, source: str, error: type[UserError] = SpecError) -> tuple[Any, yaml.Node | None]:
    """YAML text -> (the data, its composed node tree for line numbers); every problem one `error` line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_expansion(root, source, error)
        return yaml.safe_load(text), root
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(err, "problem", None) or (str(err).splitlines() or ["unreadable"])[0]
        raise error(f"{where}: not valid YAML ({problem}); fix the syntax") from None
    except RecursionError:
        raise error(f"{source}: nested too deeply to be a config; flatten it") from None


def _check_expansion(root: yaml.Node | None, source: str, error: type[UserError]) -> None:
    sizes: dict[int, int] = {}  # id(node) -> nodes it expands to; an alias is the same node object again
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise error(
                f"{source}:{node.start_mark.line + 1}: a YAML alias refers to its own anchor; write the value out"
            )
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:
                raise error(
                    f"{source}: expands to over {MAX_EXPANDED_NODES:,} YAML values (an alias bomb?); "
                    "use fewer aliases and keep data in files the job reads"
                )
        on_path.discard(key)
        sizes[key] = total
        return total

    if root is not None:
        size(root)
