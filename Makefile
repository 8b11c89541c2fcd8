# Setup is idempotent: a venv in .venv with the CPU flavour of everything.
# constraints-cpu.txt pins the local CPU torch wheel for this kind of machine only.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test demo bench clean
setup: $(VENV)/.installed
# torch goes in through pip, which reads this machine's pip config (where the local CPU wheel
# lies); uv, which does not, installs the rest: the same versions, in a fraction of pip's time
# (measured: 48 s vs 108 s of CPU for the whole setup). --no-compile: modules compile on import.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile uv
	$(PY) -m pip install -q --no-compile -c constraints-cpu.txt torch
	$(VENV)/bin/uv pip install --python $(PY) -q -c constraints-cpu.txt -e ".[cpu,export,serve,dev,ray]"
	touch $@

# Three workers on two cores, one test file each at a time (module fixtures stay in one
# process), the slowest files first (tests/conftest.py): the Ray module's cluster mostly
# waits while two workers compute (cold: 5 min 20 s vs 7 min 15 s with 2 workers, the same
# CPU; docs/benchmarks.md). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: setup
	$(VENV)/bin/dflash-export demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
