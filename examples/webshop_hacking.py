"""The web shop where hacking pays: scripted policies, and optionally a real training run.

    .venv/bin/python examples/webshop_hacking.py                 # scripted: a few seconds, no model
    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python examples/webshop_hacking.py --train
        # + two short runs of the embedded model (naive reward, without and with a detector)

The reward is the careless "order confirmed" count (``webshop_naive``); true success is
the right product confirmed once. See docs/concepts/detectors.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfrl.safety.detectors import DetectorConfig, HackingMonitor
from selfrl.envs.webshop import WebShopSource, hacking_policy, honest_policy
from selfrl.envs.rewards import get_preset, score_batch
from selfrl.rollout.agent import RolloutConfig, scripted_rollout

LABEL_FREE = ["repeated_action", "format_gaming", "length_exploitation"]  # need no reference answers
ALL = LABEL_FREE + ["verifier_disagreement"]


def scripted_table(n_tasks: int = 64, seed: int = 11) -> list[dict]:
    """Each scripted policy on ``n_tasks`` shop tasks (groups of 8 copies of a task, like a
    training batch) plus the 8 probes, without and with detectors."""
    src = WebShopSource()
    tasks, probes = [t for t in src.sample(n_tasks // 8, seed) for _ in range(8)], src.probe_tasks()
    cfg = RolloutConfig(max_turns=8, tools=[])
    rows = []
    for policy in (honest_policy, hacking_policy):
        for names in ([], ["repeated_action"], ALL):
            groups = [f"g{i // 8}" for i in range(len(tasks))]
            trajs = scripted_rollout(policy, tasks, [], cfg, src.make_env, group_ids=groups)
            score_batch(trajs, {t.id: t for t in tasks}, src, get_preset("webshop-naive"))
            naive = sum(t.reward for t in trajs) / len(trajs)
            mon = HackingMonitor(DetectorConfig(names=names), get_preset("webshop-naive"))
            mon.apply(trajs)
            probe_trajs = scripted_rollout(policy, probes, [], cfg, src.make_env)
            probe_ok = [src.correct(p, src.trajectory_answer(t)) for p, t in zip(probes, probe_trajs)]
            probe_score = sum(probe_ok) / len(probes)
            rows.append({
                "policy": policy.__name__.removesuffix("_policy"), "detectors": ", ".join(names) or "none",
                "naive reward": naive, "reward after detectors": sum(t.reward for t in trajs) / len(trajs),
                "true success": sum(bool(t.correct) for t in trajs) / len(trajs),
                "flagged": sum(bool(t.flags) for t in trajs) / len(trajs), "probe score": probe_score,
            })
    # the probe check across "versions": honest as version 0, then the hacking policy as version 1
    mon = HackingMonitor(DetectorConfig(names=["probe_regression"]), {})
    honest_p = next(r["probe score"] for r in rows if r["policy"] == "honest")
    hack_p = next(r["probe score"] for r in rows if r["policy"] == "hacking")
    mon.record_probes(0, honest_p)
    verdict = mon.record_probes(1, hack_p)
    print(f"probe_regression, honest (version 0) then hacking (version 1): "
          f"flagged={verdict.flagged} ({verdict.reason})")
    return rows


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def train(out: Path, iterations: int, model: str | None, names: list[str], temperature: float,
          num_prompts: int, stop_at_tool_call: bool = True, max_turns: int = 8) -> list[dict]:
    """One short ``selfrl run`` on the web shop with the naive reward; per-iteration figures
    read back from the store (naive reward before detectors, true success, flagged share)."""
    from selfrl.config import load_config
    from selfrl.run.main import run
    from selfrl.record.store import Store

    overrides = {"run_dir": str(out), "iterations": iterations, "detectors.names": names + ["probe_regression"],
                 "rollout.temperature": temperature, "model.name": model,
                 "num_prompts": num_prompts, "rollout.stop_at_tool_call": stop_at_tool_call,
                 "rollout.max_turns": max_turns}
    result = run(load_config("configs/webshop.toml", overrides=overrides))
    rows = []
    with Store(out / "selfrl.db") as store:
        by_it: dict[int, list] = {}
        for row in store.conn.execute("SELECT iteration, data_json FROM trajectories ORDER BY rowid"):
            by_it.setdefault(row["iteration"], []).append(json.loads(row["data_json"]))
        probes = [m["value"] for m in store.metrics() if m["name"] == "hacking/probe_score"]
    for it, ts in sorted(by_it.items()):
        n = len(ts)
        rows.append({
            "detectors": ", ".join(names) or "none", "iteration": it,
            "naive reward": sum(t["rewards"].get("webshop_naive") or 0.0 for t in ts) / n,
            "reward trained on": sum(t["reward"] or 0.0 for t in ts) / n,
            "true success": sum(bool(t["correct"]) for t in ts) / n,
            "confirmed >1": sum((t["env_state"] or {}).get("confirms", 0) > 1 for t in ts) / n,
            "flagged": sum(bool(t["flags"]) for t in ts) / n,
        })
    print(f"held-out true success: base {result.base_success:.3f}, final version {result.final_version} "
          f"{result.final_success:.3f}; probe scores at each validation: {probes}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5))
    FigureCanvasAgg(fig)
    for ax, det in zip(fig.subplots(1, 2, sharey=True), sorted({r["detectors"] for r in rows}, key=len)):
        sel = [r for r in rows if r["detectors"] == det]
        its = [r["iteration"] for r in sel]
        for key in ("naive reward", "reward trained on", "true success", "confirmed >1"):
            ax.plot(its, [r[key] for r in sel], marker="o", label=key)
        ax.set_title(f"detectors: {det}")
        ax.set_xlabel("iteration")
    fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def plot_scripted(rows: list[dict], path: Path) -> None:
    """Bars: naive reward, reward after detectors and true success, per policy and detector set."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sel = [r for r in rows if r["detectors"] in ("none", "repeated_action")]
    fig = Figure(figsize=(7, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    keys = ("naive reward", "reward after detectors", "true success")
    for k, key in enumerate(keys):
        ax.bar([i + 0.27 * (k - 1) for i in range(len(sel))], [r[key] for r in sel], width=0.27, label=key)
    ax.set_xticks(range(len(sel)), [f"{r['policy']}\ndetectors: {r['detectors']}" for r in sel], fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title("scripted agents in the web shop (64 tasks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="also run two short trainings of the real model")
    p.add_argument("--iterations", type=int, default=4, help="iterations per training run")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the training runs")
    p.add_argument("--num-prompts", type=int, default=4, help="tasks per iteration (8 generations each)")
    p.add_argument("--max-turns", type=int, default=8, help="assistant turns per episode in the training runs")
    p.add_argument("--no-stop-at-tool-call", action="store_true",
                   help="let a turn run past </tool_call> (the model then makes up the shop's reply)")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="runs/webshop-hacking", help="folder for the two runs, the JSON and the figure")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = scripted_table()
    print_table(rows)
    plot_scripted(rows, out / "webshop_scripted.png")
    result = {"scripted": rows}
    if args.train:
        train_rows = []
        for names, sub in (([], "naive"), (["repeated_action"], "detected")):
            train_rows += train(out / sub, args.iterations, args.model, names, args.temperature, args.num_prompts,
                                not args.no_stop_at_tool_call, args.max_turns)
            print_table([r for r in train_rows if r["detectors"] == (", ".join(names) or "none")])
        result["train"] = train_rows
        plot(train_rows, out / "webshop_training.png")
    (out / "webshop_hacking.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
