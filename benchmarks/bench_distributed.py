"""Distributed rollouts: trajectories per second against the number of Ray workers,
and the synchronous loop on the same tasks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_distributed.py --workers 1 2 4   # a few minutes

The policy is a random Phi saved to disk (``--hidden``, ``--layers``; its output bias
makes turns end, as in ``tests/test_loop.py``), the reward the test reward ``short``
(so updates happen). Each configuration is one ``selfrl run`` of ``--iterations``
iterations; the first iteration (worker start-up, model loading) is left out, and the
throughput is the trained trajectories of the others over their rollout + update
seconds (the loop's ``time/rollout_s`` and ``time/update_s``). Every worker has one
torch thread and half a CPU of Ray's. Writes ``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine, print_table, save_phi, write_result  # noqa: E402


def short(traj, ctx):
    """1 for an immediate EOS, falling to 0 at the token limit."""
    return 1.0 - traj.num_completion_tokens / ctx_limit[0]


ctx_limit = [32]


def make_cfg(model: str, run_dir: Path, args):
    from selfrl.config import RunConfig

    cfg = RunConfig(run_dir=str(run_dir), iterations=args.iterations, num_prompts=args.num_prompts,
                    num_generations=args.num_generations, reward_weights={"short": 1.0})
    cfg.model.name = model
    cfg.lora.r = 4
    cfg.task.source = "chain_sum"
    cfg.task.num_train = 64
    cfg.rollout.max_new_tokens = args.max_new_tokens
    cfg.rollout.max_turns = 1
    cfg.gate.val_size = 4
    cfg.gate.eval_every = 1000
    cfg.collapse.enabled = False
    cfg.train.learning_rate = 1e-3
    return cfg.validate()


def throughput(run_dir: Path, per_iteration: int) -> dict:
    from selfrl.record.store import Store

    store = Store(run_dir / "selfrl.db")
    rows = store.metrics()
    store.close()
    per = {}
    for m in rows:
        per.setdefault(m["step"], {})[m["name"]] = m["value"]
    steps = [s for s in per if s >= 1 and "time/rollout_s" in per[s]]
    n = len(steps) * per_iteration
    tokens = sum(per[s]["train/completion_tokens"] * per_iteration for s in steps)
    secs = sum(per[s]["time/rollout_s"] + (per[s].get("time/update_s") or 0.0) for s in steps)
    rollout = sum(per[s]["time/rollout_s"] for s in steps)
    rewards = [per[s].get("reward/mean") for s in sorted(per) if "reward/mean" in per[s]]
    return {"iterations_timed": len(steps), "seconds": secs, "rollout_s": rollout, "rewards": rewards, "tokens": tokens,
            "dropped_stale": sum(per[s].get("async/dropped_stale", 0) or 0 for s in steps), "n": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--no-sync", action="store_true", help="skip the synchronous baseline")
    args = p.parse_args()
    ctx_limit[0] = args.max_new_tokens

    import ray

    from selfrl.config import DistributedConfig
    from selfrl.run.ray.driver import run_distributed
    from selfrl.run.main import run
    from selfrl.envs.rewards import REWARD_FUNCS

    REWARD_FUNCS["short"] = short
    load0, rows, results = loadavg(), [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_phi(Path(tmp) / "model", args.hidden, args.layers)
        if not args.no_sync:
            t0 = time.perf_counter()
            run(make_cfg(model, Path(tmp) / "sync", args))
            r = throughput(Path(tmp) / "sync", args.num_prompts * args.num_generations)
            r["wall_s"] = time.perf_counter() - t0
            results["sync"] = r
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 configure_logging=False)
        for w in args.workers:
            t0 = time.perf_counter()
            cfg = make_cfg(model, Path(tmp) / f"ray{w}", args)
            cfg.distributed = DistributedConfig(address="local", num_workers=w, max_staleness=1)
            run_distributed(cfg)
            r = throughput(Path(tmp) / f"ray{w}", args.num_prompts * args.num_generations)
            r["wall_s"] = time.perf_counter() - t0
            results[f"ray-{w}"] = r
        ray.shutdown()
    for name, r in results.items():
        rows.append([name, r["n"], f"{r['seconds']:.1f}", f"{r['n'] / r['seconds']:.2f}",
                     f"{r['tokens'] / r['seconds']:.0f}", r["dropped_stale"],
                     f"{r['wall_s']:.0f}"])
    print_table("trajectories per second (iterations 1.., rollout + update)",
                ["mode", "trajectories", "seconds", "traj/s", "tokens/s", "dropped stale groups", "wall s (all)"], rows)
    data = {"command": " ".join(sys.argv), "args": vars(args), "machine": machine(), "loadavg_start": load0,
            "loadavg_end": loadavg(), "results": results}
    print(write_result("distributed", data))


if __name__ == "__main__":
    main()
