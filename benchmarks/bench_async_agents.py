"""Held-out success against wall-clock, synchronous against asynchronous (Ray), and two agents
whose tasks pull in opposite directions sharing one learner, each with its own gate.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/bench_async_agents.py    # about 5 minutes

A random model cannot solve arithmetic, so the task here is one it can learn in a few
updates, and it is said plainly: the policy is a small random Phi (``--hidden``,
``--layers``; its output bias makes it stop at once), the questions are reasoning-gym
chain_sum, and **success is about the length of the greedy answer**, not its value:

* ``LengthEnv(direction="long", threshold=N)``: solved when the greedy completion has at
  least N tokens (the base model: none);
* ``LengthEnv(direction="short", threshold=N)``: solved when it has at most N tokens (the
  base model: all).

The training reward (``length_goal``) is the dense version: the share of the token limit
used (long) or left (short). It is a stand-in for a real task whose held-out success moves
within minutes on 2 shared cores; the loop, the gate, the store and the timings are the
real ones.

1. ``sync`` and ``async`` (``--ray local``, 2 workers, ``max_staleness`` 1): one agent
   (short: the base model, with no EOS bias, runs to the token limit), the same tasks, seeds and settings; held-out success of each validated version
   against the wall-clock since the run started (``val/success`` in the store).
2. ``agents``: two agents, ``long`` on 3-4-term sums (at least half the token limit) and
   ``short`` on 2-term sums (at most ``--threshold`` tokens), into
   one learner (``[[agents]]``), each with its own held-out set and tolerance; the report
   lists each validated version's success per agent and each conflict.

Writes ``benchmarks/results/async_agents.json`` and ``docs/images/async_vs_sync.png``,
``docs/images/two_agents.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine, save_phi, write_result  # noqa: E402

from selfrl.envs.arithmetic import ReasoningGymEnv  # noqa: E402

LIMIT = [16]  # rollout.max_new_tokens, for the reward


class LengthEnv(ReasoningGymEnv):
    """chain_sum questions; solved when the greedy completion is long (>= threshold tokens)
    or short (<= threshold tokens), as ``direction`` says."""

    def __init__(self, direction: str = "long", threshold: int = 8, **options):
        if direction not in ("long", "short"):
            raise ValueError(f"direction must be 'long' or 'short', got {direction!r}")
        super().__init__("chain_sum", options)
        self.direction, self.threshold = direction, threshold

    def trajectory_answer(self, traj) -> str:
        return str(traj.num_completion_tokens)

    def score(self, task, answer) -> float:
        n = int(answer or 0)
        return float(n >= self.threshold if self.direction == "long" else n <= self.threshold)


def length_goal(traj, ctx) -> float:
    """The share of the token limit used (a ``long`` task) or left (``short``)."""
    source = ctx.source
    env = source.env(ctx.task)[0] if hasattr(source, "envs") else source
    share = min(traj.num_completion_tokens / LIMIT[0], 1.0)
    return share if env.direction == "long" else 1.0 - share


def make_cfg(model: str, run_dir: Path, args, mode: str):
    from selfrl.config import AgentConfig, DistributedConfig, RunConfig

    cfg = RunConfig(run_dir=str(run_dir), iterations=args.iterations, num_prompts=args.num_prompts,
                    num_generations=args.num_generations, reward_weights={"length_goal": 1.0}, engine="reference")
    cfg.model.name, cfg.model.device = model, "cpu"
    cfg.lora.r, cfg.lora.lora_alpha = 8, 32
    cfg.task.num_train = 64
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = LIMIT[0], 1, 1.0
    cfg.gate.val_size, cfg.gate.eval_every, cfg.gate.tolerance = args.val_size, 1, 0.05
    cfg.collapse.enabled = False  # the length task drives the KL rule on purpose; the gate is what is measured
    cfg.train.learning_rate, cfg.train.beta = args.learning_rate, 0.0
    if mode == "agents":
        cfg.agents = [
            AgentConfig("long", "bench_async_agents:LengthEnv",
                        {"direction": "long", "threshold": LIMIT[0] // 2, "min_terms": 3, "max_terms": 4,
                         "min_digits": 2, "max_digits": 2}, tolerance=0.1),
            AgentConfig("short", "bench_async_agents:LengthEnv",
                        {"direction": "short", "threshold": args.threshold, "min_terms": 2, "max_terms": 2,
                         "min_digits": 1, "max_digits": 1}, tolerance=0.1)]
    else:
        cfg.task.source = "bench_async_agents:LengthEnv"
        cfg.task.options = {"direction": "short", "threshold": args.threshold}
    if mode == "async":
        cfg.distributed = DistributedConfig(address="local", num_workers=2, max_staleness=1, worker_cpus=0.5,
                                            job_timeout_s=300)
    return cfg.validate()


def curve(run_dir: Path) -> list[tuple[float, float, int, str]]:
    """``(seconds since the run's first metric, held-out success, version, its status)`` of each
    validation (the version validated is the ``version`` metric of the same step)."""
    from selfrl.record.store import Store

    with Store(run_dir / "selfrl.db", readonly=True) as store:
        rows = store.metrics()
        status = {v["version"]: v["status"] for v in store.versions()}
        t0 = min(m["wall_time"] for m in rows)
        versions = {m["step"]: int(m["value"]) for m in rows if m["name"] == "version"}
        out = []
        for m in rows:
            if m["name"] == "val/success":
                v = versions.get(m["step"], 0) if out else 0
                out.append((m["wall_time"] - t0, m["value"], v, status.get(v, "?")))
    return out


def agents_table(run_dir: Path) -> dict:
    """Per validated version: its status and each agent's held-out success; and the conflicts."""
    from selfrl.envs.agents import agent_results
    from selfrl.record.store import Store

    with Store(run_dir / "selfrl.db", readonly=True) as store:
        versions = []
        for v in store.versions():
            res = store.evaluation(v["version"])
            if res:
                per = {a: sum(r.values()) / len(r) for a, r in agent_results(res).items()}
                versions.append({"version": v["version"], "status": v["status"], "success": per})
        conflicts = [{k: e["data"][k] for k in ("version", "agent", "champion_success", "candidate_success",
                                                 "drop", "tolerance")} | {"lost_tasks": len(e["data"]["lost_tasks"])}
                     for e in store.events() if e["kind"] == "agent_conflict"]
    return {"versions": versions, "conflicts": conflicts}


def plot_curves(curves: dict[str, list], path: Path, title: str) -> None:
    """The served (champion's) held-out success as a step line; rejected candidates as crosses."""
    from matplotlib.figure import Figure

    from selfrl.report.figures import RUN_COLOURS, save

    fig = Figure(figsize=(6.4, 3.8))
    ax = fig.add_subplot()
    for (name, pts), colour in zip(curves.items(), RUN_COLOURS):
        served = [p for p in pts if p[3] in ("base", "promoted")]
        ax.plot([p[0] for p in served], [p[1] for p in served], marker="o", color=colour, label=name,
                drawstyle="steps-post")
        rejected = [p for p in pts if p[3] not in ("base", "promoted")]
        ax.scatter([p[0] for p in rejected], [p[1] for p in rejected], marker="x", color=colour)
    ax.set_xlabel("wall-clock since the run started (s); x: a rejected candidate")
    ax.set_ylabel("held-out success of the served version")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.subplots_adjust(bottom=0.16)
    save(fig, path)


def plot_agents(table: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    from selfrl.report.figures import MARK_STYLE, RUN_COLOURS, save
    from selfrl.report.timeline import Mark

    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    rows = table["versions"]
    agents = sorted({a for r in rows for a in r["success"]})
    for agent, colour in zip(agents, RUN_COLOURS):
        ax.plot([r["version"] for r in rows], [r["success"][agent] for r in rows], marker="o", color=colour,
                label=f"agent {agent}")
    for r in rows:
        mark = {"promoted": Mark.PROMOTE, "rejected": Mark.REJECT}.get(r["status"])
        if mark is not None:
            symbol, colour, label = MARK_STYLE[mark]
            ax.scatter([r["version"]], [1.08], marker=symbol, color=colour, clip_on=False)
    ax.set_xlabel("validated version (^ promoted, X rejected by an agent's gate)")
    ax.set_ylabel("held-out success per agent")
    ax.set_ylim(-0.05, 1.12)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    ax.set_title(title, fontsize=9)
    fig.subplots_adjust(bottom=0.16)
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--val-size", type=int, default=16)
    p.add_argument("--threshold", type=int, default=4, help="a short answer has at most this many tokens")
    p.add_argument("--learning-rate", type=float, default=2e-2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--eos-bias", type=float, default=0.0, help="output bias at EOS (0: the greedy answer runs long)")
    p.add_argument("--modes", nargs="*", default=["sync", "async", "agents"])
    p.add_argument("--keep", help="keep the run folders here")
    args = p.parse_args()
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    # Ray workers import LengthEnv by its dotted path: they inherit this PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    from selfrl.run.main import run
    from selfrl.envs.rewards import REWARD_FUNCS

    REWARD_FUNCS["length_goal"] = length_goal
    sys.modules.setdefault("bench_async_agents", sys.modules[__name__])
    result = {"machine": machine(), "load_before": loadavg(), "settings": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = save_phi(work / "model", args.hidden, args.layers, args.eos_bias)
        for mode in args.modes:
            run_dir = work / mode
            t0 = time.perf_counter()
            out = run(make_cfg(model, run_dir, args, mode))
            seconds = time.perf_counter() - t0
            entry = {"seconds": seconds, "base": out.base_success, "final": out.final_success,
                     "final_version": out.final_version, "curve": curve(run_dir)}
            if mode == "agents":
                entry["agents"] = agents_table(run_dir)
            result["runs"][mode] = entry
            print(f"{mode}: {seconds:.0f} s, held-out {out.base_success:.3f} -> {out.final_success:.3f} "
                  f"(version {out.final_version})", flush=True)
            if mode == "async":
                import ray

                ray.shutdown()
    result["load_after"] = loadavg()
    images = ROOT / "docs" / "images"
    runs = result["runs"]
    if "sync" in runs and "async" in runs:
        plot_curves({"synchronous": runs["sync"]["curve"], "asynchronous (Ray, 2 workers, staleness <= 1)":
                     runs["async"]["curve"]}, images / "async_vs_sync.png",
                    f"held-out success (greedy answer <= {args.threshold} tokens), small random Phi, 2 shared cores")
    if "agents" in runs:
        plot_agents(runs["agents"]["agents"], images / "two_agents.png",
                    "two agents pulling in opposite directions, one shared adapter, a gate per agent")
        for c in runs["agents"]["agents"]["conflicts"]:
            print(f"  conflict: version {c['version']}: agent {c['agent']} {c['champion_success']:.3f} -> "
                  f"{c['candidate_success']:.3f} (tolerance {c['tolerance']}), {c['lost_tasks']} tasks lost")
        for v in runs["agents"]["agents"]["versions"]:
            print(f"  version {v['version']} {v['status']}: " +
                  ", ".join(f"{a} {s:.3f}" for a, s in v["success"].items()))
    print(json.dumps({m: {k: v for k, v in e.items() if k in ("seconds", "base", "final", "final_version")}
                      for m, e in runs.items()}))
    write_result("async_agents", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
