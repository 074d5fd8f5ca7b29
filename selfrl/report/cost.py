"""The cost of a ``selfrl run``, read from its store: the seconds of each iteration's rollouts
(inference) and update (training), of every held-out validation and of the warm start, the
rollouts it sampled, and (inference + training) / inference, the figure that should stay well
under 2. ``benchmarks/bench_cost.py`` and ``scripts/results.py`` both read it here.

An iteration is a step whose metrics hold ``time/rollout_s`` (logged with the iteration's
update, :mod:`selfrl.run.loop`); its update seconds are ``time/update_s`` (0 when absent).
Validation seconds are every ``time/validation_s`` row: the base model's, each gated
candidate's and the warm start's candidate's. The warm start (:mod:`selfrl.run.warm_start`)
records its last phase in a ``warm_start`` event; its seconds here are its sampling and
fine-tuning (its candidate's validation is already among the validation seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfrl.record.store import Store
from selfrl.record.versions import EventKind


@dataclass(frozen=True)
class IterationCost:
    """One RL iteration's numbers (seconds; tokens)."""

    step: int
    rollout_s: float  # sampling the iteration's rollouts (``time/rollout_s``)
    update_s: float  # its update (``time/update_s``; 0 when not logged)
    completion_tokens: float  # mean sampled completion tokens per rollout (``train/completion_tokens``)
    trained_tokens: float  # completion tokens that went into the update (``num_tokens``)
    skipped: bool  # the update was skipped


@dataclass(frozen=True)
class WarmStartCost:
    """The warm start's samples and seconds, as its last ``warm_start`` event records them; all
    None when it recorded nothing yet (enabled, but stopped before its sampling ended)."""

    outcome: str | None  # "promoted", "rejected", "no_successes", ...; "not yet gated" after phase "trained"
    samples: int | None  # rollouts sampled on training tasks
    seconds: float | None  # sampling and fine-tuning (its candidate's validation not included)

    @property
    def recorded(self) -> bool:
        return self.samples is not None


@dataclass(frozen=True)
class RunCost:
    """What a run spent: its iterations in step order, every validation's seconds, the RL
    rollouts stored (every session's), and the warm start (None when the config has it off)."""

    iterations: list[IterationCost]
    validations_s: list[float]
    rollouts: int
    warm_start: WarmStartCost | None

    @property
    def inference_s(self) -> float:
        """Seconds sampling RL rollouts, over the iterations."""
        return sum(i.rollout_s for i in self.iterations)

    @property
    def training_s(self) -> float:
        """Seconds in RL updates, over the iterations."""
        return sum(i.update_s for i in self.iterations)

    @property
    def validation_s(self) -> float:
        return sum(self.validations_s)

    @property
    def cost_ratio(self) -> float | None:
        """(inference + training) / inference over the iterations; None without inference time."""
        return cost_ratio(self.inference_s, self.training_s)


def cost_ratio(inference_s: float, training_s: float) -> float | None:
    """``(inference_s + training_s) / inference_s``; None when ``inference_s`` is not positive.

    >>> cost_ratio(4.0, 2.0)
    1.5
    >>> cost_ratio(0.0, 2.0) is None
    True
    """
    return (inference_s + training_s) / inference_s if inference_s > 0 else None


def warm_start_cost(store: Store) -> WarmStartCost:
    """The warm start's :class:`WarmStartCost` from the run's last ``warm_start`` event."""
    events = [e for e in store.events() if e["kind"] == EventKind.WARM_START.value]
    if not events:
        return WarmStartCost(None, None, None)
    data: dict[str, Any] = events[-1]["data"] or {}
    # "train_seconds" (sampling + fine-tuning) is written before the gate; "seconds" adds the gate
    # to it, and is all there is when no candidate was made (nothing kept, or no step taken)
    seconds = data.get("train_seconds", data.get("seconds"))
    outcome = "not yet gated" if data.get("phase") == "trained" else data.get("outcome")
    samples = data.get("samples")
    return WarmStartCost(outcome, None if samples is None else int(samples), seconds)


def run_cost(store: Store, config: dict[str, Any]) -> RunCost:
    """The :class:`RunCost` of the run in ``store`` whose config (``config.json``) is ``config``.

    A run with no iteration yet has an empty ``iterations`` and a ``cost_ratio`` of None.
    """
    by_step: dict[int, dict[str, float]] = {}
    validations = []
    for r in store.metrics():
        if r["value"] is None:
            continue
        if r["name"] == "time/validation_s":
            validations.append(r["value"])
        else:
            by_step.setdefault(r["step"], {})[r["name"]] = r["value"]
    iterations = [IterationCost(step, m["time/rollout_s"], m.get("time/update_s", 0.0),
                                m.get("train/completion_tokens", 0.0), m.get("num_tokens", 0.0),
                                bool(m.get("skipped")))
                  for step, m in sorted(by_step.items()) if "time/rollout_s" in m]
    warm = warm_start_cost(store) if (config.get("warm_start") or {}).get("enabled") else None
    return RunCost(iterations, validations, store.count_trajectories(), warm)
