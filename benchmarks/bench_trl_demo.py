"""selfrl against TRL's GRPOTrainer on the arithmetic demo: same model, tasks, held-out set, LoRA, group size
and rollouts, compared after equal updates (the learning curve on BFCL: ``bench_trl.py``).

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_trl_demo.py   # real model, ~20 min
    .venv/bin/python benchmarks/bench_trl_demo.py --tiny                                    # seconds (smoke test)

Three processes, one after the other (each its own peak RSS, no thread pools fighting):

1. ``selfrl``: ``selfrl.run.main.run`` with ``configs/demo.toml`` (validation only at the end),
   every update saved as a version folder.
2. ``trl``: ``trl.GRPOTrainer`` with a peft ``LoraConfig`` of the same shape, on the same
   training tasks in the same order, an adapter saved after every step.
3. ``eval``: every adapter needed for the comparison scored by ``selfrl.safety.gate.validate``
   (greedy pass@1 on the same held-out tasks, multi-turn with the calculator), so both
   trainers' results are measured the same way.

What differs, on purpose or by necessity (see docs/results/benchmarks.md):

* TRL samples **single-turn** completions: its tool loop needs a chat template that renders
  tools and a known response parser, and SmolLM2's template has neither. TRL therefore
  gets the same prompt (system text with the tool description, the worked example, the
  task) and a reward that is selfrl's ``verified`` preset applied to that one turn: tool
  calls in the completion are run for ``tool_success``, the verifier checks the text
  outside them. Evaluation is multi-turn for both.
* Wall-clock counts only rollouts + updates (selfrl's ``time/rollout_s + time/update_s``;
  TRL's step time minus our adapter saving); model loading and validation are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT, Stats, base_parser, command_line, envelope, finish, in_memory_dataset, loadavg, model_name, peak_rss_bytes,
    print_table, run_child,
)
from trl_setup import grpo_args, grpo_trainer, load_trainable, step_timeline  # noqa: E402

CONFIG = ROOT / "configs" / "demo.toml"
TINY_OVERRIDES = {"rollout.max_new_tokens": 8, "rollout.max_turns": 2, "gate.val_size": 4, "gate.batch_size": 4,
                  "task.num_train": 16, "train.micro_batch_size": 4}


def bench_config(model: str, run_dir: Path, updates: int, num_prompts: int, num_generations: int, tiny: bool):
    """The demo config with validation only after the last update (the comparison evaluates itself)."""
    from selfrl.config import load_config

    overrides = {"model.name": model, "run_dir": str(run_dir), "iterations": updates, "num_prompts": num_prompts,
                 "num_generations": num_generations, "gate.eval_every": updates}
    if tiny:
        overrides.update(TINY_OVERRIDES)
    return load_config(CONFIG, overrides)


# ------------------------------------------------------------------ workers (one process each)


def worker_selfrl(cfg_dict: dict, out: Path) -> None:
    """Run ``selfrl.run.main.run``; write per-update times, versions and peak RSS to ``out``."""
    from selfrl.config import load_config
    from selfrl.run.main import run
    from selfrl.run.progress import PlainProgress
    from selfrl.record.store import Store

    cfg = load_config(base=cfg_dict)
    t = time.perf_counter()
    result = run(cfg, progress=PlainProgress())
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    steps, elapsed = [], 0.0
    for r in rows:
        if "time/rollout_s" not in r:
            continue
        elapsed += r["time/rollout_s"] + r.get("time/update_s", 0.0)
        version = int(r["version"])
        steps.append({"step": r["step"] + 1, "seconds": elapsed, "rollout_s": r["time/rollout_s"],
                      "update_s": r.get("time/update_s", 0.0), "version": version,
                      "adapter": str(Path(cfg.run_dir) / "adapters" / f"v{version:06d}"),
                      "reward": r.get("reward/mean"), "correct": r.get("train/correct")})
    store = Store(Path(cfg.run_dir) / "selfrl.db")
    evals = {v["version"]: store.evaluation(v["version"]) for v in store.versions()}
    store.close()
    json.dump({"steps": steps, "wall_s": wall, "peak_rss_bytes": peak_rss_bytes(), **process_load(),
               "evaluations": {str(k): v for k, v in evals.items() if v}, "summary": result.summary},
              open(out, "w"), default=str)


def worker_trl(cfg_dict: dict, out: Path) -> None:
    """Train with TRL's ``GRPOTrainer`` on the tasks selfrl sees, in the same order."""
    from selfrl.config import load_config
    from selfrl.run.loop import iteration_tasks
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.rollout.agent import initial_messages
    from selfrl.envs import get_env
    from selfrl.chat.toolcall import execute_call, parse_tool_calls
    from selfrl.core.tools import resolve_tools
    from selfrl.core.trajectory import Trajectory

    cfg = load_config(base=cfg_dict)
    source = get_env(cfg.task.source, **cfg.task.options)
    train, _ = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    tasks = [t for it in range(cfg.iterations) for t in iteration_tasks(train, it, cfg.num_prompts, cfg.task.train_seed)]
    by_id = {t.id: t for t in tasks}
    tools = resolve_tools(cfg.rollout.tools)
    tool_map = {t.name: t for t in tools}
    weights = cfg.reward_weights or get_preset(cfg.preset)
    model, tok = load_trainable(cfg.model.name)
    data = in_memory_dataset([{"prompt": initial_messages(t, tools, cfg.rollout, tok), "task_id": t.id} for t in tasks],
                             "bench-trl-demo")

    def selfrl_reward(prompts, completions, task_id, **kwargs):
        """selfrl's reward preset on a one-turn trajectory (tool calls run, answer verified)."""
        trajs = []
        for c, tid in zip(completions, task_id):
            text = c[-1]["content"] if isinstance(c, list) else c
            rest, calls = parse_tool_calls(text)
            trajs.append(Trajectory(task_id=tid, group_id=tid, adapter_version=0, final_answer=rest, num_turns=1,
                                    tool_calls=[execute_call(x, tool_map) for x in calls]))
        score_batch(trajs, by_id, source, weights)
        return [t.reward for t in trajs]

    timeline = step_timeline(Path(cfg.run_dir) / "adapters", 4, details=True)
    steps = timeline.steps
    args = grpo_args(cfg, gradient_checkpointing=False, max_steps=cfg.iterations)
    trainer = grpo_trainer(cfg, model, tok, selfrl_reward, args, data, timeline)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    json.dump({"steps": steps, "wall_s": wall, "peak_rss_bytes": peak_rss_bytes(), **process_load(),
               "log_history": trainer.state.log_history, "config": args.to_dict()}, open(out, "w"), default=str)


def worker_eval(cfg_dict: dict, adapters: dict[str, str | None], out: Path) -> None:
    """Held-out greedy pass@1 of each adapter (None = the base model) with ``selfrl.safety.gate.validate``."""
    from safetensors.torch import load_file

    from selfrl.config import load_config
    from selfrl.engines.reference import Engine
    from selfrl.safety.gate import validate
    from selfrl.model.load import build_policy
    from selfrl.envs import get_env
    from selfrl.core.tools import resolve_tools

    cfg = load_config(base=cfg_dict)
    source = get_env(cfg.task.source, **cfg.task.options)
    _, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    tools = resolve_tools(cfg.rollout.tools)
    model, tok = build_policy(cfg)  # B = 0: the base model until a version is swapped in
    engine = Engine(model, tok)
    results = {}
    for k, (name, path) in enumerate(adapters.items(), start=1):
        if path is not None:
            engine.swap(load_file(str(Path(path) / "adapter_model.safetensors")), k)  # selfrl's and TRL's alike
        res = validate(engine, val, source, tools, cfg.rollout, cfg.gate.batch_size)
        results[name] = {t: c for t, c, _ in res.results}
    json.dump({"results": results, "peak_rss_bytes": peak_rss_bytes()}, open(out, "w"))


def process_load() -> dict:
    """This process's CPU seconds (user + system) and the load average now: a wall time
    measured while other jobs ran shows as CPU seconds well below ``2 x wall``."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "loadavg_end": loadavg()}


def _call(args, worker: str, payload: dict, workdir: Path) -> dict:
    out = workdir / f"{worker}.json"
    if args.reuse and out.exists():  # finished in an earlier, interrupted invocation
        return json.loads(out.read_text())
    spec = workdir / f"{worker}-input.json"
    spec.write_text(json.dumps(payload))
    if args.inprocess:
        WORKERS[worker](**payload, out=out)
        return json.loads(out.read_text())
    return run_child([__file__, "--worker", worker, "--input", str(spec), "--output", str(out)], out)


WORKERS = {"selfrl": worker_selfrl, "trl": worker_trl, "eval": worker_eval}


# ------------------------------------------------------------------ comparison


def checkpoint_at(steps: list[dict], seconds: float) -> dict | None:
    """The last step finished within ``seconds`` of training time, or None (base model).

    >>> checkpoint_at([{"seconds": 10.0}, {"seconds": 25.0}], 20.0)
    {'seconds': 10.0}
    >>> checkpoint_at([{"seconds": 10.0}], 5.0) is None
    True
    """
    done = [s for s in steps if s["seconds"] <= seconds + 1e-9]
    return done[-1] if done else None


def rate(per_task: dict[str, bool]) -> float:
    return sum(per_task.values()) / max(len(per_task), 1)


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__, repeats=False)
    p.add_argument("--updates", type=int, default=4, help="updates (optimizer steps) for each trainer")
    p.add_argument("--num-prompts", type=int, default=8, help="tasks per update")
    p.add_argument("--num-generations", type=int, default=8, help="samples per task (group size)")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-trl", help="run folders and adapters")
    p.add_argument("--reuse", type=Path, help="continue in this earlier workdir, keeping the workers that finished")
    p.add_argument("--inprocess", action="store_true", help="run the workers in this process (smoke test)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        WORKERS[args.worker](**json.loads(args.input.read_text()), out=args.output)
        return {}
    if args.tiny:
        args.updates, args.num_prompts, args.num_generations = 2, 2, 2
    import trl  # noqa: F401  fail early with a clear message when the extra is not installed

    result = envelope(args, command_line("bench_trl_demo.py", argv))
    result["trl_version"] = trl.__version__
    workdir = args.reuse or args.workdir / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=bool(args.reuse))
    model = model_name(args, workdir)
    cfgs = {name: bench_config(model, workdir / name, args.updates, args.num_prompts, args.num_generations, args.tiny)
            for name in ("selfrl", "trl")}
    if args.tiny:
        cfgs["trl"].train.micro_batch_size = 2
    ours = _call(args, "selfrl", {"cfg_dict": cfgs["selfrl"].to_dict()}, workdir)
    theirs = _call(args, "trl", {"cfg_dict": cfgs["trl"].to_dict()}, workdir)
    t_equal = min(ours["steps"][-1]["seconds"], theirs["steps"][-1]["seconds"])
    picks = {"selfrl@budget": ours["steps"][-1], "trl@budget": theirs["steps"][-1],
             "selfrl@time": checkpoint_at(ours["steps"], t_equal), "trl@time": checkpoint_at(theirs["steps"], t_equal)}
    known = ours["evaluations"]  # selfrl's own run already evaluated the base and its last version
    need = {"base": None} if "0" not in known else {}
    for name, step in picks.items():
        if step is not None and not (name.startswith("selfrl") and str(step["version"]) in known):
            need[step["adapter"]] = step["adapter"]
    evals = _call(args, "eval", {"cfg_dict": cfgs["selfrl"].to_dict(), "adapters": need}, workdir)["results"] if need else {}

    def success(name: str) -> float:
        step = picks[name]
        if step is None:
            return rate(known["0"] if "0" in known else evals["base"])
        if name.startswith("selfrl") and str(step["version"]) in known:
            return rate(known[str(step["version"])])
        return rate(evals[step["adapter"]])

    per_update = {n: Stats.of([s["rollout_s"] + s["update_s"] for s in ours["steps"]]) if n == "selfrl"
                  else Stats.of([s["step_s"] for s in theirs["steps"]]) for n in ("selfrl", "trl")}
    base = rate(known["0"]) if "0" in known else rate(evals["base"])
    rows = {
        "held-out success, equal rollouts": (success("selfrl@budget"), success("trl@budget")),
        f"held-out success, equal wall-clock ({t_equal:.0f} s)": (success("selfrl@time"), success("trl@time")),
        "seconds per update (median)": (per_update["selfrl"].median, per_update["trl"].median),
        "training wall-clock, all updates (s)": (ours["steps"][-1]["seconds"], theirs["steps"][-1]["seconds"]),
        "peak RSS (GB)": (ours["peak_rss_bytes"] / 1e9, theirs["peak_rss_bytes"] / 1e9),
    }
    result.update({
        "updates": args.updates, "num_prompts": args.num_prompts, "num_generations": args.num_generations,
        "rollouts_per_trainer": args.updates * args.num_prompts * args.num_generations,
        "base_success": base, "equal_time_s": t_equal, "picks": picks,
        "rows": {k: {"selfrl": a, "trl": b, "ratio": ratio(a, b)} for k, (a, b) in rows.items()},
        "seconds_per_update": per_update, "selfrl": ours, "trl": theirs, "evaluated": list(need),
        "workdir": str(workdir), "config": cfgs["selfrl"].to_dict(),
    })
    print_table(f"selfrl vs TRL {result['trl_version']} ({result['rollouts_per_trainer']} rollouts each; "
                f"base {base:.3f})", ["figure", "selfrl", "TRL", "selfrl/TRL"],
                [[k, f"{a:.3f}", f"{b:.3f}", "-" if ratio(a, b) is None else f"{ratio(a, b):.2f}"]
                 for k, (a, b) in rows.items()] +
                [["seconds per update [min, max]", per_update["selfrl"].fmt(".1f"), per_update["trl"].fmt(".1f"), ""]])
    print(f"load average: start {result['loadavg_start']:.2f}, end {loadavg():.2f}")
    print(f"wrote {finish(result, 'trl', args.out)}")
    return result


if __name__ == "__main__":
    main()
