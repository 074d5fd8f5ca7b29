"""Rollouts overlapped with the update (``selfrl run --async-rollouts``) against one after the other.

    nice -n -10 .venv/bin/python benchmarks/bench_overlap.py --repeats 2   # real model, ~8 min per engine
    .venv/bin/python benchmarks/bench_overlap.py --tiny                      # seconds

One ``selfrl run`` iteration's work, on the demo's config (``configs/demo.toml``): the 64
rollouts of its first batch (8 chain_sum tasks x 8, up to 3 turns with the calculator) and one
GRPO update on 64 rollouts (every one given a non-zero advantage, so the whole batch trains).
Each repeat times, side by side in one process:

* **serial**: the rollouts, then the update (what ``selfrl run`` does by default);
* **overlapped**: the rollouts sampled in a thread by a :func:`selfrl.rollout.prefetch.shadow_policy`
  copy while the update trains the policy (what ``--async-rollouts`` does in every iteration
  but the last).

The ratio serial / overlapped is what overlap gains per iteration on this machine; the
update's own seconds inside the overlapped pair say what sharing the cores costs it.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG  # noqa: E402
from common import (  # noqa: E402
    Stats, base_parser, command_line, envelope, finish, give_signal, iteration_work, print_table,
)


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--engines", default="reference,slots", help="comma-separated sampling backends")
    args = p.parse_args(argv)
    import torch

    from selfrl.rollout.prefetch import shadow_policy
    from selfrl.engines import make_engine
    from selfrl.rollout.agent import rollout

    result = envelope(args, command_line("bench_overlap.py", argv))
    work = iteration_work(args, CONFIG, "bench-overlap-")
    cfg, tasks, learner = work.cfg, work.tasks, work.learner
    rows, per_engine = [], {}
    for name in args.engines.split(","):
        engine = make_engine(name, shadow_policy(work.model), work.tokenizer)

        def sample(seed: int):
            torch.manual_seed(seed)
            t = time.perf_counter()
            trajs = rollout(engine, tasks, work.groups, work.tools, cfg.rollout)
            return trajs, time.perf_counter() - t

        batch, _ = sample(0)  # the batch every update trains on, and a warm-up
        give_signal(batch)

        def update() -> float:
            t = time.perf_counter()
            learner.step(batch)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {k: [] for k in ("rollouts", "update", "serial", "overlapped",
                                                         "rollouts_overlapped", "update_overlapped")}
        tokens = []
        for rep in range(args.repeats):
            trajs, t_roll = sample(1 + rep)
            t_upd = update()
            box = {}
            t0 = time.perf_counter()
            th = threading.Thread(target=lambda: box.update(zip(("trajs", "s"), sample(1 + rep))))
            th.start()
            t_upd2 = update()
            th.join()
            both = time.perf_counter() - t0
            times["rollouts"].append(t_roll)
            times["update"].append(t_upd)
            times["serial"].append(t_roll + t_upd)
            times["overlapped"].append(both)
            times["rollouts_overlapped"].append(box["s"])
            times["update_overlapped"].append(t_upd2)
            tokens.append(sum(t.num_completion_tokens for t in trajs))
        if hasattr(engine, "close"):
            engine.close()
        stats = {k: Stats.of(v) for k, v in times.items()}
        ratios = Stats.of([s / o for s, o in zip(times["serial"], times["overlapped"])])
        per_engine[name] = {"seconds": stats, "serial_over_overlapped": ratios, "sampled_tokens": tokens}
        rows.append([name, stats["rollouts"].fmt(".1f"), stats["update"].fmt(".1f"), stats["serial"].fmt(".1f"),
                     stats["overlapped"].fmt(".1f"), stats["rollouts_overlapped"].fmt(".1f"),
                     stats["update_overlapped"].fmt(".1f"), ratios.fmt(".2f")])
    result.update({"model": cfg.model.name, "batch": len(tasks), "engines": per_engine})
    print_table(f"one iteration ({len(tasks)} rollouts + one update), seconds: median [min, max] of {args.repeats}",
                ["engine", "rollouts", "update", "serial", "overlapped", "rollouts (in overlap)",
                 "update (in overlap)", "serial / overlapped"], rows)
    print(f"wrote {finish(result, 'overlap', args.out)}")
    return result


if __name__ == "__main__":
    main()
