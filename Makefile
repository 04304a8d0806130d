# Two entry points (see README): `make demo` and `make test`.
# Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench bench-small bench-scan accel-hlo accel-copies accel-inplace setup clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[torch,test,experiments,bench,ray]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) experiments/dqn_anakin.py --config=configs/dqn_anakin.py --workdir=runs/dqn_anakin

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

# No test XLA_FLAGS here: the cheap-compile flags of tests/conftest.py would distort timings.
bench: $(STAMP)
	$(PY) experiments/benchmark.py --out=results/benchmark.json --plot=results/benchmark.png

bench-small: $(STAMP)
	$(PY) experiments/benchmark.py --small --out=results/benchmark_small.json --plot=results/benchmark_small.png

# Issue 25's in-scan cases vs flashbax on one backend: make bench-scan PLATFORM=gpu
PLATFORM ?=
bench-scan: $(STAMP)
	$(PY) experiments/bench_scan.py --rounds=5 --hlo --platform=$(PLATFORM)

# The in-scan programs compiled for an H200 and a TPU v5e on a machine with neither
# (experiments/accel_hlo.py). A venv of its own: the plugins make JAX look for devices.
# Needs ptxas (the CUDA toolkit's) on PATH or in /usr/local/cuda.
ACCEL_HLO_VENV ?= .venv-accel-hlo
$(ACCEL_HLO_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(ACCEL_HLO_VENV)
	$(ACCEL_HLO_VENV)/bin/python -m pip install -q --upgrade pip
	$(ACCEL_HLO_VENV)/bin/python -m pip install -q -c constraints.txt -e . flashbax==0.1.3 \
	  jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2 'libtpu==0.0.42.*' \
	  pytest hypothesis scipy
	touch $@

accel-hlo: $(ACCEL_HLO_VENV)/.installed
	$(ACCEL_HLO_VENV)/bin/python experiments/accel_hlo.py

# Whole-buffer copies in every kind of table's programs, on the CPU and an H200
# (experiments/accel_copies.py; exits 1 on a copy not listed as known).
accel-copies: $(ACCEL_HLO_VENV)/.installed
	$(ACCEL_HLO_VENV)/bin/python experiments/accel_copies.py --targets=cpu,h200

# tests/core/test_inplace.py's copy checks with every program compiled for an H200
# (experiments/accel_pytest.py; the portable programs: native ones do not run there).
accel-inplace: $(ACCEL_HLO_VENV)/.installed
	$(ACCEL_HLO_VENV)/bin/python -m pytest -q -p experiments.accel_pytest -k portable \
	  tests/core/test_inplace.py

clean:
	rm -rf $(VENV) $(ACCEL_HLO_VENV) .pytest_cache .hypothesis
