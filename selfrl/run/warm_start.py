"""Warm start: fine-tune the LoRA on the policy's own rejection-sampled successes, before RL.

Where the policy almost never solves a task, every GRPO group is all-fail and RL has
no signal. The warm start is rejection-sampling fine-tuning (expert iteration) as in
STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning With Reasoning") and RAFT
(Dong et al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model
Alignment"), run once before RL iteration 0 (:func:`run_warm_start`):

    1. sample ``samples_per_task`` rollouts of ``num_tasks`` TRAINING tasks at
       ``warm_start.temperature`` with the run's own engine, tools, environments and
       grammar (``rollout.constrain``) (:func:`sample_successes`; a held-out task is refused);
    2. score them with the run's reward weights and detectors, and keep the verified
       successes with ``reward >= min_reward`` that no detector flagged, identical ones
       dropped, at most ``max_per_task`` per task (:func:`select_successes`);
    3. fine-tune the LoRA on them by the NLL of the policy's own sampled tokens
       (``completion_mask``: prompts and tool outputs are never trained on) for ``epochs``
       at ``learning_rate`` (:func:`fine_tune`, loss :func:`sft_loss`);
    4. save the result as a candidate version, validate it on the held-out tasks and gate it
       exactly as an RL update (:class:`selfrl.run.cycle.UpdateCycle`): promoted only if it passes.

Every step is recorded as ``warm_start`` events (:class:`selfrl.record.versions.EventKind`) with
its numbers; ``report.md`` shows the last one.

Departures from the papers, on purpose:

* One round. STaR repeats sample -> fine-tune (restarting from the base model each
  time); here RL takes over after one round, so the two coincide.
* No rationalization (STaR's second try with the answer given as a hint): only the
  policy's own unaided successes are imitated, so nothing the environment would not pay
  for enters the weights.
* RAFT keeps the top-ranked sample per prompt; here every verified, unflagged success
  is kept (up to ``max_per_task`` distinct ones), because on hard tasks there are few.
* A success that any reward-hacking detector flagged is never imitated (it is counted).
* The log-probs are taken under ``logits / rollout.temperature``, as the learner takes
  them, so the fine-tune raises the kept tokens' probability under the distribution RL
  samples from; constrained turns replay their grammar masks as the learner does.
* Its own AdamW; RL's optimizer state is not touched.
* Once promoted, the warm-started adapter is RL's KL reference (``kl_reference =
  "warm_start"``, the default), as an SFT model is for the RL after it; "initial" keeps the
  base model (or ``lora.init_adapter``), whose KL term then pulls back toward it.
* Crash safety: a ``warm_start`` event with ``phase = "trained"`` names the candidate
  as soon as it is saved; a resumed run gates that candidate instead of training again,
  and a run whose warm start finished (``phase`` "done" or "no_successes") never repeats it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from selfrl.config import DetectorConfig, RolloutConfig, WarmStartConfig
from selfrl.safety.detectors import PENALTY_KEY, apply_detectors
from selfrl.envs.rewards import score_batch
from selfrl.rl.batch import collate
from selfrl.rl.logprobs import per_token_logps
from selfrl.rollout.agent import rollout
from selfrl.core.tasks import Task, TaskSource, assert_disjoint
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import EventKind, VersionStatus

if TYPE_CHECKING:
    from selfrl.rl.learner import Learner


class Runner(Protocol):
    """What the warm start uses of the run it belongs to (:class:`selfrl.run.loop.Runner` is one):
    its setup ``s`` (store, ledger, learner, engine), config, progress, champion, held-out
    validation and the many-agents gate. Named here so that this module does not import the loop
    that calls it."""

    s: Any
    cfg: Any
    progress: Any
    champion: Any

    def validate(self) -> Any: ...

    def agents_gate(self, step: int, res: Any) -> str | None: ...

__all__ = ["FineTuneStats", "Selection", "WarmStartError", "WarmStartResult", "fine_tune", "mean_nll",
           "run_warm_start", "sample_successes", "select_successes", "sft_loss", "stored_phase",
           "warm_start_tasks"]

PHASE_TRAINED, PHASE_DONE, PHASE_NONE = "trained", "done", "no_successes"  # ``data["phase"]`` of the events


class WarmStartError(ValueError):
    """``warm_start.required`` and no success was found, or the warm start cannot run (the message says why)."""


# ---------------------------------------------------------------- pure parts


def sft_loss(per_token_logps: torch.Tensor, completion_mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Supervised NLL of the sampled tokens: ``-sum(logp_t * mask_t) / num_tokens``.

    ``num_tokens`` is the number of completion tokens of the whole optimizer step, not of
    this micro-batch, so the losses of its micro-batches add up to the step's token mean
    (as :class:`selfrl.rl.losses.Normalizer` does for the GRPO loss).

    Args:
        per_token_logps: (B, T) log-probs of the tokens (0 where the mask is 0).
        completion_mask: (B, T) 1 on tokens the policy sampled, 0 on prompts and tool output.
        num_tokens: the step's completion tokens (>= 1).

    Returns:
        a scalar tensor (nats per token).

    Raises:
        ValueError: ``num_tokens`` < 1, or the shapes differ.

    >>> sft_loss(torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, 1.0, 1.0]]), 2).item()
    1.5
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if per_token_logps.shape != completion_mask.shape:
        raise ValueError(f"per_token_logps {tuple(per_token_logps.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} differ in shape")
    return -(per_token_logps * completion_mask).sum() / num_tokens  # ()


@dataclass
class Selection:
    """What rejection sampling kept, and what it dropped and why (counts of trajectories)."""

    kept: list[Trajectory]
    samples: int  # rollouts scored
    errors: int  # rollouts whose run or reward failed (never scored)
    successes: int  # verified correct with reward >= min_reward, flagged ones included
    flagged: int  # successes a reward-hacking detector flagged: never imitated
    duplicates: int  # unflagged successes identical (token for token) to one kept earlier
    capped: int  # unflagged distinct successes beyond max_per_task

    def counts(self) -> dict[str, int]:
        """The numbers, for an event's data."""
        return {"samples": self.samples, "errors": self.errors, "successes": self.successes,
                "flagged_dropped": self.flagged, "duplicates_dropped": self.duplicates,
                "capped_dropped": self.capped, "kept": len(self.kept)}


def unclamped_reward(traj: Trajectory) -> float:
    """The reward before a detector's clamp (``rewards["hacking_penalty"]`` undone)."""
    return traj.reward - (traj.rewards.get(PENALTY_KEY) or 0.0)


def select_successes(trajs: list[Trajectory], min_reward: float, max_per_task: int) -> Selection:
    """Keep the scored trajectories that the verifier calls correct, whose reward (before any
    detector clamp) is at least ``min_reward``, that no detector flagged and that have a
    sampled token; then drop repeats (the same ``token_ids``) and keep at most
    ``max_per_task`` per task (0: all), in the order given.

    >>> ok = Trajectory(task_id="a", group_id="g", adapter_version=0, prompt_len=1, token_ids=[1, 2],
    ...                 completion_mask=[0, 1], logprobs=[0.0, -1.0], reward=1.0, correct=True)
    >>> flagged = dataclasses.replace(ok, token_ids=[1, 3], flags={"repeated_action": "confirm twice"})
    >>> sel = select_successes([ok, dataclasses.replace(ok), flagged], 0.0, 0)
    >>> len(sel.kept), sel.successes, sel.flagged, sel.duplicates
    (1, 3, 1, 1)
    """
    scored = [t for t in trajs if t.error is None and t.reward is not None]
    wins = [t for t in scored if t.correct and unclamped_reward(t) >= min_reward and t.num_completion_tokens > 0]
    clean = [t for t in wins if not t.flags]
    seen: set[tuple[str, tuple[int, ...]]] = set()
    per_task: dict[str, int] = {}
    kept, duplicates, capped = [], 0, 0
    for t in clean:
        key = (t.task_id, tuple(t.token_ids))
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        if max_per_task and per_task.get(t.task_id, 0) >= max_per_task:
            capped += 1
            continue
        per_task[t.task_id] = per_task.get(t.task_id, 0) + 1
        kept.append(t)
    return Selection(kept, len(trajs), len(trajs) - len(scored), len(wins), len(wins) - len(clean), duplicates,
                     capped)


def warm_start_tasks(train: list[Task], num_tasks: int, seed: int) -> list[Task]:
    """``num_tasks`` training tasks (all of them when there are fewer), drawn without
    replacement by ``seed``: the same tasks on every resume."""
    if num_tasks >= len(train):
        return list(train)
    return random.Random(seed).sample(train, num_tasks)


# ---------------------------------------------------------------- sampling


def sample_successes(engine, tasks: list[Task], held_out: list[Task], source: TaskSource, tools: list,
                     rollout_cfg: RolloutConfig, weights: dict[str, float], detectors: DetectorConfig,
                     cfg: WarmStartConfig, chunk: int = 64, on_chunk=None) -> Selection:
    """Rejection sampling: ``cfg.samples_per_task`` rollouts of each task at ``cfg.temperature``
    (the run's engine, tools, environment and ``rollout.constrain``), scored by ``weights`` and
    checked by the trajectory and group detectors of ``detectors``; returns
    :func:`select_successes` of them. Rollouts run ``chunk`` trajectories at a time (whole
    tasks); ``on_chunk()`` is called after each.

    Raises:
        ValueError: a task is also in ``held_out`` (the held-out set is never trained on).
    """
    assert_disjoint(tasks, held_out)
    rcfg = dataclasses.replace(rollout_cfg, temperature=cfg.temperature)
    per = max(1, chunk // cfg.samples_per_task)  # tasks per rollout call
    trajs: list[Trajectory] = []
    for s in range(0, len(tasks), per):
        batch = tasks[s:s + per]
        flat = [t for t in batch for _ in range(cfg.samples_per_task)]
        groups = [f"warm-{s + j}" for j in range(len(batch)) for _ in range(cfg.samples_per_task)]
        out = rollout(engine, flat, groups, tools, rcfg, env_factory=source.make_env)
        score_batch(out, {t.id: t for t in batch}, source, weights)
        apply_detectors(out, detectors)
        trajs += out
        if on_chunk is not None:
            on_chunk()
    return select_successes(trajs, cfg.min_reward, cfg.max_per_task)


# ---------------------------------------------------------------- fine-tuning


@dataclass
class FineTuneStats:
    """What :func:`fine_tune` did: mean NLL per token before and after (nats), optimizer steps
    taken and skipped (a non-finite loss or gradient), completion tokens per epoch, seconds."""

    loss_before: float
    loss_after: float
    steps: int
    skipped_steps: int
    num_tokens: int
    seconds: float


def _batches(learner: "Learner", trajs: list[Trajectory]):
    """Micro-batches of ``trajs`` (the learner's size), collated as the learner collates (grammar
    masks replayed), with the advantage set to 1 (unused here; ``collate`` requires one)."""
    ready = [dataclasses.replace(t, advantage=1.0) for t in trajs]
    for r in learner.micro_batches(ready):
        yield collate(ready[r.start:r.stop], learner.pad_token_id, learner.grammar_masks).to(learner.device)


def _logps(learner: "Learner", mb) -> torch.Tensor:
    """(B, T) log-probs of ``mb``'s completion tokens under the learner's model and temperature."""
    return per_token_logps(learner.model, mb.input_ids, mb.attention_mask, mb.completion_mask, learner.temperature,
                           vocab_masks=mb.vocab_masks)


def mean_nll(learner: "Learner", trajs: list[Trajectory]) -> float:
    """Mean NLL per completion token of ``trajs`` under the learner's current weights (no gradient)."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in _batches(learner, trajs):
            n = mb.num_tokens
            total += float(sft_loss(_logps(learner, mb), mb.completion_mask, max(n, 1))) * n
            tokens += n
    return total / tokens if tokens else math.nan


def fine_tune_steps(trajs: list[Trajectory], epochs: int, batch_size: int) -> int:
    """How many optimizer steps :func:`fine_tune` takes (applied or skipped) on ``trajs``:
    ``epochs * ceil(n / batch_size)``, ``n`` the trajectories with a sampled token."""
    return epochs * math.ceil(sum(t.num_completion_tokens > 0 for t in trajs) / batch_size)


def fine_tune(learner: "Learner", trajs: list[Trajectory], epochs: int, learning_rate: float, batch_size: int,
              seed: int = 0, on_step: Callable[[], None] | None = None) -> FineTuneStats:
    """Fine-tune the learner's LoRA parameters on ``trajs`` by :func:`sft_loss`: ``epochs`` passes,
    each over the trajectories shuffled by ``seed`` + epoch, one AdamW step (its own optimizer,
    ``learning_rate``, the learner's weight decay and gradient clipping) per ``batch_size``
    trajectories, micro-batched by ``train.micro_batch_size``. A step whose loss or gradient
    norm is not finite is not applied (counted in ``skipped_steps``). ``on_step`` is called after each
    of the :func:`fine_tune_steps` steps, applied or skipped (a progress bar).

    Raises:
        ValueError: no trajectory, or none with a sampled token.
    """
    usable = [t for t in trajs if t.num_completion_tokens > 0]
    if not usable:
        raise ValueError("fine_tune needs at least one trajectory with a sampled token")
    t0 = time.perf_counter()
    before = mean_nll(learner, usable)
    optimizer = torch.optim.AdamW(learner.params, lr=learning_rate, weight_decay=learner.cfg.weight_decay)
    steps = skipped = 0
    rng = random.Random(seed)
    learner.model.train()
    try:
        for epoch in range(epochs):
            order = usable[:]
            rng.shuffle(order)
            for s in range(0, len(order), batch_size):
                step = order[s:s + batch_size]
                n = sum(t.num_completion_tokens for t in step)
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for mb in _batches(learner, step):
                    part = sft_loss(_logps(learner, mb), mb.completion_mask, n)  # this micro-batch's share
                    part.backward()
                    loss += float(part.detach())
                norm = float(torch.nn.utils.clip_grad_norm_(learner.params, learner.cfg.max_grad_norm))
                if not (math.isfinite(loss) and math.isfinite(norm)):
                    optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                else:
                    optimizer.step()
                    steps += 1
                if on_step is not None:
                    on_step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        learner.model.eval()
    after = mean_nll(learner, usable)
    tokens = sum(t.num_completion_tokens for t in usable)
    return FineTuneStats(before, after, steps, skipped, tokens, time.perf_counter() - t0)


# ---------------------------------------------------------------- the run's warm start


@dataclass
class WarmStartResult:
    """The warm start of a run: ``outcome`` is "promoted", "rejected", "collapse" or "corrupt" (the
    gate's verdict on the candidate ``version``), "no_successes", "not_trained" (every step
    skipped) or "already_done" (a resumed run: nothing was repeated)."""

    outcome: str
    message: str
    version: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def stored_phase(store) -> tuple[str | None, dict[str, Any]]:
    """The phase and data of the run's last ``warm_start`` event (``(None, {})`` when none)."""
    events = [e for e in store.events() if e["kind"] == EventKind.WARM_START.value]
    if not events:
        return None, {}
    data = events[-1]["data"] or {}
    return data.get("phase"), data


def no_success_hint(cfg: WarmStartConfig, tasks: int) -> str:
    """What to try when rejection sampling found nothing."""
    return (f"no success in {tasks * cfg.samples_per_task} samples of {tasks} training tasks at temperature "
            f"{cfg.temperature:g}; try more samples (warm_start.samples_per_task), more tasks "
            "(warm_start.num_tasks), a higher warm_start.temperature, or an easier tier of tasks (the "
            "environment's options)")


def run_warm_start(runner: Runner, start: int) -> WarmStartResult:
    """The warm start of ``runner``'s run, before RL iteration ``start`` (see the module docstring).

    A resumed run continues it: finished, it is not repeated ("already_done"); a saved
    candidate that was never gated is validated and gated now; nothing stored: it runs.

    Raises:
        WarmStartError: ``warm_start.required`` and no success was found; or RL iterations
            already ran (``start`` > 0) and the warm start never did (it comes first or not at all).
        ValueError: a warm-start task is a held-out task.
    """
    s, cfg, ws = runner.s, runner.cfg, runner.cfg.warm_start
    phase, data = stored_phase(s.store)
    if phase in (PHASE_DONE, PHASE_NONE):
        msg = f"warm start: already done in an earlier session ({data.get('outcome', phase)}); not repeated"
        runner.progress.log(msg)
        if data.get("outcome") == "promoted":
            adopt_reference(runner, data["version"])
        return WarmStartResult("already_done", msg, data.get("version"), data)
    if phase == PHASE_TRAINED:
        return gate_candidate(runner, data["version"], data, resumed=True)
    if start > 0:
        raise WarmStartError(f"warm_start.enabled, but this run already ran {start} RL iteration(s) without it; "
                             "the warm start comes before the first update or not at all: turn it off to "
                             "resume, or start a new run")
    t0 = time.perf_counter()
    tasks = warm_start_tasks(s.train, ws.num_tasks, cfg.seed)
    chunk = cfg.num_prompts * cfg.num_generations  # the RL batch, known to fit
    per = max(1, chunk // ws.samples_per_task)
    runner.progress.phase(f"warm start: sampling {len(tasks)} tasks x {ws.samples_per_task}", -(-len(tasks) // per))
    sel = sample_successes(s.engine, tasks, s.val, s.source, s.tools, cfg.rollout, s.weights, s.monitor.cfg, ws,
                           chunk, on_chunk=runner.progress.advance)
    counts = {"tasks": len(tasks), **sel.counts(), "temperature": ws.temperature}
    sampled_s = time.perf_counter() - t0
    if not sel.kept:
        msg = (f"warm start: {sel.successes} success(es), {sel.flagged} flagged, none kept; "
               + no_success_hint(ws, len(tasks)) + "; " +
               ("stopping (warm_start.required)" if ws.required else "continuing with plain RL"))
        out = {"phase": PHASE_NONE, "outcome": "no_successes", **counts, "seconds": sampled_s}
        s.ledger.event(EventKind.WARM_START, msg, out)
        runner.progress.log(msg)
        if ws.required:
            raise WarmStartError(msg)
        return WarmStartResult("no_successes", msg, None, out)
    epochs = f"{ws.epochs} epoch{'s' * (ws.epochs != 1)}"
    runner.progress.phase(f"warm start: fine-tuning steps on {len(sel.kept)} trajectories over {epochs}",
                          fine_tune_steps(sel.kept, ws.epochs, ws.batch_size))
    stats = fine_tune(s.learner, sel.kept, ws.epochs, ws.learning_rate, ws.batch_size, cfg.seed,
                      on_step=runner.progress.advance)
    counts.update({"loss_before": stats.loss_before, "loss_after": stats.loss_after, "steps": stats.steps,
                   "skipped_steps": stats.skipped_steps, "tokens": stats.num_tokens})
    if stats.steps == 0:
        msg = "warm start: every fine-tuning step was skipped (not finite); no candidate; continuing with plain RL"
        out = {"phase": PHASE_DONE, "outcome": "not_trained", **counts, "seconds": time.perf_counter() - t0}
        s.cycle.restore_champion()  # a skipped step never moves the weights; this makes sure
        s.ledger.event(EventKind.WARM_START, msg, out)
        runner.progress.log(msg)
        return WarmStartResult("not_trained", msg, None, out)
    champ = runner.champion
    cand = s.ledger.save_candidate(s.learner.model, champ.version)
    trained = {"phase": PHASE_TRAINED, "version": cand.version, "parent": champ.version, **counts,
               "train_seconds": time.perf_counter() - t0}
    s.ledger.event(EventKind.WARM_START, (
        f"warm start: version {cand.version} fine-tuned on {len(sel.kept)} of {sel.samples} samples "
        f"({sel.successes} successes, {sel.flagged} flagged dropped); NLL {stats.loss_before:.3f} -> "
        f"{stats.loss_after:.3f}; validating"), trained)
    if s.sampler is not None:  # the sampler must serve what the gate validates
        s.sampler.push(cand.version, "candidate")
    else:
        s.engine.version = cand.version
    return gate_candidate(runner, cand.version, trained, resumed=False)


def gate_candidate(runner: Runner, version: int, data: dict[str, Any], resumed: bool) -> WarmStartResult:
    """Validate the warm-started ``version`` (loaded first when ``resumed``) and gate it as an RL
    update; records the ``warm_start`` event of phase "done" and returns the result. A candidate
    an earlier session already gated is not gated again (its status is reported)."""
    s, t0 = runner.s, time.perf_counter()
    rec = s.ledger.get(version)
    if rec is not None and rec.status != VersionStatus.CANDIDATE:
        outcome, success = rec.status.value, rec.val_success
    else:
        if resumed:  # a candidate saved by a session that stopped before its gate
            state = s.ledger.load_state(version)
            if s.sampler is not None:
                s.sampler.load(state, version, "candidate")
            else:
                s.engine.swap(state, version)
        best = runner.champion.success
        res = runner.validate()
        veto = runner.agents_gate(0, res) if runner.cfg.agents else None
        verdict = s.cycle.gate(0, version, res.success, res.degenerate, veto=veto)
        outcome, success = verdict.outcome, res.success
        runner.progress.log(f"warm start: {verdict.message} (champion before: held-out {_fmt(best)})")
    if outcome == VersionStatus.PROMOTED.value:
        adopt_reference(runner, version)
    seconds = data.get("train_seconds", 0.0) + time.perf_counter() - t0
    out = {**data, "phase": PHASE_DONE, "outcome": outcome, "val_success": success, "seconds": seconds}
    msg = (f"warm start: {data.get('kept')} kept of {data.get('samples')} samples on {data.get('tasks')} training "
           f"tasks ({data.get('successes')} successes, {data.get('flagged_dropped')} flagged dropped), NLL "
           f"{data.get('loss_before', math.nan):.3f} -> {data.get('loss_after', math.nan):.3f}; version {version} "
           f"{outcome} (held-out {_fmt(success)}); {seconds:.0f} s")
    s.ledger.event(EventKind.WARM_START, msg, out)
    runner.progress.log(msg)
    return WarmStartResult(outcome, msg, version, out)


def adopt_reference(runner: Runner, version: int) -> None:
    """With ``warm_start.kl_reference = "warm_start"``, the promoted warm-started ``version``
    becomes RL's KL reference (the learner's ``ref_state``; also on every resume), as an SFT
    model is the reference of the RL that follows it; with "initial" the reference stays the
    base model or ``lora.init_adapter``."""
    if runner.cfg.warm_start.kl_reference == "warm_start":
        runner.s.learner.ref_state = runner.s.ledger.load_state(version)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
