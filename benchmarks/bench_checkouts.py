"""The slot engine's rollout batches at this checkout against another checkout of selfrl (a commit
before a change), each in its own processes, alternating, the order flipped each round.

A change that no setting can turn off (a different cache layout, a different search) is measured
this way: each process loads the policy, runs a short and a full warm-up batch, then the demo's
first batch (``configs/demo.toml``, 8 tasks x 8, multi-turn with the calculator) at seeds 0 to
``--seeds - 1``, and measures the bound (oneDNN's 4096² product over 2P) at its start. The table
gives each checkout's seconds in all, the median tokens/s [min, max], its share of the median bound
of all processes, the ratio of medians seed by seed, and whether both sampled the same ids.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_checkouts.py --before /tmp/before --rounds 4 --seeds 3
    python benchmarks/bench_checkouts.py --before /tmp/before --rounds 2 --seeds 2 --adapter runs/demo/adapters/v000002
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, base_parser, command_line, envelope, finish, print_table  # noqa: E402


def child(args) -> None:
    """One process: the batches of this process's checkout (``selfrl`` from ``PYTHONPATH``)."""
    from bench_ceiling import CONFIG, matmul_flops, matmul_params
    from bench_drafts import timed_rollouts
    from bench_engines import policy_with_adapter
    from common import bench_config, first_batch

    import selfrl
    from selfrl.engines.slots import SlotEngine

    cfg = bench_config(args, CONFIG, "bench-checkouts-")
    model, tok = policy_with_adapter(cfg, args.adapter, {})
    engine = SlotEngine(model, tok, driver="caller")
    tasks, tools = first_batch(cfg)
    timed_rollouts(engine, tasks[:max(2, len(tasks) // 8)], tools, cfg.rollout, 99)  # warm-up
    timed_rollouts(engine, tasks, tools, cfg.rollout, 98)
    flops = matmul_flops(256 if args.tiny else 4096, 2)
    out = {"selfrl": selfrl.__file__, "bound": flops.median / (2 * matmul_params(model)), "batches": []}
    for seed in range(args.seeds):
        seconds, tokens, ids, _ = timed_rollouts(engine, tasks, tools, cfg.rollout, seed)
        out["batches"].append({"seed": seed, "seconds": seconds, "tokens": tokens,
                               "ids": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]})
    engine.close()
    Path(args.result).write_text(json.dumps(out))


def run_in(checkout: Path, argv: list[str], result: Path) -> dict:
    """Run this script's ``--child`` with ``checkout``'s selfrl first on the path; its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--result", str(result), *argv],
                          capture_output=True, text=True, cwd=checkout, env=env)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"the child in {checkout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(result.read_text())
    if not Path(got["selfrl"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"the child in {checkout} imported selfrl from {got['selfrl']}")
    return got


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__, repeats=False)
    p.add_argument("--before", type=Path, default=None, help="the other checkout (a git worktree of an earlier commit)")
    p.add_argument("--rounds", type=int, default=2, help="processes per checkout")
    p.add_argument("--seeds", type=int, default=3, help="batches per process (seeds 0 to N - 1)")
    p.add_argument("--adapter", type=Path, default=None, help="a saved adapter version: a trained policy")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.before is None or not (args.before / "selfrl").is_dir():
        raise SystemExit("--before must name another checkout of selfrl (it has a selfrl/ folder)")
    result = envelope(args, command_line("bench_checkouts.py", argv))
    extra = ["--seeds", str(args.seeds)] + (["--tiny"] if args.tiny else []) + (
        ["--adapter", str(args.adapter.resolve())] if args.adapter else [])
    checkouts = {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="bench-checkouts-") as tmp:
        for r in range(args.rounds):
            for name in (list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]):
                got = run_in(checkouts[name], extra, Path(tmp) / f"{name}-{r}.json")
                runs[name].append(got)
                print(f"round {r} {name}: " + ", ".join(f"{b['tokens']} tokens in {b['seconds']:.2f} s"
                                                         for b in got["batches"]), flush=True)
    bound = statistics.median(g["bound"] for rs in runs.values() for g in rs)
    out, rows = {}, []
    for name, rs in runs.items():
        batches = [b for g in rs for b in g["batches"]]
        tps = [b["tokens"] / b["seconds"] for b in batches]
        med = statistics.median(tps)
        out[name] = {"checkout": str(checkouts[name]), "seconds": sum(b["seconds"] for b in batches),
                     "tokens": sum(b["tokens"] for b in batches), "median_tokens_per_s": med,
                     "min_tokens_per_s": min(tps), "max_tokens_per_s": max(tps), "fraction_of_bound": med / bound,
                     "bounds": [g["bound"] for g in rs], "batches": [g["batches"] for g in rs]}
        rows.append([name, len(batches), f"{out[name]['seconds']:.1f}", f"{med:.0f} [{min(tps):.0f}, {max(tps):.0f}]",
                     f"{med / bound:.1%}"])
    by_seed = {}
    for seed in range(args.seeds):
        med = {name: statistics.median(b["tokens"] / b["seconds"] for g in rs for b in g["batches"] if b["seed"] == seed)
               for name, rs in runs.items()}
        by_seed[seed] = med["after"] / med["before"]
    same = all(len({b["ids"] for rs in runs.values() for g in rs for b in g["batches"] if b["seed"] == s}) == 1
               for s in range(args.seeds))
    result.update({"bound_tokens_per_s": bound, "checkouts": out, "speed_up_by_seed": by_seed, "same_ids": same,
                   "adapter": str(args.adapter) if args.adapter else None})
    print_table(f"the demo's first batch, {args.rounds} processes each, alternating; median bound {bound:.0f} tokens/s",
                ["checkout", "batches", "seconds in all", "median tokens/s [min, max]", "of the bound"], rows)
    print("after / before by seed: " + ", ".join(f"{s}: {v:.2f}x" for s, v in by_seed.items())
          + f"; same ids: {'yes' if same else 'no'}")
    print(f"wrote {finish(result, 'checkouts' if args.adapter is None else 'checkouts_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()
