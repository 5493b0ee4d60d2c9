"""One-line messages for spec validation errors: pydantic's errors -> `file:line: field: problem; fix`, with the
YAML line of the field, a did-you-mean for unknown fields, and values shortened so a line stays a line."""

from __future__ import annotations

import difflib
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


def describe(
    err: ValidationError,
    model: type[BaseModel],
    root: yaml.Node | None,
    source: str,
    overrides: tuple[str, ...] | list[str] = (),
    overrides_where: str = "--set {item}",
) -> str:
    """The one line for a validation error of `model` read from `source` (its composed YAML `root` gives the
    line); a field set by an override is named as `overrides_where` says ({item}: FIELD=VALUE, {field}: FIELD)."""
    # A misspelled required field yields "missing" and "unknown field" errors: the typo is the useful one.
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    kind = first["type"]
    dotted = ".".join(_key(p) for p in loc) or "(root)"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(model, loc[:-1])
        line = _line_of(root, loc, key=True)
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = f"did you mean '{hint[0]}'?" if hint else f"allowed here: {', '.join(allowed)}"
        message = f"{dotted}: unknown field; {fix}"
    elif kind == "missing":
        line = _line_of(root, loc[:-1], key=False)
        message = f"{dotted}: required field is missing; add `{loc[-1]}:` to the file"
    else:
        line = _line_of(root, loc, key=False)
        got = first.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {_shorten(repr(got))})"
        text = PATTERN_HINTS.get(first["type"] == "string_pattern_mismatch" and str(loc[-1]), None) or first[
            "msg"
        ].removeprefix("Value error, ")
        fix = _FIXES.get(kind, "")
        message = f"{dotted}: {_shorten(text, 200)}{shown}{fix}"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    overridden = [
        o
        for o in overrides
        if dotted == o.partition("=")[0].strip() or dotted.startswith(o.partition("=")[0].strip() + ".")
    ]
    if overridden:
        item = overridden[-1]
        where = overrides_where.format(item=item, field=item.partition("=")[0].strip())
    else:
        where = f"{source}:{line}" if line else source
    return f"{where}: {message}{more}"


_FIXES = {  # pydantic's message says what is wrong; this says what to do
    "less_than_equal": "; lower it",
    "less_than": "; lower it",
    "greater_than_equal": "; raise it",
    "greater_than": "; raise it",
}


def _key(part) -> str:
    """One step of a field path as the error line shows it: a key with a newline or a control character in it is
    quoted, so the line stays one line."""
    text = str(part)
    return _shorten(text if text.isprintable() and text.strip() == text else repr(text), 40)


def _shorten(text: str, limit: int = 60) -> str:
    """A value as the error line shows it: a 5,000-character value must not become a 5,000-character line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


PATTERN_HINTS = {
    "name": "use lowercase letters, digits, '.', '_' or '-' (up to 63), starting with a letter or digit",
    "entrypoint": "use path/to/file.py:function or package.module:function",
}


def _allowed_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    current: Any = model
    for part in loc:
        if typing.get_origin(current) is dict:  # dict[str, Model] (a sweep's space): `part` is a key
            current = typing.get_args(current)[1]
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
    return list(getattr(current, "model_fields", {}).keys())


def _line_of(root: yaml.Node | None, loc: tuple, key: bool) -> int | None:
    """1-based line of the node at `loc` (the key's line when key=True); the nearest parent's if absent."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                return line
            node = match[1]
            line = (match[0] if key else match[1]).start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
