"""The run report: ``report.md``, an overview figure at the top and one PNG per logged metric.

Everything comes from the store (metrics, events, adapter versions, per-task held-out
evaluations) and from a small ``summary`` dict of run totals. The before/after
comparison is paired: the base and the final version are compared on the held-out
tasks both were evaluated on (:func:`selfrl.core.stats.paired_difference_ci`).

:func:`rebuild_report` writes the same report from a run directory alone, at any
time: for a finished run, a run in progress (the store is opened read-only) or a
killed one (``selfrl report RUN_DIR``). A ``selfrl serve`` run directory gets the
serving report instead (:mod:`selfrl.report.serve`).

Plots are drawn on a ``FigureCanvasAgg`` directly, so writing a report neither
needs a display nor changes the process-wide matplotlib backend.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from selfrl.report.figures import overview_figure, save
from selfrl.config import GateConfig
from selfrl.record.rundir import check_folder
from selfrl.record.runlock import RunDirLock
from selfrl.record.serve_rule import ServedChoice, choose_served
from selfrl.record.versions import VersionRecord
from selfrl.report.serve import write_serve_report
from selfrl.core.stats import paired_difference_ci, wilson_interval
from selfrl.core.wording import plural
from selfrl.record.store import Store
from selfrl.report.timeline import Mark, Timeline, duration, event_mark, load_timeline

# Plotted first, in this order; any other logged metric follows alphabetically.
KEY_METRICS = ("reward/mean", "kl", "val/success", "loss")
TIME_KEYS = ("time_inference_s", "time_training_s", "time_validation_s")
OVERVIEW_CAPTION = (
    "Held-out success with its 95 % Wilson interval (band) and the base model's level (dashed); "
    "dotted vertical lines mark promotions, rejections, rollbacks and collapse rollbacks. "
    "The panels against updates place a validation after the update it follows."
)


def write_report(run_dir: Path, store: Store, run_id: int, summary: dict[str, Any],
                 label: str | None = None) -> Path:
    """Write ``run_dir/report.md``, ``run_dir/plots/overview.png`` and one plot per metric.

    Args:
        run_dir: output folder (created if missing).
        store: the run's store.
        run_id: which run's metrics to plot.
        summary: run totals. Read: ``base_version`` and ``final_version``
            (adapter versions to compare on the held-out set; the final one is the one served),
            ``gate_rule`` and ``gate_tolerance`` (the rule that chose it: :func:`served_lines`),
            ``time_inference_s``, ``time_training_s``, ``time_validation_s``
            (seconds). Any other keys are listed as they are. Missing keys are
            reported as "n/a".
        label: the run's name in the heading and on the overview figure (default: the folder).

    Returns:
        The path of ``report.md``.

    Missing data (no metrics, a metric with only NaN, a version never
    evaluated) skips that plot or row; it does not raise.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_metrics(store.metrics(), run_dir / "plots")  # every session of this run directory
    lines = [f"# selfrl run report: {label or run_dir}", ""]
    timeline = load_timeline(store, Path(label).name if label else run_dir.name)
    if timeline.series:
        save(overview_figure([timeline], "update", overview_title(timeline)), run_dir / "plots" / "overview.png")
        lines += ["![overview](plots/overview.png)", "", OVERVIEW_CAPTION, ""]
    lines += heldout_section(store, summary.get("base_version"), summary.get("final_version"))
    lines += served_lines(store, summary.get("gate_rule"), summary.get("gate_tolerance"))
    lines += warm_start_section(store)
    lines += time_section(summary)
    lines += versions_section(store)
    lines += agents_section(store)
    lines += judge_section(store)
    lines += other_summary_section(summary)
    lines += events_section(store)
    lines += ["## Metrics", ""]
    if plots:
        lines += [f"![{name}](plots/{path.name})" for name, path in plots.items()]
    else:
        lines.append("No metrics were logged.")
    lines.append("")
    out = run_dir / "report.md"
    out.write_text("\n".join(lines))
    return out


def series_by_name(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Metric rows -> ``{name: (steps, values)}``, dropping NULL and non-finite values."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        v = r["value"]
        if v is None or not math.isfinite(v):
            continue
        steps, values = series.setdefault(r["name"], ([], []))
        steps.append(r["step"])
        values.append(v)
    return series


def plot_metrics(rows: list[dict[str, Any]], plot_dir: Path) -> dict[str, Path]:
    """One PNG per metric with at least one finite value; returns ``{name: png path}``.

    Key metrics (:data:`KEY_METRICS`) come first. A metric name becomes a file
    name by replacing anything but letters, digits, ``-`` and ``.`` with ``_``
    (``reward/mean`` -> ``reward_mean.png``).
    """
    series = series_by_name(rows)
    names = [n for n in KEY_METRICS if n in series] + sorted(n for n in series if n not in KEY_METRICS)
    out: dict[str, Path] = {}
    if names:
        plot_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        steps, values = series[name]
        fig = Figure(figsize=(6, 3.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(steps, values, marker="o" if len(steps) < 50 else None, markersize=3)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(name)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = plot_dir / (re.sub(r"[^A-Za-z0-9.\-]", "_", name) + ".png")
        fig.savefig(path, dpi=100)
        out[name] = path
    return out


def rate_with_ci(results: dict[str, bool]) -> str:
    """``"k/n = 0.xxx [low, high]"`` with the 95% Wilson interval."""
    k, n = sum(results.values()), len(results)
    low, high = wilson_interval(k, n)
    rate = k / n if n else float("nan")
    return f"{k}/{n} = {rate:.3f} [{low:.3f}, {high:.3f}]"


def heldout_section(store: Store, base: int | None, final: int | None) -> list[str]:
    """Before/after held-out success with Wilson CIs and the paired difference."""
    lines = ["## Held-out success", ""]
    if base is None or final is None:
        return lines + ["Base or final version not given; no comparison.", ""]
    before, after = store.evaluation(base), store.evaluation(final)
    lines += ["| | version | success, 95% Wilson CI |", "|---|---|---|"]
    for label, version, res in (("before", base, before), ("after (served)", final, after)):
        lines.append(f"| {label} | {version} | {rate_with_ci(res) if res else 'not evaluated'} |")
    lines.append("")
    shared = sorted(before.keys() & after.keys())
    if not shared:
        return lines + ["No held-out task was evaluated on both versions; no paired difference.", ""]
    diff, low, high = paired_difference_ci([before[t] for t in shared], [after[t] for t in shared])
    lines.append(
        f"Paired difference (after - before) on {len(shared)} shared tasks: "
        f"{diff:+.3f}, 95% CI [{low:+.3f}, {high:+.3f}] (normal approximation on per-task differences)."
    )
    if len(shared) < max(len(before), len(after)):
        lines.append("Tasks evaluated on only one of the two versions are left out of the paired difference.")
    return lines + [""]


RULES = {"newest": "the newest promoted version serves; each promotion was within gate.tolerance = {tol:g} "
                   "of the best held-out success so far",
         "best": "the version with the highest held-out success serves (the newer on a tie)"}


def served_lines(store: Store, rule: str | None, tolerance: float | None) -> list[str]:
    """Which version serves and why (:meth:`selfrl.record.serve_rule.ServedChoice.line`), the rule
    in words, and, when the best held-out version is another, the paired difference of the two;
    empty without a rule (a report written before runs recorded it)."""
    if rule is None or tolerance is None:
        return []
    versions = [VersionRecord.from_row(v) for v in store.versions()]
    if not any(v.servable for v in versions):
        return []
    choice = choose_served(versions, rule, tolerance)
    line = choice.line()
    lines = [line[0].upper() + line[1:] + ".", "",
             f"Rule (gate.rule = {rule!r}): " + RULES[rule].format(tol=tolerance) + "."]
    other = choice.best if choice.served != choice.best else choice.newest
    if other != choice.served:
        served, alt = store.evaluation(choice.served), store.evaluation(other)
        shared = sorted(served.keys() & alt.keys())
        if shared:
            d, lo, hi = paired_difference_ci([alt[t] for t in shared], [served[t] for t in shared])
            lines.append(f"Served version {choice.served} - version {other} on {len(shared)} shared held-out "
                         f"tasks: {d:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}].")
    return lines + [""]


def warm_start_section(store: Store) -> list[str]:
    """The warm start's line (``selfrl.run.warm_start``): its last ``warm_start`` event, with the
    numbers; empty when the run had none."""
    events = [e for e in store.events() if e["kind"] == "warm_start"]
    if not events:
        return []
    d = events[-1]["data"] or {}
    lines = ["## Warm start", "", events[-1]["message"], ""]
    keys = ("tasks", "samples", "successes", "flagged_dropped", "duplicates_dropped", "capped_dropped", "kept",
            "loss_before", "loss_after", "version", "outcome", "val_success", "seconds")
    shown = [(k, d[k]) for k in keys if d.get(k) is not None]
    if shown:
        lines += ["| " + " | ".join(k for k, _ in shown) + " |", "|" + "---|" * len(shown),
                  "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for _, v in shown) + " |", ""]
    return lines


def time_section(summary: dict[str, Any]) -> list[str]:
    """Wall-clock split between inference, training and validation, and the cost ratio."""
    times = {k: summary.get(k) for k in TIME_KEYS}
    lines = ["## Time", "", "| phase | seconds | share |", "|---|---|---|"]
    known = [v for v in times.values() if isinstance(v, (int, float)) and math.isfinite(v)]
    total = sum(known)
    for key, v in times.items():
        phase = key.removeprefix("time_").removesuffix("_s")
        if isinstance(v, (int, float)) and math.isfinite(v):
            share = f"{v / total:.1%}" if total > 0 else "n/a"
            lines.append(f"| {phase} | {v:.1f} | {share} |")
        else:
            lines.append(f"| {phase} | n/a | n/a |")
    inf, train = times["time_inference_s"], times["time_training_s"]
    if isinstance(inf, (int, float)) and isinstance(train, (int, float)) and inf > 0:
        ratio = f"{(inf + train) / inf:.2f}"
    else:
        ratio = "n/a"
    lines += ["", f"Cost ratio (inference + training) / inference: {ratio}", ""]
    return lines


def versions_section(store: Store) -> list[str]:
    """Table of adapter versions with their status and held-out success."""
    versions = store.versions()
    lines = ["## Adapter versions", ""]
    if not versions:
        return lines + ["No adapter versions recorded.", ""]
    lines += ["| version | parent | status | held-out success, 95% Wilson CI |", "|---|---|---|---|"]
    for v in versions:
        res = store.evaluation(v["version"])
        if res:
            success = rate_with_ci(res)
        elif isinstance(v["metrics"].get("val/success"), (int, float)):
            success = f"{v['metrics']['val/success']:.3f}"
        else:
            success = "not evaluated"
        parent = "" if v["parent"] is None else v["parent"]
        lines.append(f"| {v['version']} | {parent} | {v['status']} | {success} |")
    return lines + [""]


def agents_section(store: Store) -> list[str]:
    """A run with several agents (held-out task ids ``<agent>/<id>``): each validated version's
    held-out success per agent, and every conflict of the agents' gate (which agent lost, by
    how much, on which tasks). Empty for a run with one agent."""
    per_version = {}
    for v in store.versions():
        res = store.evaluation(v["version"])
        if res and all("/" in t for t in res):
            per_version[v["version"]] = (v["status"], res)
    if not per_version:
        return []
    agents = sorted({t.partition("/")[0] for _, res in per_version.values() for t in res})
    lines = ["## Agents", "", "Held-out success per agent (each on its own held-out set):", "",
             "| version | status | " + " | ".join(agents) + " |", "|---|---|" + "---|" * len(agents)]
    for version, (status, res) in per_version.items():
        cells = []
        for a in agents:
            mine = [c for t, c in res.items() if t.startswith(a + "/")]
            cells.append(f"{sum(mine) / len(mine):.3f} ({sum(mine)}/{len(mine)})" if mine else "n/a")
        lines.append(f"| {version} | {status} | " + " | ".join(cells) + " |")
    conflicts = [e for e in store.events() if e["kind"] == "agent_conflict"]
    lines += ["", f"Conflicts (a candidate that hurt an agent beyond its tolerance is not promoted): {len(conflicts)}", ""]
    for e in conflicts:
        d = e["data"] or {}
        ref = d.get("reference_success", d.get("champion_success", float("nan")))  # (older stores: the champion's)
        paired = d.get("paired_interval")
        ci = "" if not paired else (f", paired difference {d.get('paired_difference'):+.3f} "
                                    f"(95% CI {paired[0]:+.3f} to {paired[1]:+.3f})")
        lines.append(f"- version {d.get('version')}: agent **{d.get('agent')}** fell from "
                     f"{ref:.3f} to {d.get('candidate_success', float('nan')):.3f} "
                     f"(down {d.get('drop', float('nan')):.3f}, tolerance {d.get('tolerance')}{ci}); lost tasks: "
                     f"{', '.join(d.get('lost_tasks') or []) or 'none'}")
    return lines + [""]


def judge_section(store: Store) -> list[str]:
    """The LLM judge's calls, tokens, cost per update and per promoted version, and calibration
    (:func:`selfrl.judge.report.judge_lines`); empty when no judge metric was logged."""
    rows = [r for r in store.metrics() if r["name"].startswith("judge/")]
    if not rows:
        return []
    from selfrl.judge.report import judge_lines

    return judge_lines(rows, store.events())


def events_section(store: Store) -> list[str]:
    """Promotions, rollbacks and skipped updates of the run (all sessions), in order."""
    events = store.events()
    if not events:
        return []
    lines = ["## Events", "", "| kind | message |", "|---|---|"]
    lines += [f"| {e['kind']} | {e['message']} |" for e in events]
    return lines + [""]


def other_summary_section(summary: dict[str, Any]) -> list[str]:
    """Every summary key not shown elsewhere, as a two-column table."""
    shown = {"base_version", "final_version", "gate_rule", "gate_tolerance", "served", *TIME_KEYS}
    rest = {k: v for k, v in summary.items() if k not in shown}
    if not rest:
        return []
    lines = ["## Summary", "", "| key | value |", "|---|---|"]
    for k, v in rest.items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return lines + [""]


def overview_title(tl: Timeline) -> str:
    """``"name: held-out 9/128 → 128/128 (last validation), 4 updates, 256 rollouts, 6.1 min"``."""
    parts = []
    if tl.base is not None and tl.heldout:
        last = tl.heldout[-1]
        first = f"{tl.base.k}/{tl.base.n}" if tl.base.n else f"{tl.base.at.value:.2f}"
        final = f"{last.k}/{last.n}" if last.n else f"{last.at.value:.2f}"
        parts.append(f"held-out {first} → {final} (last validation)")
    parts += [plural(tl.updates, "update"), plural(tl.rollouts, "rollout"),
              duration(tl.elapsed_s)]
    return f"{tl.label}: " + ", ".join(parts)


def served_choice(store: Store, config: dict[str, Any]) -> ServedChoice | None:
    """The version a run serves by its config's ``gate.rule`` and ``gate.tolerance`` (the
    defaults of :class:`selfrl.config.GateConfig` for a config without them), or None when the
    store holds no base or promoted version."""
    gate, default = config.get("gate") or {}, GateConfig()
    versions = [VersionRecord.from_row(v) for v in store.versions()]
    if not any(v.servable for v in versions):
        return None
    return choose_served(versions, gate.get("rule", default.rule), gate.get("tolerance", default.tolerance))


def summary_from_store(store: Store, config: dict[str, Any]) -> dict[str, Any]:
    """The summary :func:`write_report` reads, rebuilt from the store and the run config:
    time totals over every session, the final version (the one ``gate.rule`` serves at the end:
    :func:`selfrl.record.serve_rule.choose_served`), counts of marked events, and the run's main
    settings."""
    totals: dict[str, float] = {}
    for row in store.metrics():
        if row["name"].startswith("time/") and row["value"] is not None:
            totals[row["name"]] = totals.get(row["name"], 0.0) + row["value"]
    inference, training = totals.get("time/rollout_s", 0.0), totals.get("time/update_s", 0.0)
    choice = served_choice(store, config)
    final = 0 if choice is None else choice.served
    rule, tolerance = (None, None) if choice is None else (choice.rule.value, choice.tolerance)
    marks = [event_mark(e["kind"], e["message"]) for e in store.events()]
    summary: dict[str, Any] = {
        "base_version": 0, "final_version": final, "gate_rule": rule, "gate_tolerance": tolerance,
        "time_inference_s": inference, "time_training_s": training,
        "time_validation_s": totals.get("time/validation_s", 0.0),
        "cost_ratio": (inference + training) / inference if inference else float("nan"),
        "promotions": marks.count(Mark.PROMOTE), "rejections": marks.count(Mark.REJECT),
        "rollbacks": marks.count(Mark.ROLLBACK), "collapse_events": marks.count(Mark.COLLAPSE),
        "num_trajectories": store.count_trajectories(), "sessions": len(store.runs()),
    }
    for key in ("model", "task", "preset", "num_prompts", "num_generations", "iterations"):
        value = config.get(key)
        if isinstance(value, dict):  # model and task are sections; their name says which
            value = value.get("name", value.get("source"))
        if value is not None:
            summary[key] = value
    return summary


def run_config(run_dir: Path, store: Store) -> dict[str, Any]:
    """The run's config: ``config.json`` when present, else the latest session's record."""
    path = run_dir / "config.json"
    if path.exists():
        return json.loads(path.read_text())
    runs = store.runs()
    return runs[-1]["config"] if runs else {}


def rebuild_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of ``run_dir`` from its store alone (``selfrl report``).

    The store is opened read-only, so this works while the run is still going (it shows
    what was committed so far) and after a kill. Written into ``run_dir`` itself, the report
    is that directory's one writer for the while (:mod:`selfrl.record.runlock`): refused while a
    run or server writes it; ``out`` elsewhere only reads. A ``selfrl serve`` run directory
    gets the serving report (:func:`selfrl.report.serve.write_serve_report`).

    Args:
        run_dir: a folder holding ``selfrl.db``.
        out: where ``report.md`` and ``plots/`` go (default: ``run_dir``).

    Returns:
        The path of ``report.md``.

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``selfrl.db``.
        selfrl.record.rundir.NotAFolder: ``out`` (or ``run_dir``) is a file.
        selfrl.record.store.NotAStore: ``selfrl.db`` is not a selfrl store.
        selfrl.record.runlock.RunDirLocked: ``out`` is ``run_dir`` and another process writes it.
    """
    run_dir = Path(run_dir)
    check_folder(run_dir)
    db = run_dir / "selfrl.db"
    if not db.exists():
        raise FileNotFoundError(f"no run at {run_dir}: {db} does not exist")
    out = Path(out) if out is not None else run_dir
    check_folder(out)
    inside = os.path.abspath(out) == os.path.abspath(run_dir)
    with Store(db, readonly=True) as store, (  # a file that is not a store is refused before the lock is taken
            RunDirLock(run_dir, "selfrl report", f"write the report elsewhere: selfrl report {run_dir} --out DIR")
            if inside else contextlib.nullcontext()):
        runs = store.runs()
        if runs and "serve" in runs[-1]["config"]:
            return write_serve_report(out, store, run_dir.name)
        summary = summary_from_store(store, run_config(run_dir, store))
        return write_report(out, store, runs[-1]["id"] if runs else 0, summary, label=str(run_dir))
