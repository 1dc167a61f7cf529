"""The distribution: the repository root installs as the one package ``phalanx`` (pyproject's
package-dir), with its data files, the optional native fused-copy kernel and the license, and
nothing else (no tests/, bench/, examples/) lands in site-packages.

The wheels are built from a copy of the source tree (what a fresh clone holds, without .venv,
build/, caches or built .so files): an in-tree build reuses build/lib, so a stale .so or a
module deleted since the last build would otherwise end up in the wheel."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
SUBPACKAGE_ROOTS = ("configs", "runtime", "launcher", "recovery", "spares")
DIST_INFO = f"phalanx-{VERSION}.dist-info"

# Left out of the copy: what a fresh clone does not have (see .gitignore).
_SKIP_TOP = {".git", ".venv", "build", "dist", ".phalanx", ".pytest_cache", ".hypothesis",
             ".mypy_cache", ".ruff_cache", ".import_linter_cache"}
_SKIP_ANYWHERE = ("__pycache__", "*.pyc", "*.so", "*.egg-info")

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="no C compiler here: the wheel has no native kernel")


def _ignore(folder: str, names: list[str]) -> set[str]:
    skipped = set(shutil.ignore_patterns(*_SKIP_ANYWHERE)(folder, names))
    if Path(folder).resolve() == REPO:
        skipped |= _SKIP_TOP & set(names)
    elif Path(folder).resolve() == REPO / "bench":
        skipped.add("results")
    return skipped


def _build_wheel(tmp: Path, env: dict[str, str] | None = None) -> tuple[Path, str]:
    source, out = tmp / "src", tmp / "wheel"
    shutil.copytree(REPO, source, ignore=_ignore, symlinks=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-v", "-w", str(out), str(source)],
        cwd=tmp, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = list(out.glob("phalanx-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))[0]


def _names(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as zf:
        return zf.namelist()


def _fused_copy_libs(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("phalanx/runtime/snapshot/_fused_copy")
            and n.endswith(".so")]


@pytest.mark.timeout(10)
def test_the_packages_list_names_every_folder_with_an_init() -> None:
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    on_disk = {"phalanx"} if (REPO / "__init__.py").is_file() else set()
    for root in SUBPACKAGE_ROOTS:
        for init in (REPO / root).rglob("__init__.py"):
            on_disk.add(".".join(("phalanx", *init.parent.relative_to(REPO).parts)))
    assert len(listed) == len(set(listed)), "a package is listed twice"
    assert set(listed) == on_disk, (f"missing from pyproject: {sorted(on_disk - set(listed))}; "
                                    f"listed but not on disk: {sorted(set(listed) - on_disk)}")


@pytest.mark.timeout(120)
def test_the_wheel_holds_phalanx_its_data_and_license_and_nothing_else(wheel: Path) -> None:
    names = _names(wheel)
    stray = [n for n in names if not n.startswith(("phalanx/", f"{DIST_INFO}/"))]
    assert not stray, f"files outside phalanx/ and {DIST_INFO}/: {stray}"
    assert "phalanx/__init__.py" in names and "phalanx/py.typed" in names
    assert "phalanx/configs/demo.yaml" in names
    drills = sorted(p.name for p in (REPO / "configs" / "drills").glob("*.yaml"))
    assert drills and all(f"phalanx/configs/drills/{d}" in names for d in drills)
    for folder in ("tests", "bench", "examples"):
        assert not [n for n in names if n.startswith(f"phalanx/{folder}/")], folder
    assert any(n.startswith(f"{DIST_INFO}/") and n.endswith("/LICENSE") for n in names), names
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{DIST_INFO}/METADATA").decode()
        entry_points = zf.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "phalanx = phalanx.launcher.cli:main" in entry_points


@needs_cc
@pytest.mark.timeout(120)
def test_the_wheel_carries_the_native_fused_copy(wheel: Path) -> None:
    assert len(_fused_copy_libs(_names(wheel))) == 1


@pytest.mark.timeout(120)
def test_without_a_compiler_the_build_goes_on_without_the_native_kernel(
        tmp_path: Path) -> None:
    whl, log = _build_wheel(tmp_path, env={"CC": "/bin/false", "CXX": "/bin/false"})
    names = _names(whl)
    assert not _fused_copy_libs(names), names
    assert "phalanx/runtime/snapshot/fused_copy.py" in names       # the pure-Python fallback
    # setuptools' optional ext-module: the compile error is a warning and the build goes on
    assert 'building extension "phalanx.runtime.snapshot._fused_copy" failed' in log, log[-3000:]


@pytest.mark.timeout(120)
def test_the_installed_wheel_imports_from_site_packages_not_the_repo(
        wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in site.iterdir() if p.name != "bin") == ["phalanx", DIST_INFO]
    proc = subprocess.run(
        [sys.executable, "-c",
         "import phalanx, phalanx.configs.schema; print(phalanx.__file__, phalanx.__version__)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    file, version = proc.stdout.split()
    assert Path(file).resolve().is_relative_to(site.resolve()), file
    assert version == VERSION


@pytest.mark.timeout(30)
def test_phalanx_version_prints_the_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "--version"],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"phalanx {VERSION}\n"


@pytest.mark.timeout(60)
def test_import_phalanx_does_not_import_torch_until_an_export_is_used() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import phalanx, sys; assert 'torch' not in sys.modules; "
         "phalanx.Session; assert 'torch' in sys.modules"],
        capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
