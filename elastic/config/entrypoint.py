"""Client-side check of a job's entrypoint, without importing the user's code: the file exists, parses and
defines the function (the worker resolves it for real: elastic.worker.entrypoint)."""

from __future__ import annotations

import ast
from pathlib import Path

from elastic.config.spec import JobSpec
from elastic.errors import SpecError


def check_entrypoint(spec: JobSpec, working_dir: Path, source: str | None = None) -> None:
    """Client-side check, without importing user code: the file exists and defines the function. `source` (the
    job file) starts the error line, so it names the file as every spec problem does."""
    try:
        _check(spec, working_dir)
    except SpecError as err:
        raise SpecError(f"{source}: {err}" if source else str(err)) from None


def _check(spec: JobSpec, working_dir: Path) -> None:
    target, name = spec.entrypoint_target, spec.entrypoint_function
    if not target.endswith(".py"):
        return  # a module path is importable only in the job's environment; checked when the job starts
    path = working_dir / target
    if not path.is_file():
        raise SpecError(
            f"entrypoint: {target} not found under {working_dir}; fix the path or submit from the project root"
        )
    try:
        # Bytes, as Python reads a module: ast honours a coding declaration; undecodable text is a SyntaxError.
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as err:
        raise SpecError(f"entrypoint: {target}:{err.lineno}: syntax error ({err.msg}); fix the file") from None
    except ValueError as err:  # e.g. NUL bytes: not Python source at all
        raise SpecError(f"entrypoint: {target}: not Python source ({err}); fix the path") from None
    except OSError as err:
        raise SpecError(f"entrypoint: {target}: cannot read it ({err.strerror or err})") from None
    if name not in _top_level_names(tree):
        functions = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        raise SpecError(
            f"entrypoint: {target} defines no function '{name}'; functions there: {', '.join(functions) or 'none'}"
        )


def _top_level_names(tree) -> set[str]:
    """Names a module binds at top level: defs, classes, assignments and imports (any may be the entry)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names
