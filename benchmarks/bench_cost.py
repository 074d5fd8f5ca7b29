"""The cost of learning: inference, training and validation time of a ``selfrl run``, and
(inference + training) / inference, the figure that should stay well under 2.

    .venv/bin/python benchmarks/bench_cost.py --run-dir runs/bench-trl/<stamp>/selfrl   # a finished run (no model)
    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_cost.py    # runs configs/demo.toml (~8 min)
    .venv/bin/python benchmarks/bench_cost.py --tiny                                      # seconds

Read from the run's store (``time/rollout_s``, ``time/update_s``, ``time/validation_s``,
``num_tokens``, ``train/completion_tokens``) by :func:`selfrl.report.cost.run_cost`, as
``scripts/results.py table`` reads it. Per-iteration figures are medians over the
run's iterations with min and max (``--repeats`` does not apply: one run, many
iterations). Tokens generated count the sampled completion tokens of every rollout;
tokens trained count the completion tokens of the sequences that went into the update
(those with a non-zero advantage; the others are skipped, see ``selfrl.rl.learner``).
A run that has not finished (:mod:`selfrl.report.finished`) is measured over the iterations it
has, and marked: ``finished`` false and ``status`` ``unfinished: iteration K of N`` in the JSON,
the status in the table's title and a note on stderr.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Stats, base_parser, command_line, envelope, finish, model_name, print_table  # noqa: E402


def cost_figures(run_dir: Path) -> dict:
    """Times, ratios and token rates of the run in ``run_dir``, with ``finished`` and ``status``
    (``"finished"``, ``"unfinished: iteration 3 of 10"``, ``"stopped at ..."``:
    :meth:`selfrl.report.finished.RunProgress.line`).

    Raises:
        FileNotFoundError: no run there.
        ValueError: the run has no completed iteration.
    """
    from selfrl.record.store import Store
    from selfrl.report.cost import run_cost
    from selfrl.report.finished import run_progress

    run_dir = Path(run_dir)
    if not (run_dir / "selfrl.db").exists():
        raise FileNotFoundError(f"no selfrl run at {run_dir}")
    cfg = json.loads((run_dir / "config.json").read_text())
    per_iter = cfg["num_prompts"] * cfg["num_generations"]
    with Store(run_dir / "selfrl.db", readonly=True) as store:
        cost = run_cost(store, cfg)
        progress = run_progress(store, cfg)
    iters, validation = cost.iterations, cost.validations_s
    if not iters:
        raise ValueError(f"the run at {run_dir} has no completed iteration")
    roll = [i.rollout_s for i in iters]
    upd = [i.update_s for i in iters]
    gen_tokens = [i.completion_tokens * per_iter for i in iters]
    trained = [i.trained_tokens for i in iters]
    return {
        "run_dir": str(run_dir), "finished": progress.finished,
        "status": progress.line(),
        "iterations": len(iters), "rollouts_per_iteration": per_iter,
        "inference_s": cost.inference_s, "training_s": cost.training_s, "validation_s": cost.validation_s,
        "validations": len(validation), "val_size": cfg["gate"]["val_size"],
        "cost_ratio": cost.cost_ratio,
        "cost_ratio_per_iteration": Stats.of([(r + u) / r for r, u in zip(roll, upd)]),
        "inference_per_task_s": Stats.of([r / per_iter for r in roll]),
        "training_per_task_s": Stats.of([u / per_iter for u in upd]),
        "validation_per_task_s": Stats.of([v / cfg["gate"]["val_size"] for v in validation]) if validation else None,
        "generated_tokens_per_s": Stats.of([g / r for g, r in zip(gen_tokens, roll)]),
        "trained_tokens_per_s": Stats.of([t / u for t, u in zip(trained, upd) if u > 0 and t > 0] or [0.0]),
        "generated_tokens": sum(gen_tokens), "trained_tokens": sum(trained),
        "skipped_updates": sum(1 for i in iters if i.skipped),
    }


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--run-dir", type=Path, help="a finished run to read; without it, a run is made first")
    args = p.parse_args(argv)
    result = envelope(args, command_line("bench_cost.py", argv))
    run_dir = args.run_dir
    if run_dir is None:
        from selfrl.config import load_config
        from selfrl.run.main import run
        from selfrl.run.progress import PlainProgress

        keep = ROOT / "runs" if (ROOT / "runs").exists() and not args.tiny else None  # tiny runs go to /tmp
        work = Path(tempfile.mkdtemp(prefix="bench-cost-", dir=keep))
        overrides = {"model.name": model_name(args, work), "run_dir": str(work / "run")}
        if args.tiny:
            overrides.update({"iterations": 2, "num_prompts": 2, "num_generations": 2, "rollout.max_new_tokens": 8,
                              "gate.val_size": 4, "task.num_train": 16, "gate.eval_every": 2})
        run(load_config(ROOT / "configs" / "demo.toml", overrides), progress=PlainProgress())
        run_dir = work / "run"
    fig = cost_figures(run_dir)
    result.update(fig)
    if not fig["finished"]:
        print(f"bench_cost: note: the run at {run_dir} is {fig['status']}: the figures are over the "
              f"{fig['iterations']} iterations it has", file=sys.stderr)
    rows = [
        ["inference (rollouts)", f"{fig['inference_s']:.1f}", fig["inference_per_task_s"].fmt(".3f")],
        ["training (updates)", f"{fig['training_s']:.1f}", fig["training_per_task_s"].fmt(".3f")],
        [f"validation ({fig['validations']} x {fig['val_size']} held-out tasks)", f"{fig['validation_s']:.1f}",
         fig["validation_per_task_s"].fmt(".3f") if fig["validation_per_task_s"] else "-"],
        ["(inference + training) / inference", f"{fig['cost_ratio']:.2f}", fig["cost_ratio_per_iteration"].fmt(".2f")],
        ["tokens generated per second", f"{fig['generated_tokens']:.0f} tokens", fig["generated_tokens_per_s"].fmt(".1f")],
        ["tokens trained per second", f"{fig['trained_tokens']:.0f} tokens", fig["trained_tokens_per_s"].fmt(".1f")],
    ]
    print_table(f"cost of learning: {fig['iterations']} iterations x {fig['rollouts_per_iteration']} rollouts "
                f"({fig['skipped_updates']} updates skipped)" + ("" if fig["finished"] else f"; {fig['status']}"),
                ["figure", "run total (s)", "per task / iteration: median [min, max]"], rows)
    print(f"wrote {finish(result, 'cost', args.out)}")
    return result


if __name__ == "__main__":
    main()
