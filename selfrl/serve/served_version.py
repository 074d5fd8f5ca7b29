"""Which adapter version ``selfrl serve`` serves, and every way that changes.

``engine.version`` is the version being served. :meth:`ServedVersion.restore` serves the
champion (or the pinned version) when the server starts; a promoted candidate is swapped in
by :meth:`ServedVersion.publish` (in place, under the engine lock, so between two batches)
unless a version is pinned; an admin pins, unpins or rolls back (one at a time, each whole:
the ``admin`` lock); a request that names ``<served_model_name>@v<N>`` runs on version N,
swapped in for its batch and back out after (:meth:`ServedVersion.run_on_version`). A
replica (``selfrl.serve.replica``) restores read-only and refuses the admin's changes.

The promotion itself is the version ledger's (:meth:`selfrl.record.versions.Ledger.judge`);
this module only decides what the engine serves.

With a sampler that checks its swaps (vLLM: :class:`selfrl.serve.remote.CheckedSampler`) every
change is proved by the swap check, the start version included; one that fails leaves the
previous version served: a promotion is recorded as not served, a pin, unpin or rollback is
answered 502 ``swap_check_failed`` (the rollback stays recorded in the ledger), and ``GET /health``
says degraded until a later check passes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfrl.record import adapters
from selfrl.record.adapters import lora_state
from selfrl.core.atomic import write_atomic
from selfrl.record.versions import Champion, EventKind, Ledger
from selfrl.safety.swap_check import SwapCheckError
from selfrl.serve.errors import ApiError


class ServedVersion:
    """The served version of one server: its engine's weights, the pin, the admin's changes.

    Args:
        engine: the sampling engine; ``engine.version`` is the served version.
        ledger: the run's version ledger (the stored versions, their status, the champion).
        run_dir: the run directory (``pinned.json`` keeps a pin across restarts).
        replica: a replica of another server's run directory: it never pins, unpins or rolls
            back (409), and never writes a version.

    Attributes:
        pinned: the pinned version, or None.
        admin: the lock that serialises pin, unpin, rollback and publish.
        swap_seconds: how long each of the last :attr:`SWAPS_KEPT` published swaps took (s), oldest first.
        on_rollback: called with the champion after an admin rollback, under the admin lock
            (the background learner's ``reset_to``), or None.

    The LoRA tensors of the versions used last are kept in memory, at most
    :attr:`STATES_KEPT` of them (one version of the embedded model's default LoRA is about
    20 MB); an older one is read from its folder again when asked for. Kept without a bound,
    a server that promotes a version every few minutes grew by one state per version.
    """

    STATES_KEPT = 4  # LoRA states kept in memory: the served one, the champion and a few recent ones
    SWAPS_KEPT = 10  # swap times kept (the status shows them; one a version would grow for as long as it serves)

    def __init__(self, engine, ledger: Ledger, run_dir: Path, replica: bool = False):
        self.engine, self.ledger, self.run_dir, self.replica = engine, ledger, Path(run_dir), replica
        self.pinned: int | None = None
        self.admin = threading.Lock()  # pin, unpin, rollback and publish: one at a time, each whole
        self.swap_seconds: list[float] = []
        self.on_rollback: Callable[[Champion], None] | None = None
        self._states: OrderedDict[int, Any] = OrderedDict()  # version -> its LoRA tensors, least recently used first
        self._states_lock = threading.Lock()  # request threads read it while the learner publishes

    @property
    def served(self) -> int:
        """The version the engine serves now."""
        return self.engine.version

    @property
    def checked(self) -> bool:
        """True when the engine proves each swap (a remote sampler): it takes the stage, and the start version."""
        return getattr(self.engine, "checks_swaps", False)

    def _swap(self, state, version: int, stage: str) -> float:
        """``engine.swap``; a checking engine is told the stage (the event's name).

        Raises:
            SwapCheckError: the check failed; the previous version is still served.
        """
        if self.checked:
            return self.engine.swap(state, version, stage=stage)
        return self.engine.swap(state, version)

    def _failed(self, e: SwapCheckError, what: str, param: str | None = "version") -> ApiError:
        """The 502 an admin gets when ``what`` failed its swap check (``param``: the body's field that
        named the version, None for ``/admin/unpin``, which names none)."""
        return ApiError(502, f"{what}: {e}; still serving version {self.served} (GET /health says why)", param,
                        "swap_check_failed", type_="server_error")

    def restore(self) -> None:
        """Record (or repair) the base version, move aside what a killed save left, and serve
        the latest complete promoted version (the champion) or the pinned one, as ``run`` does."""
        self.ledger.recover_strays()
        self.ledger.ensure_base(self.engine.model)
        best = self.ledger.latest_servable()
        if best.version != 0 or self.checked:  # a remote sampler proves the base it serves too
            self._swap(self.state_of(best.version), best.version, "start")
        self.ledger.set_champion(best.version, lora_state(self.engine.model))
        pin = self.run_dir / "pinned.json"
        if pin.exists():  # a pin outlives a restart
            version = json.loads(pin.read_text())["version"]
            try:
                self.check_servable(version, "version")
                self._swap(self.state_of(version), version, "restart-pin")
                self.pinned = version
            except SwapCheckError as e:  # the pin is kept; the champion serves until it passes (pin it again)
                self.event(EventKind.PIN, f"restart: the pinned version {version} is not served: {e}; serving "
                           f"version {best.version}, pin kept")
            except ApiError as e:
                if version in self.ledger.missing:  # its folder may come back: the pin is kept, not served now
                    self.event(EventKind.PIN, f"restart: the pinned version {version} is not served: "
                               f"{self.ledger.missing[version]}; serving version {best.version}, pin kept")
                    return
                self.event(EventKind.UNPIN, f"restart: the pinned version cannot be served ({e.message}); unpinned")
                pin.unlink()

    def restore_replica(self) -> None:
        """A replica serves the owner's newest servable version; it never writes a version.

        Raises:
            selfrl.serve.replica.NoOwner: the owner has not recorded a base version yet.
        """
        from selfrl.serve.replica import NoOwner, newest_servable

        best = newest_servable(self.ledger) if self.ledger.get(0) is not None else None
        if best is None:
            raise NoOwner(f"{self.run_dir} has no servable version to follow: start its owner (selfrl serve "
                          "without --replica) on it first")
        if best.version != 0:
            self.engine.swap(self.state_of(best.version), best.version)

    def owner_only(self, action: str) -> None:
        """Raise ApiError 409 on a replica: pins and rollbacks belong to the run directory's owner."""
        if self.replica:
            raise ApiError(409, f"this server is a replica of the run directory {self.run_dir}; {action} on the "
                           "server that owns it (it holds the learner and the versions)", code="replica")

    def state_of(self, version: int, param: str | None = "model"):
        """The LoRA tensors of a stored version (the last few used kept in memory); ``param``: the
        request field that named the version, which an error names (``model`` for ``selfrl@vN``,
        ``version`` for the admin routes, None when the server chose it).

        Raises:
            ApiError: 404 when the version does not exist or was never saved; 409 when its
                folder is not complete, or was pruned by retention.
        """
        with self._states_lock:
            state = self._states.get(version)
            if state is not None:
                self._states.move_to_end(version)
                return state
        rec = self.ledger.get(version)
        if rec is not None and rec.metrics.get("pruned"):  # never served or rolled back to again
            raise ApiError(409, f"adapter version {version} was pruned by retention "
                           f"({rec.metrics.get('pruned_to')}); GET /v1/models lists the versions kept",
                           param, "version_pruned")
        try:
            state = self.ledger.load_state(version)
        except KeyError:
            raise ApiError(404, f"adapter version {version} does not exist", param, "model_not_found") from None
        except (adapters.CorruptVersionError, FileNotFoundError) as e:
            raise ApiError(409, f"adapter version {version} cannot be served: {e}", param,
                           "version_incomplete") from e
        self._keep(version, state)
        return state

    def _keep(self, version: int, state) -> None:
        """Keep ``state`` as ``version``'s, the most recently used; drop the least recently used
        beyond :attr:`STATES_KEPT` (read again from its folder when asked for)."""
        with self._states_lock:
            self._states[version] = state
            self._states.move_to_end(version)
            while len(self._states) > self.STATES_KEPT:
                self._states.popitem(last=False)

    def check_servable(self, version: int, param: str = "model") -> None:
        """Raise ApiError (naming ``param``) unless ``version`` is the base or a promoted version with a
        complete folder."""
        rec = self.ledger.get(version)
        if rec is None:
            raise ApiError(404, f"adapter version {version} does not exist", param, "model_not_found")
        if not rec.servable:
            raise ApiError(409, f"adapter version {version} cannot be served: it is {rec.status.value}; only the "
                           "base and promoted versions are served", param, "version_not_servable")
        self.state_of(version, param)

    def version_ids(self) -> list[dict[str, Any]]:
        """The servable versions as dicts: version, status, created_at, metrics (a version whose
        folder is missing is not served, so not listed: :meth:`selfrl.record.versions.Ledger.servable`)."""
        return [{"version": v.version, "status": v.status.value, "created_at": v.created_at, "metrics": v.metrics}
                for v in self.ledger.servable()]

    def run_on_version(self, version: int, fn):
        """Run ``fn()`` with ``version`` swapped in, then swap the served version back.

        Raises:
            RuntimeError: the engine is a remote sampler, which serves one version at a time (its
                requests for another version are refused with a 400 before they get here).
        """
        if self.checked:
            raise RuntimeError(f"version {version} is no longer served (now {self.served}); the remote sampler "
                               "serves one version at a time")
        state = self.state_of(version)
        with self.engine.lock:
            served, served_state = self.engine.version, lora_state(self.engine.model)
            self.engine.swap(state, version)
            try:
                return fn()
            finally:
                self.engine.swap(served_state, served)

    def publish(self, version: int, state, reason: str) -> float | None:
        """Serve ``version`` now, unless a version is pinned or an admin rolled it back
        meanwhile (it is no longer servable); returns the swap seconds."""
        with self.admin:
            self._keep(version, {k: v.clone() for k, v in state.items()})
            rec = self.ledger.get(version)
            if rec is None or not rec.servable:
                status = "unknown" if rec is None else rec.status.value
                self.event(EventKind.SWAP, f"version {version} {reason}; not served: it is {status} now",
                           {"version": version, "served": False})
                return None
            if self.pinned is not None:
                self.event(EventKind.SWAP, f"version {version} {reason}; not served: version {self.pinned} is pinned",
                           {"version": version, "served": False})
                return None
            try:
                seconds = self._swap(state, version, "promote")
            except SwapCheckError as e:  # the sampler keeps the version before: said, never silent
                self.event(EventKind.SWAP, f"version {version} {reason}; not served: {e}",
                           {"version": version, "served": False, "swap_check": e.result.reason})
                return None
            self.swap_seconds.append(seconds)
            del self.swap_seconds[:-self.SWAPS_KEPT]
            self.event(EventKind.SWAP, f"serving version {version} ({reason}); swap took {seconds * 1000:.1f} ms",
                       {"version": version, "swap_s": seconds})
            return seconds

    def pin(self, version: int) -> None:
        """Serve ``version`` and keep it until :meth:`unpin`, across restarts (promotions are
        recorded, not served). Serialised with the other admin operations; the pin file is
        written before the swap, so a failure leaves the served version as it was."""
        self.owner_only("pin")
        with self.admin:
            self.check_servable(version, "version")
            state = self.state_of(version, "version")
            pin = self.run_dir / "pinned.json"
            before = pin.read_text() if pin.exists() else None
            write_atomic(pin, json.dumps({"version": version}))
            try:
                self._swap(state, version, "pin")
            except SwapCheckError as e:
                write_atomic(pin, before) if before is not None else pin.unlink(missing_ok=True)
                raise self._failed(e, f"pinning version {version}") from e
            self.pinned = version
            self.event(EventKind.PIN, f"version {version} pinned")

    def unpin(self) -> None:
        self.owner_only("unpin")
        with self.admin:
            best = self.ledger.latest_servable()
            state = self.state_of(best.version, None)
            try:
                self._swap(state, best.version, "unpin")
            except SwapCheckError as e:  # still pinned
                raise self._failed(e, f"unpinning (to serve version {best.version})", None) from e
            (self.run_dir / "pinned.json").unlink(missing_ok=True)
            self.pinned = None
            self.event(EventKind.UNPIN, f"unpinned; serving the latest promoted version {best.version}")

    def rollback(self, version: int) -> None:
        """Serve ``version`` again, mark the promoted versions after it rolled back, and
        restart the learner from it. A version that was rolled back earlier is promoted again.
        The rollback sticks: a candidate the learner is training from a rolled-back parent is
        rejected at its gate (``Ledger.judge``), and the learner continues from ``version``."""
        self.owner_only("roll back")
        with self.admin:
            self.state_of(version, "version")  # 404 / 409 before anything changes
            try:
                self.ledger.roll_back_to(version)
            except KeyError:
                raise ApiError(404, f"adapter version {version} does not exist", "version",
                               "model_not_found") from None
            except ValueError as e:
                raise ApiError(409, str(e), "version", "version_not_servable") from None
            (self.run_dir / "pinned.json").unlink(missing_ok=True)
            self.pinned = None
            champ = self.ledger.champion
            try:
                self._swap(champ.state, version, "rollback")
            except SwapCheckError as e:  # the ledger holds the rollback; the learner follows it all the same
                if self.on_rollback is not None:
                    self.on_rollback(champ)
                raise self._failed(e, f"rolled back to version {version} in the ledger, but serving it") from e
            if self.on_rollback is not None:
                self.on_rollback(champ)  # the learner's reset_to: applied before its next update

    def event(self, kind: EventKind, message: str, data: dict | None = None) -> None:
        self.ledger.event(kind, message, data)
