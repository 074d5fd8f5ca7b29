"""The server's health: whether its run directory can be written, and whether its learner
learns. ``GET /health`` answers from :func:`health`.

**Storage.** Every storage fault the server meets (a request, a feedback, the learner:
disk full, quota spent, store locked, ...; :mod:`selfrl.record.storage_errors`) is reported to
one :class:`StorageWatch`, which also reads ``statvfs`` before each request and health
check (a file system mounted read-only, or with less than ``probe_bytes`` free, is a fault
before any write meets it). While it holds a fault, requests that would record are
refused up front with the fault's 507/503 (no generation is spent on a turn that cannot
be stored), and at most once every ``probe_every_s`` a probe write
(:func:`selfrl.record.storage_errors.probe_writable`) checks whether the run directory is
writable again; the first that succeeds clears the fault. A log line (``selfrl.serve``,
WARNING) marks where a fault begins and where it ends.

**Health** (``GET /health``). Every time field (``since``, ``paused_until``, ``next_step_back_at``) is
seconds since the epoch on the server's clock, for machines, with a ``<field>_utc`` beside it: the
same time as UTC ISO 8601 (``2026-12-04T12:18:08Z``), for people (:func:`with_utc`).

* healthy: 200 ``{"status": "ok", "served_version": N}``;
* while the learner backs off after a collapse, also ``"backoff"``: the collapse budget's state
  (:meth:`selfrl.run.cycle.UpdateCycle.backoff`: ``backing_off``, ``level``, the current
  ``learning_rate`` and ``beta``, ``paused_until`` of a cool-down, ``next_step_back_at``, ...); backing off or pausing
  is not a fault: the answer stays 200 ``ok`` and requests are served as usual;
* while candidates wait for the gate (``gate.eval_every`` > 1, :mod:`selfrl.serve.chain`), also
  ``"chained"``: ``{"versions", "eval_every", "message": "chained: 1 of 2 before the gate"}``
  (none of them is served);
* degraded: ``{"status": "degraded", "served_version": N, "reasons": [{"code", "message"}]}``,
  with HTTP 503 and ``Retry-After`` while a storage fault lasts (a request that records
  would be refused: a load balancer should send traffic elsewhere), and HTTP 200 when
  only the learner is affected (``learner_paused``: it waits for storage and resumes by
  itself; ``learner_stopped``: it stopped on an error, or once ``collapse.max_rollbacks``,
  when set, is exceeded; requests are served and recorded either way), and when a version failed its swap check on
  the vLLM server (``swap_check_failed``: the version before it is served; ``selfrl.serve.remote``);
  HTTP 503 when the vLLM server does not answer (``sampler_unreachable``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from selfrl.record.storage_errors import (
    PROBE_BYTES,
    StorageFault,
    StorageFaultError,
    classify,
    free_space_error,
    probe_writable,
)

log = logging.getLogger("selfrl.serve")
WHERE = "the server's run directory"  # how clients are told where: the path itself goes to the log only
BACKOFF_TIMES = ("paused_until", "next_step_back_at")  # the collapse budget's times (server clock seconds)


def utc(t: float | None) -> str | None:
    """``t`` (seconds since the epoch, as the server's clock gives them) as UTC ISO 8601 to the
    second; None stays None.

    >>> utc(1796386688.25), utc(None)
    ('2026-12-04T12:18:08Z', None)
    """
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def with_utc(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``d`` with ``<key>_utc`` (:func:`utc`) beside each of ``keys`` it holds: every time field of
    ``/health`` and ``/admin/status`` is the epoch float, for machines, and its UTC ISO 8601 text."""
    out = dict(d)
    for k in keys:
        if k in d:
            out[f"{k}_utc"] = utc(d[k])
    return out


class StorageWatch:
    """The run directory's storage as the server last found it (thread-safe).

    Args:
        run_dir: the run directory (faults name it; probes write into it).
        probe_every_s: least seconds between two probes while a fault lasts.
        probe_bytes: bytes a probe writes.
    """

    def __init__(self, run_dir: str | Path, probe_every_s: float = 1.0, probe_bytes: int = PROBE_BYTES):
        self.run_dir, self.probe_every_s, self.probe_bytes = Path(run_dir), probe_every_s, probe_bytes
        self._lock = threading.Lock()
        self._fault: StorageFault | None = None
        self._since = 0.0  # time.time() when the fault began
        self._probed = 0.0  # time.monotonic() of the last probe or fault

    def failed(self, e: BaseException) -> StorageFault | None:
        """Record ``e`` when it is a storage fault (:func:`selfrl.record.storage_errors.classify`) and
        return the fault; None for any other exception (nothing recorded)."""
        fault = classify(e, WHERE)
        if fault is None:
            return None
        with self._lock:
            if self._fault is None:
                self._since = time.time()
            if self._fault is None or self._fault.kind != fault.kind:
                log.warning("storage fault (%s) in %s: %s [%s]", fault.kind.value, self.run_dir,
                            fault.message, fault.detail)
            self._fault, self._probed = fault, time.monotonic()
        return fault

    def current(self) -> StorageFault | None:
        """The fault that lasts, or None; while one is held, a probe (at most every
        ``probe_every_s``) clears it when the run directory is writable again. Without one,
        ``statvfs`` is read (:func:`selfrl.record.storage_errors.free_space_error`)."""
        if self._fault is None:
            seen = free_space_error(self.run_dir, self.probe_bytes)
            return None if seen is None else self.failed(seen)
        with self._lock:
            if self._fault is None or time.monotonic() - self._probed < self.probe_every_s:
                return self._fault
            self._probed = time.monotonic()
            try:
                probe_writable(self.run_dir, self.probe_bytes)
            except OSError as e:
                self._fault = classify(e, WHERE) or self._fault
                return self._fault
            log.warning("storage writable again after %.0f s (%s): %s", time.time() - self._since,
                        self._fault.kind.value, self.run_dir)
            self._fault = None
            return None

    def check(self) -> None:
        """Raise :class:`selfrl.record.storage_errors.StorageFaultError` while a fault lasts."""
        fault = self.current()
        if fault is not None:
            raise StorageFaultError(fault)

    @property
    def since(self) -> float | None:
        """``time.time()`` when the current fault began, or None."""
        return self._since if self._fault is not None else None


def health(service) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(HTTP status, body, headers)`` of ``GET /health`` for ``service`` (see the module docstring)."""
    reasons: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    status = 200
    fault = service.storage.current()
    if fault is not None:
        reasons.append(with_utc({"code": fault.kind.value, "message": f"the server cannot record requests: "
                                 f"{fault.message}", "since": service.storage.since}, ("since",)))
        status, headers = 503, {"Retry-After": str(fault.retry_after_s)}
    learner = service.learner
    if learner is not None and learner.paused is not None:
        reasons.append(with_utc({"code": "learner_paused", "message": f"the learner is paused "
                                 f"({learner.paused.kind.value}) and resumes by itself once the run directory can be "
                                 "written", "since": learner.paused_since}, ("since",)))
    elif learner is not None and learner.error is not None:
        reasons.append({"code": "learner_stopped", "message": "the learner stopped (GET /admin/status and the "
                        "server log say why); requests are served and recorded, nothing is learned until the "
                        "cause is removed and the server restarted (a stop by collapse.max_rollbacks "
                        "recurs on restart: unset it or raise it)"})
    failed = getattr(service.engine, "failed", None)  # a remote sampler's swap check (selfrl.serve.remote)
    if failed is not None:
        reasons.append({"code": "swap_check_failed", "message": f"{failed.message}; requests are served by version "
                        f"{service.engine.version}, the last version that passed"})
    if getattr(service.engine, "checks_swaps", False) and not (h := service.engine.health()).ok:
        reasons.append({"code": "sampler_unreachable", "message": f"the vLLM server does not answer: {h.detail}"})
        status = 503
    body: dict[str, Any] = {"status": "degraded" if reasons else "ok", "served_version": service.engine.version}
    backoff = learner.cycle.backoff() if learner is not None else None
    if backoff and (backoff["backing_off"] or backoff["paused_until"] is not None or backoff["stopped"]):
        body["backoff"] = with_utc(backoff, BACKOFF_TIMES)  # off its configured setting (serving goes on as usual)
    if learner is not None and (chained := learner.chain.status()) is not None:
        body["chained"] = chained  # candidates trained on, not validated yet (gate.eval_every), none served
    if reasons:
        body["reasons"] = reasons
    return status, body, headers
