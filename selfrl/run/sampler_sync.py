"""A remote sampler kept in step with the in-process learner (``selfrl run --sampler URL``), or
the sampler's own copy of the adapter in this process (``selfrl run --async-rollouts``).

The learner trains its own copy of the policy in this process; a sampler in another
process (``selfrl sampler``, or a vLLM server) does every rollout and
validation. Each time a version must serve there, it is pushed by version
(``engine.swap``) and proved with the swap check (:mod:`selfrl.safety.swap_check`): the
sampler's log-probs of a fixed probe sequence must match the learner's within the
tolerance of the learner's dtype, before ``swap_check.deadline_s``. The pushes:

- ``start``: the champion (the base on a fresh run), before the base validation's
  numbers are used; this also proves the sampler holds the same base model;
- ``candidate``: each new version after its update, before its rollouts and validation;
- ``restore``: the champion again after a rejection or a collapse rollback;
- ``promote``: no push: the gate checks the validated candidate once more right before
  it can be promoted (:class:`selfrl.run.cycle.UpdateCycle`'s ``verify``), so a sampler that
  went stale or hung during validation is caught in the promote step;
- ``finish``: the champion at the end (a failure there is reported, not raised).

A failed check (``mismatch``, ``stale``, ``wrong_version``, ``timeout``, ``error``; a swap
the sampler does not acknowledge within the deadline is a ``timeout``, one it refuses an
``error``) records a ``swap_check_failed`` event with the numbers, marks a candidate
``rejected`` with the reason, and raises :class:`selfrl.safety.swap_check.SwapCheckError`: the run
stops. It does not roll back to the champion and go on, because the sampler that just
failed is the one that would serve the champion; a stale or hung sampler is never used
silently. After fixing the sampler, ``--resume`` pushes and checks the champion first.
"""

from __future__ import annotations

from pathlib import Path

from selfrl.record import adapters
from selfrl.record.versions import Ledger
from selfrl.safety.swap_check import (  # noqa: F401  (swap_within: where it was)
    SwapChecker,
    SwapCheckError,
    SwapCheckResult,
    checked_swap,
    record_check,
    swap_within,
)


# Where each kind of sampler answers a GET without an API key, and how to start one.
HEALTH_PATHS = {"selfrl": "/sampler/health", "vllm": "/health"}
START_HINTS = {"selfrl": "selfrl sampler --port PORT, with the run's model", "vllm": "vllm serve MODEL --enable-lora "
               "(docs/guides/vllm.md)"}
REACH_TIMEOUT_S = 5.0  # seconds the sampler has to answer the reachability check before the model loads


def check_reachable(url: str, kind: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """The sampler of ``kind`` (``selfrl`` or ``vllm``) at ``url`` answers its health check within
    ``timeout_s`` seconds; called before the model loads, so that a wrong URL fails in seconds.

    Raises:
        ConnectionError: it does not (the message names the URL, the reason and how to start one).
    """
    from selfrl.engines.http import unreachable

    if (why := unreachable(url, HEALTH_PATHS[kind], timeout_s)) is not None:
        raise ConnectionError(f"cannot reach the {kind} sampler at {url} (sampler.url, --sampler) within "
                              f"{timeout_s:g} s: {why}; start it ({START_HINTS[kind]}) or correct the URL, "
                              "then start again")


def connect(cfg, tokenizer, model):
    """The remote engine of ``cfg.sampler`` (a :class:`selfrl.config.RunConfig`'s), over ``tokenizer``.

    Raises:
        ConnectionError: the sampler cannot be reached (the message names the URL).
        ValueError: an unreadable API key file.
    """
    from selfrl.engines.http import RemoteBackendError
    from selfrl.engines.http import load_api_key

    sc = cfg.sampler
    key = load_api_key(sc.api_key_file)
    try:
        if sc.kind == "vllm":
            from selfrl.engines.vllm import VLLMEngine

            return VLLMEngine(sc.url, tokenizer, api_key=key, timeout_s=sc.timeout_s,
                              adapter_config=model.peft_config.get("default"))
        from selfrl.engines.remote import RemoteEngine

        return RemoteEngine(sc.url, tokenizer, api_key=key, timeout_s=sc.timeout_s)
    except (RemoteBackendError, TimeoutError, OSError) as e:
        raise ConnectionError(f"cannot reach the {sc.kind} sampler at {sc.url} (sampler.url): {e}") from e


class SamplerSync:
    """Pushes the learner's versions into a remote sampler and proves each with the swap check.

    Args:
        engine: the remote engine (``swap``, ``prompt_logprobs``, ``version``), or the local
            sampler copy of ``--async-rollouts`` (:class:`selfrl.rollout.prefetch.LocalSampler`).
        model: the learner's peft model (its LoRA weights are the version being pushed).
        ledger: the run's versions (events, and a failed candidate marked rejected).
        checker: the swap check, or None when ``swap_check.enabled = false`` (swaps are then
            trusted, and bounded only by ``sampler.timeout_s``).
        by_folder: push a version's saved folder (the server reads it: vLLM) instead of its
            tensors as bytes (``selfrl sampler``, which may run on another machine).
    """

    def __init__(self, engine, model, ledger: Ledger, checker: SwapChecker | None, by_folder: bool = False):
        self.engine, self.model, self.ledger, self.checker, self.by_folder = engine, model, ledger, checker, by_folder
        self.served: list[int] = []  # versions pushed (and passed), oldest first: the learner's weights in turn

    def push(self, version: int, stage: str) -> SwapCheckResult | None:
        """Swap the learner's current weights into the sampler as ``version``, then check them.

        Returns:
            The passing check (None when checks are off).

        Raises:
            SwapCheckError: the swap or the check failed (event recorded, a candidate rejected).
        """
        if self.by_folder:
            rec = self.ledger.get(version)
            adapter = Path(rec.path)
        else:
            adapter = adapters.lora_state(self.model)
        res = checked_swap(self.engine, adapter, version, self.checker, self.model)
        if res is not None:
            self._record(res, stage)
        self._served(version)
        return res

    def _served(self, version: int) -> None:
        if not self.served or self.served[-1] != version:  # a change of weights, as staleness counts them
            self.served.append(version)

    def verify(self, version: int) -> SwapCheckResult | None:
        """The promote step's check: the sampler still serves ``version`` = the learner's weights.

        Raises:
            SwapCheckError: as :meth:`push`.
        """
        if self.checker is None:
            return None
        return self._record(self.checker.check(self.engine, self.model, version), "promote")

    def load(self, state: dict, version: int, stage: str = "restore") -> None:
        """``UpdateCycle``'s ``load``: ``state`` into the learner's model, then pushed and checked.

        Raises:
            SwapCheckError: as :meth:`push`.
        """
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)
        self.push(version, stage)

    def _record(self, res: SwapCheckResult, stage: str) -> SwapCheckResult:
        record_check(self.ledger, res, stage)
        if res.ok:
            return res
        self.ledger.reject_unverified(res.version, res.reason, res.mean_abs_diff)
        raise SwapCheckError(res)


__all__ = ["SamplerSync", "connect", "swap_within"]
