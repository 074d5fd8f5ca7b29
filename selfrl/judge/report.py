"""The judge's lines of the run report: calls, tokens and cost per update and per promoted
version, and each judge's calibration over time (from the store's ``judge/*`` metrics)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any


TOTALS = ("calls", "cache_hits", "input_tokens", "output_tokens", "scored", "failed", "disputed", "held_out_groups")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v)}"


def judge_lines(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[str]:
    """The report's ``## Judge`` section from metric rows ``{step, name, value, wall_time}`` and
    events ``{time, kind, data}``; [] without ``judge/`` metrics.

    Cost is shown when a price was configured (``judge/cost`` logged), tokens always. A
    promoted version's cost is what the judge cost from the previous promotion (or the run's
    start) up to its own: the judging that bought it.
    """
    rows = [r for r in metrics if r["name"].startswith("judge/") and r["value"] is not None
            and math.isfinite(r["value"])]
    if not rows:
        return []
    per_step: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        per_step[r["step"]][r["name"]] = per_step[r["step"]].get(r["name"], 0.0) + r["value"]
    total = defaultdict(float)
    for r in rows:
        total[r["name"]] += r["value"]
    updates = len(per_step)
    priced = "judge/cost" in total
    lines = ["## Judge", "",
             "| calls | cache hits | input tokens | output tokens | trajectories scored | failed | disputed "
             "| groups held out |" + (" cost |" if priced else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if priced else ""),
             "| " + " | ".join(_fmt(total[f"judge/{k}"]) for k in TOTALS)
             + (f" | {total['judge/cost']:.4g} |" if priced else " |"), ""]
    per_update = (f"cost {total['judge/cost'] / updates:.4g}, " if priced else "")
    lines += [f"Per update (mean of {updates}): {per_update}{total['judge/input_tokens'] / updates:.0f} input and "
              f"{total['judge/output_tokens'] / updates:.0f} output tokens, "
              f"{total['judge/calls'] / updates:.1f} calls.", ""]
    lines += _per_version(rows, events, priced)
    lines += _calibration(per_step)
    return lines


def _per_version(rows: list[dict[str, Any]], events: list[dict[str, Any]], priced: bool) -> list[str]:
    promotions = [(e["time"], (e.get("data") or {}).get("version")) for e in events if e["kind"] == "promote"]
    if not promotions:
        return ["No version was promoted: no cost per promoted version.", ""]
    key = "judge/cost" if priced else "judge/input_tokens"
    spent = [r for r in rows if r["name"] in (key, "judge/output_tokens")]
    lines = ["| promoted version | " + ("judge cost since the previous promotion |" if priced else
                                       "judge input tokens since the previous promotion |") + " output tokens |",
             "|---|---|---|"]
    start = -math.inf
    for when, version in promotions:
        window = [r for r in spent if start < r["wall_time"] <= when]
        main = sum(r["value"] for r in window if r["name"] == key)
        out = sum(r["value"] for r in window if r["name"] == "judge/output_tokens")
        lines.append(f"| {version} | {main:.4g} | {out:.0f} |")
        start = when
    return lines + [""]


def _calibration(per_step: dict[int, dict[str, float]]) -> list[str]:
    names = sorted({n.split("/")[1] for step in per_step.values() for n in step
                    if n.endswith("/calibration") and n.count("/") == 2})
    if not names:
        return []
    lines = ["Calibration (share of known good/bad pairs ranked right, per iteration):", "",
             "| judge | iterations | first | last | mean | lowest |", "|---|---|---|---|---|---|"]
    for name in names:
        series = [m[f"judge/{name}/calibration"] for _, m in sorted(per_step.items())
                  if f"judge/{name}/calibration" in m]
        lines.append(f"| {name} | {len(series)} | {series[0]:.2f} | {series[-1]:.2f} | "
                     f"{sum(series) / len(series):.2f} | {min(series):.2f} |")
    return lines + [""]
