"""The soak's RSS measures (``scripts/soak_report.py`` reports them): the RSS target's growth over
every sample after each server process's warm-up (:func:`rss_growth`), and beside it the growth of
the RSS floor between the ends of two successive learner updates (:func:`rss_floor_growth`). How each
is measured: the docstring of ``scripts/soak_report.py``."""

from __future__ import annotations


RSS_MIN_SPAN_MIN = 20.0  # minutes after a process's warm-up its samples must span for a slope


def rss_by_process(d: dict) -> dict[int, list[tuple[float, float]]]:
    """The timeline's RSS samples per server process: ``{pid: [(t seconds, rss MB), ...]}``, in
    the order the processes first appear; samples without an RSS or a pid are left out."""
    segs: dict[int, list[tuple[float, float]]] = {}
    for t in d["timeline"]:
        if t.get("rss_mb") and t.get("pid"):
            segs.setdefault(t["pid"], []).append((t["t"], t["rss_mb"]))
    return segs


def rss_segments(d: dict, warmup_min: float, min_span_min: float = RSS_MIN_SPAN_MIN) -> list[dict]:
    """One row per server process (``pid``) of the timeline, in the order they started: its samples
    after ``warmup_min`` minutes of its own, their span (minutes) and, when they span at least
    ``min_span_min`` minutes (3 samples or more), the least-squares slope of RSS over them in % of
    the RSS at the end of the warm-up per hour (``pct_per_hour``); a shorter segment has
    ``pct_per_hour`` None and ``too_short`` True (a slope over minutes says nothing of hours)."""
    segs = rss_by_process(d)
    rows = []
    for pid, pts in segs.items():
        start = pts[0][0]
        later = [(x, y) for x, y in pts if x - start >= warmup_min * 60]
        span = (later[-1][0] - later[0][0]) / 60 if later else 0.0
        row = {"pid": pid, "samples": len(later), "span_min": round(span, 1),
               "rss_mb_at_warmup": later[0][1] if later else None, "pct_per_hour": None,
               "too_short": span < min_span_min or len(later) < 3}
        if not row["too_short"]:
            mx, my = sum(x for x, _ in later) / len(later), sum(y for _, y in later) / len(later)
            slope = sum((x - mx) * (y - my) for x, y in later) / sum((x - mx) ** 2 for x, _ in later)  # MB/s
            row["pct_per_hour"] = 100 * slope * 3600 / later[0][1]
        rows.append(row)
    return rows


def rss_growth(d: dict, warmup_min: float, min_span_min: float = RSS_MIN_SPAN_MIN) -> dict:
    """The RSS target: the growth of the server processes whose samples after their own warm-up span
    at least ``min_span_min`` minutes (:func:`rss_segments`), their slopes weighted by those spans
    (%/h); met below 10 %/h. With no such process, not measured (``met`` None): a restarted
    process's few minutes are reported, never failed on."""
    segments = rss_segments(d, warmup_min, min_span_min)
    fitted = [g for g in segments if not g["too_short"]]
    weight = sum(g["span_min"] for g in fitted)
    pct = sum(g["pct_per_hour"] * g["span_min"] for g in fitted) / weight if fitted else None
    return {"met": None if pct is None else pct < 10.0, "pct_per_hour": pct, "segments": segments,
            "min_span_min": min_span_min, "warmup_min": warmup_min,
            "max_rss_mb": max((t["rss_mb"] for t in d["timeline"] if t.get("rss_mb")), default=None)}


GATE_OUTCOMES = ("promote", "reject", "collapse")  # a gate's (or a collapse rule's) verdict: the trim follows
CYCLE_MERGE_S = 60.0  # a skip this soon after an update's end or a verdict: one pause (turns queued in the gate)


def learner_cycle_starts(d: dict) -> tuple[list[float], list[float]]:
    """Where the learner's updates ended and where its trims are known to follow, from ``d``'s store.

    An update ends with a version (``adapter_versions.created_at`` of a version with a parent: the
    end of its training, before its gate; a chained candidate's too, which records no event) or with
    a ``skip`` event (no version). A skip within :data:`CYCLE_MERGE_S` of the last end kept or of a
    verdict (:data:`GATE_OUTCOMES`) is no end of its own: its batch came in while that update was
    judged, and the trim comes just before it, so a cycle ending there would hold the gate's samples
    and no floor. The trim follows each skip and each verdict within seconds; it follows a chained
    candidate's end too, but nothing in the store says so.

    Returns:
        ``(ends, settled)``: s after ``soak.json``'s started, each sorted; ``ends`` the updates' ends
        kept, ``settled`` the times of every verdict and of the skips kept (a skip merged into a
        verdict's pause settles nothing of its own).
    """
    t0 = d["soak"]["started"]
    verdicts = sorted(e["time"] - t0 for e in d["events"] if e["kind"] in GATE_OUTCOMES)
    skips = sorted(e["time"] - t0 for e in d["events"] if e["kind"] == "skip")
    ends = sorted([(v["created_at"] - t0, False) for v in d["versions"].values() if v.get("parent") is not None]
                  + [(t, True) for t in skips])
    starts: list[float] = []
    kept_skips: list[float] = []
    for t, skip in ends:
        last = max(([starts[-1]] if starts else []) + [v for v in verdicts if v <= t], default=None)
        if skip and last is not None and t - last < CYCLE_MERGE_S:
            continue
        starts.append(t)
        if skip:
            kept_skips.append(t)
    return starts, sorted(verdicts + kept_skips)


def _slope_pct(pts: list[tuple[float, float]], base: float) -> float:
    """Least-squares slope of ``pts`` ((s, MB), 2 or more distinct times) in % of ``base`` MB per hour."""
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)  # MB/s
    return 100 * slope * 3600 / base


def rss_floor_growth(d: dict, warmup_min: float, min_span_min: float = RSS_MIN_SPAN_MIN) -> dict:
    """The RSS floor's growth, reported beside :func:`rss_growth` (a leak detector, not a target).

    A learner cycle is one learner tick: from the end of one learner update to the end of the next
    (:func:`learner_cycle_starts`: a version's creation or a ``skip``, at ``time - soak.json's started``
    s), it holds that update's gate when one ran (a chained candidate of ``gate.eval_every`` above 1
    has none), then its trim, which gives the update's memory back; its floor is its lowest RSS
    sample after the warm-up (the first sample or two after the trim). Per server process (``pid``),
    the cycles whose trim is known to come after its ``warmup_min`` minutes and within its samples:
    one that starts after the warm-up and ends within the process, or one with a verdict or a kept
    skip (``settled``) after the warm-up and before its end. Left out: a cycle whose trim came
    before the warm-up's end, and a process's last cycle (it ends with the samples) without a
    verdict or skip, whose gate a kill or the soak's end may have cut short before the trim (a
    chained candidate's too: the store cannot tell it apart). Where their floors span at least
    ``min_span_min`` minutes and number 3 or more, the least-squares slope of the floors in % of the
    first floor per hour (``pct_per_hour``); otherwise ``too_short``. The processes' slopes are
    weighted by their spans, as :func:`rss_growth` weighs its own.

    Returns:
        ``{"pct_per_hour": float | None, "warmup_min", "min_span_min", "segments": [{"pid", "cycles",
        "span_min", "floors_mb": [MB per cycle], "pct_per_hour", "too_short"}]}``.
    """
    ends, settled = learner_cycle_starts(d)
    segs = rss_by_process(d)
    rows = []
    for pid, pts in segs.items():
        warm, last = pts[0][0] + warmup_min * 60, pts[-1][0]
        starts = [e for e in ends if pts[0][0] <= e <= last]
        floors = []
        for lo, hi in zip(starts, starts[1:] + [float("inf")]):
            if not (lo >= warm and hi <= last) and not any(max(lo, warm) <= s < hi and s <= last for s in settled):
                continue  # its trim came before the warm-up's end, or is not known to have come at all
            inside = [p for p in pts if max(lo, warm) <= p[0] < hi]
            if inside:
                floors.append(min(inside, key=lambda p: p[1]))
        span = (floors[-1][0] - floors[0][0]) / 60 if floors else 0.0
        row = {"pid": pid, "cycles": len(floors), "span_min": round(span, 1),
               "floors_mb": [round(y) for _, y in floors], "pct_per_hour": None,
               "too_short": span < min_span_min or len(floors) < 3}
        if not row["too_short"]:
            row["pct_per_hour"] = _slope_pct(floors, floors[0][1])
        rows.append(row)
    fitted = [g for g in rows if not g["too_short"]]
    weight = sum(g["span_min"] for g in fitted)
    pct = sum(g["pct_per_hour"] * g["span_min"] for g in fitted) / weight if fitted else None
    return {"pct_per_hour": pct, "warmup_min": warmup_min, "min_span_min": min_span_min, "segments": rows}


def rss_floor_text(floor: dict) -> str:
    """The floor row's measured cell: the weighted floor growth, then each process's floors."""
    def one(g):
        where = f"pid {g['pid']}: {g['cycles']} cycles over {g['span_min']:.0f} min"
        if g["too_short"]:
            return f"{where}, too short for a slope"
        return f"{where}, floors {', '.join(str(y) for y in g['floors_mb'])} MB, {g['pct_per_hour']:+.1f} %/h"

    head = (f"not measured (no process had 3 learner cycles over {floor['min_span_min']:.0f} min past its "
            f"{floor['warmup_min']:.0f}-min warm-up)") if floor["pct_per_hour"] is None else \
        f"{floor['pct_per_hour']:+.1f} %/h, least squares over the lowest RSS between the ends of two successive " \
        "learner updates"
    return f"{head} ({'; '.join(one(g) for g in floor['segments']) or 'no samples'})"


def rss_text(rss: dict) -> str:
    """The RSS row's measured cell: the weighted growth, then each process's segment."""
    def one(g):
        where = f"pid {g['pid']}: {g['samples']} samples over {g['span_min']:.0f} min"
        return f"{where}, too short for a slope" if g["too_short"] else f"{where}, {g['pct_per_hour']:+.1f} %/h"

    head = (f"not measured (no process ran {rss['min_span_min']:.0f} min past its {rss['warmup_min']:.0f}-min "
            "warm-up)") if rss["pct_per_hour"] is None else \
        f"{rss['pct_per_hour']:+.1f} %/h, time-weighted over the segments of {rss['min_span_min']:.0f} min or more"
    peak = "" if rss["max_rss_mb"] is None else f"; max RSS {rss['max_rss_mb']:.0f} MB"
    return f"{head} ({'; '.join(one(g) for g in rss['segments']) or 'no samples'}){peak}"
