"""The RSS floor's growth (``scripts/soak_report.py``), reported beside the RSS target: per server process,
the least-squares slope of the lowest RSS between two learner updates' ends, after the process's warm-up.
A served learner's RSS is a sawtooth; when later updates run longer, more samples sit on the climb and the
slope over every sample rises though nothing is kept from update to update."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import rss_floor_growth, rss_floor_text, rss_growth  # noqa: E402

T0 = 1_800_000_000.0  # the soak's start (soak.json's started); the store's events are wall-clock


def sawtooth(pid: int, start_min: float, minutes: float, floor_mb: float, floor_mb_per_hour: float,
             climb_mb_per_min: float, cycles_min: list[float], sample_s: float = 10.0) -> tuple[list[dict], list[dict]]:
    """(samples every ``sample_s`` s, the learner's ``promote`` events) of a process from ``start_min`` for
    ``minutes``: each cycle starts at the floor (rising ``floor_mb_per_hour``) and climbs ``climb_mb_per_min``
    until its update ends (the event, then the drop); cycle lengths in minutes, the last repeated."""
    rows, events, t, k = [], [], 0.0, 0
    while t <= minutes * 60:
        length = cycles_min[min(k, len(cycles_min) - 1)] * 60
        start = t
        while t < start + length and t <= minutes * 60:
            rows.append({"t": start_min * 60 + t, "pid": pid, "rss_mb": floor_mb + floor_mb_per_hour * start / 3600
                         + climb_mb_per_min * (t - start) / 60})
            t += sample_s
        events.append({"time": T0 + start_min * 60 + start + length - 0.5, "kind": "promote"})
        k += 1
    return rows, events


def soak(*processes: tuple[list[dict], list[dict]], noise: bool = True) -> dict:
    """A report's ``d``: the processes' samples and events, and events that end no update (which cut nothing)."""
    rows = [r for p in processes for r in p[0]]
    events = [e for p in processes for e in p[1]]
    if noise:  # a swap and a late judgement mid-climb are no cycle's end
        events += [{"time": T0 + r["t"] + 3, "kind": kind} for r, kind in zip(rows[100::97], ("swap", "late_feedback") * 50)]
    return {"soak": {"started": T0}, "timeline": sorted(rows, key=lambda r: r["t"]), "events": events}


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
    assert rss_floor_text(floor) == ("+0.0 %/h, least squares over the lowest RSS between two learner updates (pid 1: "
                                     "13 cycles over 72 min, floors " + ", ".join(["4000"] * 13) + " MB, +0.0 %/h)")


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
    rows, _ = sawtooth(1, 0, 60, 4000.0, 0.0, 500.0, [5.0])
    floor = rss_floor_growth(soak((rows, []), noise=False), warmup_min=15.0)
    assert floor["pct_per_hour"] is None and floor["segments"][0]["cycles"] == 0
    assert rss_floor_text(floor).startswith("not measured (no process had 3 learner cycles over 20 min past its "
                                            "15-min warm-up)")


def test_a_batch_skipped_right_after_an_update_ends_no_cycle_of_its_own():
    # each update's end is followed, 1 s later, by a skipped batch and, 1 s after, by a sample taken before the
    # memory was given back: as a cycle of its own that sample would be a floor 2 GB up
    rows, events = sawtooth(1, 0, 60, 4000.0, 0.0, 500.0, [5.0])
    events += [{"time": e["time"] + 1, "kind": "skip"} for e in events]
    rows += [{"t": e["time"] - T0 + 1.5, "pid": 1, "rss_mb": 6000.0} for e in events
             if e["kind"] == "skip" and e["time"] - T0 < 60 * 60]
    floor = rss_floor_growth(soak((rows, events), noise=False), warmup_min=15.0)
    assert floor["segments"][0]["floors_mb"] == [4000] * 9  # cycles from 20 to 60 min
    assert floor["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)
