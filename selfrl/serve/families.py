"""No forgetting in ``selfrl serve``: a held-out set per family of traffic (``[[families]]``),
and the rule of :mod:`selfrl.safety.families` on every candidate.

A request names its family in ``metadata.family`` (the user simulator, ``selfrl simulate``,
sends ``{"family": ..., "user": ...}``); the family is recorded on its served turns
(:func:`selfrl.record.served.learned_families`). Once the learner has trained on one turn of a
family, the family is *learned*, and from then on every candidate is judged on it: its
held-out success must be at least the best any promoted version (or the base) had on that
family's held-out tasks, minus the family's tolerance. A candidate that drops a learned family
beyond its tolerance is rejected; the ``reject`` event's message and data name the family, the
drop, its Wilson intervals, the paired difference with its 95 % interval and the tasks lost.

Every configured family is validated on every version (so a family's reference exists from
the base on, before it is learned); only learned families gate. The held-out set of family
``f`` is ``distinct_sample(f's environment, val_size, val_seed)`` (each family's ``val_seed``,
else ``task.val_seed``), its task ids tagged ``"<f>/<id>"`` as ``selfrl run``'s ``[[agents]]``
are (:class:`selfrl.envs.agents.AgentsEnv`). Training traffic must come from other tasks:
``selfrl simulate`` redraws any task whose id is in the family's held-out set (give it the
same seed and size: its ``heldout_seed`` and ``heldout_size``).
"""

from __future__ import annotations

from typing import Any

from selfrl.config import AgentConfig
from selfrl.config.serve import ServeConfig
from selfrl.core.tasks import Task, TaskSource, assert_disjoint
from selfrl.envs.agents import AgentsEnv, agent_results
from selfrl.envs.registry import get_env
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.record.versions import Ledger
from selfrl.safety.families import FamiliesVerdict, best_per_family, judge_families


def held_out_sets(cfg: ServeConfig, store: Store, ledger: Ledger) -> tuple[TaskSource, list[Task], "FamilyGate | None"]:
    """The gate's environment, its held-out tasks, and the :class:`FamilyGate` (None without
    ``[[families]]``: ``gate.val_size`` tasks of ``[task]``'s environment from ``task.val_seed``).

    Raises:
        ValueError: an environment cannot be built, or its held-out set cannot be drawn.
    """
    if cfg.families:
        gate = FamilyGate(cfg, store, ledger)
        return gate.source, gate.val, gate
    source = get_env(cfg.task.source, **cfg.task.options)
    _, val = source.split(0, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    assert_disjoint([], val)
    return source, val, None


class FamilyGate:
    """The families of one server: their environment, held-out tasks and the no-forgetting gate.

    Args:
        cfg: the server's settings (``cfg.families`` not empty).
        store: the run's store (which families were trained on).
        ledger: the version ledger (the reference versions' stored results).

    Raises:
        ValueError: a family's environment cannot be built (an unknown name: the message lists
            the valid ones), or its held-out set cannot be drawn.
    """

    def __init__(self, cfg: ServeConfig, store: Store, ledger: Ledger):
        self.cfg, self.store, self.ledger = cfg, store, ledger
        agents = [AgentConfig(name=f.name, source=f.source, options=dict(f.options), tolerance=f.tolerance,
                              val_size=f.val_size, val_seed=f.val_seed, rollout=dict(f.rollout)) for f in cfg.families]
        self.source = AgentsEnv(agents, cfg.task, cfg.gate)
        _, self.val = self.source.split(0, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
        self.tolerance = self.source.tolerance  # {family: largest allowed drop}

    @property
    def val_ids(self) -> set[str]:
        return {t.id for t in self.val}

    def covers(self, version: int) -> bool:
        """``version`` has stored results on every family's held-out task (else it is validated again)."""
        with self.store.lock:
            return self.val_ids <= set(self.store.evaluation(version))

    def learned(self) -> list[str]:
        """The configured families the learner has trained on, sorted."""
        return sorted(records.learned_families(self.store) & set(self.tolerance))

    def judge(self, results: list[tuple[str, bool, Any]] | dict[str, bool]) -> FamiliesVerdict:
        """The no-forgetting rule on a candidate's held-out ``results`` (``EvalResult.results``):
        each learned family against the best stored result of a promoted version or the base."""
        candidate = agent_results(results)
        refs = {v: agent_results({t: ok for t, ok in ev.items() if t in self.val_ids})
                for v, ev in self.ledger.reference_evaluations().items()}
        reference, versions = best_per_family(refs, candidate)
        gated = [f for f in self.learned() if f in reference]
        return judge_families(reference, candidate, self.tolerance, gated=gated, reference_version=versions)

    def veto(self, step: int, results) -> tuple[str | None, dict[str, Any] | None]:
        """Judge a candidate (:meth:`judge`) and log ``val/<family>``, its held-out success on every
        family, at ``step``. Returns ``(veto message, reject event data)``, both None when it passes."""
        self.store.log_metrics(self.ledger.run_id, step, {
            f"val/{f}": sum(r.values()) / len(r) for f, r in agent_results(results).items()})
        verdict = self.judge(results)
        if verdict.passed:
            return None, None
        return verdict.message(), {"families": [c.to_dict() for c in verdict.dropped]}


def check_family_sources(cfg: ServeConfig) -> None:
    """Each family's environment can be built from its ``source`` and ``options``, and has the
    distinct tasks its held-out set asks for (:func:`selfrl.run.setup.check_held_out_size`).

    Raises:
        selfrl.config.ConfigError: an unknown environment (the valid names listed), bad options,
            or fewer tasks than ``val_size``, with the family named.
    """
    from selfrl.config import ConfigError
    from selfrl.envs.registry import build_env
    from selfrl.run.setup import check_held_out_size

    for i, f in enumerate(cfg.families):
        try:
            env = build_env(f.source, f.options, f"[[families]] {f.name!r}")
        except ValueError as e:
            raise ConfigError(f"families[{i}] ({f.name}).source: {e}") from e
        size = cfg.gate.val_size if f.val_size is None else f.val_size
        check_held_out_size(env, size, cfg.task.val_seed if f.val_seed is None else f.val_seed,
                            f"families[{i}] ({f.name}).val_size" if f.val_size is not None else
                            f"families[{i}] ({f.name}) takes gate.val_size")

