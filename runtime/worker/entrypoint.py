"""Resolve a training entrypoint, ``path/to/train.py:function`` or ``package.module:function``."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from phalanx.configs.errors import ConfigError


def resolve_path(entrypoint: str, base_dir: Path) -> str:
    """Make a file entrypoint absolute (relative to ``base_dir``); modules stay as they are."""
    target, _, function = entrypoint.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute():
            path = (base_dir / path).resolve()
        if not path.is_file():
            raise ConfigError("job.entrypoint", f"file {str(path)!r} does not exist",
                              "give a path relative to the directory you launch from")
        return f"{path}:{function}"
    return entrypoint


def load_entrypoint(entrypoint: str) -> Callable[..., object]:
    """Import the entrypoint's module and return its function; raises ``ConfigError``. A
    file entrypoint's folder goes on ``sys.path`` first, so the script imports its
    sibling modules as it would when run with ``python file.py``."""
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
