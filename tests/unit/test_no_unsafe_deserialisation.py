"""The no-pickle rule, enforced: an ``ast`` scan of the project's Python for every way to turn
untrusted bytes into code or arbitrary objects (pickle and its relatives, ``torch.load``
without ``weights_only=True``, ``yaml.load`` without a safe loader, ``numpy.load`` with
``allow_pickle=True``, ``eval``/``exec``). Ray's own pickling of actor calls is Ray's
boundary: phalanx passes only plain values and byte buffers across it.

The scanner resolves import aliases (``import pickle as p``, ``from yaml import load``) so a
renamed import does not hide a call; comments and strings are never flagged.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCANNED_DIRS = ("runtime", "launcher", "recovery", "spares", "configs", "examples", "bench",
                "tests")
SCANNED_FILES = ("__init__.py",)

# Any call to these (after alias resolution) deserialises arbitrary objects.
UNSAFE_CALLS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
    "_pickle.Unpickler", "cPickle.load", "cPickle.loads", "cPickle.Unpickler",
    "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads",
    "ray.cloudpickle.load", "ray.cloudpickle.loads", "marshal.load", "marshal.loads",
    "shelve.open", "shelve.Shelf", "shelve.DbfilenameShelf", "jsonpickle.decode",
    "pandas.read_pickle", "joblib.load", "copyreg.constructor",
    "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
    "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader", "yaml.CLoader",
    "yaml.CUnsafeLoader", "yaml.CFullLoader", "builtins.eval", "builtins.exec",
}
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
                  "jsonpickle", "ray.cloudpickle"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader",
                     "yaml.CBaseLoader"}
LOADER_NAMES = {"load", "loads", "Unpickler", "open", "decode"}


class _Scanner(ast.NodeVisitor):
    """Collects ``(line, message)`` for each unsafe deserialisation in one module."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.findings: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = full
            if full in UNSAFE_CALLS or (module in UNSAFE_MODULES and alias.name in LOADER_NAMES):
                self.findings.append((node.lineno, f"imports the deserialiser {full}"))
        self.generic_visit(node)

    def _name(self, node: ast.expr) -> str | None:
        """The dotted name a call target resolves to, through import aliases."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        head = self.aliases.get(node.id, node.id)
        return ".".join([head, *reversed(parts)])

    def visit_Call(self, node: ast.Call) -> None:
        name = self._name(node.func)
        if name is not None:
            problem = self._problem(name, node)
            if problem:
                self.findings.append((node.lineno, problem))
        self.generic_visit(node)

    def _problem(self, name: str, call: ast.Call) -> str | None:
        keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        if name in ("eval", "exec") and name not in self.aliases:
            return f"calls the builtin {name}()"
        if name in UNSAFE_CALLS:
            if self._round_trip(name, call):
                return None
            return f"calls {name}()"
        if name in ("__import__", "importlib.import_module") and call.args \
                and isinstance(call.args[0], ast.Constant) and call.args[0].value in UNSAFE_MODULES:
            return f"imports {call.args[0].value} dynamically"
        if name == "torch.load" and not _is_true(keywords.get("weights_only")):
            return "calls torch.load() without weights_only=True"
        if name == "numpy.load" and "allow_pickle" in keywords \
                and not _is_false(keywords["allow_pickle"]):
            return "calls numpy.load() with allow_pickle"
        if name in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader", call.args[1] if len(call.args) > 1 else None)
            if loader is None or self._name(loader) not in SAFE_YAML_LOADERS:
                return f"calls {name}() without Loader=SafeLoader/CSafeLoader"
        return None


    def _round_trip(self, name: str, call: ast.Call) -> bool:
        """``pickle.loads(pickle.dumps(x))``: the bytes never left this process (tests use it
        to show that errors cross Ray), so nothing untrusted is deserialised."""
        if not name.endswith(".loads") or len(call.args) != 1 or call.keywords:
            return False
        inner = call.args[0]
        return isinstance(inner, ast.Call) and \
            self._name(inner.func) == name.removesuffix("loads") + "dumps"


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def scan_source(text: str, filename: str = "<snippet>") -> list[tuple[int, str]]:
    """Every unsafe deserialisation in ``text``, as (line, message)."""
    scanner = _Scanner()
    scanner.visit(ast.parse(text, filename=filename))
    return scanner.findings


def project_files() -> list[Path]:
    files = [REPO / name for name in SCANNED_FILES if (REPO / name).exists()]
    for folder in SCANNED_DIRS:
        files += sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return files


@pytest.mark.timeout(60)
def test_no_unsafe_deserialisation_anywhere_in_the_project() -> None:
    files = project_files()
    assert len(files) > 100     # the walk found the project, not an empty folder
    found = [f"{path.relative_to(REPO)}:{line}: {message}"
             for path in files
             for line, message in scan_source(path.read_text(encoding="utf-8"), str(path))]
    assert found == [], "unsafe deserialisation (see DESIGN.md, no pickle):\n" + "\n".join(found)


FLAGGED = {
    "pickle.loads": "import pickle\npickle.loads(b'x')\n",
    "pickle.load": "import pickle\nwith open('f', 'rb') as fh:\n    pickle.load(fh)\n",
    "pickle alias": "import pickle as p\np.loads(data)\n",
    "round trip of other bytes": "import pickle\npickle.loads(pickle.dumps(x) + tail)\n",
    "round trip through marshal": "import pickle, marshal\npickle.loads(marshal.dumps(x))\n",
    "from pickle import": "from pickle import loads\n",
    "from pickle import as": "from pickle import loads as safe_looking\nsafe_looking(b'')\n",
    "Unpickler": "import pickle\npickle.Unpickler(fh).load()\n",
    "cPickle": "import cPickle\ncPickle.loads(data)\n",
    "_pickle": "import _pickle\n_pickle.loads(data)\n",
    "dill": "import dill\ndill.loads(data)\n",
    "cloudpickle": "import cloudpickle\ncloudpickle.loads(data)\n",
    "ray.cloudpickle": "import ray.cloudpickle\nray.cloudpickle.loads(data)\n",
    "marshal": "import marshal\nmarshal.loads(code)\n",
    "shelve": "import shelve\nshelve.open('db')\n",
    "torch.load bare": "import torch\ntorch.load('x.pt')\n",
    "torch.load False": "import torch\ntorch.load('x.pt', weights_only=False)\n",
    "torch.load variable": "import torch\ntorch.load('x.pt', weights_only=flag)\n",
    "torch.load from-import": "from torch import load\nload('x.pt')\n",
    "yaml.load bare": "import yaml\nyaml.load(text)\n",
    "yaml.load Loader": "import yaml\nyaml.load(text, Loader=yaml.Loader)\n",
    "yaml.load positional unsafe": "import yaml\nyaml.load(text, yaml.UnsafeLoader)\n",
    "yaml.load_all": "import yaml\nyaml.load_all(text)\n",
    "yaml.unsafe_load": "import yaml\nyaml.unsafe_load(text)\n",
    "yaml.full_load": "import yaml\nyaml.full_load(text)\n",
    "yaml.Loader()": "import yaml\nyaml.Loader(text).get_single_data()\n",
    "from yaml import load": "from yaml import load\nload(text)\n",
    "numpy allow_pickle": "import numpy as np\nnp.load('a.npy', allow_pickle=True)\n",
    "eval": "eval(user_text)\n",
    "exec": "exec(compile(src, 'f', 'exec'))\n",
    "builtins.eval": "import builtins\nbuiltins.eval('1')\n",
    "__import__": "m = __import__('pickle')\n",
    "import_module": "import importlib\nimportlib.import_module('marshal')\n",
}

ALLOWED = {
    "comment": "# pickle.loads(data) would be unsafe\nx = 1\n",
    "string": "HINT = 'never call pickle.loads or torch.load'\n",
    "pickle.dumps": "import pickle\npickle.dumps(obj)\n",
    "in-process round trip": "import pickle\nagain = pickle.loads(pickle.dumps(error))\n",
    "torch.load weights_only": "import torch\ntorch.load('x.pt', weights_only=True)\n",
    "yaml.safe_load": "import yaml\nyaml.safe_load(text)\n",
    "yaml.load SafeLoader": "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)\n",
    "yaml.load CSafeLoader": "import yaml\nyaml.load(text, Loader=yaml.CSafeLoader)\n",
    "yaml.load from-import loader": "import yaml\nfrom yaml import SafeLoader\n"
                                    "yaml.load(text, Loader=SafeLoader)\n",
    "yaml.SafeLoader()": "import yaml\nyaml.SafeLoader(text).get_single_node()\n",
    "json": "import json\njson.loads(text)\n",
    "safetensors": "import safetensors.torch\nsafetensors.torch.load(data)\n",
    "numpy load plain": "import numpy as np\nnp.load('a.npy')\n",
    "numpy allow_pickle False": "import numpy as np\nnp.load('a.npy', allow_pickle=False)\n",
    "method named eval": "model.eval()\nmodule.exec()\n",
    "method named load": "state.load(fh)\nself.loads(x)\n",
    "shadowed eval": "from mylib import eval\neval('x')\n",
}


@pytest.mark.parametrize("snippet", FLAGGED.values(), ids=FLAGGED.keys())
def test_scanner_flags_unsafe_snippets(snippet: str) -> None:
    assert scan_source(snippet), f"not flagged:\n{snippet}"


@pytest.mark.parametrize("snippet", ALLOWED.values(), ids=ALLOWED.keys())
def test_scanner_allows_safe_snippets(snippet: str) -> None:
    assert scan_source(snippet) == []


def test_scanner_reports_the_line() -> None:
    assert scan_source("import yaml\n\n\nyaml.load(t)\n") == [
        (4, "calls yaml.load() without Loader=SafeLoader/CSafeLoader")]
