"""The online self-improvement loop: rollouts -> rewards -> advantages -> LoRA update
-> candidate version -> validation gate -> promote or roll back; all recorded.

This module only orchestrates (:class:`Runner` drives a run that
:func:`selfrl.run.setup.build_run` built; :func:`selfrl.run.main.run` is the entry); the
math lives in ``selfrl.rl`` and each part in its own module. Version semantics: the engine's ``version`` is always the
version whose weights are loaded. An update saves its result as a new
*candidate* version, which serves the next rollouts (on-policy); every
``gate.eval_every`` updates the candidate is validated and either *promoted*
(new best) or *rejected*, in which case the best version is swapped back in.
"""

from __future__ import annotations

import time

from selfrl.core import faults
from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory
from selfrl.core.wording import plural
from selfrl.record import adapters
from selfrl.run.agents import agents_gate
from selfrl.run.metrics import MetricsLog, iteration_line, iteration_metrics
from selfrl.run.order import iteration_tasks, shuffled
from selfrl.run.result import RunResult, finish_run
from selfrl.record.versions import Champion, EventKind, VersionStatus
from selfrl.rl.schedule import lr_factor
from selfrl.rollout.agent import env_offers_tools, rollout
from selfrl.rollout.prefetch import Prefetch, staleness
from selfrl.safety import collapse
from selfrl.safety.collapse import CollapseStop
from selfrl.safety.gate import EvalResult, validate
from selfrl.safety.swap_check import SwapCheckError
from selfrl.envs.rewards import score_batch
from selfrl.run.progress import PROGRESS_LOG, Progress, ProgressLog
from selfrl.run.setup import RunSetup
from selfrl.run.signal import SignalChooser, diagnose, probe_report
from selfrl.run.warm_start import WarmStartError, run_warm_start

__all__ = ["NoSignalStop", "Runner"]


class NoSignalStop(Exception):
    """``task.signal_check = "stop"`` and the first batch had no group with reward spread."""


class Runner:
    """Drives one run built by :func:`selfrl.run.setup.build_run` (the entry is
    :func:`selfrl.run.main.run`): :meth:`start`, then per iteration :meth:`iteration` (rollouts,
    rewards, one update through the update cycle), :meth:`validate` and :meth:`gate` when due,
    and :meth:`finish`.

    Its methods are the phases of one run, sharing the run's state (the chooser's pass rates, the
    batch sampled during the update, the pre-flight check done once); the Ray driver overrides
    where rollouts come from (:class:`selfrl.run.ray.driver.AsyncRunner`) and the warm start calls
    its validation and gate. What is not state lives beside it: the setup (:mod:`selfrl.run.setup`),
    the update cycle (:mod:`selfrl.run.cycle`), the task order (:mod:`selfrl.run.order`), the
    agents' gate (:func:`selfrl.run.agents.agents_gate`) and the end (:mod:`selfrl.run.result`).
    """

    def __init__(self, setup: RunSetup, progress: Progress):
        # every line also in RUN_DIR/progress.log, with a heartbeat during long phases
        self.s, self.cfg, self.progress = setup, setup.cfg, ProgressLog(progress, setup.run_dir / PROGRESS_LOG)
        self.tasks_by_id = {t.id: t for t in setup.train}
        self.step = 0  # the iteration under way, for metrics logged outside an iteration
        self.t_start = time.perf_counter()
        task = setup.cfg.task
        self.chooser = (SignalChooser(setup.cfg.num_generations, task.min_spread, task.retry_after)
                        if task.choice == "signal" else None)  # signal-aware task choice (selfrl.run.signal)
        self.checked_signal = False  # the pre-flight signal check runs on this session's first batch
        self.pending: Prefetch | None = None  # --async-rollouts: the next batch, sampling during the update

    @property
    def champion(self) -> Champion:
        return self.s.ledger.champion

    # -- phases -------------------------------------------------------------------------

    def validate(self) -> EvalResult:
        """Held-out pass@1 of the engine's current version, stored per task."""
        s = self.s
        self.progress.phase(f"validation (version {s.engine.version})", len(s.val))
        res = validate(s.engine, s.val, s.source, s.tools, self.cfg.rollout, self.cfg.gate.batch_size,
                       on_batch=self.progress.advance, collapse=self.cfg.collapse)
        faults.point("during_validation")
        if res.errors:  # counted as not solved; said, never hidden
            first = next(iter(res.errors.items()))
            self.progress.log(f"validation of version {res.version}: {len(res.errors)} task(s) failed in their "
                              f"environment or verifier (counted as not solved), e.g. {first[0]}: {first[1]}")
        s.ledger.record_validation(res.version, res.success, res.degenerate, res.results)
        s.store.log_metrics(s.run_id, self.step, {"time/validation_s": res.seconds})
        probes = s.cycle.probe(res.version, s.engine, s.source, s.tools, self.cfg.rollout)  # selfrl.safety.detectors
        if probes:
            s.store.log_metrics(s.run_id, self.step, probes)
        return res

    def start(self) -> int:
        """Evaluate the base model (fresh run, or a resume whose base validation never
        finished) or restore the best version (resume); returns the first iteration."""
        s = self.s
        if s.resume:
            self.recover()
        backend = getattr(s.engine, "name", type(s.engine).__name__)
        s.ledger.event(EventKind.ENGINE, f"sampling on the {backend} engine (engine = {self.cfg.engine!r})",
                       {"engine": backend, "configured": self.cfg.engine})
        fresh = s.ledger.get(0) is None
        if fresh:
            s.store.add_tasks([_task_row(t) for t in s.train], "train")
            s.store.add_tasks([_task_row(t) for t in s.val], "val")
        base = s.ledger.ensure_base(s.learner.model)
        pushed = None
        if s.sampler is not None and base.val_success is None:  # the sampler must serve the base it validates
            s.sampler.push(0, "start")
            pushed = 0
        if base.val_success is None:
            res = self.validate()
            self.progress.log(f"base model: held-out success {res.success:.3f} on {plural(len(s.val), 'task')} "
                              f"({res.seconds:.0f} s)")
        best = s.ledger.latest_servable()
        if s.sampler is not None:
            if best.version != pushed:
                s.sampler.load(s.ledger.load_state(best.version), best.version, "start")
        elif best.version != 0:
            s.engine.swap(s.ledger.load_state(best.version), best.version)
        s.ledger.set_champion(best.version, adapters.lora_state(s.learner.model))
        done = [m["step"] for m in s.store.metrics() if m["name"] == "reward/mean"]
        start = max(done) + 1 if done else 0
        if self.chooser is not None and start:  # resume: pass rates from the stored groups
            self.chooser.observe(s.store.trajectories())
            self.chooser.cursor = start * self.cfg.num_prompts
        s.cycle.guard.new_chain()
        if s.resume:
            champ = self.champion
            # candidates trained after the champion and never gated: the chain goes on from the champion
            ungated = [v.version for v in s.ledger.all()
                       if v.status == VersionStatus.CANDIDATE and v.version > champ.version]
            aside = (f"; {plural(len(ungated), 'candidate')} trained after it but not yet gated "
                     f"({', '.join(f'v{v}' for v in ungated)}) set aside: training goes on from version "
                     f"{champ.version}" if ungated else "")
            s.ledger.event(EventKind.RESUME, f"resumed at iteration {start} from version {champ.version}{aside}")
            self.progress.log(f"resuming at iteration {start} from version {champ.version} "
                              f"(held-out {champ.success:.3f}){aside}")
        return start

    def iteration(self, it: int) -> dict[str, float]:
        """Rollouts, rewards, advantages, one update, the collapse rules; returns the logged metrics."""
        s, cfg = self.s, self.cfg
        faults.set_iteration(it)
        trajs, t_roll, sampled, lag = self.batch(it)
        score_batch(trajs, self.tasks_by_id, s.source, s.weights)
        judged = s.judge.pop_metrics() if s.judge is not None else {}  # tokens, cost, calibration (selfrl.judge)
        adv, hacking = s.cycle.advantages(it, trajs)
        s.store.add_trajectories(s.run_id, it, trajs)
        faults.point("after_store")
        probe = probe_report(trajs)
        cause = diagnose(probe, cfg.rollout.temperature, cfg.num_generations, bool(s.tools) or
                         env_offers_tools(s.source.make_env, self.tasks_by_id[trajs[0].task_id]),
                         cfg.rollout.demonstration, cfg.rollout.tools_prompt, cfg.rollout.constrain)
        if self.chooser is not None:
            self.chooser.observe(trajs)
        if not self.checked_signal and cfg.task.signal_check != "off":
            self.preflight(it, probe.line(), cause)
        parent = s.engine.version  # the learner's (the sampler is kept at it between updates)
        self.prefetch(it + 1)
        signal = sum(1 for t in trajs if t.advantage)
        self.progress.phase(f"iteration {it}: update (micro-batches)", max(1, -(-signal // cfg.train.micro_batch_size)))
        factor = lr_factor(cfg.train.lr_scheduler_type, it, cfg.iterations, cfg.train.warmup_ratio)
        step = s.cycle.update(it, trajs, parent, on_micro_batch=self.progress.advance, lr_factor=factor)
        if self.pending is not None:  # the sampler's weights change only once its batch is back
            self.pending.wait()
        if step.candidate is not None and s.sampler is not None:  # it samples the next rollouts: pushed, checked
            s.sampler.push(step.candidate.version, "candidate")
        elif step.candidate is not None:
            s.engine.version = step.candidate.version
        else:
            self.progress.advance()  # close the update bar: no micro-batch ran
        metrics = iteration_metrics(step.result, step.candidate_kl, trajs, cfg.collapse) | hacking | judged | lag
        metrics.update({"frac_reward_zero_std": adv.frac_no_signal, "advantage_scale": adv.scale,
                        "version": float(s.engine.version), "time/rollout_s": t_roll, "sampled_version": float(sampled),
                        "signal/pass_at_k": probe.pass_at_k, "signal/all_fail": probe.all_fail,
                        "signal/all_pass": probe.all_pass})
        if self.chooser is not None:
            metrics["signal/skipped_tasks"] = float(self.chooser.last_skipped)
        cause_note = None
        if cause and (step.result.skipped or probe.zero_signal >= 0.75):  # say why it is not learning
            cause_note = cause
            s.ledger.event(EventKind.NO_SIGNAL, f"iteration {it}: {cause}", {"zero_signal": probe.zero_signal})
        self.progress.log(iteration_line(it, metrics, step.result, s.engine.version, t_roll, cause_note))
        # also when the champion sampled them: the new candidate goes, the setting gets safer
        record = collapse.UpdateRecord(it, sampled, metrics["reward/mean"], metrics["train/entropy"],
                                       metrics["train/degenerate"], step.result.stats.get("kl"), step.candidate_kl)
        observed = s.cycle.observe(record)  # a collapse rolled back, or a stable stretch stepped back
        for line in (observed.rolled_back, observed.stepped_back):
            if line:
                self.progress.log(line)
        return metrics

    def choose(self, it: int) -> list[Task]:
        """The iteration's ``num_prompts`` tasks."""
        cfg = self.cfg
        if self.chooser is not None:  # signal-aware choice (selfrl.run.signal)
            return self.chooser.choose(shuffled(self.s.train, cfg.task.train_seed), it, cfg.num_prompts)
        return iteration_tasks(self.s.train, it, cfg.num_prompts, cfg.task.train_seed)

    def rollouts(self, it: int, batch: list[Task] | None = None, quiet: bool = False) -> tuple[list[Trajectory], float]:
        """The group of ``num_generations`` rollouts of each task of ``batch`` (None: :meth:`choose`);
        returns them and the seconds. ``quiet``: no progress bar (a batch sampled during the update)."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.choose(it) if batch is None else batch
        tasks = [t for t in batch for _ in range(cfg.num_generations)]
        groups = [f"{it}-{j}" for j, t in enumerate(batch) for _ in range(cfg.num_generations)]
        if not quiet:
            self.progress.phase(f"iteration {it}: rollouts (turns)", cfg.rollout.max_turns)
        trajs = rollout(self.s.engine, tasks, groups, self.s.tools, cfg.rollout,
                        on_turn=None if quiet else self.progress.advance, env_factory=self.s.source.make_env)
        t_roll = time.perf_counter() - t0
        faults.point("after_rollout")
        return trajs, t_roll

    def prefetch(self, it: int) -> None:
        """With ``async_rollouts``: start sampling iteration ``it``'s batch in a thread, by the
        version serving now, while the update trains (:mod:`selfrl.rollout.prefetch`)."""
        if not self.cfg.async_rollouts or it >= self.cfg.iterations:
            return
        batch = self.choose(it)
        self.pending = Prefetch(it, self.s.engine.version, lambda: self.rollouts(it, batch, quiet=True), batch)

    def batch(self, it: int) -> tuple[list[Trajectory], float, int, dict[str, float]]:
        """The iteration's rollouts, the seconds they took, the version that sampled them, and
        (``async_rollouts``) the staleness metrics: the batch sampled during the last update when
        its staleness is at most 1, else (the champion came back since) the same tasks sampled
        again now by the version serving, the stale batch dropped whole."""
        p, self.pending = self.pending, None
        if p is None or p.iteration != it:
            trajs, t_roll = self.rollouts(it)
            return trajs, t_roll, self.s.engine.version, ({"async/dropped_stale": 0.0, "async/mean_staleness": 0.0}
                                                          if self.cfg.async_rollouts else {})
        trajs, t_roll = p.result()
        lag = staleness(p.version, self.s.sampler.served)
        if lag <= 1:
            self.progress.log(f"iteration {it}: rollouts sampled by version {p.version} during the last update "
                              f"({t_roll:.0f} s; staleness {lag})")
            return trajs, t_roll, p.version, {"async/dropped_stale": 0.0, "async/mean_staleness": float(lag)}
        self.progress.log(f"iteration {it}: the rollouts sampled by version {p.version} during the last update are "
                          f"dropped (staleness {lag} > 1: version {self.s.engine.version} serves again); "
                          "sampling them again")
        again, t_again = self.rollouts(it, p.tasks)
        return again, t_roll + t_again, self.s.engine.version, {"async/dropped_stale": float(len(p.tasks)),
                                                                "async/mean_staleness": 0.0}

    def preflight(self, it: int, line: str, cause: str | None) -> None:
        """The pre-flight signal check on the first batch, before the first update: log what the
        batch shows and, without signal, why and what to change; stop under ``signal_check = "stop"``.

        Raises:
            NoSignalStop: ``signal_check`` is "stop" and the batch had no signal at all.
        """
        self.checked_signal = True
        msg = f"pre-flight (iteration {it}, before the update): {line}" + (f". {cause}" if cause else ". Signal: yes")
        self.s.ledger.event(EventKind.PREFLIGHT, msg)
        self.progress.log(msg)
        if cause and cause.startswith("no signal") and self.cfg.task.signal_check == "stop":
            raise NoSignalStop(msg)

    def gate(self, it: int, res: EvalResult) -> None:
        """Promote the validated candidate, or reject it (or roll its chain back) and serve the champion.
        With ``[[agents]]`` every agent gates it too (:meth:`agents_gate`)."""
        if res.version == self.champion.version:
            return
        veto, data = (self.agents_gate(it, res) if self.cfg.agents else None) or (None, None)
        verdict = self.s.cycle.gate(it, res.version, res.success, res.degenerate, veto=veto, veto_data=data)
        self.progress.log(verdict.message if verdict.outcome == "collapse" else f"iteration {it}: {verdict.message}")

    def agents_gate(self, it: int, res: EvalResult) -> tuple[str, dict] | None:
        """:func:`selfrl.run.agents.agents_gate` on this run's ledger, its agents' tolerances."""
        return agents_gate(self.s.ledger, self.s.source.tolerance, it, res, self.progress.log)

    def recover(self) -> None:
        """On resume: move aside what a killed save left (never recorded), and restore the
        rollback count, the safer setting and the collapse history of earlier sessions
        (a damaged base is re-saved by :meth:`Ledger.ensure_base`)."""
        s = self.s
        s.ledger.recover_strays()
        s.cycle.resume(s.store)

    def run(self) -> RunResult:
        """The whole run (see :func:`selfrl.run.main.run`); the run directory's lock is released however it ends."""
        try:
            return self.run_loop()
        finally:
            self.progress.close()
            if self.s.lock is not None:
                self.s.lock.release()

    def run_loop(self) -> RunResult:
        s = self.s
        try:
            start = self.start()
            if self.cfg.warm_start.enabled:  # own successes fine-tuned and gated first (selfrl.run.warm_start)
                run_warm_start(self, start)
        except KeyboardInterrupt:
            s.store.close()
            self.progress.log("interrupted before the first update; --resume starts again from the base validation "
                              "(or the warm start's saved candidate)")
            raise
        except WarmStartError as e:
            s.store.close()
            self.progress.log(f"error: {e}")
            raise
        except SwapCheckError as e:
            s.store.close()
            self.progress.log(f"error: {e}; the sampler at {self.cfg.sampler.url} does not serve the learner's "
                              "weights (the same model, LoRA shape and seed?); nothing was trained")
            raise
        log = MetricsLog(s.run_dir, s.store, s.run_id)
        log.log(start, {"val/success": self.champion.success})
        stopped, failure = False, None
        try:
            for it in range(start, self.cfg.iterations):
                self.step = it
                if (wait := s.cycle.check_budget()) > 0:  # a collapse cool-down: the run waits, then learns on
                    self.progress.log(f"collapse cool-down: {wait:.0f} s without updates "
                                      "(collapse.max_per_window, collapse.cooldown_s)")
                    time.sleep(wait)
                log.log(it, self.iteration(it))
                due = (it + 1) % self.cfg.gate.eval_every == 0 or it == self.cfg.iterations - 1
                if due and s.engine.version != self.champion.version:  # nothing new to validate otherwise
                    res = self.validate()
                    log.log(it, {"val/success": res.success})
                    self.gate(it, res)
                if hasattr(self.progress, "iteration_done"):
                    self.progress.iteration_done(it)
        except KeyboardInterrupt:
            stopped = True
            self.progress.log("interrupted: stored trajectories and versions are kept; continue with --resume")
        except (CollapseStop, NoSignalStop) as e:
            stopped = True
            self.progress.log(str(e))
        except SwapCheckError as e:  # never go on with a stale or hung sampler (selfrl.run.sampler_sync)
            stopped, failure = True, e
            self.progress.log(f"error: {e}; stopping: the sampler at {self.cfg.sampler.url} does not serve the "
                              "trained weights; fix it and continue with --resume")
        finally:
            log.close()
            if self.pending is not None:  # never swap the sampler under a batch still sampling
                self.pending.wait()
                self.pending = None
        result = self.finish(stopped)
        if failure is not None:
            raise failure
        return result

    def finish(self, stopped: bool) -> RunResult:
        """:func:`selfrl.run.result.finish_run`: serve the version ``gate.rule`` chooses, write the
        report, close the store."""
        return finish_run(self.s, self.progress, stopped, time.perf_counter() - self.t_start)


def _task_row(t: Task) -> dict:
    return {"id": t.id, "source": t.source, "question": t.question, "answer": t.answer, "metadata": t.metadata}
