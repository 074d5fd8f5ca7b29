"""The background learner of ``selfrl serve``: served turns with complete rewards ->
groups -> advantages -> the same GRPO update as ``selfrl run`` -> candidate version ->
validation gate -> published to the serving engine, or rejected.

It trains its own copy of the policy in its own thread, so the serving engine only
ever holds validated versions; publishing copies the LoRA tensors into the serving
engine in place (``Service.publish``).

Departures from ``selfrl run``, on purpose:

* Turns arrive from clients at whatever temperature they chose, so the recorded
  sampling logprobs are not those of the learner's distribution. The old logprobs are
  recomputed with the learner's current weights at ``learner.temperature`` before the
  update, as TRL's GRPOTrainer does when it does not sample with vLLM; the importance
  ratio of the first pass is then 1 and the update is REINFORCE with a group baseline.
  The sampled logprobs stay in the store untouched.
* Groups are formed by ``task_key`` (or the first user message), not by repeated
  samples of one task: a group holds different prompts, and its mean reward is a
  baseline for all of them.
* Every candidate is validated before it is served (``selfrl run`` validates every
  ``eval_every`` updates).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from selfrl import adapters
from selfrl.engines import make_engine
from selfrl.gate import evaluate, passes_gate
from selfrl.rl.advantages import group_advantages
from selfrl.rl.batch import collate
from selfrl.rl.logprobs import per_token_logps
from selfrl.serve import records
from selfrl.serve.feedback import served_rewards
from selfrl.tasks import assert_disjoint, get_task_source, split_tasks
from selfrl.tools import resolve_tools
from selfrl.trainer import Learner
from selfrl.trajectory import Trajectory


class BackgroundLearner(threading.Thread):
    """Trains on recorded traffic and publishes validated versions to ``service``.

    Args:
        service: the :class:`selfrl.serve.service.Service` it learns for.
        model: the learner's own copy of the policy (a ``peft.PeftModel``).
    """

    def __init__(self, service, model):
        super().__init__(name="selfrl-learner", daemon=True)
        self.service, self.cfg = service, service.cfg
        tok = service.tok
        self.model = model
        self.engine = make_engine(service.cfg.engine, model, tok, version=service.engine.version)  # validation runs here, not on the server
        if service.engine.version != 0:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, service.state_of(service.engine.version))
        lc = self.cfg.learner
        self.learner = Learner(model, self.cfg.train, lc.temperature, tok.pad_token_id, self.cfg.max_tokens_default)
        self.source = get_task_source(self.cfg.task.source, **self.cfg.task.options)
        _, self.val = split_tasks(self.source, 0, self.cfg.gate.val_size, self.cfg.task.train_seed,
                                  self.cfg.task.val_seed)
        assert_disjoint([], self.val)
        self.tools = resolve_tools(self.cfg.rollout.tools)
        self.lock = threading.RLock()
        self._halt = threading.Event()
        self.best_version = self.engine.version
        self.best_success: float | None = None
        self.best_state = adapters.lora_state(model)
        self.updates = 0
        self.last: dict[str, Any] = {}
        self.error: str | None = None
        self.busy = False  # between taking a batch and finishing its gate

    # -- thread ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.busy = True
            self.best_success = self.validated(self.best_version)
            self.busy = False
            while not self._halt.wait(self.cfg.learner.poll_s):
                self.tick()
        except Exception as e:  # the server keeps serving; the failure is visible in status and events
            self.error = f"{type(e).__name__}: {e}"
            self.service.event("learner_error", f"the background learner stopped: {self.error}")

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=600)

    def status(self) -> dict[str, Any]:
        return {"alive": self.is_alive(), "busy": self.busy, "updates": self.updates, "best_version": self.best_version,
                "best_val_success": self.best_success, "last_update": self.last, "error": self.error}

    # -- steps -------------------------------------------------------------------------

    def validated(self, version: int) -> float:
        """Held-out success of the learner's current weights as ``version`` (stored; reused when known)."""
        store = self.service.store
        with store.lock:
            row = next((v for v in store.versions() if v["version"] == version), None)
        if row is not None and "val/success" in row["metrics"]:
            return row["metrics"]["val/success"]
        self.engine.version = version
        res = evaluate(self.engine, self.val, self.source, self.tools, self.cfg.rollout, self.cfg.gate.batch_size)
        with store.lock:
            store.add_evaluation(version, res.results)
            store.set_version_status(version, row["status"] if row else "candidate", {"val/success": res.success})
            store.log_metrics(self.service.run_id, self.updates, {"time/validation_s": res.seconds})
        return res.success

    def tick(self) -> bool:
        """One update if enough turns are ready; returns True when one ran."""
        store, lc = self.service.store, self.cfg.learner
        with store.lock:
            batch = records.ready(store, lc.feedback_wait_s, lc.max_batch)
        if len(batch) < lc.min_batch:
            return False
        with self.lock:
            self.busy = True
            try:
                self.update(batch)
            finally:
                self.busy = False
        return True

    def score(self, batch: list[tuple[Trajectory, dict]]) -> tuple[list[Trajectory], list[Trajectory]]:
        """Rewards and group advantages; returns (scored, left out because no reward applied)."""
        scored, unscored = [], []
        for traj, row in batch:
            traj.rewards, traj.reward = served_rewards(row["feedback"], traj.tool_success_rate,
                                                       self.cfg.learner.reward_weights)
            traj.group_id = row["group_key"]
            (scored if traj.reward is not None else unscored).append(traj)
        if scored:
            adv = group_advantages([t.reward for t in scored], [t.group_id for t in scored],
                                   self.cfg.train.scale_rewards,
                                   num_completion_tokens=[t.num_completion_tokens for t in scored])
            for t, a in zip(scored, adv.advantages):
                t.advantage = a
        return scored, unscored

    @torch.no_grad()
    def recompute_old_logps(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Copies of ``trajs`` whose ``logprobs`` are the learner's own at its temperature."""
        out = []
        pad = self.service.tok.pad_token_id
        for i in range(0, len(trajs), self.cfg.train.micro_batch_size):
            chunk = trajs[i:i + self.cfg.train.micro_batch_size]
            mb = collate(chunk, pad).to(self.learner.device)
            logps = per_token_logps(self.model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                    self.cfg.learner.temperature)  # (B, T)
            for j, t in enumerate(chunk):
                copy = Trajectory.from_dict(t.to_dict())
                copy.logprobs = (logps[j, :len(t.token_ids)] * mb.completion_mask[j, :len(t.token_ids)]).tolist()
                copy.advantage = t.advantage
                out.append(copy)
        return out

    def update(self, batch: list[tuple[Trajectory, dict]]) -> dict[str, Any]:
        """Score, update, save a candidate, validate it, publish or reject it."""
        store, t0 = self.service.store, time.perf_counter()
        scored, unscored = self.score(batch)
        with store.lock:
            records.mark(store, unscored, "skipped", None)
        usable = [t for t in scored if t.advantage]
        metrics = self.learner.step(self.recompute_old_logps(usable)) if usable else {"skipped": 1.0}
        self.updates += 1
        info: dict[str, Any] = {"turns": len(batch), "scored": len(scored), "with_signal": len(usable),
                                "reward_mean": sum(t.reward for t in scored) / max(len(scored), 1)}
        if metrics.get("skipped"):
            with store.lock:
                records.mark(store, scored, "skipped", None)
            reasons = [k.removeprefix("skip_reason_") for k, v in metrics.items() if k.startswith("skip_reason_") and v]
            info["result"] = "skipped (" + (", ".join(reasons) or "no reward spread") + ")"
            self.service.event("skip", f"update skipped: {', '.join(reasons) or 'no reward spread'}",
                               {k: v for k, v in metrics.items() if isinstance(v, float)})
            self.last = info
            return info
        with store.lock:
            version = store.next_version()
            path = adapters.save_version(self.model, self.service.run_dir, version)
            store.add_version(version, self.best_version, str(path), "candidate", {})
            records.mark(store, scored, "trained", version)
            store.log_metrics(self.service.run_id, self.updates, {
                k: v for k, v in metrics.items() if isinstance(v, float)} | {"reward/mean": info["reward_mean"]})
        success = self.validated(version)
        info.update(version=version, val_success=success, update_s=metrics.get("time/update_s"))
        if passes_gate(success, self.best_success or 0.0, self.cfg.gate.tolerance):
            with store.lock:
                store.set_version_status(version, "promoted", {"val/success": success})
            msg = f"held-out {success:.3f} (best {self.best_success:.3f})"
            self.best_version, self.best_success = version, max(success, self.best_success or 0.0)
            self.best_state = adapters.lora_state(self.model)
            info["result"] = "promoted"
            self.last = info  # before the swap: whoever sees the new version sees this too
            info["swap_s"] = self.service.publish(version, self.best_state, f"promoted: {msg}")
        else:
            with store.lock:
                store.set_version_status(version, "rejected", {"val/success": success})
            self._load(self.best_state, self.best_version)
            self.service.event("reject", f"version {version} rejected: held-out {success:.3f} < best "
                               f"{self.best_success:.3f} - {self.cfg.gate.tolerance}")
            info["result"] = "rejected"
        info["seconds"] = time.perf_counter() - t0
        self.last = info
        return info

    def _load(self, state, version: int) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)
        self.engine.version = version
        self.learner.reset_optimizer()

    def reset_to(self, version: int, state) -> None:
        """Continue learning from ``version`` (after an admin rollback)."""
        with self.lock:
            self._load(state, version)
            self.best_version, self.best_state = version, {k: v.clone() for k, v in state.items()}
            with self.service.store.lock:
                row = next((v for v in self.service.store.versions() if v["version"] == version), None)
            self.best_success = (row or {}).get("metrics", {}).get("val/success")
