"""Do the sampling backends draw the same rollouts? Label-free group statistics side by side.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/bench_parity.py --seeds 6   # real model, ~10 min
    .venv/bin/python benchmarks/bench_parity.py --tiny                                    # seconds
    .venv/bin/python benchmarks/bench_parity.py --store runs/x/selfrl.db --store runs/y/selfrl.db

Each backend (:mod:`selfrl.engines`) runs the first iteration of ``make demo-label-free``
(``configs/demo.toml``, the ``label-free`` preset: ``num_prompts`` tasks x ``num_generations``
multi-turn rollouts with the calculator) on the base policy, once per seed: seed ``s`` takes
the tasks of iteration ``s`` and ``torch.manual_seed(s)``, the same for every backend. The
rollouts are scored and their GRPO advantages computed as ``selfrl run`` does, and the
per-iteration statistics of the label-free signal are pooled per backend: tool use, correct
answers, the share of groups with no reward spread (no gradient), distinct completions and
answers per group, the mean reward, and the advantage summed over tool-using rollouts (what
pushes the policy toward the calculator in the first update). Two-sample tests
(:mod:`selfrl.engines.two_sample`) say whether the backends differ: chi-square on first tokens, tool
use and turn counts; Mann-Whitney on completion lengths, rewards and distinct completions per group.

``--store`` prints the same per-iteration statistics from the stores of finished runs instead;
with ``--pit`` it also checks each store's first-iteration sampling on its own: the model's
logits are recomputed at every sampled position, and the randomized probability integral
transforms of the sampled ids under ``softmax(logits / temperature)`` must be i.i.d.
uniform (:func:`selfrl.engines.two_sample.sampling_pit`, Kolmogorov-Smirnov). A sampler that is too
sharp, too flat, truncated (top-k, top-p) or off the logits fails it, whatever the task.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, command_line, bench_config, envelope, finish, model_name, print_table  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"


def group_stats(trajs: list[dict]) -> dict[str, float]:
    """Statistics of one iteration's rollouts, given as stored trajectory dicts
    (``Trajectory.to_dict()`` / the store's ``data_json``)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for t in trajs:
        groups[t["group_id"]].append(t)
    tool = [t for t in trajs if t["tool_calls"]]
    return {
        "rollouts": len(trajs),
        "groups": len(groups),
        "zero_spread_share": sum(len({t["reward"] for t in g}) == 1 for g in groups.values()) / len(groups),
        "distinct_completions_per_group": statistics.mean(
            len({tuple(t["token_ids"][t["prompt_len"]:]) for t in g}) for g in groups.values()),
        "distinct_answers_per_group": statistics.mean(len({t["final_answer"] for t in g}) for g in groups.values()),
        "reward_mean": statistics.mean(t["reward"] or 0.0 for t in trajs),
        "correct": statistics.mean(bool(t["correct"]) for t in trajs),
        "tool_use": len(tool) / len(trajs),
        "truncated": statistics.mean(bool(t["truncated"]) for t in trajs),
        "turns_mean": statistics.mean(t["num_turns"] for t in trajs),
        "completion_tokens_mean": statistics.mean(sum(t["completion_mask"]) for t in trajs),
        "advantage_on_tool_use": sum(t["advantage"] or 0.0 for t in tool),
    }


def store_stats(path: Path) -> dict[int, dict[str, float]]:
    """Per-iteration :func:`group_stats` of a run's store (read only)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    by_it: dict[int, list[dict]] = defaultdict(list)
    for it, data in con.execute("SELECT iteration, data_json FROM trajectories ORDER BY iteration"):
        by_it[it].append(json.loads(data))
    con.close()
    return {it: group_stats(ts) for it, ts in sorted(by_it.items())}


def store_pit(path: Path, model, temperature: float, iteration: int = 0, batch: int = 4) -> dict[str, float]:
    """KS test of the sampled ids of ``iteration`` in a store against ``model`` (the weights
    they were sampled with: the base model for iteration 0 of a run whose LoRA starts at zero)."""
    import torch

    from selfrl.engines.two_sample import ks_uniform, sampling_pit

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    trajs = [json.loads(d) for (d,) in con.execute("SELECT data_json FROM trajectories WHERE iteration = ?",
                                                  (iteration,))]
    con.close()
    gen = torch.Generator().manual_seed(0)
    pits, gaps = [], []
    with torch.no_grad():
        for i in range(0, len(trajs), batch):
            chunk = trajs[i:i + batch]
            width = max(len(t["token_ids"]) for t in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # (b, L) right-padded
            for r, t in enumerate(chunk):
                ids[r, :len(t["token_ids"])] = torch.tensor(t["token_ids"])
            hidden = model.model(input_ids=ids).last_hidden_state  # (b, L, H)
            for r, t in enumerate(chunk):
                pos = [k for k, m in enumerate(t["completion_mask"]) if m]
                logits = model.lm_head(hidden[r, [k - 1 for k in pos]]).float() / temperature  # (n, V)
                probs = torch.softmax(logits, -1)
                x = torch.tensor([t["token_ids"][k] for k in pos])
                pits += sampling_pit(probs, x, torch.rand(len(pos), generator=gen)).tolist()
                recorded = torch.tensor([t["logprobs"][k] for k in pos])
                gaps.append(float((torch.log_softmax(logits, -1).gather(-1, x[:, None]).squeeze(-1) - recorded).abs().max()))
    ks = ks_uniform(pits)
    return {"sampled_ids": len(pits), "ks_d": ks.statistic, "ks_p": ks.p_value, "pit_mean": statistics.mean(pits),
            "max_logprob_gap": max(gaps)}


def compare(a: list[dict], b: list[dict]) -> dict[str, float]:
    """p-values of two-sample tests between two backends' pooled rollouts (stored dicts)."""
    from selfrl.engines.two_sample import chi_square_homogeneity, mann_whitney

    def per_group(ts: list[dict]) -> list[int]:
        groups: dict[str, set] = defaultdict(set)
        for t in ts:
            groups[t["group_id"]].add(tuple(t["token_ids"][t["prompt_len"]:]))
        return [len(s) for s in groups.values()]

    def first(ts: list[dict]) -> list[int]:
        return [t["token_ids"][t["prompt_len"]] for t in ts]

    return {
        "first_token_chi2_p": chi_square_homogeneity(first(a), first(b)).p_value,
        "tool_use_chi2_p": chi_square_homogeneity([bool(t["tool_calls"]) for t in a],
                                                  [bool(t["tool_calls"]) for t in b]).p_value,
        "turns_chi2_p": chi_square_homogeneity([t["num_turns"] for t in a], [t["num_turns"] for t in b]).p_value,
        "completion_tokens_mw_p": mann_whitney([sum(t["completion_mask"]) for t in a],
                                               [sum(t["completion_mask"]) for t in b]).p_value,
        "reward_mw_p": mann_whitney([t["reward"] or 0.0 for t in a], [t["reward"] or 0.0 for t in b]).p_value,
        "distinct_per_group_mw_p": mann_whitney(per_group(a), per_group(b)).p_value,
    }


def _rows(label: str, stats: dict[str, float]) -> list:
    return [label, f"{stats['tool_use']:.3f}", f"{stats['correct']:.3f}", f"{stats['zero_spread_share']:.2f}",
            f"{stats['distinct_completions_per_group']:.2f}", f"{stats['distinct_answers_per_group']:.2f}",
            f"{stats['reward_mean']:.3f}", f"{stats['completion_tokens_mean']:.1f}",
            f"{stats['advantage_on_tool_use']:+.2f}"]


COLUMNS = ["", "tool use", "correct", "zero-spread groups", "distinct compl./group", "distinct answers/group",
           "mean reward", "completion tokens", "advantage on tool use"]


def main(argv: list[str] | None = None) -> Path:
    p = base_parser(__doc__, repeats=False)
    p.add_argument("--engines", default="reference,slots", help="backends, comma-separated (selfrl.engines)")
    p.add_argument("--seeds", type=int, default=6, help="first iterations sampled per backend (seed = iteration)")
    p.add_argument("--preset", default="label-free", help="reward preset the rollouts are scored with")
    p.add_argument("--store", action="append", default=[], help="print a finished run's statistics instead")
    p.add_argument("--pit", action="store_true", help="with --store: check the first iteration's sampling on its own")
    args = p.parse_args(argv)
    result = envelope(args, command_line("bench_parity.py", argv))
    if args.store:
        result["stores"] = {}
        for path in args.store:
            per_it = store_stats(Path(path))
            result["stores"][path] = per_it
            print_table(f"{path}, per iteration", COLUMNS, [_rows(f"iteration {i}", s) for i, s in per_it.items()])
        if args.pit:
            from selfrl.model.load import load_model

            model, _ = load_model(model_name(args, Path(tempfile.mkdtemp(prefix="bench-parity-"))))
            result["pit"] = {}
            for path in args.store:
                cfg = json.loads((Path(path).parent / "config.json").read_text())
                result["pit"][path] = pit = store_pit(Path(path), model, cfg["rollout"]["temperature"])
                print(f"{path}: iteration 0, " + ", ".join(f"{k} {v:.4g}" for k, v in pit.items()), flush=True)
        return finish(result, "parity_stores", args.out)

    import torch

    from selfrl.engines import make_engine
    from selfrl.model.load import build_policy
    from selfrl.run.loop import iteration_tasks
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.rl.advantages import group_advantages
    from selfrl.envs import get_env
    from selfrl.core.tools import resolve_tools

    tiny = {"num_prompts": 2, "num_generations": 4, "rollout.max_new_tokens": 8, "task.num_train": 16, "gate.val_size": 2}
    cfg = bench_config(args, CONFIG, "bench-parity-", tiny, preset=args.preset)
    names = args.engines.split(",")
    model, tok = build_policy(cfg)
    engines = {n: make_engine(n, model, tok) for n in names}
    source = get_env(cfg.task.source, **cfg.task.options)
    train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    tools = resolve_tools(cfg.rollout.tools)
    weights = get_preset(args.preset)
    from selfrl.rollout.agent import rollout

    pooled: dict[str, list[dict]] = {n: [] for n in names}
    per_seed: dict[str, list[dict]] = {n: [] for n in names}
    for s in range(args.seeds):
        batch = iteration_tasks(train, s, cfg.num_prompts, cfg.task.train_seed)
        tasks = [t for t in batch for _ in range(cfg.num_generations)]
        groups = [f"{s}-{j}" for j, _ in enumerate(batch) for _ in range(cfg.num_generations)]
        for n in names:  # backends take turns seed by seed: the machine's load falls on both alike
            torch.manual_seed(s)
            t0 = time.perf_counter()
            trajs = rollout(engines[n], tasks, groups, tools, cfg.rollout)
            seconds = time.perf_counter() - t0
            score_batch(trajs, {t.id: t for t in batch}, source, weights)
            adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], cfg.train.scale_rewards,
                                   num_completion_tokens=[t.num_completion_tokens for t in trajs])
            for t, a in zip(trajs, adv.advantages):
                t.advantage = a
            stored = [t.to_dict() for t in trajs]
            pooled[n] += stored
            st = group_stats(stored)
            st["seconds"] = seconds
            per_seed[n].append(st)
            print(f"seed {s} {n}: " + ", ".join(f"{k} {v:.3g}" for k, v in st.items()), flush=True)
    for e in engines.values():
        if hasattr(e, "close"):
            e.close()
    summary = {n: group_stats(pooled[n]) for n in names}
    result.update({"model": cfg.model.name, "preset": args.preset, "engines": names, "seeds": args.seeds,
                   "per_seed": per_seed, "pooled": summary})
    rows = [_rows(f"{n} (pooled, {args.seeds} seeds)", summary[n]) for n in names]
    rows += [_rows(f"{n} seed {s}", st) for n in names for s, st in enumerate(per_seed[n])]
    print_table(f"first iteration of {CONFIG.name} with the {args.preset} preset, per backend", COLUMNS, rows)
    if len(names) == 2:
        result["tests"] = compare(pooled[names[0]], pooled[names[1]])
        print_table(f"{names[0]} against {names[1]}: p-values", ["test", "p"],
                    [[k, f"{v:.3g}"] for k, v in result["tests"].items()])
    return finish(result, "parity", args.out)


if __name__ == "__main__":
    main()
