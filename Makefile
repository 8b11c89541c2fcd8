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

# Two workers, one test file each at a time (module fixtures stay in one process), the
# slowest files first (tests/conftest.py); TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: setup
	$(VENV)/bin/dflash-export demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
