"""The soak's no-forgetting target (``scripts/soak_report.py`` ``no_forgetting``): each family's held-out
success at each promoted version against its best earlier one; with no version promoted over the base there
is nothing to check, and the target says so instead of failing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import no_forgetting  # noqa: E402


def run(evaluations: dict[int, dict[str, bool]], promoted: list[int]) -> dict:
    versions = {0: {"version": 0, "status": "base"}} | {v: {"version": v, "status": "promoted"} for v in promoted}
    return {"evaluations": evaluations, "versions": versions, "events": [], "sim": []}


BASE = {"arithmetic/a": False, "arithmetic/b": True, "function_calling/c": True, "function_calling/d": True}


def test_only_the_base_served_is_not_measured_rather_than_failed():
    got = no_forgetting(run({0: BASE}, []), tolerance=0.1)
    assert got["checked"] == 0 and got["fails"] == [] and got["met"] is None


def test_a_family_below_its_best_minus_tolerance_fails_and_one_within_passes():
    better_arith = {**BASE, "arithmetic/a": True}
    lost_fc = {**better_arith, "function_calling/d": False}  # 2/2 -> 1/2: a drop of 0.5 > 0.1
    got = no_forgetting(run({0: BASE, 1: better_arith, 2: lost_fc}, [1, 2]), tolerance=0.1)
    assert got["checked"] == 4 and got["met"] is False
    assert [(f["family"], f["version"]) for f in got["fails"]] == [("function_calling", 2)]
    kept = no_forgetting(run({0: BASE, 1: better_arith}, [1]), tolerance=0.1)
    assert kept["checked"] == 2 and kept["met"] is True
