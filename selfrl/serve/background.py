"""The background learner of ``selfrl serve``: served turns with complete rewards ->
rewards (``score_group``, the ``user_feedback`` reward) -> detectors -> group
advantages -> the same update cycle as ``selfrl run`` (:class:`selfrl.run.cycle.UpdateCycle`:
anomaly skip, candidate version, KL probe, collapse rules, gate) -> published to the
serving engine, or rejected / rolled back.

It trains its own copy of the policy in its own thread, so the serving engine only
ever holds validated versions. Its interface to the server is narrow: the store, the
version ledger and a ``publish(version, state, reason)`` callback.

Departures from ``selfrl run``, on purpose:

* Turns arrive from clients at whatever temperature they chose, so the recorded
  sampling logprobs are not those of the learner's distribution. The old logprobs are
  recomputed with the learner's current weights at ``learner.temperature`` before the
  update, as TRL's GRPOTrainer does when it does not sample with vLLM; the importance
  ratio of the first pass is then 1 and the update is REINFORCE with a group baseline.
  The sampled logprobs stay in the store untouched.
* Groups are formed by ``task_key`` (or the first user message), not by repeated
  samples of one task: a group holds different prompts, and its mean reward is a
  baseline for all of them. A batch in which no group has two or more turns is
  skipped as ``no_group`` (the message says how to fix it).
* A turn none of whose reward components applies (no feedback, no tool call) is not
  trained on (``run`` scores such a rollout 0).
* An update takes the newest ready turns first (``learner.order``), and the pending turns
  already past the age rule are expired before it (:func:`selfrl.serve.late_feedback.take_batch`):
  a learner slower than its traffic trains on the freshest turns, not on a backlog that ages out.
* ``gate.eval_every`` defaults to 1 (``selfrl run``'s to 4): every candidate is validated before
  it may be served. With k > 1 the learner trains on from k - 1 unvalidated candidates that are
  never served and validates the k-th; rejected, it goes back to the champion and the chain's
  candidates are rejected with it (:mod:`selfrl.serve.chain`). Nothing unvalidated is served.
* A storage fault (disk full, store locked, ...: :mod:`selfrl.record.storage_errors`) pauses the
  learner instead of stopping it: it waits ``learner.retry_s`` seconds, doubling up to
  ``learner.retry_max_s``, until a probe write succeeds, undoes what the failed step left
  (as a restart would: the version it made is rejected unless it became the champion, a
  stray folder moved aside, the champion's weights loaded again; its turns are still
  pending and are trained on again), then goes on. A log line marks the pause and the
  resume, and a ``learner_resumed`` event records how long it lasted. ``run`` has no such
  pause: it stops, and ``--resume`` continues it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from selfrl.safety import collapse
from selfrl.core import faults
from selfrl.core.memory import trim_heap
from selfrl.core.threads_at_exit import join_at_exit
from selfrl.safety.collapse import CollapseGuard, CollapseStop
from selfrl.run.cycle import UpdateCycle
from selfrl.safety.detectors import HackingMonitor
from selfrl.engines import make_engine
from selfrl.safety.gate import validate
from selfrl.rl.batch import collate
from selfrl.rl.logprobs import per_token_logps
from selfrl.record import adapters, served as records
from selfrl.config.serve import ServeConfig
from selfrl.serve.chain import CandidateChain
from selfrl.serve.corrections import demonstrations, sampled_only, signal_report, with_its_group
from selfrl.serve.families import held_out_sets
from selfrl.serve.feedback import score_served
from selfrl.serve.health import BACKOFF_TIMES, StorageWatch, with_utc
from selfrl.serve.late_feedback import FeedbackAges, stale_note, take_batch
from selfrl.record.storage_errors import StorageFault
from selfrl.record.store import Store
from selfrl.core.tools import resolve_tools
from selfrl.rl.learner import Learner, kl_reference
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import Champion, EventKind, Ledger, VersionStatus

Publish = Callable[[int, dict, str], "float | None"]
log = logging.getLogger("selfrl.serve")


def gate_engine(cfg: ServeConfig, model, tokenizer, version: int):
    """The learner's own sampling engine, for its held-out gate: it runs in the learner's thread
    (driver ``"caller"``), not on the server, and keeps its key/value cache between two gates only
    up to ``learner.idle_kv_cache_mb`` (none by default: a gate runs once an update). What its
    finished rows kept (``kv_continuation_mb``) serves the gate's own next turns, and is forgotten
    after each gate (:func:`gate_pass`): the next gate samples other weights."""
    return make_engine(cfg.engine, model, tokenizer, version=version, driver="caller",
                       idle_cache_bytes=cfg.learner.idle_kv_cache_mb * 2**20,
                       continuation_bytes=cfg.kv_continuation_mb * 2**20)


@contextlib.contextmanager
def gate_pass(engine, version: int):
    """``engine`` (:func:`gate_engine`'s) samples as ``version`` inside the block; after it, even
    on an error, a slot engine forgets its stored prefixes and finished rows' keys and values
    (:meth:`selfrl.engines.slots.SlotEngine.forget_kept`), stale once the weights change, so that
    none is held between updates. The reference engine keeps none."""
    engine.version = version
    try:
        yield engine
    finally:
        if (forget := getattr(engine, "forget_kept", None)) is not None:
            forget()


class ValidationStopped(Exception):
    """The server stops during the start-up validation; raised between two generation batches."""

    def __init__(self, done: int, total: int):
        super().__init__(f"{done} of {total} held-out tasks validated")
        self.done, self.total = done, total


class BackgroundLearner(threading.Thread):
    """Trains on recorded traffic and publishes validated versions.

    Args:
        cfg: the server's settings.
        model: the learner's own copy of the policy (a ``peft.PeftModel``), as built
            (its adapter is the KL reference when ``lora.init_adapter`` is set).
        tokenizer: its tokenizer.
        store: the server's store (shared; it takes its own lock).
        ledger: the server's version ledger; its champion is where learning starts.
        publish: ``publish(version, state, reason)`` serves a promoted version.
        storage: the server's watch over its run directory (storage faults are reported to
            it; its probe says when to retry); None: one of the learner's own.
        clock: seconds (``time.time``): the collapse budget's window, cool-down and stable stretch
            run on it (a fake clock plays days without waiting).
        prune: called after every update, whatever its outcome, under :attr:`lock` (retention); None: none.
    """

    def __init__(self, cfg: ServeConfig, model, tokenizer, store: Store, ledger: Ledger, publish: Publish,
                 storage: StorageWatch | None = None, clock: Callable[[], float] = time.time,
                 prune: Callable[[], object] | None = None):
        super().__init__(name="selfrl-learner", daemon=True)
        self.cfg, self.model, self.tok, self.store, self.ledger, self.publish = (
            cfg, model, tokenizer, store, ledger, publish)
        self.storage = storage if storage is not None else StorageWatch(ledger.run_dir)
        ref_state = kl_reference(model, cfg.lora.init_adapter)  # before any other version is loaded (same rule as run)
        champ = ledger.champion
        self.engine = gate_engine(cfg, model, tokenizer, champ.version)
        if champ.version != 0:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, champ.state)
        lc = cfg.learner
        self.learner = Learner(model, cfg.train, lc.temperature, tokenizer.pad_token_id, cfg.max_completion_length,
                               ref_state=ref_state, tokenizer=tokenizer)
        # the gate's held-out tasks; with [[families]] one set per family, none forgotten (selfrl.serve.families)
        self.source, self.val, self.families = held_out_sets(cfg, store, ledger)
        self.tools = resolve_tools(cfg.rollout.tools)
        self.monitor = HackingMonitor(cfg.detectors, lc.reward_weights)
        self.clock, self.prune = clock, prune
        self.ages = FeedbackAges.from_config(lc, ledger, clock)  # the age rule (selfrl.serve.late_feedback)
        self.chain = CandidateChain(ledger, cfg.gate.eval_every)  # candidates between two validations
        self.cycle = UpdateCycle(ledger, self.learner, CollapseGuard(cfg.collapse), self.monitor, cfg.collapse,
                                 cfg.gate.tolerance, cfg.train.scale_rewards, load=self._load, clock=clock)
        self.lock = threading.RLock()
        self._halt = threading.Event()
        join_at_exit(self, stop=self._halt.set)  # stopped and joined at exit, if started (selfrl.core.threads_at_exit)
        done = [m["step"] for m in store.metrics() if m["name"] == "reward/mean"]
        self.updates = max(done) + 1 if done else 0  # numbered on from the run directory's earlier sessions
        self.cycle.resume(store)  # their collapse budget, history and setting, as run --resume
        self.last: dict[str, Any] = {}
        self.error: str | None = None
        self.busy = False  # between taking a batch and finishing its gate
        self.paused: StorageFault | None = None  # the storage fault the learner waits out
        self.paused_since: float | None = None  # time.time() when it paused
        self._made: int | None = None  # the version the update under way saved (undone if it fails)
        self._reset: Champion | None = None  # set by an admin rollback, applied before the next update

    # -- thread ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            if self.until_done(self.ensure_champion_validated):
                while not self._halt.wait(self.cfg.learner.poll_s) and self.until_done(self.tick):
                    pass
        except CollapseStop as e:
            self.error = str(e)
        except Exception as e:  # the server keeps serving; the failure is visible in status and events
            self.error = f"{type(e).__name__}: {e}"
            log.error("the background learner stopped: %s", self.error, exc_info=e)
            try:
                self.ledger.event(EventKind.LEARNER_ERROR, f"the background learner stopped: {self.error}")
            except Exception as again:  # the store itself may be what failed: the log line above says it
                self.storage.failed(again)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=600)

    def status(self) -> dict[str, Any]:
        champ = self.ledger.champion
        paused = None if self.paused is None else with_utc({"code": self.paused.kind.value, "message": self.paused.message,
                                                            "since": self.paused_since}, ("since",))
        return {"alive": self.is_alive(), "busy": self.busy, "updates": self.updates, "best_version": champ.version,
                "best_val_success": champ.success, "last_update": self.last, "error": self.error, "paused": paused,
                "backoff": with_utc(self.cycle.backoff(), BACKOFF_TIMES), "families_learned": self.families.learned() if self.families else None,
                "chained": self.chain.status()}

    # -- storage faults: pause, undo, resume -------------------------------------------

    def until_done(self, step: Callable[[], object]) -> bool:
        """Run ``step``; while it fails on a storage fault, pause (see the module docstring)
        and run it again once the run directory can be written. Returns False when the
        learner was stopped while paused.

        Raises:
            Exception: whatever ``step`` raises that is no storage fault.
        """
        wait = self.cfg.learner.retry_s
        while True:
            try:
                if self.paused is not None:
                    self._undo_failed_step()
                step()
                if self.paused is not None:
                    self._resumed()
                return True
            except Exception as e:
                fault = self.storage.failed(e)
                if fault is None:
                    raise
                self._pause(fault, wait)
            while True:  # wait, longer each time, until a probe write succeeds
                if self._halt.wait(wait):
                    return False
                wait = min(2 * wait, self.cfg.learner.retry_max_s)
                if self.storage.current() is None:
                    break

    def _pause(self, fault: StorageFault, wait: float) -> None:
        if self.paused is None:
            self.paused_since = time.time()
            log.warning("the background learner paused: %s (%s); it retries in %g s, then at most every "
                        "%g s", fault.kind.value, fault.detail, wait, self.cfg.learner.retry_max_s)
        self.paused = fault

    def _resumed(self) -> None:
        fault, since = self.paused, self.paused_since
        seconds = time.time() - since
        self.ledger.event(EventKind.LEARNER_RESUMED, f"the background learner resumed after a pause of {seconds:.0f} s "
                          f"({fault.kind.value})", {"kind": fault.kind.value, "since": since, "paused_s": seconds})
        self.paused = self.paused_since = None
        log.warning("the background learner resumed after %.0f s (%s)", seconds, fault.kind.value)

    def _undo_failed_step(self) -> None:
        """Before a step runs again after a storage fault, undo what the failed one left, as a
        restart would: the version it saved is rejected unless it became the champion (then it
        is published again, in case the failure came before the swap); a folder it left
        unrecorded is moved aside; the champion's weights are loaded again, AdamW reset."""
        made, champ = self._made, self.ledger.champion
        if made is not None and made == champ.version:
            self.publish(made, champ.state, "promoted (published again after a storage fault)")
        elif made is not None and (rec := self.ledger.get(made)) is not None and rec.status in (
                VersionStatus.CANDIDATE, VersionStatus.PROMOTED):
            kind = self.paused.kind.value
            self.store.set_version_status(made, VersionStatus.REJECTED.value, {"storage_fault": kind})
            self.ledger.event(EventKind.REJECT, f"version {made} rejected: its update failed on a storage fault "
                              f"({kind}); serving version {champ.version}", {"version": made})
        self._made = None
        self.ledger.recover_strays()
        self.cycle.restore_champion()
        self.chain.end(f"an update of its chain failed on a storage fault ({self.paused.kind.value})")
        self.cycle.guard.new_chain()

    # -- steps -------------------------------------------------------------------------

    def ensure_champion_validated(self) -> None:
        """Validate the champion once (stored; reused when known, unless it lacks a family's held-out tasks).
        A stop of the server (:meth:`stop`: Ctrl-C, SIGTERM) ends it after the generation batch under
        way, with a line in serve.log; nothing of it is recorded, so the next start validates again."""
        champ = self.ledger.champion
        if champ.success is None or (self.families is not None and not self.families.covers(champ.version)):
            self.busy = True
            try:
                champ.success = self.validate(champ.version, stoppable=True).success
            except ValidationStopped as e:
                log.warning("the start-up validation of version %d stopped after %d of %d held-out tasks: the "
                            "server stops; the next start validates it again", champ.version, e.done, e.total)
            finally:
                self.busy = False

    def validate(self, version: int, stoppable: bool = False):
        """Held-out validation of the learner's current weights as ``version``, recorded (:func:`validate_held_out`)."""
        return validate_held_out(self, version, stoppable)

    def tick(self) -> bool:
        """One update if enough turns are ready and the collapse budget allows one; True when one ran.

        Raises:
            CollapseStop: only with ``collapse.max_rollbacks`` set, once it is spent.
        """
        lc = self.cfg.learner
        if self.cycle.check_budget() > 0:  # a cool-down: the turns wait, serving goes on
            return False
        batch = take_batch(self.store, self.ages, lc)  # learner.order (newest first); those past the age rule expired
        if len(batch) < lc.min_batch:
            return False
        with self.lock:
            self.busy = True
            try:
                self.update(batch)
                if self.prune is not None:  # between updates: nothing it prunes is in one
                    self.prune()
            finally:
                trim_heap()  # the update's freed tensors back to the OS: RSS stays flat for days
                self.busy = False  # last: whoever sees it idle sees the update, the prune and the trim done
        return True

    def score(self, batch: list[tuple[Trajectory, dict]], demos=()) -> tuple[list[Trajectory], list[Trajectory]]:
        """Rewards, detectors, group advantages (with ``demos``); returns (scored, left out: no reward applied)."""
        scored, unscored = score_served(batch, self.cfg.learner.reward_weights)
        if scored:
            self.cycle.advantages(self.updates, scored + with_its_group(scored, list(demos)))
        return scored, unscored

    def recompute_old_logps(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Copies of ``trajs`` whose ``logprobs`` are the learner's own at its temperature (:func:`own_logps`)."""
        return own_logps(self.model, self.learner, self.cfg.learner.temperature, trajs)

    def update(self, batch: list[tuple[Trajectory, dict]]) -> dict[str, Any]:
        """Score, update, save a candidate, check the collapse rules, validate it (or chain it: gate.eval_every)."""
        t0, cycle = time.perf_counter(), self.cycle
        faults.set_iteration(self.updates)  # SELFRL_FAULT counts the learner's updates as iterations
        self._apply_reset()
        if (wait := cycle.check_budget()) > 0:
            self.last = {"turns": len(batch), "result": f"paused (collapse cool-down, {wait:.0f} s left)"}
            return self.last
        n_turns = len(batch)
        batch, too_old = self.ages.split(batch)  # past an age cutoff: only recorded
        records.mark(self.store, [t for t, _ in too_old], "skipped", None)
        demos, seen = demonstrations_of(self, batch)  # corrections that say the right answer (off by default)
        scored, unscored = self.score(batch, demos)
        records.mark(self.store, unscored, "skipped", None)
        usable = [t for t in scored + demos if t.advantage]
        parent, sampled = self.chain.current, self.ledger.champion.version  # a chain's candidate samples nothing
        step_no = self.updates
        train, ages = (self.recompute_old_logps(usable), {}) if usable else (scored, {})
        gone: list[Trajectory] = []
        if usable:  # a turn of an older version: its advantage times its sequence weight
            ages = self.ages.weigh(train, usable, self._logps_under)
            gone, train, scored = leave_out_gone(self.store, usable, train, scored)
        reward_mean = sum(t.reward for t in scored) / max(len(scored), 1)
        info: dict[str, Any] = {"turns": n_turns, "scored": len(scored), "with_signal": len(usable) - len(gone),
                                "reward_mean": reward_mean, "too_old": len(too_old) + len(gone), **signal_report(seen, demos)}
        if (gone or too_old) and not train:  # nothing left to train on: the skip names the age rule, not "no spread"
            self.updates += 1
            self.last = skip_stale(self.ledger, step_no, too_old, gone, scored, info, self.ages.policy)
            return self.last
        step = cycle.update(step_no, train, parent, sampled=sampled_only(train, demos))  # KL probed on these
        self.updates += 1
        if step.candidate is not None:
            self._made = step.candidate.version
        if step.candidate is None:
            records.mark(self.store, scored, "skipped", None)
            stale = f"; {len(too_old) + len(gone)} of its {n_turns} turns were too old" if too_old or gone else ""
            info["result"] = f"skipped ({step.result.note}{stale})"
            info["reason"] = step.result.reason.value
            self.last = info
            return info
        version = step.candidate.version
        # the names run logs, so that a restart rebuilds the collapse history (UpdateCycle.resume); each family's too
        metrics = step.result.metrics() | ages | {
            "feedback/too_old": float(len(too_old) + len(gone)), "reward/mean": reward_mean, "version": float(version),
            "sampled_version": float(sampled)} | ({"feedback/demonstrations": float(info["demonstrations"])} if demos else {}) | (
            collapse.batch_metrics(scored, {t.id: row.get("family") for t, row in batch}, self.cfg.collapse))
        if step.candidate_kl is not None:
            metrics["candidate_kl"] = step.candidate_kl
        records.mark(self.store, scored, "trained", version)
        self.store.log_metrics(self.ledger.run_id, step_no, metrics)
        rec = collapse.record_from_metrics(step_no, metrics)
        info.update(version=version, update_s=step.result.stats.get("time/update_s"))
        if cycle.observe(rec).rolled_back:  # a cheap collapse rule fired: rolled back before validation
            info["result"] = "rolled back (collapse)"
        elif not self.chain.due(version):  # gate.eval_every: unvalidated, unserved; the next update trains on from it
            info["result"] = self.chain.status()["message"]
        else:
            res = self.validate(version)
            veto, data = self.families.veto(step_no, res.results) if self.families else (None, None)  # no forgetting
            verdict = cycle.gate(step_no, version, res.success, res.degenerate, veto=veto, veto_data=data)
            info.update(val_success=res.success, result=verdict.outcome)
            if verdict.outcome == "promoted":
                champ = self.ledger.champion
                self.last = info  # before the swap: whoever sees the new version sees this too
                info["swap_s"] = self.publish(version, champ.state, verdict.message)
            elif verdict.outcome == "collapse":
                info["result"] = "rolled back (collapse)"
        self.chain.settle(version)
        self._apply_reset()
        self._made = None
        info["seconds"] = time.perf_counter() - t0
        self.last = info
        return info

    def _logps_under(self, version: int, trajs: list[Trajectory]) -> list[list[float]]:
        """(T,) log-probs of each of ``trajs`` under ``version``'s stored weights at
        ``learner.temperature``; the weights it held (the champion's, or a chain's candidate's) are loaded back after.

        Raises:
            FileNotFoundError, ValueError: the version's weights are not stored (any more).
        """
        try:
            state, held = self.ledger.load_state(version), adapters.lora_state(self.model)
        except (KeyError, FileNotFoundError, adapters.CorruptVersionError) as e:  # any other OSError: a storage fault
            raise FileNotFoundError(f"version {version}: {e}") from e
        try:
            self._load(state, version)
            return [t.logprobs for t in self.recompute_old_logps(trajs)]
        finally:
            self._load(held, self.chain.current)

    def _load(self, state: dict, version: int) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)
        self.engine.version = version

    def reset_to(self, champion: Champion) -> None:
        """Continue learning from ``champion`` (after an admin rollback). Returns at once: the
        learner loads it before its next update (an update under way is judged against the
        ledger, which already holds the rollback, so its candidate is rejected)."""
        self._reset = champion

    def _apply_reset(self) -> None:
        champion, self._reset = self._reset, None
        if champion is not None:
            self._load(champion.state, champion.version)
            self.learner.reset_optimizer()
            self.cycle.guard.new_chain()
            self.chain.end(f"an admin rolled back to version {champion.version}")


def demonstrations_of(bl: BackgroundLearner, batch: list[tuple[Trajectory, dict]]) -> tuple[list[Trajectory], dict]:
    """The corrections of ``batch``'s turns as demonstrations (:mod:`selfrl.serve.corrections`) when
    ``learner.learn_from_corrections`` is not off, and what the update says of them: ``{}`` when it found
    none, else ``{"demonstrations": n, "corrections_left_out": {reason: count}}``."""
    if bl.cfg.learner.learn_from_corrections == "off" or not batch:
        return [], {}
    from selfrl.engines.base import model_context
    from selfrl.engines.reference import eos_ids

    found = records.corrections(bl.store, [(r["response_id"], r["choice"]) for _, r in batch])
    demos, skipped = demonstrations(batch, found, bl.tok, eos_ids(bl.model, bl.tok), bl.ages.held(),
                                    bl.cfg.max_completion_length, bl.cfg.learner.reward_weights,
                                    model_context(bl.model, bl.tok), bl.model.get_output_embeddings().weight.shape[0],
                                    bl.cfg.learner.learn_from_corrections)
    return demos, {"demonstrations": len(demos), "corrections_left_out": dict(skipped)} if demos or skipped else {}


@torch.no_grad()
def own_logps(model, learner: Learner, temperature: float, trajs: list[Trajectory]) -> list[Trajectory]:
    """Copies of ``trajs`` whose ``logprobs`` (T,) are ``model``'s at ``temperature``, the grammar's
    masks replayed, in the learner's micro-batches; each copy keeps its turn's advantage."""
    out = []
    for r in learner.micro_batches(trajs):
        chunk = trajs[r.start:r.stop]
        mb = collate(chunk, learner.pad_token_id, learner.grammar_masks).to(learner.device)
        logps = per_token_logps(model, mb.input_ids, mb.attention_mask, mb.completion_mask, temperature,
                                vocab_masks=mb.vocab_masks)  # (B, T)
        for j, t in enumerate(chunk):
            copy = Trajectory.from_dict(t.to_dict())
            copy.logprobs = (logps[j, :len(t.token_ids)] * mb.completion_mask[j, :len(t.token_ids)]).tolist()
            copy.advantage = t.advantage
            out.append(copy)
    return out


def leave_out_gone(store: Store, usable: list[Trajectory], train: list[Trajectory], scored: list[Trajectory]):
    """The turns :meth:`FeedbackAges.weigh` found too old (their version's weights are no longer
    stored), marked ``skipped`` (only recorded, as any turn past the age rule; never trained on
    with a weight of 0); returns ``(gone, train, scored)`` without them."""
    gone = [t for t in usable if ((t.reward_details.get("user_feedback") or {}).get("age") or {}).get("outcome")
            == "too_old"]
    if gone:
        ids = {t.id for t in gone}
        train, scored = [t for t in train if t.id not in ids], [t for t in scored if t.id not in ids]
        records.mark(store, gone, "skipped", None)
    return gone, train, scored


def skip_stale(ledger: Ledger, step_no: int, too_old: list, gone: list[Trajectory], scored: list[Trajectory],
               info: dict[str, Any], policy) -> dict[str, Any]:
    """Update ``step_no`` skipped because nothing was left to train on but turns past the age rule
    (``too_old``) or turns with a signal whose version's weights are gone (``gone``): ``scored`` (the
    rest, without a signal) marked ``skipped``, a ``skip`` event (reason ``too_old``, :func:`stale_note`
    its message); returns ``info`` with the result that says why."""
    records.mark(ledger.store, scored, "skipped", None)  # the rest had no signal
    note = stale_note(too_old, gone, policy)
    ledger.event(EventKind.SKIP, f"iteration {step_no}: update skipped: {note}",
                 {"iteration": step_no, "reason": "too_old", "too_old": len(too_old), "weights_gone": len(gone)})
    return {**info, "result": f"skipped ({note})", "reason": "too_old"}


def validate_held_out(learner: BackgroundLearner, version: int, stoppable: bool = False):
    """Held-out validation of ``learner``'s current weights as ``version`` on its gate engine: the
    families' held-out tasks in batches of ``gate.batch_size``, recorded in the ledger with the
    probes ``selfrl run`` makes, ``time/validation_s`` logged. Returns the gate's result.

    Raises:
        ValidationStopped: ``stoppable`` and the learner was stopped (:meth:`BackgroundLearner.stop`);
            checked between generation batches, nothing recorded.
    """
    done, n = 0, len(learner.val)

    def between_batches(k: int) -> None:
        nonlocal done
        done += k
        if stoppable and learner._halt.is_set() and done < n:
            raise ValidationStopped(done, n)

    cfg = learner.cfg
    with gate_pass(learner.engine, version):
        res = validate(learner.engine, learner.val, learner.source, learner.tools, cfg.rollout,
                       cfg.gate.batch_size, on_batch=between_batches, collapse=cfg.collapse)
        learner.ledger.record_validation(version, res.success, res.degenerate, res.results)
        probes = learner.cycle.probe(version, learner.engine, learner.source, learner.tools, cfg.rollout)  # as run does
    learner.store.log_metrics(learner.ledger.run_id, learner.updates, {"time/validation_s": res.seconds, **probes})
    return res
