"""Asynchronous rollouts in one process (``selfrl run --async-rollouts``): the next
iteration's rollouts are sampled while the current update trains.

Every framework users would pick instead (ART, verl, prime-rl, AReaL, SkyRL) overlaps
sampling with training, accepting samples one or more versions behind the learner and
correcting for it with importance sampling. ``selfrl run --ray`` does the same across
processes (:mod:`selfrl.run.ray`); this module does it inside one process, with the
depth of overlap fixed at one batch:

- **Two copies of the adapter, one of the base.** :func:`shadow_policy` gives the sampler
  its own copy of the policy whose frozen (base) tensors *are* the learner's (no memory
  for them) and whose LoRA tensors are its own. The learner trains its LoRA in place
  while the sampler samples from the version it holds; the sampler's weights change only
  by a swap, between batches.
- **One batch ahead.** After iteration ``i``'s rollouts are scored, iteration ``i + 1``'s
  are sampled in a thread (:class:`Prefetch`) by the version that sampled iteration ``i``
  while the update trains. The candidate the update saves is pushed into the sampler
  (and checked, :mod:`selfrl.run.sampler_sync`) only once that batch is back, so every
  trajectory is sampled by exactly one version.
- **The staleness bound.** A prefetched batch has staleness 1 when the update made a new
  version, 0 when it was skipped (counted as in :mod:`selfrl.rollout.staleness`:
  weight changes of the learner since the sampling version was last in it). When the gate
  or a collapse rollback puts the champion back, the batch may be staler; then it is
  dropped, whole, and sampled again by the version now serving, as ``--ray`` drops a group
  staler than ``distributed.max_staleness``. The update trains the batch it is given with
  the truncated importance correction (``train.tis_cap``), the sampler's recorded
  log-probs being the behaviour policy.
- **Every push proved.** The sampler copy is kept in step through the same
  :class:`selfrl.run.sampler_sync.SamplerSync` as a sampler in another process, so every
  version it serves passes the swap check (:mod:`selfrl.safety.swap_check`;
  ``[swap_check]``) before its rollouts count: the probe's log-probs under the
  sampler's copy must equal the learner's.

What it costs and gains on this 2-core CPU: docs/results/benchmarks.md, "Overlapping rollouts
with updates". A seeded asynchronous run is not the same run as a synchronous one with
the same seed (the batches are sampled by other versions).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

from selfrl.core.threads_at_exit import join_at_exit
from selfrl.rollout.staleness import staleness

__all__ = ["LocalSampler", "Prefetch", "shadow_policy", "staleness"]


def shadow_policy(model):
    """A copy of the peft ``model`` for sampling: every frozen parameter and every buffer
    is the model's own tensor (shared storage, no extra memory); every trainable
    parameter (the LoRA matrices) is a copy, which the learner's in-place updates do not
    touch.

    Raises:
        ValueError: ``model`` has no trainable parameter (nothing would tell the copies apart).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the policy has no trainable (LoRA) parameter to copy for the sampler")
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(model, memo)


class LocalSampler:
    """An in-process engine seen as the swap check's backend (:class:`selfrl.safety.swap_check.ProbeScorer`):
    ``swap`` goes to the engine, ``prompt_logprobs`` scores a sequence with the weights the
    engine samples from (its ``model``), ``version`` is the engine's.

    Args:
        engine: a reference or slot engine over :func:`shadow_policy`'s copy.
    """

    def __init__(self, engine):
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.version

    def swap(self, adapter, version: int) -> float:
        """See :meth:`selfrl.engines.reference.Engine.swap`."""
        return self.engine.swap(adapter, version)

    def prompt_logprobs(self, token_ids: list[int], timeout_s: float | None = None) -> tuple[list[float], int]:
        """(n - 1) temperature-1 log-probs of ``token_ids[1:]`` under the sampler's weights, and
        its version. ``timeout_s`` is not needed in process (the check's deadline still applies)."""
        from selfrl.rl.logprobs import sequence_logprobs

        synced = getattr(self.engine, "synced_model", None)  # the slot engine's merged view: what it samples with
        return sequence_logprobs(synced() if synced else self.engine.model, token_ids), self.engine.version


class Prefetch:
    """One iteration's rollouts sampled in a background thread.

    Args:
        iteration: the iteration the batch is for.
        version: the sampler's version when sampling started (the batch's behaviour policy).
        sample: ``sample()`` returns ``(trajectories, seconds)``; run once, in the thread.
        tasks: the batch's tasks (sampled again if the batch is dropped as too stale).
    """

    def __init__(self, iteration: int, version: int, sample: Callable[[], tuple[list, float]], tasks: list):
        self.iteration, self.version, self.tasks = iteration, version, tasks
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(sample,), daemon=True,
                                        name=f"selfrl-prefetch-{iteration}")
        self.started = time.perf_counter()
        self._thread.start()
        join_at_exit(self._thread)  # a run that stops mid-update: the batch ends before the process does

    def _run(self, sample) -> None:
        try:
            self._box["result"] = sample()
        except BaseException as e:  # handed to the caller by result(), never lost
            self._box["error"] = e

    def wait(self) -> None:
        """Block until the batch is sampled (or sampling failed)."""
        self._thread.join()

    def result(self) -> tuple[list, float]:
        """The batch and the seconds its sampling took.

        Raises:
            whatever sampling raised, re-raised here in the caller's thread.
        """
        self.wait()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["result"]
