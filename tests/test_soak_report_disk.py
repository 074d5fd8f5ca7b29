"""The soak's disk target (``scripts/soak_report.py`` ``disk_retention``): every adapter folder at the end is
one the retention policy keeps. Retention runs after each learner update (its gate included), so the
versions an update still under way at the end has made have had no pass yet."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import disk_retention  # noqa: E402


def soak_dir(tmp_path: Path, statuses: dict[int, str], folders: list[int], last_update: int) -> dict:
    """What ``disk_retention`` reads: the run's adapter folders, its versions, events and samples."""
    for v in folders:
        (tmp_path / "adapters" / f"v{v:06d}").mkdir(parents=True)
    return {"run": tmp_path, "versions": {v: {"version": v, "status": s} for v, s in statuses.items()},
            "events": [], "timeline": [{"t": 10.0, "disk_mb": 5.0, "learner": {"last_update": {"version": 7}}},
                                       {"t": 20.0, "disk_mb": 9.5, "learner": {"last_update": {"version": last_update}}}]}


# the soak of 2026-12-05 at its end: 11 the champion, 12-14 rolled back (12 pruned), 15 a chain's first candidate
# (its update done, then a pass), 16 the chain's second, its gate under way when the soak stopped
STATUSES = {0: "base", 6: "promoted", 8: "promoted", 11: "promoted", 12: "rolled_back", 13: "rolled_back",
            14: "rolled_back", 15: "candidate", 16: "candidate"}
FOLDERS = [0, 6, 8, 11, 13, 14, 15, 16]


def test_a_version_made_by_an_update_still_under_way_has_had_no_retention_pass(tmp_path):
    got = disk_retention(soak_dir(tmp_path, STATUSES, FOLDERS, last_update=15), keep=3)
    assert got["in_flight"] == [16]
    assert got["outside_policy"] == [] and got["met"] is True
    assert (got["folders"], got["versions"], got["max_disk_mb"]) == (8, 9, 9.5)


def test_a_folder_the_last_pass_should_have_removed_is_outside_the_policy(tmp_path):
    # every update finished (16 included): newest 3 are 14, 15, 16, so 13's folder should be gone
    got = disk_retention(soak_dir(tmp_path, STATUSES, FOLDERS, last_update=16), keep=3)
    assert got["in_flight"] == []
    assert got["outside_policy"] == [13] and got["met"] is False
