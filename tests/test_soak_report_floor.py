"""The RSS floor's growth (``scripts/soak_report.py``), reported beside the RSS target: per server process,
the least-squares slope of the lowest RSS between the ends of two successive learner updates (a version's
creation or a skip), after the process's warm-up. A served learner's RSS is a sawtooth; when later updates
run longer, more samples sit on the climb and the slope over every sample rises though nothing is kept from
update to update."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import rss_floor_growth, rss_floor_text, rss_growth  # noqa: E402

T0 = 1_800_000_000.0  # the soak's start (soak.json's started); the store's events and versions are wall-clock


def sawtooth(pid: int, start_min: float, minutes: float, floor_mb: float, floor_mb_per_hour: float,
             climb_mb_per_min: float, cycles_min: list[float],
             sample_s: float = 10.0) -> tuple[list[dict], list[dict], list[float]]:
    """(samples every ``sample_s`` s, the learner's ``promote`` events, its versions' ``created_at``) of a
    process from ``start_min`` for ``minutes``: each cycle starts at the floor (rising ``floor_mb_per_hour``)
    and climbs ``climb_mb_per_min`` until its update ends (the version, a gate of half a second, the event,
    then the drop); cycle lengths in minutes, the last repeated."""
    rows, events, created, t, k = [], [], [], 0.0, 0
    while t <= minutes * 60:
        length = cycles_min[min(k, len(cycles_min) - 1)] * 60
        start = t
        while t < start + length and t <= minutes * 60:
            rows.append({"t": start_min * 60 + t, "pid": pid, "rss_mb": floor_mb + floor_mb_per_hour * start / 3600
                         + climb_mb_per_min * (t - start) / 60})
            t += sample_s
        created.append(T0 + start_min * 60 + start + length - 1.0)
        events.append({"time": T0 + start_min * 60 + start + length - 0.5, "kind": "promote"})
        k += 1
    return rows, events, created


def chained(minutes: float, floor_mb: float, floor_mb_per_hour: float) -> tuple[list[dict], list[dict], list[float]]:
    """Like :func:`sawtooth` with ``gate.eval_every = 2``, from 0 for ``minutes``: ticks of 4 and 6 minutes
    in turn, each from its floor (rising ``floor_mb_per_hour``) climbing 500 MB a minute for 238 s to its
    version. The first of each pair is chained: no event, its trim 2 s later. The second is validated: a
    gate of 119 s at the update's peak, a ``promote``, three skipped batches queued in the gate over the
    next 2.4 s, then its trim. Each trim (the next tick's start) falls on a sample (every 10 s)."""
    rows, events, created = [], [], []
    ticks, start = [], 0.0  # (start, its version's created_at, gated)
    while start <= minutes * 60:
        gated = len(ticks) % 2 == 1
        ticks.append((start, start + 238.0, gated))
        created.append(T0 + start + 238.0)
        if gated:
            events.append({"time": T0 + start + 357.0, "kind": "promote"})
            events += [{"time": T0 + start + 358.0 + 0.7 * i, "kind": "skip"} for i in range(3)]
        start += 360.0 if gated else 240.0
    for i in range(int(minutes * 6) + 1):
        t = i * 10.0
        tick_start, made, _ = max(x for x in ticks if x[0] <= t)
        floor = floor_mb + floor_mb_per_hour * tick_start / 3600
        rows.append({"t": t, "pid": 1, "rss_mb": floor + 500.0 * (min(t, made) - tick_start) / 60})
    return rows, events, created


def soak(*processes: tuple[list[dict], list[dict], list[float]], noise: bool = True) -> dict:
    """A report's ``d``: the processes' samples, events and versions (a base, then one per ``created_at``,
    each the next one's parent), and events that end no update (which cut nothing)."""
    rows = [r for p in processes for r in p[0]]
    events = [e for p in processes for e in p[1]]
    created = sorted(t for p in processes for t in p[2])
    versions = {0: {"version": 0, "parent": None, "status": "base", "created_at": T0 - 1.0}}
    versions |= {v: {"version": v, "parent": v - 1, "status": "promoted", "created_at": t}
                 for v, t in enumerate(created, 1)}
    if noise:  # a swap and a late judgement mid-climb are no cycle's end
        events += [{"time": T0 + r["t"] + 3, "kind": kind} for r, kind in zip(rows[100::97], ("swap", "late_feedback") * 50)]
    return {"soak": {"started": T0}, "timeline": sorted(rows, key=lambda r: r["t"]), "events": events,
            "versions": versions}


def test_a_sawtooth_with_a_flat_floor_and_longer_cycles_later_has_no_floor_growth():
    # the soak's shape: a 4 GB floor, +500 MB a minute through an update, cycles of 4 minutes, then of 8
    d = soak(sawtooth(1, 0, 90, 4000.0, 0.0, 500.0, [4.0] * 10 + [8.0]))
    every = rss_growth(d, warmup_min=15.0)
    floor = rss_floor_growth(d, warmup_min=15.0)
    assert every["pct_per_hour"] > 15.0 and every["met"] is False  # the all-samples slope rises with the cycles
    (g,) = floor["segments"]
    # cycles start at 16, 20, ..., 40 min (7), then 48, ..., 88 min (6): 13 floors over 72 minutes
    assert (g["cycles"], g["span_min"], g["too_short"]) == (13, 72.0, False)
    assert g["floors_mb"] == [4000] * 13
    assert floor["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)
    assert rss_floor_text(floor) == ("+0.0 %/h, least squares over the lowest RSS between the ends of two successive "
                                     "learner updates (pid 1: 13 cycles over 72 min, floors " + ", ".join(["4000"] * 13)
                                     + " MB, +0.0 %/h)")


def test_a_rising_floor_gives_its_slope():
    # the same sawtooth, cycles of 5 minutes, its floor rising 400 MB an hour; the first cycle past the
    # warm-up starts at 20 min, at 4133 MB
    d = soak(sawtooth(1, 0, 90, 4000.0, 400.0, 500.0, [5.0]))
    floor = rss_floor_growth(d, warmup_min=15.0)
    (g,) = floor["segments"]
    assert g["floors_mb"][0] == 4133 and len(g["floors_mb"]) == 15
    assert floor["pct_per_hour"] == pytest.approx(100 * 400.0 / (4000.0 + 400.0 * 20 / 60), rel=1e-3)


def test_per_process_after_its_own_warm_up_weighted_by_span_and_a_short_process_reported():
    # process 1: a flat floor, cycles from 20 to 75 min; process 2 restarted at 80 min, 10 min past its own
    d = soak(sawtooth(1, 0, 75, 4000.0, 0.0, 500.0, [5.0]), sawtooth(2, 80, 25, 3000.0, 2000.0, 500.0, [5.0]))
    floor = rss_floor_growth(d, warmup_min=15.0)
    one, two = floor["segments"]
    assert (one["pid"], one["cycles"], one["span_min"], one["too_short"]) == (1, 12, 55.0, False)
    assert (two["pid"], two["cycles"], two["too_short"], two["pct_per_hour"]) == (2, 2, True, None)
    assert two["floors_mb"] == [3667, 3833]  # its own cycles only: from 100 and 105 min
    assert floor["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)
    assert "pid 2: 2 cycles over 5 min, too short for a slope" in rss_floor_text(floor)


def test_with_no_learner_update_the_floor_is_not_measured():
    rows, _, _ = sawtooth(1, 0, 60, 4000.0, 0.0, 500.0, [5.0])
    floor = rss_floor_growth(soak((rows, [], []), noise=False), warmup_min=15.0)
    assert floor["pct_per_hour"] is None and floor["segments"][0]["cycles"] == 0
    assert rss_floor_text(floor).startswith("not measured (no process had 3 learner cycles over 20 min past its "
                                            "15-min warm-up)")


def test_a_batch_skipped_right_after_an_update_ends_no_cycle_of_its_own():
    # each update's end is followed, 1 s later, by a skipped batch and, 1 s after, by a sample taken before the
    # memory was given back: as a cycle of its own that sample would be a floor 2 GB up
    rows, events, created = sawtooth(1, 0, 60, 4000.0, 0.0, 500.0, [5.0])
    events += [{"time": e["time"] + 1, "kind": "skip"} for e in events]
    rows += [{"t": e["time"] - T0 + 1.5, "pid": 1, "rss_mb": 6000.0} for e in events
             if e["kind"] == "skip" and e["time"] - T0 < 60 * 60]
    floor = rss_floor_growth(soak((rows, events, created), noise=False), warmup_min=15.0)
    assert floor["segments"][0]["floors_mb"] == [4000] * 9  # cycles from 20 to 60 min
    assert floor["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)


def test_with_a_chain_of_candidates_every_update_is_a_cycle_of_its_own():
    # gate.eval_every = 2: the chained candidate records no event, so the verdicts alone cut a cycle per two
    # updates (5 here, each the lower of two floors); every update's end cuts one with its own trim. The
    # skips queued in a 2-minute gate come 2 minutes after its update's end: merged with its verdict, not a
    # cycle of the gate's samples alone. Trims past the 15-min warm-up: 20, 24, 30, 34, ..., 54, 60 min
    d = soak(chained(60, 4000.0, 300.0))
    floor = rss_floor_growth(d, warmup_min=15.0)
    (g,) = floor["segments"]
    assert (g["cycles"], g["span_min"], g["too_short"]) == (9, 40.0, False)
    assert g["floors_mb"] == [4100, 4120, 4150, 4170, 4200, 4220, 4250, 4270, 4300]  # 4000 + 300 MB/h at each trim
    assert floor["pct_per_hour"] == pytest.approx(100 * 300.0 / 4100.0, rel=1e-9)
    assert "pid 1: 9 cycles over 40 min" in rss_floor_text(floor)


def test_a_process_killed_in_a_gate_leaves_that_update_out():
    # the chained soak's samples end at 58 min, in the gate of the update that ended at 57:58: no verdict, so
    # no trim is known in its cycle (its lowest sample, at 58 min, is the gate's, 1983 MB above the floor)
    rows, events, created = chained(60, 4000.0, 0.0)
    floor = rss_floor_growth(soak(([r for r in rows if r["t"] <= 58 * 60], events, created), noise=False),
                             warmup_min=15.0)
    assert floor["segments"][0]["floors_mb"] == [4000] * 8  # trims at 20, 24, ..., 54 min
    # the same process until 60 min: the verdict at 59:57, then the trim and the floor at 60 min, counts
    floor = rss_floor_growth(soak((rows, events, created), noise=False), warmup_min=15.0)
    assert floor["segments"][0]["floors_mb"] == [4000] * 9


def test_a_cycle_across_the_warm_up_counts_when_its_trim_comes_after_it():
    # a warm-up of 14.5 min ends in the cycle of the chained update that ended at 13:58: its trim (14:00) came
    # before, and from 14:30 the cycle holds only the next update's climb (its lowest sample 250 MB above the
    # floor), so it is left out: the trims counted are at 20, 24, ..., 60 min
    d = soak(chained(60, 4000.0, 0.0), noise=False)
    early = rss_floor_growth(d, warmup_min=14.5)["segments"][0]
    assert early["floors_mb"] == [4000] * 9
    # a warm-up of 19 min ends in the gate of the update that ended at 17:58: its verdict (19:57), so its trim,
    # comes after, and its cycle's samples from 19 min hold its floor at 20 min
    late = rss_floor_growth(d, warmup_min=19.0)["segments"][0]
    assert (late["floors_mb"], late["span_min"]) == ([4000] * 9, 40.0)
