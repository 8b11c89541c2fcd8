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
# (measured with pip compiling torch and uv compiling nothing: 48 s vs 108 s of user CPU for the
# whole setup). uv compiles the bytecode of what it installs (a fresh venv without it once missed
# Ray's 60 s proxy deadline in a suite run). torch's bytecode is compiled last, on every core:
# where PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing else ever writes it, and each
# process would recompile torch on import (4.9 s vs 2.3 s; the cold suite saved ~30 s of CPU,
# measured on a cold suite). Only a speed-up: a file that does not compile (torch ships test helpers in
# Python 3.12 syntax) is skipped silently and compiles, or fails, on import as before.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile uv
	$(PY) -m pip install -q --no-compile -c constraints-cpu.txt torch
	$(VENV)/bin/uv pip install --python $(PY) -q --compile-bytecode -c constraints-cpu.txt -e ".[cpu,export,serve,dev,ray]"
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" || true
	touch $@

# The real TensorRT Python bindings (10.12 and 11.4) with stub libraries, in a cache outside the
# venv (tests/trt_bindings.py): the TensorRT tests check the project's calls against them. Runs
# every time: a no-op (~0.1 s) once the cache holds both; needs pip's registry and gcc the first time.
# Then the official reference's `dflash/model.py` (tests/test_rejection.py, bench/rejection.py): the
# `dflash` package without its pinned dependencies (it needs transformers >= 5.14, which dev has).
setup:
	$(PY) tests/trt_bindings.py
	$(PY) -c "import importlib.util as u; exit(u.find_spec('dflash') is None)" || $(VENV)/bin/uv pip install --python $(PY) -q --no-deps dflash==0.1.0

# Two workers on two cores, one test file each at a time (module fixtures stay in one process),
# the slowest files first and the Ray module last (tests/conftest.py). TEST_WORKERS=0: one process.
# What it costs on a 2-vCPU machine: 4-8 min while nothing else runs (213-451 s measured), and
# more in proportion to what shares the cores: a fresh clone's run at load 3-9 took 31 min
# (pytest 1,893 s). Once the machine is busy, wall time ~ CPU time x load / cores: a sample
# (tests/test_info.py + tests/test_export_errors.py, one process, artifacts cached) took 53 s of
# CPU and 268 s of wall time at load 19. Tests build tiny models; the suite must stay under 15 min
# on an idle 2-core machine.
# DFLASH_REQUIRE_TRT_BINDINGS=1: a missing TensorRT bindings wheel fails its tests instead of skipping them.
TEST_WORKERS ?= 2
test: setup
	DFLASH_REQUIRE_TRT_BINDINGS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: setup
	$(VENV)/bin/dflash-export demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
