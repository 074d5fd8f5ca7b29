"""The swap check: after an adapter version is loaded into a sampling backend, prove
numerically that the backend serves the weights the learner trained, before the
version is promoted.

Silently stale or hung weight sync is the most reported failure of RL frameworks
that sample from a separate server (TRL, verl, AReaL, SkyRL, Unsloth, ART all have
issues about it): the server keeps sampling from an old adapter, the importance
ratios drift, and nothing says so. The check:

1. scores one fixed *probe sequence* (:func:`probe_ids`) on the backend
   (``backend.prompt_logprobs``: the log-prob of every token given its prefix, at
   temperature 1) and with the learner's own weights (:func:`selfrl.rl.logprobs.sequence_logprobs`);
2. compares them: the mean absolute difference per token must be within a tolerance
   set by the dtype (:data:`TOLERANCE`; fp32 on both sides agrees to about 1e-6, bf16
   to about 1e-2);
3. when the previous version's probe log-probs are known and the two versions differ
   on the probe by more than a tenth of the tolerance, the served ones must not be
   closer to the old version than to the new one (a stale adapter can sit within a
   loose bf16 tolerance of a version that moved little). With noise that is
   symmetric around the true values, E|noise + gap| >= E|noise|, so an honest
   backend is not closer to the old version on average;
4. does all of it within a deadline: a backend that does not answer in time fails (its call
   goes on in a daemon thread, which the exit joins within a bound: :mod:`selfrl.core.threads_at_exit`).

A failure is a :class:`SwapCheckResult` with ``ok = False`` and a reason
(``mismatch``, ``stale``, ``timeout``, ``wrong_version``, ``error``);
:meth:`SwapChecker.require` turns it into a :class:`SwapCheckError` and an event,
which is what the promote step calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from selfrl.config import SwapCheckConfig  # the settings live with every other settings dataclass
from selfrl.core.threads_at_exit import join_at_exit

# Mean |served - learner| log-prob per probe token allowed, by the lower precision of the two sides.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 17 + 25 = 42. "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>'
)


class ProbeScorer(Protocol):
    """What the check needs from a backend besides the engine interface."""

    version: int

    def prompt_logprobs(self, token_ids: list[int], timeout_s: float | None = None) -> tuple[list[float], int]:
        """(n - 1) log-probs of ``token_ids[1:]`` each given its prefix, at temperature 1, and
        the adapter version that computed them."""
        ...


class SwapCheckError(RuntimeError):
    """The served version is not the trained one, or the backend did not answer in time.

    Attributes:
        result: the :class:`SwapCheckResult` that failed.
    """

    def __init__(self, result: "SwapCheckResult"):
        super().__init__(result.message)
        self.result = result


@dataclass
class SwapCheckResult:
    """The outcome of one check.

    Attributes:
        version: the version that was swapped in and checked.
        ok: the backend serves it.
        reason: ``ok``, ``mismatch`` (beyond tolerance), ``stale`` (closer to the previous
            version), ``timeout`` (no answer within the deadline), ``wrong_version`` (the
            backend says it serves another version) or ``error`` (the backend failed).
        mean_abs_diff: mean |served - learner| log-prob per probe token (NaN when none came back).
        max_abs_diff: the largest per-token difference.
        diff_to_previous: mean |served - previous version| (NaN when unknown).
        tolerance: the tolerance applied.
        seconds: time the check took.
        detail: one line for the log.
    """

    version: int
    ok: bool
    reason: str
    mean_abs_diff: float = float("nan")
    max_abs_diff: float = float("nan")
    diff_to_previous: float = float("nan")
    tolerance: float = float("nan")
    seconds: float = 0.0
    detail: str = ""

    @property
    def message(self) -> str:
        if self.ok:
            return (f"swap check passed for version {self.version}: mean |dlogp| {self.mean_abs_diff:.2e} "
                    f"<= {self.tolerance:.1e} ({self.seconds:.2f} s)")
        return f"swap check failed for version {self.version} ({self.reason}): {self.detail}; not promoted"

    def to_dict(self) -> dict:
        return asdict(self)


def probe_ids(tokenizer, length: int = 48) -> list[int]:
    """A fixed probe sequence of ``length`` token ids (the probe text, repeated as needed).

    Raises:
        ValueError: ``length < 2`` (a single token has no predicted log-prob).
    """
    if length < 2:
        raise ValueError(f"the probe needs at least 2 tokens, got {length}")
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def tolerance_for(dtype: str) -> float:
    """The default tolerance for a dtype name (``float32`` or ``bfloat16``).

    Raises:
        ValueError: another dtype.
    """
    if dtype not in TOLERANCE:
        raise ValueError(f"no swap-check tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCE)}")
    return TOLERANCE[dtype]


def _mean_abs(a: list[float], b: list[float]) -> tuple[float, float]:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def check_swap(backend: ProbeScorer, expected: list[float], probe: list[int], version: int, tolerance: float,
               deadline_s: float, previous: list[float] | None = None) -> SwapCheckResult:
    """Compare the backend's probe log-probs with ``expected`` (the learner's, for ``version``).

    Args:
        backend: the sampling backend the version was swapped into.
        expected: (n - 1) learner log-probs of ``probe`` (:func:`selfrl.rl.logprobs.sequence_logprobs`).
        probe: the probe token ids.
        version: the version that was swapped in.
        tolerance: largest mean |difference| per token that passes.
        deadline_s: seconds the backend has to answer; the call returns by then.
        previous: the previous served version's probe log-probs, or None.

    Returns:
        A :class:`SwapCheckResult`; never raises for a backend failure (the reason says it).
    """
    t0 = time.monotonic()
    box: dict = {}

    def call() -> None:
        try:
            box["answer"] = backend.prompt_logprobs(probe, timeout_s=deadline_s)
        except Exception as e:  # reported as the result's reason, never swallowed
            box["error"] = e

    worker = threading.Thread(target=call, daemon=True, name=f"swap-check-v{version}")
    join_at_exit(worker)  # an in-process sampler scores in torch: one past the deadline is joined (bounded) at exit
    worker.start()
    worker.join(timeout=deadline_s)
    if worker.is_alive():  # a backend given the same deadline raises at about this moment: let its reason through
        worker.join(timeout=min(0.1, deadline_s))
    seconds = time.monotonic() - t0
    base = dict(version=version, tolerance=tolerance, seconds=seconds)
    if worker.is_alive() or ("error" in box and _is_timeout(box["error"])):
        why = f" ({box['error']})" if "error" in box else ""
        return SwapCheckResult(ok=False, reason="timeout", **base,
                               detail=f"the backend did not return the probe log-probs within {deadline_s:g} s{why}")
    if "error" in box:
        e = box["error"]
        return SwapCheckResult(ok=False, reason="error", **base, detail=f"{type(e).__name__}: {e}")
    served, served_version = box["answer"]
    if served_version != version:
        return SwapCheckResult(ok=False, reason="wrong_version", **base,
                               detail=f"the backend reports version {served_version}, expected {version}")
    if len(served) != len(expected):
        return SwapCheckResult(ok=False, reason="error", **base,
                               detail=f"{len(served)} probe log-probs came back, expected {len(expected)}")
    mean, worst = _mean_abs(served, expected)
    to_prev, gap = float("nan"), float("nan")
    if previous is not None:
        to_prev, _ = _mean_abs(served, previous)
        gap, _ = _mean_abs(expected, previous)
    base.update(mean_abs_diff=mean, max_abs_diff=worst, diff_to_previous=to_prev)
    if not mean <= tolerance:  # NaN fails too
        return SwapCheckResult(ok=False, reason="mismatch", **base,
                               detail=f"mean |dlogp| {mean:.3g} per probe token > tolerance {tolerance:.1e} "
                                      f"(max {worst:.3g})")
    if previous is not None and gap > tolerance / 10 and to_prev < mean:
        return SwapCheckResult(ok=False, reason="stale", **base,
                               detail=f"served log-probs are closer to the previous version ({to_prev:.3g}) "
                                      f"than to version {version} ({mean:.3g})")
    return SwapCheckResult(ok=True, reason="ok", **base)


def _is_timeout(e: BaseException) -> bool:
    import socket

    return isinstance(e, (TimeoutError, socket.timeout)) or isinstance(getattr(e, "reason", None), TimeoutError)


@dataclass
class SwapChecker:
    """Checks each swap against the learner and remembers the last good probe log-probs.

    The call site in the promote step is two lines::

        checker.require(backend, learner_model, version, log_event)  # raises SwapCheckError
        # ... only now mark the version promoted

    Attributes:
        probe: the probe token ids (:func:`probe_ids`).
        tolerance: see :data:`TOLERANCE` (:func:`tolerance_for` the learner's dtype).
        deadline_s: seconds the backend has to answer.
        last: the probe log-probs of the last version that passed (for the stale test).
    """

    probe: list[int]
    tolerance: float = TOLERANCE["float32"]
    deadline_s: float = 30.0
    last: list[float] | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: SwapCheckConfig, tokenizer, dtype: str) -> "SwapChecker":
        """A checker for a learner whose base weights are ``dtype`` (``float32`` or ``bfloat16``).

        Raises:
            ValueError: invalid settings, or a dtype with no default tolerance.
        """
        cfg.validate()
        tol = cfg.tolerance if cfg.tolerance is not None else tolerance_for(dtype)
        return cls(probe_ids(tokenizer, cfg.probe_tokens), tol, cfg.deadline_s)

    def check(self, backend: ProbeScorer, model, version: int) -> SwapCheckResult:
        """Run :func:`check_swap` for ``version`` against ``model``'s current weights; a pass
        becomes the reference of the next stale test."""
        from selfrl.rl.logprobs import sequence_logprobs  # torch, only when a check runs

        expected = sequence_logprobs(model, self.probe)
        res = check_swap(backend, expected, self.probe, version, self.tolerance, self.deadline_s, self.last)
        if res.ok:
            self.last = expected
        return res

    def require(self, backend: ProbeScorer, model, version: int,
                log_event: Callable[[str, str, dict], None] | None = None) -> SwapCheckResult:
        """:meth:`check`, logging a ``swap_check`` event (pass) or ``swap_check_failed`` (failure)
        through ``log_event(kind, message, data)``.

        Raises:
            SwapCheckError: the check failed; the version must not be promoted.
        """
        res = self.check(backend, model, version)
        if log_event is not None:
            log_event("swap_check" if res.ok else "swap_check_failed", res.message, res.to_dict())
        if not res.ok:
            raise SwapCheckError(res)
        return res


def swap_within(engine, adapter, version: int, deadline_s: float, tolerance: float) -> SwapCheckResult | None:
    """``engine.swap(adapter, version)`` given ``deadline_s`` seconds; None when it was acknowledged
    in time, else a failed :class:`SwapCheckResult` (``timeout``, or ``error`` with the sampler's reason).
    A swap still under way at the deadline is left to its daemon thread, which the exit joins
    (at most :data:`selfrl.core.threads_at_exit.JOIN_TIMEOUT_S`)."""
    t0, box = time.monotonic(), {}

    def call() -> None:
        try:
            engine.swap(adapter, version)
        except Exception as e:  # reported as the result's reason, never swallowed
            box["error"] = e

    worker = threading.Thread(target=call, daemon=True, name=f"sampler-swap-v{version}")
    join_at_exit(worker)  # an in-process sampler loads in torch: one past the deadline is joined (bounded) at exit
    worker.start()
    worker.join(timeout=deadline_s)
    base = dict(version=version, ok=False, tolerance=tolerance, seconds=time.monotonic() - t0)
    if worker.is_alive() or isinstance(box.get("error"), TimeoutError):
        return SwapCheckResult(reason="timeout", **base,
                               detail=f"the sampler did not acknowledge the swap within {deadline_s:g} s")
    if "error" in box:
        e = box["error"]
        return SwapCheckResult(reason="error", **base, detail=f"the swap failed: {type(e).__name__}: {e}")
    return None


def checked_swap(engine, adapter, version: int, checker: "SwapChecker | None", model) -> SwapCheckResult | None:
    """Swap ``adapter`` into ``engine`` as ``version`` within the check's deadline, then prove it with
    ``checker`` against ``model`` (holding ``version``'s weights): the one way both ``selfrl run``
    (:class:`selfrl.run.sampler_sync.SamplerSync`) and ``selfrl serve`` (:mod:`selfrl.serve.remote`)
    put a version into a separate sampler.

    Returns:
        The check's result, passed or failed (a swap that failed or timed out is a failed result);
        None when ``checker`` is None (checks off: the swap is trusted and any error raised).
    """
    if checker is None:
        engine.swap(adapter, version)
        return None
    failed = swap_within(engine, adapter, version, checker.deadline_s, checker.tolerance)
    return failed or checker.check(engine, model, version)


def record_check(ledger, res: SwapCheckResult, stage: str) -> None:
    """Record ``res`` in ``ledger`` (a :class:`selfrl.record.versions.Ledger`) as a ``swap_check`` or
    ``swap_check_failed`` event, its numbers and ``stage`` in the data."""
    from selfrl.record.versions import EventKind

    kind = EventKind.SWAP_CHECK if res.ok else EventKind.SWAP_CHECK_FAILED
    ledger.event(kind, f"{stage}: {res.message}", {**res.to_dict(), "stage": stage})
