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

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from selfrl.record import adapters
from selfrl.safety import collapse
from selfrl.core import faults
from selfrl.safety.collapse import Alarm, CollapseConfig, CollapseGuard, CollapseStop, UpdateRecord
from selfrl.safety.collapse_budget import CollapseBudget, policy_from_config
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


@dataclass(frozen=True)
class Observed:
    """What the collapse rules made of one update (:meth:`UpdateCycle.observe`): the ``collapse``
    event's message when a cheap rule fired and the chain was rolled back, or the ``step_back``
    event's message when the stable stretch earned one backoff level back; None where neither."""

    rolled_back: str | None = None
    stepped_back: str | None = None


class UpdateCycle:
    """The steps of one update, shared by the loop and the background learner.

    Args:
        ledger: the run directory's versions (its champion must be set before :meth:`update`).
        learner: the GRPO learner over the model being trained.
        guard: the collapse history.
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
        clock: seconds (``time.time``), the collapse budget's clock: its window, cool-down and stable
            stretch (tests and the user simulator pass a fake one to play days without waiting).

    The collapse budget (:class:`selfrl.safety.collapse_budget.CollapseBudget`, built from
    ``collapse_cfg`` around the learner's configured learning rate and ``beta``) decides what a
    collapse costs: a backoff level (applied to the learner), a cool-down, or, only with
    ``collapse.max_rollbacks`` set, a stop.
    """

    def __init__(self, ledger: Ledger, learner: Learner, guard: CollapseGuard, monitor: HackingMonitor | None,
                 collapse_cfg: CollapseConfig, tolerance: float, scale_rewards: str,
                 load: Callable[[dict, int], None], agent_of: Callable[[str], str] | None = None,
                 verify: Callable[[int], object] | None = None, clock: Callable[[], float] = time.time):
        self.ledger, self.learner, self.guard, self.monitor = ledger, learner, guard, monitor
        self.collapse_cfg, self.tolerance, self.scale_rewards, self.load = collapse_cfg, tolerance, scale_rewards, load
        self.agent_of, self.verify = agent_of, verify
        self.budget = CollapseBudget(policy_from_config(collapse_cfg, learner.cfg.learning_rate, learner.cfg.beta),
                                     clock)

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
               on_micro_batch: Callable[[], None] | None = None,
               sampled: list[Trajectory] | None = None, lr_factor: float = 1.0) -> CycleStep:
        """One GRPO update; on success the new weights are saved as a candidate trained from
        ``parent`` and, when the collapse rules are on, their KL to the reference probed on
        ``sampled`` (None or empty: ``trajs``): the sequences a policy sampled. A demonstration
        (:mod:`selfrl.serve.corrections`) is not a sample of any policy, and the k3 estimate on
        the very tokens the update pushed up reads as a drift the policy does not have; an
        update of demonstrations alone is still probed, on them. A
        skipped update makes no version and records a ``skip`` event with its reason. ``lr_factor``:
        the run's learning-rate schedule at this update (:func:`selfrl.rl.schedule.lr_factor`)."""
        result = self.learner.step(trajs, on_micro_batch=on_micro_batch, lr_factor=lr_factor)
        if result.skipped:
            self.ledger.event(EventKind.SKIP, f"iteration {step}: update skipped: {result.note}",
                              {"iteration": step, "reason": result.reason.value, **result.metrics()})
            return CycleStep(result)
        if faults.active("noise"):
            faults.add_noise(self.learner.params)
        candidate = self.ledger.save_candidate(self.learner.model, parent)
        kl = None
        if self.collapse_cfg.enabled and self.collapse_cfg.kl_probe_size:
            kl = self.learner.probe_kl(sampled or trajs, self.collapse_cfg.kl_probe_size)
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

    def observe(self, rec: UpdateRecord) -> Observed:
        """Record one update for the collapse rules; when a cheap rule fires, roll back now. An
        update without an alarm counts toward the budget's stable stretch (:meth:`stable_update`).
        Returns the message of the event either recorded (each None when it recorded none)."""
        alarms = self.guard.observe(rec)
        if alarms:
            return Observed(rolled_back=self.roll_back(rec.step, alarms))
        return Observed(stepped_back=self.stable_update(rec.step))

    def stable_update(self, step: int) -> str | None:
        """One update without a collapse: when the stable stretch earns it, step one backoff level
        back toward the configured setting, applied to the learner, with a ``step_back`` event,
        whose message is returned (None: no step back)."""
        setting = self.budget.update_done()
        if setting is None:
            return None
        lr, beta = setting
        self.learner.set_hyperparameters(lr, beta)
        level = self.budget.level
        msg = (f"iteration {step}: stable since the last collapse or step: backoff level {level}, "
               f"learning rate {lr:.3g}, beta {beta:.3g}")
        self.ledger.event(EventKind.STEP_BACK, msg, {"iteration": step, "level": level, "learning_rate": lr,
                                                     "beta": beta, "at": self.budget.clock()})
        return msg

    # -- gate ----------------------------------------------------------------------------

    def gate(self, step: int, version: int, success: float, degenerate: float, veto: str | None = None,
             veto_data: dict | None = None) -> Verdict:
        """Decide a validated candidate (its validation already recorded): collapse rules at
        the gate, then the ledger's verdict; a rejected candidate gives way to the champion.
        ``veto`` (the no-forgetting rule's drops, :mod:`selfrl.safety.families`) rejects a
        candidate the collapse rules let through; ``veto_data`` goes into its ``reject`` event.

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
            verdict = self.ledger.judge(version, success, self.tolerance, alarms, veto=veto, veto_data=veto_data)
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
        champion serves again, AdamW is reset and the budget decides the setting to go on with
        (a lower learning rate and a larger ``beta``, maybe a cool-down or, on request, a stop);
        one ``collapse`` event, whose message is returned."""
        with self.ledger.lock:
            bad = self.ledger.roll_back_collapse(alarms[0].rule)
            self.restore_champion()
        self.guard.new_chain()
        decision = self.budget.collapse()
        self.learner.set_hyperparameters(decision.learning_rate, decision.beta)
        champ, state = self.ledger.champion, self.budget.state()
        undone = (f"Versions {bad} rolled back" if bad else
                  f"No candidate since version {champ.version} to roll back (it sampled these rollouts)")
        msg = (f"iteration {step}: collapse: {'; '.join(a.message for a in alarms)}. {undone}, "
               f"serving version {champ.version}; {decision.reason}")
        self.ledger.event(EventKind.COLLAPSE, msg, {
            "iteration": step, "alarms": [a.to_dict() for a in alarms], "rolled_back": bad,
            "serving": champ.version, "learning_rate": decision.learning_rate, "beta": decision.beta,
            "rollbacks": self.budget.collapses, "action": decision.action.value, "level": state.level,
            "paused_until": decision.paused_until, "collapses_in_window": state.collapses_in_window,
            "at": self.budget.clock()})
        return msg

    def check_budget(self) -> float:
        """Before an update: the seconds until updates may run again (0.0: now; > 0 during a
        cool-down, when the caller waits or serves without learning).

        Raises:
            CollapseStop: ``collapse.max_rollbacks`` is set and the collapses exceed it (after a
                ``collapse_stop`` event).
        """
        if self.budget.stopped:
            champ = self.ledger.champion
            best = champ.success if champ.success is not None else float("nan")
            n = self.budget.collapses
            msg = (f"stopping: {n} collapse rollbacks exceed collapse.max_rollbacks = "
                   f"{self.collapse_cfg.max_rollbacks}; serving the best version {champ.version} "
                   f"(held-out {best:.3f}); unset collapse.max_rollbacks to back off and keep learning instead")
            self.ledger.event(EventKind.COLLAPSE_STOP, msg, {"rollbacks": n})
            raise CollapseStop(msg)
        paused = self.budget.state().paused_until
        return 0.0 if paused is None else max(paused - self.budget.clock(), 0.0)

    def resume(self, store) -> int:
        """After a restart (``run --resume``, or ``serve`` on a run directory it served before):
        the collapse budget replayed from the ``collapse`` and ``step_back`` events of ``store``
        at their budget-clock times (``data.at``; the event's time when older stores lack it):
        level, window, cool-down, a stop; the updates since the last of them counted from the metrics, the history rebuilt from the metrics
        (:func:`selfrl.safety.collapse.history_from_metrics`), and the budget's setting applied
        to the learner, so that the budget and the setting outlive the process. Returns the
        number of collapses."""
        last = None  # the iteration of the last collapse or step back
        for e in store.events():
            if e["kind"] in (EventKind.COLLAPSE.value, EventKind.STEP_BACK.value):
                at = e["data"].get("at", e["time"])
                self.budget.collapse(at=at) if e["kind"] == EventKind.COLLAPSE.value else self.budget.step_back(at)
                last = e["data"].get("iteration", -1)
        rows = store.metrics()
        if last is not None:
            self.budget.updates_since(sum(1 for m in rows if m["name"] == "reward/mean" and m["step"] > last))
        self.guard.history = collapse.history_from_metrics(rows)
        self.guard.new_chain()
        self.learner.set_hyperparameters(*self.budget.setting())
        return self.budget.collapses

    def backoff(self) -> dict:
        """The budget's state for ``/health``, ``/admin/status`` and the report: ``backing_off``,
        ``level``, ``learning_rate``, ``beta``, ``collapses``, ``collapses_in_window``,
        ``paused_until`` (clock seconds or None), ``next_step_back_at``,
        ``next_step_back_after_updates``, ``stopped``."""
        return dataclasses.asdict(self.budget.state())
