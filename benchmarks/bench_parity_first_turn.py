"""Real model, first turn only: the first 4 sampled tokens of the demo's first turn, 128 rows for
each of the 8 tasks of iteration 0, per engine (rollout path: batched on the reference, per-row seeded
``submit`` on the slot engine), compared per task by chi-square (selfrl.engines.two_sample).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/bench_parity_first_turn.py 128   # ~10 min on 2 busy cores
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from selfrl.config import load_config
from selfrl.engines import make_engine
from selfrl.model.load import build_policy
from selfrl.run.loop import iteration_tasks
from selfrl.envs import get_env
from selfrl.core.tools import resolve_tools
from selfrl.rollout.agent import rollout
from selfrl.engines.two_sample import chi_square_homogeneity, combine_chi_square
cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.toml", {"preset": "label-free", "rollout.max_new_tokens": 4, "rollout.max_turns": 1})
model, tok = build_policy(cfg)
source = get_env(cfg.task.source, **cfg.task.options)
train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
tasks = iteration_tasks(train, 0, 8, cfg.task.train_seed)
tools = resolve_tools(cfg.rollout.tools)
R = int(sys.argv[1]) if len(sys.argv) > 1 else 128
out = {}
for name in ("reference", "slots"):
    eng = make_engine(name, model, tok)
    rows = []
    t0 = time.time()
    for j, t in enumerate(tasks):
        torch.manual_seed(100 + j)
        trajs = rollout(eng, [t] * R, [f"{j}-{i // 8}" for i in range(R)], tools, cfg.rollout)
        rows += [(j, tuple(tr.token_ids[tr.prompt_len:tr.prompt_len + 4])) for tr in trajs]
    if hasattr(eng, "close"):
        eng.close()
    out[name] = rows
    tool = sum(tok.decode(list(r)).startswith("<tool") for _, r in rows)
    print(name, len(rows), "rows", f"{time.time()-t0:.0f}s", "starts '<tool':", tool, f"{tool/len(rows):.3f}", flush=True)
a, b = out["reference"], out["slots"]
def per_task(f):
    return combine_chi_square([chi_square_homogeneity([f(r) for j, r in a if j == k], [f(r) for j, r in b if j == k]) for k in range(len(tasks))])
print("first token per task:", per_task(lambda r: r[0]))
print("first two tokens per task:", per_task(lambda r: r[:2]))
print("starts <tool per task:", per_task(lambda r: tok.decode(list(r)).startswith("<tool")))
print("starts <tool pooled:", chi_square_homogeneity([tok.decode(list(r)).startswith("<tool") for _, r in a], [tok.decode(list(r)).startswith("<tool") for _, r in b]))
json.dump({k: [[j, list(r)] for j, r in v] for k, v in out.items()}, open(Path(__file__).resolve().parent / "results" / "parity_first_turn.json", "w"))
