"""One update cycle for ``selfrl run`` and ``selfrl serve``: scored trajectories ->
detectors -> group advantages -> GRPO update -> candidate version -> KL probe ->
collapse rules -> (validation) -> gate -> promote | reject | roll back.

Both ends build an :class:`UpdateCycle` around their own model and call the same
steps, so the anomaly skip, the reward-hacking detectors, the collapse rules and the
version ledger behave the same way in both by construction. What differs is only
where trajectories come from (rollouts of tasks, or served turns with feedback) and
how a version reaches the engine that serves (the ``load`` and ``publish``
callbacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selfrl.record import adapters
from selfrl.safety import collapse
from selfrl.core import faults
from selfrl.safety.collapse import Alarm, CollapseConfig, CollapseGuard, CollapseStop, UpdateRecord
from selfrl.safety.detectors import HackingMonitor
from selfrl.rl.advantages import AdvantageResult, group_advantages
from selfrl.rl.learner import Learner, UpdateResult
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import EventKind, Ledger, VersionRecord, Verdict


@dataclass
class CycleStep:
    """What one update produced: the learner's result, and the candidate it saved (None when skipped)."""

    result: UpdateResult
    candidate: VersionRecord | None = None
    candidate_kl: float | None = None


class UpdateCycle:
    """The steps of one update, shared by the loop and the background learner.

    Args:
        ledger: the run directory's versions (its champion must be set before :meth:`update`).
        learner: the GRPO learner over the model being trained.
        guard: the collapse history and budget.
        monitor: reward-hacking detectors (None: none).
        collapse_cfg: collapse settings (the KL probe size).
        tolerance: the gate's tolerance (``gate.tolerance``).
        scale_rewards: advantage scaling (``train.scale_rewards``).
        load: ``load(state, version)`` puts LoRA tensors back into the trained model (and,
            in ``run``, marks the engine's version): used to serve the champion again.
        agent_of: with several agents, ``agent_of(task_id)`` names a trajectory's agent, and the
            group advantages are balanced per agent (``selfrl.run.agents.balance_agents``);
            None: one agent.
        verify: ``verify(version)``, the promote step's swap check: proves that the sampler
            serves the validated candidate before the gate may promote it, raising
            :class:`selfrl.safety.swap_check.SwapCheckError` otherwise (a remote sampler,
            :mod:`selfrl.run.sampler_sync`); None: the engine shares the trained model.
    """

    def __init__(self, ledger: Ledger, learner: Learner, guard: CollapseGuard, monitor: HackingMonitor | None,
                 collapse_cfg: CollapseConfig, tolerance: float, scale_rewards: str,
                 load: Callable[[dict, int], None], agent_of: Callable[[str], str] | None = None,
                 verify: Callable[[int], object] | None = None):
        self.ledger, self.learner, self.guard, self.monitor = ledger, learner, guard, monitor
        self.collapse_cfg, self.tolerance, self.scale_rewards, self.load = collapse_cfg, tolerance, scale_rewards, load
        self.agent_of, self.verify = agent_of, verify

    # -- update --------------------------------------------------------------------------

    def advantages(self, step: int, trajs: list[Trajectory]) -> tuple[AdvantageResult, dict[str, float]]:
        """Run the detectors (a flagged trajectory earns at most 0), then group advantages
        over the trajectories with a reward and a trainable token; sets ``advantage`` on each. Returns the advantage
        result and the detectors' metrics."""
        hacking = self.monitor.apply(trajs) if self.monitor is not None else {}
        if self.monitor is not None:
            for alert in self.monitor.pop_alerts():
                self.ledger.event(EventKind.HACKING, f"iteration {step}: {alert}")
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], self.scale_rewards,
                               num_completion_tokens=[t.num_completion_tokens for t in trajs])
        advantages = adv.advantages
        if self.agent_of is not None:  # several agents: each carries the same share of the update
            from selfrl.run.agents import balance_agents

            advantages = balance_agents(advantages, [self.agent_of(t.task_id) for t in trajs])
        for t, a in zip(trajs, advantages):  # None where the reward is None or nothing is trainable
            t.advantage = a
        return adv, hacking

    def update(self, step: int, trajs: list[Trajectory], parent: int,
               on_micro_batch: Callable[[], None] | None = None) -> CycleStep:
        """One GRPO update; on success the new weights are saved as a candidate trained from
        ``parent`` and, when the collapse rules are on, their KL to the reference probed. A
        skipped update makes no version and records a ``skip`` event with its reason."""
        result = self.learner.step(trajs, on_micro_batch=on_micro_batch)
        if result.skipped:
            self.ledger.event(EventKind.SKIP, f"iteration {step}: update skipped: {result.note}",
                              {"iteration": step, "reason": result.reason.value, **result.metrics()})
            return CycleStep(result)
        if faults.active("noise"):
            faults.add_noise(self.learner.params)
        candidate = self.ledger.save_candidate(self.learner.model, parent)
        kl = None
        if self.collapse_cfg.enabled and self.collapse_cfg.kl_probe_size:
            kl = self.learner.probe_kl(trajs, self.collapse_cfg.kl_probe_size)
        return CycleStep(result, candidate, kl)

    def probe(self, version: int, engine, source, tools, rollout_cfg) -> dict[str, float]:
        """The ``probe_regression`` detector at a validation of ``version`` (the engine's current
        weights): the source's probe tasks scored, a ``hacking`` event per alert; returns the
        ``hacking/probe_*`` metrics ({} when the detector is off or the source has no probes)."""
        if self.monitor is None or not self.monitor.runs_probes:
            return {}
        probes = self.monitor.run_probes(engine, source, tools, rollout_cfg)
        for alert in self.monitor.pop_alerts():
            self.ledger.event(EventKind.HACKING, f"version {version}: {alert}")
        return probes

    def observe(self, rec: UpdateRecord) -> str | None:
        """Record one update for the collapse rules; when a cheap rule fires, roll back now and
        return the ``collapse`` event's message (None when no rule fired)."""
        alarms = self.guard.observe(rec)
        return self.roll_back(rec.step, alarms) if alarms else None

    # -- gate ----------------------------------------------------------------------------

    def gate(self, step: int, version: int, success: float, degenerate: float, veto: str | None = None) -> Verdict:
        """Decide a validated candidate (its validation already recorded): collapse rules at
        the gate, then the ledger's verdict; a rejected candidate gives way to the champion.
        ``veto`` (the agents' gate's conflicts) rejects a candidate the collapse rules let through.

        Raises:
            selfrl.safety.swap_check.SwapCheckError: ``verify`` failed (the candidate is rejected, not promoted).
        """
        if self.verify is not None:  # the served version must be the trained one before any verdict
            self.verify(version)
        with self.ledger.lock:  # one step: an admin's rollback comes before or after it, never inside
            champ = self.ledger.champion
            base = self.ledger.get(0)
            alarms = self.guard.heldout(success, champ.success if champ.success is not None else 0.0, champ.version,
                                        self.tolerance, degenerate, base.metrics.get("val/degenerate") if base else None)
            verdict = self.ledger.judge(version, success, self.tolerance, alarms, veto=veto)
            if verdict.outcome == "collapse":
                verdict = Verdict("collapse", self.roll_back(step, alarms))
            elif verdict.outcome == "promoted":
                self.ledger.promote(version, adapters.lora_state(self.learner.model), success)
            else:
                self.restore_champion()
            self.guard.new_chain()
        return verdict

    def restore_champion(self) -> None:
        """The champion's weights back into the trained model, AdamW's moments forgotten."""
        champ = self.ledger.champion
        self.load(champ.state, champ.version)
        self.learner.reset_optimizer()

    def roll_back(self, step: int, alarms: list[Alarm]) -> str:
        """A collapse: the candidates since the champion are marked ``rolled_back``, the
        champion serves again, AdamW is reset and the setting made safer; one ``collapse``
        event, whose message is returned."""
        with self.ledger.lock:
            bad = self.ledger.roll_back_collapse(alarms[0].rule)
            self.restore_champion()
        lr, beta = self.guard.rolled_back(self.learner.cfg.learning_rate, self.learner.cfg.beta)
        self.learner.set_hyperparameters(lr, beta)
        cc, champ = self.collapse_cfg, self.ledger.champion
        msg = (f"iteration {step}: collapse: {'; '.join(a.message for a in alarms)}. Versions {bad} rolled back, "
               f"serving version {champ.version}; now learning rate {lr:.3g}, beta {beta:.3g} "
               f"(rollback {self.guard.rollbacks} of {cc.max_rollbacks} allowed)")
        self.ledger.event(EventKind.COLLAPSE, msg, {
            "iteration": step, "alarms": [a.to_dict() for a in alarms], "rolled_back": bad,
            "serving": champ.version, "learning_rate": lr, "beta": beta, "rollbacks": self.guard.rollbacks})
        return msg

    def check_budget(self) -> None:
        """Raise :class:`CollapseStop` (after a ``collapse_stop`` event) once the collapse
        rollbacks exceed ``collapse.max_rollbacks``."""
        if self.guard.over_budget():
            champ = self.ledger.champion
            best = champ.success if champ.success is not None else float("nan")
            msg = (f"stopping: {self.guard.rollbacks} collapse rollbacks exceed collapse.max_rollbacks = "
                   f"{self.collapse_cfg.max_rollbacks}; serving the best version {champ.version} "
                   f"(held-out {best:.3f})")
            self.ledger.event(EventKind.COLLAPSE_STOP, msg, {"rollbacks": self.guard.rollbacks})
            raise CollapseStop(msg)

    def resume(self, store) -> int:
        """After a restart (``run --resume``, or ``serve`` on a run directory it served before):
        the collapse rollbacks counted from the ``collapse`` events of ``store``, the history
        rebuilt from its metrics (:func:`selfrl.safety.collapse.history_from_metrics`), and the safer
        setting applied once per rollback, so the budget and the setting outlive the process.
        Returns the number of rollbacks."""
        self.guard.rollbacks = sum(1 for e in store.events() if e["kind"] == EventKind.COLLAPSE.value)
        self.guard.history = collapse.history_from_metrics(store.metrics())
        self.guard.new_chain()
        self.restore_setting()
        return self.guard.rollbacks

    def restore_setting(self) -> None:
        """On resume: apply the safer setting once per earlier collapse rollback."""
        for _ in range(self.guard.rollbacks):
            lr, beta = collapse.safer_setting(self.learner.cfg.learning_rate, self.learner.cfg.beta, self.collapse_cfg)
            self.learner.set_hyperparameters(lr, beta)
