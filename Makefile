# Each target builds its own virtual environment with the exact versions in constraints.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench lint soak

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hf_paged_attn.demo

test: $(STAMP)
	$(PY) -m ruff check .
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(PY) -m pytest -q

test-slow: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(PY) -m ruff check .

# BENCH_ARGS: e.g. --smoke, --workload shared-prefix, --systems engine,hf_cb (see benchmarks/README.md).
BENCH_ARGS ?= --workload uniform
bench: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m hf_paged_attn.bench $(BENCH_ARGS)

soak: $(STAMP)
	$(PY) scripts/soak.py
