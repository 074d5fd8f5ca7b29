"""The online self-improvement loop: rollouts -> rewards -> advantages -> LoRA update
-> candidate version -> validation gate -> promote or roll back; all recorded.

This module only orchestrates; the math lives in ``selfrl.rl`` and each part in
its own module. Version semantics: the engine's ``version`` is always the
version whose weights are loaded. An update saves its result as a new
*candidate* version, which serves the next rollouts (on-policy); every
``gate.eval_every`` updates the candidate is validated and either *promoted*
(new best) or *rejected*, in which case the best version is swapped back in.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from selfrl import adapters, collapse, faults
from selfrl.atomic import write_atomic
from selfrl.config import RunConfig
from selfrl.detectors import HackingMonitor
from selfrl.engine import Engine
from selfrl.gate import EvalResult, evaluate, passes_gate
from selfrl.metrics import MetricsLog, rollout_metrics
from selfrl.model import build_policy
from selfrl.progress import PlainProgress, Progress
from selfrl.rewards import get_preset, score_batch
from selfrl.rl.advantages import group_advantages
from selfrl.rollout import rollout
from selfrl.store import Store
from selfrl.tasks import Task, assert_disjoint, get_task_source, split_tasks
from selfrl.tools import resolve_tools
from selfrl.trainer import Learner, skip_note
from selfrl.trajectory import Trajectory


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


class CollapseStop(Exception):
    """The collapse rollback budget is spent; the run stops with the best version served."""


def iteration_tasks(train: list[Task], iteration: int, num_prompts: int, seed: int) -> list[Task]:
    """The tasks of one iteration: a deterministic walk through a shuffled training set."""
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    start = (iteration * num_prompts) % len(order)
    idx = (order + order)[start:start + num_prompts]
    return [train[i] for i in idx]


def run(cfg: RunConfig, resume: bool = False, progress: Progress | None = None) -> RunResult:
    """Run (or resume) the self-improvement loop described by ``cfg``.

    With ``resume``, the store in ``cfg.run_dir`` is reopened, the last promoted
    version is loaded into the engine, and iterations continue after the last
    one stored; no stored trajectory is touched (the optimizer state starts
    fresh). Ctrl-C stops after the current step, gates nothing new, and still
    writes the report.

    Raises:
        FileExistsError: ``run_dir`` already holds a run and ``resume`` is False.
        FileNotFoundError: ``resume`` but there is no run to resume.
    """
    return Runner(cfg, resume, progress or PlainProgress()).run()


class Runner:
    """State of one run; :meth:`run` drives it. See :func:`run`."""

    def __init__(self, cfg: RunConfig, resume: bool, progress: Progress):
        self.cfg, self.resume, self.progress = cfg, resume, progress
        self.run_dir = Path(cfg.run_dir)
        db = self.run_dir / "selfrl.db"
        if resume and not db.exists():
            raise FileNotFoundError(f"nothing to resume: no run at {self.run_dir}")
        if not resume and db.exists():
            raise FileExistsError(f"{self.run_dir} already holds a run; pass --resume or choose another --run-dir")
        stored = self.run_dir / "config.json"
        if resume and stored.exists():
            check_resumable(json.loads(stored.read_text()), cfg.to_dict())
        self.source = get_task_source(cfg.task.source, **cfg.task.options)
        self.train, self.val = split_tasks(
            self.source, cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed
        )
        assert_disjoint(self.train, self.val)
        self.tasks_by_id = {t.id: t for t in self.train}
        self.tools = resolve_tools(cfg.rollout.tools)
        self.weights = cfg.reward_weights or get_preset(cfg.preset)
        self.monitor = HackingMonitor(cfg.detectors, self.weights)
        model, tok = build_policy(cfg)
        # The KL reference is the adapter the run started from (LoraSettings.init_adapter),
        # taken before a resume swaps in a later version; None means the base model.
        ref_state = adapters.lora_state(model) if cfg.lora.init_adapter else None
        self.engine = Engine(model, tok)
        self.learner = Learner(
            model, cfg.train, cfg.rollout.temperature, tok.pad_token_id,
            cfg.rollout.max_new_tokens * cfg.rollout.max_turns, ref_state=ref_state,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
        self.store = Store(db)
        self.run_id = self.store.start_run(cfg.to_dict())
        self.step = 0  # the iteration under way, for metrics logged outside an iteration
        self.t_start = time.perf_counter()
        self.best_version, self.best_success, self.best_state = 0, 0.0, None
        self.history: list[collapse.UpdateRecord] = []  # one record per iteration, for the collapse rules
        self.chain_start = 0  # history index where the current candidate chain began
        self.rollbacks = 0  # collapse rollbacks so far (all sessions of this run)

    # -- phases -------------------------------------------------------------------------

    def validate(self) -> EvalResult:
        """Held-out pass@1 of the engine's current version, stored per task."""
        self.progress.phase(f"validation (version {self.engine.version})", len(self.val))
        res = evaluate(self.engine, self.val, self.source, self.tools, self.cfg.rollout,
                       self.cfg.gate.batch_size, on_batch=self.progress.advance, collapse=self.cfg.collapse)
        faults.point("during_validation")
        self.store.add_evaluation(res.version, res.results)
        self.store.log_metrics(self.run_id, self.step, {"time/validation_s": res.seconds})
        if self.monitor.runs_probes:  # adversarial probe tasks scored per version (selfrl.detectors)
            probes = self.monitor.run_probes(self.engine, self.source, self.tools, self.cfg.rollout)
            self.store.log_metrics(self.run_id, self.step, probes)
            for alert in self.monitor.pop_alerts():
                self.store.log_event(self.run_id, "hacking", f"version {res.version}: {alert}")
        return res

    def start(self) -> int:
        """Evaluate the base model (fresh run, or a resume whose base validation never
        finished) or restore the best version (resume); returns the first iteration."""
        if self.resume:
            self.recover()
        base = next((v for v in self.store.versions() if v["version"] == 0), None)
        if base is None or "val/success" not in base["metrics"]:
            if base is None:
                self.store.add_tasks([_task_row(t) for t in self.train], "train")
                self.store.add_tasks([_task_row(t) for t in self.val], "val")
                existing = adapters.version_dir(self.run_dir, 0)
                complete = existing.exists() and adapters.verify_version(existing) is None
                path = existing if complete else adapters.save_version(self.engine.model, self.run_dir, 0)
                self.store.add_version(0, None, str(path), "base", {})
            res = self.validate()
            self.store.set_version_status(0, "base", {"val/success": res.success, "val/degenerate": res.degenerate})
            self.progress.log(f"base model: held-out success {res.success:.3f} on {len(self.val)} tasks "
                              f"({res.seconds:.0f} s)")
        best = self.served_version()
        if best["version"] != 0:
            self.engine.swap(adapters.load_version_state(Path(best["path"])), best["version"])
        self.best_version, self.best_success = best["version"], best["metrics"]["val/success"]
        self.best_state = adapters.lora_state(self.engine.model)
        done = [m["step"] for m in self.store.metrics() if m["name"] == "reward/mean"]
        start = max(done) + 1 if done else 0
        self.chain_start = len(self.history)
        if self.resume:
            self.store.log_event(self.run_id, "resume", f"resumed at iteration {start} from version {self.best_version}")
            self.progress.log(f"resuming at iteration {start} from version {self.best_version} "
                              f"(held-out {self.best_success:.3f})")
        return start

    def iteration(self, it: int) -> dict[str, float]:
        """Rollouts, rewards, advantages and one update; returns the logged metrics."""
        cfg = self.cfg
        faults.set_iteration(it)
        trajs, t_roll = self.rollouts(it)
        score_batch(trajs, self.tasks_by_id, self.source, self.weights)
        hacking = self.monitor.apply(trajs)  # reward-hacking detectors: a flagged trajectory earns at most 0
        for alert in self.monitor.pop_alerts():
            self.store.log_event(self.run_id, "hacking", f"iteration {it}: {alert}")
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], cfg.train.scale_rewards,
                               num_completion_tokens=[t.num_completion_tokens for t in trajs])
        for t, a in zip(trajs, adv.advantages):
            t.advantage = a
        self.store.add_trajectories(self.run_id, it, trajs)
        faults.point("after_store")
        sampled = self.engine.version
        signal = sum(1 for t in trajs if t.advantage)
        self.progress.phase(f"iteration {it}: update (micro-batches)", max(1, -(-signal // cfg.train.micro_batch_size)))
        metrics = self.learner.step(trajs, on_micro_batch=self.progress.advance)
        if not metrics.get("skipped"):
            if faults.active("noise"):
                faults.add_noise(self.learner.params)
            version = self.store.next_version()
            path = adapters.save_version(self.engine.model, self.run_dir, version)
            self.store.add_version(version, self.engine.version, str(path), "candidate", {})
            self.engine.version = version
            if cfg.collapse.enabled and cfg.collapse.kl_probe_size:
                metrics["candidate_kl"] = self.learner.probe_kl(trajs, cfg.collapse.kl_probe_size)
        else:
            self.store.log_event(self.run_id, "skip", f"iteration {it}: update skipped: {skip_note(metrics)}", metrics)
            self.progress.advance()  # close the update bar: no micro-batch ran
        metrics.update(rollout_metrics(trajs))
        metrics.update(hacking)
        metrics.update({"frac_reward_zero_std": adv.frac_no_signal, "version": float(self.engine.version),
                        "time/rollout_s": t_roll, "sampled_version": float(sampled),
                        "train/entropy": collapse.entropy_estimate(trajs),
                        "train/degenerate": collapse.degenerate_share(trajs, cfg.collapse)})
        note = f" (update skipped: {skip_note(metrics)})" if metrics.get("skipped") else ""
        self.progress.log(
            f"iteration {it}: reward {metrics['reward/mean']:.3f} correct {metrics['train/correct']:.3f} "
            f"tool use {metrics['train/tool_use']:.2f} kl {metrics.get('kl', 0.0):.4f} "
            f"version {self.engine.version} (rollouts {t_roll:.0f} s, update {metrics.get('time/update_s', 0.0):.0f} s){note}"
        )
        self.history.append(collapse.record_from_metrics(it, metrics))
        alarms = collapse.cheap_alarms(self.history, cfg.collapse)
        if alarms:  # also when the best version sampled them: the new candidate goes, the setting gets safer
            self.roll_back(it, alarms)
        return metrics

    def rollouts(self, it: int) -> tuple[list[Trajectory], float]:
        """The iteration's group of ``num_generations`` rollouts per task; returns them and the seconds."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = iteration_tasks(self.train, it, cfg.num_prompts, cfg.task.train_seed)
        tasks = [t for t in batch for _ in range(cfg.num_generations)]
        groups = [f"{it}-{j}" for j, t in enumerate(batch) for _ in range(cfg.num_generations)]
        self.progress.phase(f"iteration {it}: rollouts (turns)", cfg.rollout.max_turns)
        trajs = rollout(self.engine, tasks, groups, self.tools, cfg.rollout, on_turn=self.progress.advance,
                        env_factory=self.source.make_env)
        t_roll = time.perf_counter() - t0
        faults.point("after_rollout")
        return trajs, t_roll

    def gate(self, it: int, res: EvalResult) -> None:
        """Promote the validated candidate, or reject it and swap the best version back in."""
        if res.version == self.best_version:
            return
        tol = self.cfg.gate.tolerance
        chain = self.history[self.chain_start:]
        alarms = collapse.heldout_alarms(
            res.success, self.best_success, [r.reward for r in chain if r.version != self.best_version],
            [r.reward for r in self.history if r.version == self.best_version], tol, self.cfg.collapse)
        base = next((v for v in self.store.versions() if v["version"] == 0), None)
        base_degenerate = (base or {}).get("metrics", {}).get("val/degenerate")
        degenerate = collapse.validation_alarm(
            res.degenerate, math.nan if base_degenerate is None else base_degenerate, self.cfg.collapse)
        alarms += [degenerate] if degenerate else []
        self.store.set_version_status(res.version, "candidate", {"val/success": res.success,
                                                                  "val/degenerate": res.degenerate})
        if alarms:
            self.roll_back(it, alarms)
            return
        broken = adapters.verify_version(adapters.version_dir(self.run_dir, res.version))
        if broken is not None:  # never promote a version whose folder is not complete
            self.store.set_version_status(res.version, "rejected", {"corrupt": broken})
            self.engine.swap(self.best_state, self.best_version)
            self.learner.reset_optimizer()
            msg = f"version {res.version} not promoted: {broken}; serving version {self.best_version} again"
            self.store.log_event(self.run_id, "corrupt_version", msg)
        elif passes_gate(res.success, self.best_success, tol):
            self.store.set_version_status(res.version, "promoted", {"val/success": res.success})
            msg = f"version {res.version} promoted: held-out {res.success:.3f} (best was {self.best_success:.3f})"
            self.store.log_event(self.run_id, "promote", msg)
            self.best_success = max(self.best_success, res.success)
            self.best_version, self.best_state = res.version, adapters.lora_state(self.engine.model)
        else:
            self.store.set_version_status(res.version, "rejected", {"val/success": res.success})
            self.engine.swap(self.best_state, self.best_version)
            self.learner.reset_optimizer()
            msg = (f"version {res.version} rejected: held-out {res.success:.3f} < best {self.best_success:.3f} "
                   f"- {tol}; serving version {self.best_version} again")
            self.store.log_event(self.run_id, "rollback", msg)
        self.chain_start = len(self.history)
        self.progress.log(f"iteration {it}: {msg}")

    def roll_back(self, it: int, alarms: list[collapse.Alarm]) -> None:
        """A collapse: mark the candidates since the best version ``rolled_back``, serve
        the best version again, reset AdamW, continue with the safer setting, and log
        it all as a ``collapse`` event. The run loop stops before the next iteration when
        the rollbacks exceed ``collapse.max_rollbacks`` (:meth:`check_budget`)."""
        bad = [v["version"] for v in self.store.versions()
               if v["status"] == "candidate" and v["version"] > self.best_version]
        for v in bad:
            self.store.set_version_status(v, "rolled_back", {"collapse": alarms[0].rule})
        self.engine.swap(self.best_state, self.best_version)
        self.learner.reset_optimizer()
        self.rollbacks += 1
        lr, beta = collapse.safer_setting(self.learner.cfg.learning_rate, self.learner.cfg.beta, self.cfg.collapse)
        self.learner.set_hyperparameters(lr, beta)
        self.chain_start = len(self.history)
        cc = self.cfg.collapse
        msg = (f"iteration {it}: collapse: {'; '.join(a.message for a in alarms)}. Versions {bad} rolled back, "
               f"serving version {self.best_version}; now learning rate {lr:.3g}, beta {beta:.3g} "
               f"(rollback {self.rollbacks} of {cc.max_rollbacks} allowed)")
        self.store.log_event(self.run_id, "collapse", msg, {
            "iteration": it, "alarms": [a.to_dict() for a in alarms], "rolled_back": bad,
            "serving": self.best_version, "learning_rate": lr, "beta": beta, "rollbacks": self.rollbacks})
        self.progress.log(msg)

    def check_budget(self) -> None:
        """Raise :class:`CollapseStop` (after logging a ``collapse_stop`` event) when the
        collapse rollbacks exceed ``collapse.max_rollbacks``."""
        if self.rollbacks > self.cfg.collapse.max_rollbacks:
            msg = (f"stopping: {self.rollbacks} collapse rollbacks exceed collapse.max_rollbacks = "
                   f"{self.cfg.collapse.max_rollbacks}; serving the best version {self.best_version} "
                   f"(held-out {self.best_success:.3f})")
            self.store.log_event(self.run_id, "collapse_stop", msg, {"rollbacks": self.rollbacks})
            raise CollapseStop(msg)

    def served_version(self) -> dict:
        """The version to serve: the store's latest promoted (or base) version whose folder is
        complete (:func:`adapters.verify_version`). One that is not is marked ``rolled_back``,
        with a ``corrupt_version`` event, and the next older one is tried.

        Raises:
            adapters.CorruptVersionError: no promoted or base version is complete.
        """
        for v in reversed(self.store.versions()):
            if v["status"] not in ("promoted", "base"):
                continue
            reason = adapters.verify_version(Path(v["path"]))
            if reason is None:
                return v
            self.store.set_version_status(v["version"], "rolled_back", {"corrupt": reason})
            self.store.log_event(self.run_id, "corrupt_version", f"version {v['version']} is not served: {reason}")
        raise adapters.CorruptVersionError(f"no complete adapter version to serve in {self.run_dir}")

    def recover(self) -> None:
        """On resume: move aside what a killed save left (never recorded), re-save a damaged
        base version (the freshly built policy is the base), and restore the rollback count,
        the safer setting and the collapse history of earlier sessions."""
        versions = self.store.versions()
        for path in adapters.stray_dirs(self.run_dir, {v["version"] for v in versions}):
            dest = adapters.quarantine(path)
            self.store.log_event(self.run_id, "recover", f"{path.name} was left by an interrupted save and never "
                                 f"recorded; moved to {dest}")
        base = next((v for v in versions if v["version"] == 0), None)
        if base is not None and (reason := adapters.verify_version(Path(base["path"]))) is not None:
            if Path(base["path"]).exists():
                adapters.quarantine(Path(base["path"]))
            adapters.save_version(self.engine.model, self.run_dir, 0)
            self.store.log_event(self.run_id, "recover", f"base version 0 was damaged ({reason}); saved again")
        self.rollbacks = sum(1 for e in self.store.events() if e["kind"] == "collapse")
        for _ in range(self.rollbacks):
            lr, beta = collapse.safer_setting(self.learner.cfg.learning_rate, self.learner.cfg.beta, self.cfg.collapse)
            self.learner.set_hyperparameters(lr, beta)
        self.history = collapse.history_from_metrics(self.store.metrics())

    def run(self) -> RunResult:
        try:
            start = self.start()
        except KeyboardInterrupt:
            self.store.close()
            self.progress.log("interrupted before the first update; --resume starts again from the base validation")
            raise
        log = MetricsLog(self.run_dir, self.store, self.run_id)
        log.log(start, {"val/success": self.best_success})
        stopped = False
        try:
            for it in range(start, self.cfg.iterations):
                self.step = it
                self.check_budget()
                log.log(it, self.iteration(it))
                due = (it + 1) % self.cfg.gate.eval_every == 0 or it == self.cfg.iterations - 1
                if due and self.engine.version != self.best_version:  # nothing new to validate otherwise
                    res = self.validate()
                    log.log(it, {"val/success": res.success})
                    self.gate(it, res)
                if hasattr(self.progress, "iteration_done"):
                    self.progress.iteration_done(it)
        except KeyboardInterrupt:
            stopped = True
            self.progress.log("interrupted: stored trajectories and versions are kept; continue with --resume")
        except CollapseStop as e:
            stopped = True
            self.progress.log(str(e))
        finally:
            log.close()
        return self.finish(stopped)

    def finish(self, stopped: bool) -> RunResult:
        """Serve the best version, write the report, close the store."""
        from selfrl.report import write_report

        # Always: an interrupted update may have changed the weights without saving a version.
        self.engine.swap(self.best_state, self.best_version)
        totals: dict[str, float] = {}
        for row in self.store.metrics():  # every session of this run directory, not only this one
            if row["name"].startswith("time/") and row["value"] is not None:
                totals[row["name"]] = totals.get(row["name"], 0.0) + row["value"]
        inference, training = totals.get("time/rollout_s", 0.0), totals.get("time/update_s", 0.0)
        summary = {
            "base_version": 0, "final_version": self.best_version,
            "time_inference_s": inference, "time_training_s": training,
            "time_validation_s": totals.get("time/validation_s", 0.0),
            "cost_ratio": (inference + training) / inference if inference else float("nan"),
            "stopped_early": stopped, "collapse_rollbacks": self.rollbacks,
            "model": self.cfg.model.name, "task": self.cfg.task.source, "preset": self.cfg.preset,
            "reward_weights": self.weights, "num_prompts": self.cfg.num_prompts,
            "num_generations": self.cfg.num_generations, "iterations": self.cfg.iterations,
            "session_wall_time_s": time.perf_counter() - self.t_start,
        }
        report = write_report(self.run_dir, self.store, self.run_id, summary)
        base, final = self.store.evaluation(0), self.store.evaluation(self.best_version)
        self.store.close()
        return RunResult(self.run_dir, _rate(base), _rate(final), 0, self.best_version, stopped,
                         {**summary, "report": str(report)})


# Settings a resumed run must share with the run it continues: the same policy, tasks,
# held-out set and agent. Anything else (iterations, learning rate, ...) may change.
RESUME_FIXED = ("model", "lora", "task", "rollout", "preset", "reward_weights")


def check_resumable(stored: dict, new: dict) -> None:
    """Raise ConfigError naming the settings that differ from the stored run's.

    Raises:
        ConfigError: a key of ``RESUME_FIXED`` or ``gate.val_size`` differs.
    """
    from selfrl.config import ConfigError

    changed = [k for k in RESUME_FIXED if stored.get(k) != new.get(k)]
    if stored.get("gate", {}).get("val_size") != new.get("gate", {}).get("val_size"):
        changed.append("gate.val_size")
    if changed:
        raise ConfigError(f"--resume cannot change {', '.join(changed)} of the stored run; "
                          "start a new run (another --run-dir) for that")


def _rate(evaluation: dict[str, bool]) -> float:
    return sum(evaluation.values()) / len(evaluation) if evaluation else float("nan")


def _task_row(t: Task) -> dict:
    return {"id": t.id, "source": t.source, "question": t.question, "answer": t.answer, "metadata": t.metadata}
