"""Whether a ``selfrl run`` reached its end, read from its store: what the result scripts
(``scripts/results.py``, ``scripts/judge_vs_verifier.py``) check before they count a run.

A run has finished when every configured iteration logged its update (``reward/mean``, the row
``selfrl run --resume`` counts to know where to go on) and its newest version was gated, or when
it stopped itself for good (``collapse.max_rollbacks`` spent, or ``task.signal_check = "stop"``
on a first batch without signal): resuming those would not train further. A run still going,
interrupted (Ctrl-C writes its report too) or killed midway has not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from selfrl.config import RunConfig
from selfrl.record.store import Store
from selfrl.record.versions import EventKind, VersionStatus


ITERATIONS = next(f.default for f in dataclasses.fields(RunConfig) if f.name == "iterations")


@dataclass(frozen=True)
class RunProgress:
    """How far one run got."""

    done: int  # iterations whose update was logged
    total: int  # the config's ``iterations``
    stopped: str | None  # why the run ended itself before ``total`` (then it is finished), else None
    ungated: int | None  # the newest version when it is a candidate never gated, else None

    @property
    def finished(self) -> bool:
        return self.stopped is not None or (self.done >= self.total and self.ungated is None)

    def line(self) -> str:
        """``"finished"``, ``"stopped: ..."`` or ``"unfinished: iteration 3 of 10"`` (3 done)."""
        if self.stopped is not None:
            return f"stopped at iteration {self.done} of {self.total}: {self.stopped}"
        if self.finished:
            return "finished"
        if self.done >= self.total:
            return f"unfinished: iteration {self.done} of {self.total}, v{self.ungated} not yet gated"
        return f"unfinished: iteration {self.done} of {self.total}"


def run_progress(store: Store, config: dict[str, Any]) -> RunProgress:
    """The progress of the run in ``store`` whose config is ``config`` (``iterations`` missing:
    the :class:`selfrl.config.RunConfig` default)."""
    steps = {m["step"] for m in store.metrics() if m["name"] == "reward/mean"}
    done = max(steps) + 1 if steps else 0
    total = int(config.get("iterations", ITERATIONS))
    stopped = None
    signal_check = (config.get("task") or {}).get("signal_check")
    for e in store.events():
        if e["kind"] == EventKind.COLLAPSE_STOP.value:
            stopped = "collapse.max_rollbacks spent"
        elif e["kind"] == EventKind.PREFLIGHT.value and signal_check == "stop" and ". no signal" in e["message"]:
            stopped = 'no signal in the first batch (task.signal_check = "stop")'
    versions = store.versions()
    newest = versions[-1] if versions else None
    ungated = newest["version"] if newest is not None and newest["status"] == VersionStatus.CANDIDATE.value else None
    return RunProgress(done, total, stopped if done < total else None, ungated)
