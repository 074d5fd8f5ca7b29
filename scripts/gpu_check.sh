#!/usr/bin/env bash
# The GPU checks of issue 15 part 5 in one go (run from the repository root, or from a copy of it).
# Wheels in ./whl (transformers/peft pinned as in pyproject, fastapi stack, reasoning-gym and its
# pure-Python needs) are installed into /tmp/site; stubs/ holds a pycosat stand-in (a C extension
# with no cp312 wheel; reasoning-gym imports it, selfrl's tasks never call it).
# Results go to $OUT (pytest.txt, bench.json, bench.txt, env.txt). BENCH=0 runs the tests only.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if ls whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD:$PWD/stubs
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft, fastapi; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'bf16', torch.cuda.is_bf16_supported(), 'transformers', transformers.__version__, 'peft', peft.__version__, 'fastapi', fastapi.__version__)"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::FutureWarning --continue-on-collection-errors \
  tests/test_device.py tests/test_swap_check.py tests/test_engine_conformance.py tests/test_vllm_backend.py \
  tests/test_remote_sampler.py tests/test_trainer.py tests/test_engine.py tests/test_loop.py 2>&1 | tee "$OUT/pytest.txt" | tail -25
echo "pytest: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest.txt"
[ "${BENCH:-1}" = 0 ] && exit 0
t0=$(date +%s)
timeout 170 python3 scripts/gpu_bench.py --out "$OUT" 2>&1 | grep -E '^(\{|learner|generate|run) ' | tee "$OUT/bench.txt"
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.txt"
