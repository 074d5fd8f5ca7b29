"""Scaling: seconds per update against num_generations, completion length and LoRA rank.

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_scaling.py --repeats 2   # ~5 min
    .venv/bin/python benchmarks/bench_scaling.py --tiny                                                # seconds

Each point is one ``Learner.step`` (the demo's update settings, ``beta > 0`` so the KL
reference pass is included) on a synthetic batch: ``num_prompts`` real chain_sum prompts
(system text, tool description and worked example, as in a run) each followed by
``num_generations`` completions of exactly ``completion_length`` random tokens, every one
with a non-zero advantage. Only the update is timed, never the sampling; one variable
moves at a time from the base point. Writes ``benchmarks/results/scaling.json`` and
``docs/scaling.png`` (with ``--plot``).
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, base_parser, command_line, envelope, finish, model_name, print_table, timed  # noqa: E402

BASE = {"num_generations": 8, "completion_length": 48, "lora_r": 16}
GRID = {"num_generations": [4, 8, 16], "completion_length": [24, 48, 96], "lora_r": [4, 16, 64]}
TINY_GRID = {"num_generations": [2, 4], "completion_length": [4, 8], "lora_r": [2, 4]}


def synthetic_batch(tok, prompts: list[list[int]], num_generations: int, completion_length: int, seed: int = 0):
    """``len(prompts) x num_generations`` trajectories of random completion tokens.

    Advantages alternate +1/-1 within each group (all carry signal); the sampling logprobs
    are -2.0 per token (only the update's cost is measured, not what it learns).
    """
    from selfrl.core.trajectory import Trajectory

    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    trajs = []
    for j, prompt in enumerate(prompts):
        for g in range(num_generations):
            completion = [rng.choice(vocab) for _ in range(completion_length - 1)] + [tok.eos_token_id]
            trajs.append(Trajectory(
                task_id=f"t{j}", group_id=f"g{j}", adapter_version=0, prompt_len=len(prompt),
                token_ids=prompt + completion, completion_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=[0.0] * len(prompt) + [-2.0] * len(completion), reward=float(g % 2),
                advantage=1.0 if g % 2 else -1.0, num_turns=1))
    return trajs


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per update (groups)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (e.g. docs/scaling.png)")
    args = p.parse_args(argv)
    from selfrl.chat.template import prompt_ids
    from selfrl.config import load_config
    from selfrl.model.load import build_policy
    from selfrl.rollout.agent import initial_messages
    from selfrl.envs import get_env
    from selfrl.core.tools import resolve_tools
    from selfrl.rl.learner import Learner

    result = envelope(args, command_line("bench_scaling.py", argv))
    name = model_name(args, Path(tempfile.mkdtemp(prefix="bench-scaling-")))
    grid = TINY_GRID if args.tiny else GRID
    base = {k: v[0] for k, v in grid.items()} if args.tiny else dict(BASE)
    if args.tiny:
        args.num_prompts = 2
    points = [dict(base)] + [{**base, k: v} for k, vs in grid.items() for v in vs if v != base[k]]
    rows, measured, models = [], [], {}
    for point in points:
        r = point["lora_r"]
        if r not in models:  # one model per rank, loaded once
            cfg = load_config(ROOT / "configs" / "demo.toml", {"model.name": name, "lora.r": r, "lora.lora_alpha": 2 * r,
                                                               "task.num_train": 16, "gate.val_size": 4})
            model, tok = build_policy(cfg)
            source = get_env(cfg.task.source, **cfg.task.options)
            train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
            tools = resolve_tools(cfg.rollout.tools)
            prompts = [prompt_ids(tok, initial_messages(t, tools, cfg.rollout, tok)) for t in train]
            models = {r: (model, tok, cfg, prompts)}  # keep one model in memory at a time
        model, tok, cfg, prompts = models[r]
        trajs = synthetic_batch(tok, prompts[:args.num_prompts], point["num_generations"], point["completion_length"])
        learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id, point["completion_length"])
        t, metrics = timed(lambda: learner.step(trajs).metrics(), args.repeats, warmup=0 if args.tiny else 1)
        seqs = len(trajs)
        measured.append({**point, "seconds": t, "sequences": seqs, "tokens": sum(len(x.token_ids) for x in trajs),
                         "completion_tokens": seqs * point["completion_length"], "skipped": metrics.get("skipped")})
        rows.append([point["num_generations"], point["completion_length"], r, seqs, t.fmt(".2f"),
                     f"{t.median / seqs:.3f}", f"{seqs * point['completion_length'] / t.median:.0f}"])
        print(f"{point}: {t.fmt('.2f')} s", flush=True)
    result.update({"model": name, "num_prompts": args.num_prompts, "base": base, "points": measured,
                   "beta": cfg.train.beta, "micro_batch_size": cfg.train.micro_batch_size})
    print_table(f"seconds per update ({args.num_prompts} prompts), median [min, max] of {args.repeats}",
                ["num_generations", "completion_length", "lora_r", "sequences", "s / update", "s / sequence",
                 "completion tokens/s"], rows)
    if args.plot:
        plot(measured, base, args.plot)
        result["plot"] = str(args.plot)
        print(f"plot: {args.plot}")
    print(f"wrote {finish(result, 'scaling', args.out)}")
    return result


def plot(measured: list[dict], base: dict, path: Path) -> None:
    """Three panels, one per variable, median with a min-max bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels = {"num_generations": "num_generations (2 prompts)", "completion_length": "completion length (tokens)",
              "lora_r": "LoRA rank"}
    for ax, key in zip(axes, labels):
        pts = sorted((m for m in measured if all(m[k] == base[k] for k in base if k != key)), key=lambda m: m[key])
        xs = [m[key] for m in pts]
        med = [m["seconds"].median for m in pts]
        err = [[m["seconds"].median - m["seconds"].min for m in pts], [m["seconds"].max - m["seconds"].median for m in pts]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(labels[key])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds per update")
    fig.suptitle("selfrl update time (median, min-max bars); base point " +
                 ", ".join(f"{k}={v}" for k, v in base.items()))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
