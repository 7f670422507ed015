# Each target builds its own virtual environment with the exact versions in constraints.txt.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: docs demo test test-slow test-integration test-gpu test-clients bench guidellm-bench lint soak notebooks

# OpenMP threads that spin while they wait make a shared or busy CPU up to 30x slower (the demo:
# 0.6 s or 20 s). Every target runs with OMP_WAIT_POLICY=PASSIVE unless the environment sets it.
OMP_WAIT_POLICY ?= PASSIVE
export OMP_WAIT_POLICY

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hf_paged_attn.demo

# Both tiers (tests/: units laid out like the package; integration_tests/: the package driven whole from
# outside) without the slow and clients markers, one test file per core: one thread each.
test: $(STAMP)
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# What `make test` leaves out for time: executed notebooks, the GPU check's CPU variants, soak.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow

# Every integration test but the clients' (make test-clients), the slow ones included.
test-integration: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not clients" integration_tests

# On a machine with CUDA: the tests marked gpu (skipped elsewhere), then the GPU check.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu
	bash scripts/gpu_check.sh

# TRL's GRPOTrainer and lm-eval driving the engine (the [clients] extra takes ~1 min to install,
# so it is not part of `make test`); no downloads: tiny local models, tasks and data.
test-clients: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[clients]'
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -m clients integration_tests/test_clients.py

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a warning, a broken link or anchor fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(PY) -m ruff check .

# BENCH_ARGS: e.g. --smoke, --workload shared-prefix, --systems engine,hf_cb (docs/performance.md).
BENCH_ARGS ?= --workload uniform
bench: $(STAMP)
	$(PY) -m hf_paged_attn_tools.bench --out benchmarks/results $(BENCH_ARGS)

# guidellm (installed apart: docs/performance.md, Serving) against our server and transformers serve; GUIDELLM=its executable.
GUIDELLM_ARGS ?= --repeat 3
guidellm-bench: $(STAMP)
	$(PY) -m hf_paged_attn_tools.bench guidellm --out benchmarks/results $(GUIDELLM_ARGS)

# Regenerate examples/*.ipynb from examples/make_notebooks.py, execute them, store them with outputs.
notebooks: $(STAMP)
	$(PY) examples/make_notebooks.py

soak: $(STAMP)
	$(PY) scripts/soak.py
