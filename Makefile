# Setup is idempotent: a venv in .venv with the CPU flavour of everything.
# constraints-cpu.txt pins the local CPU torch wheel for this kind of machine only.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test demo bench clean
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[cpu,export,serve,dev,ray]"
	touch $@

test: setup
	$(PY) -m pytest

demo: setup
	$(VENV)/bin/dflash-export demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
