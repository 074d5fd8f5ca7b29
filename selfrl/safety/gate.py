"""Held-out validation and the promotion gate.

Every candidate adapter is scored on held-out tasks with greedy decoding
(pass@1, judged by the task's verifier) before it may serve as "best". The gate
is deliberately simple here: promote when the candidate is not worse than the
best so far by more than ``tolerance`` (absolute success rate; the rule is
:func:`selfrl.record.versions.passes_gate`, which :meth:`Ledger.judge` applies). Validation also
measures the share of degenerate held-out rollouts (loops, empty answers, cut off
at the length limit), which the collapse rules compare with the base version's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from selfrl.safety.collapse import degenerate_share
from selfrl.config import CollapseConfig, GateConfig, RolloutConfig
from selfrl.engines.base import SamplingEngine
from selfrl.rollout.agent import rollout
from selfrl.core.tasks import Task, TaskSource
from selfrl.core.tools import Tool
from selfrl.record.versions import passes_gate  # noqa: F401  the promotion rule, applied by the ledger


@dataclass
class EvalResult:
    """Outcome of one validation.

    Attributes:
        version: adapter version evaluated.
        results: ``(task_id, correct, answer)`` per task, in task order.
        seconds: wall time of the evaluation.
        degenerate: share (0..1) of the held-out rollouts that were degenerate
            (``selfrl.safety.collapse.degenerate_reasons``).
        errors: task id -> why its rollout or its verdict failed (an environment hook or the
            verifier raised); such a task counts as not solved: a candidate is never
            promoted on a failure.
    """

    version: int
    results: list[tuple[str, bool, str | None]]
    seconds: float
    degenerate: float = math.nan
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def success(self) -> float:
        """Share of tasks solved (0..1)."""
        return sum(c for _, c, _ in self.results) / max(len(self.results), 1)


def validate(
    engine: SamplingEngine, tasks: list[Task], source: TaskSource, tools: list[Tool], cfg: RolloutConfig, batch_size: int = 64,
    on_batch: Callable[[int], None] | None = None, collapse: CollapseConfig | None = None,
) -> EvalResult:
    """Greedy pass@1 of the engine's current version on ``tasks``; ``on_batch(n)`` is
    called after each batch of n tasks (progress display); ``collapse`` sets what
    counts as degenerate (default :class:`CollapseConfig`). A task whose environment or
    verifier raises is not solved, and its error is kept in ``EvalResult.errors``."""
    t0 = time.perf_counter()
    results, degenerate, errors = [], 0.0, {}
    for s in range(0, len(tasks), batch_size):
        chunk = tasks[s:s + batch_size]
        trajs = rollout(engine, chunk, [f"val-{t.id}" for t in chunk], tools, cfg, greedy=True,
                        env_factory=source.make_env)
        for task, tr in zip(chunk, trajs):
            answer, correct = None, False
            try:
                answer = source.trajectory_answer(tr)
                correct = tr.error is None and bool(source.correct(task, answer))
            except Exception as e:  # this task fails; the validation goes on
                tr.error = tr.error or f"verifier failed: {type(e).__name__}: {e}"
            if tr.error is not None:
                errors[task.id] = tr.error
            results.append((task.id, correct, answer))
        degenerate += degenerate_share(trajs, collapse or CollapseConfig()) * len(chunk)
        if on_batch is not None:
            on_batch(len(chunk))
    return EvalResult(engine.version, results, time.perf_counter() - t0, degenerate / max(len(results), 1), errors)

