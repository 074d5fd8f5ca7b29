"""The soak's RSS target (``scripts/soak_report.py``) on hand-made timelines: a slope per server
process over its samples after its own warm-up, only where they span 20 minutes or more; the
target weighs those slopes by their spans, and a restarted process's few minutes are reported as
too short, never failed on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import rss_growth, rss_text  # noqa: E402


def timeline(*processes: tuple[int, float, float, float, float]) -> dict:
    """Samples each minute of ``(pid, start_min, end_min, rss_at_start_mb, mb_per_hour)`` processes."""
    rows = []
    for pid, start, end, rss0, per_hour in processes:
        for minute in range(int(start), int(end) + 1):
            rows.append({"t": minute * 60.0, "pid": pid, "rss_mb": rss0 + per_hour * (minute - start) / 60})
    return {"timeline": sorted(rows, key=lambda r: r["t"])}


def test_a_short_restarted_process_is_reported_not_failed_on():
    # the soak's case: a process flat for 75 minutes, then one restarted late that grew while warming up
    d = timeline((1, 0, 75, 5000.0, 0.0), (2, 80, 90, 3000.0, 6000.0))
    rss = rss_growth(d, warmup_min=1.0)
    one, two = rss["segments"]
    assert (one["pid"], one["samples"], one["span_min"], one["too_short"]) == (1, 75, 74.0, False)
    assert one["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)
    assert (two["pid"], two["samples"], two["span_min"], two["too_short"], two["pct_per_hour"]) == (2, 10, 9.0, True, None)
    assert rss["met"] is True and rss["pct_per_hour"] == pytest.approx(0.0, abs=1e-9)
    assert "pid 2: 10 samples over 9 min, too short for a slope" in rss_text(rss)


def test_the_growth_is_per_process_over_its_own_warm_up_and_weighted_by_span():
    # 5000 MB at 15 min into each process, growing 500 MB/h (10 %/h) and 250 MB/h (5 %/h): the jump at the
    # restart (5000 -> 1000 MB) and each process's first 15 minutes are no growth at all
    d = timeline((1, 0, 15, 1000.0, 16000.0), (1, 16, 75, 5000.0 + 500 / 60, 500.0),
                 (2, 76, 91, 1000.0, 16000.0), (2, 92, 136, 5000.0 + 250 / 60, 250.0))
    rss = rss_growth(d, warmup_min=15.0)
    one, two = rss["segments"]
    assert one["span_min"] == 60.0 and one["pct_per_hour"] == pytest.approx(10.0, rel=1e-3)
    assert two["span_min"] == 45.0 and two["pct_per_hour"] == pytest.approx(5.0, rel=1e-3)
    assert rss["pct_per_hour"] == pytest.approx((10.0 * 60 + 5.0 * 45) / 105, rel=1e-3)  # 7.86: met
    assert rss["met"] is True
    assert rss_text(rss).startswith("+7.9 %/h, time-weighted over the segments of 20 min or more (pid 1: 61 samples "
                                    "over 60 min, +10.0 %/h; pid 2: 46 samples over 45 min, +5.0 %/h); max RSS")


def test_a_long_process_that_grows_fails_the_target():
    rss = rss_growth(timeline((7, 0, 90, 5000.0, 1000.0)), warmup_min=15.0)  # +1000 MB/h on 5250 MB at 15 min
    assert rss["met"] is False and rss["pct_per_hour"] == pytest.approx(100 * 1000 / 5250, rel=1e-3)


def test_with_no_process_long_enough_the_target_is_not_measured():
    rss = rss_growth(timeline((1, 0, 30, 5000.0, 0.0), (2, 31, 50, 5000.0, 9000.0)), warmup_min=15.0)
    assert [g["too_short"] for g in rss["segments"]] == [True, True]  # 15 and 4 minutes after their warm-ups
    assert rss["met"] is None and rss["pct_per_hour"] is None
    assert rss_text(rss).startswith("not measured (no process ran 20 min past its 15-min warm-up)")
