"""What every cluster-config check returns (`Problem`: the key and the fix) and the helpers the checks share."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

_ENV_ASSIGNMENT = re.compile(r"(?<![\w$.-])([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|[^\s;&|'\"]*)")


@dataclass(frozen=True)
class Problem:
    key: str  # dotted path into the file, e.g. available_node_types.gpu_spot.node_config.InstanceType
    message: str  # what is wrong and the fix, one line

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def unique(problems: list[Problem]) -> list[Problem]:
    """Drop repeats (a command shared by several node types is reported once), keeping the order."""
    return list(dict.fromkeys(problems))


def env_assignments(command: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).strip("'\"")) for m in _ENV_ASSIGNMENT.finditer(command)]


def key_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def one_line(text: str) -> str:
    return " ".join(text.split())


def suggest(value: Any, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
