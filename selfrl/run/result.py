"""What a run ends with: the version ``gate.rule`` chooses served (:func:`finish_run`), the
totals ``report.md`` opens with (:func:`run_summary`), and the :class:`RunResult` returned."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from selfrl.record.serve_rule import ServedChoice, serve_by_rule
from selfrl.run.progress import Progress
from selfrl.run.setup import RunSetup
from selfrl.safety.swap_check import SwapCheckError

__all__ = ["RunResult", "finish_run", "run_summary"]


@dataclass
class RunResult:
    """What a run ends with (also written to ``report.md``)."""

    run_dir: Path
    base_success: float
    final_success: float
    base_version: int
    final_version: int
    stopped_early: bool = False
    summary: dict = field(default_factory=dict)


def finish_run(s: RunSetup, progress: Progress, stopped: bool, session_s: float) -> RunResult:
    """Serve the version ``gate.rule`` chooses (:func:`selfrl.record.serve_rule.serve_by_rule`),
    say which and why, write the report, close the store (and the judge). ``session_s``: the
    seconds this session ran."""
    from selfrl.report.run import write_report

    choice, note = serve_by_rule(s.ledger, s.cfg.gate.rule, s.cfg.gate.tolerance)
    if note:
        progress.log(note)
    champ = s.ledger.champion
    # Always: an interrupted update may have changed the weights without saving a version.
    if s.sampler is None:
        s.engine.swap(champ.state, champ.version)
    else:
        try:
            s.sampler.load(champ.state, champ.version, "finish")
        except SwapCheckError as e:  # the run is ending: reported, the learner holds the champion
            progress.log(f"the sampler could not be put back on version {champ.version}: {e}")
    summary = run_summary(s, champ.version, stopped, session_s, choice)
    progress.log(summary["served"])
    report = write_report(s.run_dir, s.store, s.run_id, summary)
    base, final = s.store.evaluation(0), s.store.evaluation(champ.version)
    s.store.close()
    if s.judge is not None:
        s.judge.close()
    return RunResult(s.run_dir, _rate(base), _rate(final), 0, champ.version, stopped,
                     {**summary, "report": str(report)})


def run_summary(s: RunSetup, final_version: int, stopped: bool, session_s: float, choice: ServedChoice) -> dict:
    """The totals ``report.md`` opens with: time in rollouts, updates and validation over every
    session of the run directory (seconds), the cost ratio, the final version (the one served),
    the rule that chose it and its line (``choice``) and the main settings."""
    cfg = s.cfg
    totals: dict[str, float] = {}
    for row in s.store.metrics():  # every session of this run directory, not only this one
        if row["name"].startswith("time/") and row["value"] is not None:
            totals[row["name"]] = totals.get(row["name"], 0.0) + row["value"]
    inference, training = totals.get("time/rollout_s", 0.0), totals.get("time/update_s", 0.0)
    return {
        "base_version": 0, "final_version": final_version,
        "gate_rule": choice.rule.value, "gate_tolerance": choice.tolerance, "served": choice.line(),
        "time_inference_s": inference, "time_training_s": training,
        "time_validation_s": totals.get("time/validation_s", 0.0),
        "cost_ratio": (inference + training) / inference if inference else float("nan"),
        "stopped_early": stopped, "collapse_rollbacks": s.cycle.budget.collapses,
        "model": cfg.model.name, "task": cfg.task.source, "preset": cfg.preset,
        "reward_weights": s.weights, "num_prompts": cfg.num_prompts,
        "num_generations": cfg.num_generations, "iterations": cfg.iterations,
        "session_wall_time_s": session_s,
    }


def _rate(evaluation: dict[str, bool]) -> float:
    return sum(evaluation.values()) / len(evaluation) if evaluation else float("nan")
