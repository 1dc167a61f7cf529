"""Resolve a training entrypoint: a script ``path/to/train.py`` (run as ``__main__``), or a
function ``path/to/train.py:function`` or ``package.module:function``."""
from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import runpy
import sys
from pathlib import Path
from typing import Callable

from phalanx.configs.errors import ConfigError


def is_script(entrypoint: str) -> bool:
    """A script entrypoint (``train.py``, run as ``__main__``), not ``file.py:function``."""
    return entrypoint.endswith(".py")


def entry_source(entrypoint: str) -> str:
    """The source text of the entrypoint's file (a script, ``file.py:fn`` or the module of
    ``module:fn``); "" when it cannot be found or read."""
    path = entrypoint if is_script(entrypoint) else entrypoint.rpartition(":")[0]
    if not path.endswith(".py"):
        try:
            spec = importlib.util.find_spec(path)
        except (ImportError, ValueError):
            return ""
        path = spec.origin if spec is not None and spec.origin else ""
    try:
        return Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""


def resolve_path(entrypoint: str, base_dir: Path) -> str:
    """Make a file entrypoint absolute (relative to ``base_dir``); modules stay as they are."""
    target, _, function = entrypoint.rpartition(":")
    if is_script(entrypoint):
        target, function = entrypoint, ""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute():
            path = (base_dir / path).resolve()
        if not path.is_file():
            raise ConfigError("job.entrypoint", f"file {str(path)!r} does not exist",
                              "give a path relative to the directory you launch from")
        return f"{path}:{function}" if function else str(path)
    return entrypoint


def script_runner(path: str) -> Callable[..., object]:
    """Run ``path`` as ``__main__`` with ``argv`` as ``sys.argv[1:]``, like ``python path``
    (its folder first on ``sys.path``); returns None. A ``SystemExit(0)`` (argparse's
    ``--help``, an explicit ``sys.exit()``) is a normal end."""
    def run(argv: list[str] | None = None) -> object:
        folder = str(Path(path).resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        saved = sys.argv
        sys.argv = [path, *(argv or [])]
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        finally:
            sys.argv = saved
        return None
    return run


def load_entrypoint(entrypoint: str) -> Callable[..., object]:
    """Import the entrypoint's module and return its function; raises ``ConfigError``. A
    file entrypoint's folder goes on ``sys.path`` first, so the script imports its
    sibling modules as it would when run with ``python file.py``."""
    if is_script(entrypoint):
        if not Path(entrypoint).is_file():
            raise ConfigError("job.entrypoint", f"script {entrypoint!r} does not exist",
                              "give a path relative to the directory you launch from")
        return script_runner(entrypoint)
    target, _, function = entrypoint.rpartition(":")
    if not target or not function:
        raise ConfigError("job.entrypoint", f"{entrypoint!r} is not 'file.py:fn' or 'module:fn'",
                          "e.g. examples/train_mlp.py:main")
    if target.endswith(".py"):
        name = "phalanx_entry_" + hashlib.sha1(target.encode()).hexdigest()[:12]
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, target)
            if spec is None or spec.loader is None:
                raise ConfigError("job.entrypoint", f"cannot load {target!r}", "check the path")
            module = importlib.util.module_from_spec(spec)
            folder = str(Path(target).resolve().parent)
            if folder not in sys.path:  # as `python file.py` does: siblings import by name
                sys.path.insert(0, folder)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError("job.entrypoint", f"module {target!r} cannot be imported: {exc}",
                              "install it or put it on PYTHONPATH") from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError("job.entrypoint", f"{target!r} has no function {function!r}",
                          "name a function defined at module level")
    return fn


def check_entrypoint(entrypoint: str, as_written: str = "") -> None:
    """Refuse, before anything starts, an entrypoint whose function its file does not
    define: read statically (the source is parsed, never imported or run). A file
    entrypoint must already be resolved (``resolve_path``; ``as_written`` is the config's
    text, for the hint); a ``module:function`` one is checked when the module's source can
    be found without importing it (else the worker's import reports it). Raises
    ``ConfigError`` (key ``job.entrypoint``) naming the file, the function and the nearest
    top-level functions it does define."""
    if is_script(entrypoint):      # a script: it must parse
        target, function = entrypoint, ""
    else:
        target, _, function = entrypoint.rpartition(":")
    if target.endswith(".py"):
        path: Path | None = Path(target)
    else:
        path = _module_source(target)
    if path is None or not path.is_file():
        return
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as exc:
        lineno = getattr(exc, "lineno", None)
        line = f" line {lineno}" if lineno else ""
        raise ConfigError("job.entrypoint", f"{str(path)!r} does not parse:{line} "
                          f"{getattr(exc, 'msg', exc)}", "fix the script's syntax") from None
    names = _top_level_names(tree)
    if not function or names is None or function in names:    # a star import or __getattr__: cannot tell
        return
    functions = [n for n, kind in names.items() if kind == "function"]
    close = difflib.get_close_matches(function, functions, n=3)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}? " if close else "") + (
        f"{path.name} defines {', '.join(sorted(functions))}" if functions
        else f"{path.name} defines no function at its top level") + (
        f"; write job.entrypoint as '{(as_written or entrypoint).rpartition(':')[0]}:NAME'")
    raise ConfigError("job.entrypoint", f"{str(path)!r} has no top-level function "
                      f"{function!r}", hint)


def _module_source(module: str) -> Path | None:
    """The source file of ``a.b.c`` found the way import would find it, without importing
    anything (not even its parent packages); None when not found or not Python source."""
    if module in sys.modules:
        origin = getattr(sys.modules[module], "__file__", None)
        return Path(origin) if origin and origin.endswith(".py") else None
    search: list[str] | None = None
    spec = None
    for depth, part in enumerate(module.split(".")):
        try:     # a top-level name through every finder (finding imports nothing)
            spec = (importlib.util.find_spec(part) if depth == 0 else
                    importlib.machinery.PathFinder.find_spec(part, search))
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(tree: ast.Module) -> dict[str, str] | None:
    """Names a module binds at its top level (``function`` for a def, else ``name``),
    looking into if/try/with blocks; None when a star import, a module ``__getattr__``,
    ``globals()`` or ``exec`` makes the set unknowable."""
    names: dict[str, str] = {}
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = "function"
        elif isinstance(node, ast.ClassDef):
            names[node.name] = "name"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.setdefault((alias.asname or alias.name).split(".")[0], "name")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor,
                               ast.With, ast.AsyncWith)):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For,
                                                          ast.AsyncFor)) else
                       [item.optional_vars for item in node.items if item.optional_vars])
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.setdefault(sub.id, "name")
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor,
                             ast.While)) or type(node).__name__ == "TryStar":
            for field in ("body", "orelse", "finalbody"):
                body.extend(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.NamedExpr):
            names.setdefault(node.value.target.id, "name")
    dynamic = any(isinstance(n, ast.Name) and n.id in ("globals", "exec") for n in ast.walk(tree))
    if "__getattr__" in names or dynamic:      # names made at run time
        return None
    return names
