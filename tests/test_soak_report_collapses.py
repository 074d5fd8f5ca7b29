"""The soak's collapse target (``scripts/soak_report.py`` ``collapses_caught``): with no collapse or NaN
loss injected there is nothing to catch, and the target says so instead of failing; an injected one that
was never applied, or applied and served, fails it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import collapses_caught  # noqa: E402


def run(faults: list[dict], events: list[dict] = (), served: list[int] = ()) -> dict:
    return {"soak": {"faults": [{"kind": "kill"}, *faults]}, "metrics": [{"name": "version", "step": 3, "value": 4}],
            "events": list(events), "versions": {4: {"status": "candidate"}},
            "sim": [{"event": "request", "version": v} for v in served]}


ROLLED = {"kind": "collapse", "data": {"iteration": 3, "rolled_back": [4]}}


def test_with_no_collapse_injected_the_target_is_not_applicable():
    c = collapses_caught(run([]))
    assert c["met"] is None and (c["injected"], c["applied"], c["caught"]) == (0, 0, 0)


def test_an_applied_collapse_rolled_back_and_never_served_is_caught():
    c = collapses_caught(run([{"kind": "collapse", "spec": "noise", "update": 3, "applied": True}], [ROLLED]))
    assert c["met"] is True and c["caught"] == 1 and c["faults"][0]["how"] == "collapse event, rolled back"


def test_a_collapse_never_applied_or_served_fails_the_target():
    assert collapses_caught(run([{"kind": "collapse", "spec": "noise", "update": None}]))["met"] is False
    served = run([{"kind": "collapse", "spec": "noise", "update": 3, "applied": True}], [ROLLED], served=[4])
    assert collapses_caught(served)["met"] is False
