"""Signal-aware task choice against the plain cycle, simulated (no model): the share of groups
with no reward spread, per rollout spent.

Each task has a fixed true pass rate; a group is ``G`` Bernoulli samples. The mix is what a
small model meets on a hard benchmark: most tasks never solved, a few always, the rest in
between. Both choosers walk the same shuffled order; ``SignalChooser`` skips tasks predicted
to give constant groups (``selfrl.run.signal``). Writes benchmarks/results/signal_choice.json.

    python benchmarks/bench_signal_choice.py [--iterations 40] [--seeds 5]

This measures the mechanism (how many rollouts land in groups with signal), not held-out gain:
that needs real runs (README).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from selfrl.run.signal import SignalChooser
from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory


def simulate(choice: str, iterations: int, seed: int, n_tasks: int = 200, prompts: int = 8, group: int = 8,
             mix=(0.7, 0.1)) -> dict:
    rng = random.Random(seed)
    tasks = [Task.make("sim", f"q{i}", "") for i in range(n_tasks)]
    p = {}
    for t in tasks:
        u = rng.random()
        p[t.id] = 0.0 if u < mix[0] else 1.0 if u < mix[0] + mix[1] else rng.uniform(0.1, 0.9)
    order = tasks[:]
    rng.shuffle(order)
    chooser = SignalChooser(group_size=group)
    zero = total = 0
    for it in range(iterations):
        if choice == "signal":
            batch = chooser.choose(order, it, prompts)
        else:
            start = (it * prompts) % len(order)
            batch = (order + order)[start:start + prompts]
        trajs = []
        for j, t in enumerate(batch):
            passes = [rng.random() < p[t.id] for _ in range(group)]
            trajs += [Trajectory(t.id, f"{it}-{j}", 0, reward=float(x), correct=x) for x in passes]
            zero += len(set(passes)) == 1
            total += 1
        chooser.observe(trajs)
    return {"zero_signal_share": zero / total, "groups": total, "rollouts": total * group}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    out = {}
    for choice in ("cycle", "signal"):
        runs = [simulate(choice, a.iterations, s) for s in range(a.seeds)]
        out[choice] = {"zero_signal_share": sum(r["zero_signal_share"] for r in runs) / len(runs),
                       "rollouts_per_run": runs[0]["rollouts"]}
        print(f"{choice:6s}: zero-signal groups {out[choice]['zero_signal_share']:.1%} "
              f"({a.seeds} seeds x {a.iterations} iterations x 8 groups of 8)")
    res = Path(__file__).parent / "results"
    res.mkdir(exist_ok=True)
    (res / "signal_choice.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
