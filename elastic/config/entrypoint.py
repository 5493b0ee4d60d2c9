"""Client-side check of a job's entrypoint, without importing the user's code: the file exists, parses and
defines the function, whose signature fits the job's `api` (the worker resolves it for real:
elastic.worker.entrypoint)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from elastic.config.spec import JobSpec
from elastic.errors import SpecError

# What each api calls the function with, for the refusal's fix.
API_CALLS = {
    "session": "def NAME(session)",
    "ray-train": "def NAME(config) (or def NAME())",
    "transformers": "def NAME(config) (or def NAME()) returning a Trainer",
}


def check_entrypoint(spec: JobSpec, working_dir: Path, source: str | None = None) -> list[str]:
    """Client-side check, without importing user code: the file exists and defines the function, and its
    signature fits `spec.api`. `source` (the job file) starts the error line, so it names the file as every
    spec problem does. Returns warnings (lines) for what cannot be checked here."""
    try:
        return _check(spec, working_dir)
    except SpecError as err:
        raise SpecError(f"{source}: {err}" if source else str(err)) from None


def _check(spec: JobSpec, working_dir: Path) -> list[str]:
    target, name = spec.entrypoint_target, spec.entrypoint_function
    if not target.endswith(".py"):
        return _module_warnings(target)
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
    function = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if function is not None:  # an import or an assignment: its signature is known only when it runs
        _check_signature(spec.api, target, function, _uses_ray_train(tree, function))
    return []


def _check_signature(api: str, target: str, function: ast.FunctionDef, ray_train: bool) -> None:
    """The api calls the function with one argument (session: the session; ray-train: the config, or none)."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    required = len(positional) - len(args.defaults)
    required_keywords = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    takes_one = bool(positional) or args.vararg is not None
    where = f"entrypoint: {target}:{function.lineno}: {function.name}"
    call = API_CALLS[api].replace("NAME", function.name)
    if required > 1 or required_keywords:
        extra = ", ".join([a.arg for a in positional[1:required]] + required_keywords)
        raise SpecError(f"{where} also needs {extra}, which api {api} never passes; write it as {call}")
    if api == "session" and not takes_one:
        hint = " or set api: ray-train for a Ray Train function" if ray_train else ""
        raise SpecError(f"{where} takes no argument, but api session passes the session; write {call}{hint}")
    first = positional[0].arg if positional else None
    if api == "session" and ray_train and first == "config":
        raise SpecError(
            f"{where}(config) calls ray.train and takes a config: it is a Ray Train function, which api session "
            "would call with the session; set api: ray-train in the job file"
        )
    if api != "session" and first == "session":
        raise SpecError(
            f"{where}(session) takes the session, but api {api} passes the job's config; remove the api "
            f"field (api: session) or write {call}"
        )


def _uses_ray_train(tree, function: ast.FunctionDef) -> bool:
    """Does the function call into Ray Train (ray.train.X, or a name the module imported from ray.train)?"""
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("ray.train"):
                imported.update(a.asname or a.name for a in node.names)
            elif node.module == "ray":
                imported.update(a.asname or a.name for a in node.names if a.name == "train")
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id in imported:
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "ray" and node.attr == "train":
                return True
    return False


def _module_warnings(target: str) -> list[str]:
    """A module path is imported only in the job's environment; say so when it cannot be found here."""
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):  # a parent package missing, or an empty part
        found = False
    if found:
        return []
    return [
        f"entrypoint: module {target} cannot be imported here; fine if the job's runtime_env.pip installs it on "
        "the cluster, else fix the module path"
    ]


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
