"""Serve replicas: several ``selfrl serve`` processes on one machine share one learner.

One process *owns* the run directory: it holds the run lock (``selfrl.record.runlock``), runs
the background learner and writes the adapter versions. Any number of *replicas*
(``selfrl serve --replica``, same ``run_dir``) serve traffic beside it, with the least
machinery we could find: nothing but the run directory is shared.

* **Trajectories**: a replica records every turn (and the feedback on it) in the same
  SQLite store, opened in WAL mode, as the owner does; the owner's learner takes every
  pending turn of the store, whoever served it (``selfrl.record.served.ready``). So a
  replica's traffic trains the one learner, and a turn is trained once.
* **Versions**: a replica follows the version ledger. Every ``follow_s`` seconds
  :class:`Follower` reads the newest servable version (the base or the latest promoted
  one whose folder verifies) and swaps it in, as the owner's ``publish`` does (between
  two batches, under the engine lock). A rollback on the owner marks later versions
  ``rolled_back``, so replicas follow it back too. A response names the version that
  served it (``adapter_version``, ``system_fingerprint``), on a replica as on the owner.
* **What a replica never does**: train, validate, save or mark versions, move stray
  folders aside (the owner may be mid-save), pin, unpin or roll back (those are the
  owner's, refused on a replica with HTTP 409). A replica needs the owner to have
  recorded the base version first, and refuses to start otherwise.

Not done: replicas on other machines (they would need the store on a shared disk that
SQLite locking trusts, which network file systems often are not; Ray's object store
would be the next step, as ``selfrl run --ray`` does for rollouts).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from selfrl.record import adapters
from selfrl.record.versions import Ledger, VersionRecord


class NoOwner(ValueError):
    """A replica was started on a run directory whose owner never recorded a base version."""


AGE_SETTINGS = ("max_feedback_age_versions", "max_feedback_age_s", "feedback_tis_cap")  # [learner]'s age rule


def check_owner_age_rule(learner, runs: list[dict[str, Any]], run_dir: str | Path) -> None:
    """Refuse a replica whose ``[learner]`` age rule (:data:`AGE_SETTINGS`), or its
    ``learn_from_corrections``, is not its owner's.

    A replica answers ``POST /v1/feedback`` on its turns by the age rule, and leaves a turn it
    finds ``too_old`` out for good (``skipped``); the owner's learner trains them, so the rule
    must be the owner's: with another one, a turn the owner would train could be left out, or
    one it will expire be answered ``queued``. The owner's is that of its last start recorded in
    the store (``runs``, oldest first: ``{"config": {"serve": ...}}``); nothing to compare when
    no owner's start recorded it.

    Args:
        learner: this replica's ``[learner]`` (:class:`selfrl.config.serve.LearnerSettings`).

    Raises:
        selfrl.config.ConfigError: a setting differs; the message names each and its owner's value.
    """
    _refuse_differences(_differences({"learner": learner}, runs, [("learner", k) for k in AGE_SETTINGS]),
                        "age rule", run_dir, "a replica answers feedback, and leaves turns too old to train out, by the "
                        "age rule of the owner's learner, which trains its turns",
                        " (or restart the owner with this replica's values)")
    _refuse_differences(_differences({"learner": learner}, runs, [("learner", "learn_from_corrections")]),
                        "use of corrections", run_dir, "a replica's feedback answer says whether a correction trains "
                        "as a demonstration, and the owner's learner, which trains its turns, decides",
                        " (or restart the owner with this replica's value)")


OWNER_SETTINGS = (("model", "name"), ("lora", "r"), ("lora", "lora_alpha"), ("lora", "target_modules"),
                  ("lora", "init_adapter"))  # what a replica's model and adapters must share with its owner's


def check_owner_model(cfg, runs: list[dict[str, Any]], run_dir: str | Path) -> None:
    """Refuse a replica whose model or LoRA shape (:data:`OWNER_SETTINGS`) is not its owner's.

    A replica records its turns' token ids in the owner's store, and the owner's learner trains
    on them with its own model and tokenizer; it also loads the owner's adapter versions. With
    another model the ids are another tokenizer's, and with another LoRA shape the versions do not
    fit. The owner's settings are those of its last start recorded in ``runs`` (as in
    :func:`check_owner_age_rule`); nothing to compare when none is recorded.

    Args:
        cfg: this replica's :class:`selfrl.config.serve.ServeConfig`.

    Raises:
        selfrl.config.ConfigError: a setting differs; the message names each and its owner's value.
    """
    _refuse_differences(_differences({"model": cfg.model, "lora": cfg.lora}, runs, OWNER_SETTINGS), "model", run_dir,
                        "the owner's learner trains on the token ids a replica records and a replica serves the "
                        "owner's adapter versions, so both must be the owner's")


def _differences(mine: dict[str, Any], runs: list[dict[str, Any]],
                 keys: Iterable[tuple[str, str]]) -> list[tuple[str, Any, Any]]:
    """``(section.key, this replica's value, the owner's)`` for each of ``keys`` whose values differ;
    ``mine`` maps a section's name to this replica's settings of it. The owner's values are those of
    its last start recorded in ``runs`` (serve configs of replicas skipped); a key it did not record
    is not compared."""
    owner = next((c for c in (r["config"].get("serve") for r in reversed(runs))
                  if isinstance(c, dict) and not c.get("replica")), None) or {}
    out = []
    for section, key in keys:
        theirs, value = owner.get(section) or {}, getattr(mine[section], key)
        if key in theirs and _plain(theirs[key]) != _plain(value):
            out.append((f"{section}.{key}", value, theirs[key]))
    return out


def _refuse_differences(differ: list[tuple[str, Any, Any]], what: str, run_dir: str | Path, why: str,
                        alternative: str = "") -> None:
    """Raise the replica's refusal naming each of ``differ`` (see :func:`_differences`); nothing when empty.

    Raises:
        selfrl.config.ConfigError: ``differ`` is not empty.
    """
    from selfrl.config.base import ConfigError

    if differ:
        here = ", ".join(f"{k} = {mine!r} here, {theirs!r} there" for k, mine, theirs in differ)
        fix = ", ".join(f"{k} = {theirs!r}" for k, _, theirs in differ)
        raise ConfigError(f"this replica's {what} is not its owner's (the last start of selfrl serve on {run_dir}): "
                          f"{here}; {why}: set {fix} in this replica's config{alternative}")


def _plain(value: Any) -> Any:
    """A setting as compared: lists and tuples alike (the store holds JSON)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def no_owner(run_dir: str | Path) -> NoOwner:
    """The refusal of a replica on ``run_dir``, which holds no store: its owner never served it."""
    return NoOwner(f"{run_dir} has no servable version to follow: start its owner (selfrl serve "
                   "without --replica) on it first")


def newest_servable(ledger: Ledger) -> VersionRecord | None:
    """The newest base or promoted version whose folder verifies, read only (a replica never
    marks a version, unlike :meth:`selfrl.record.versions.Ledger.latest_servable`); None when none is."""
    for rec in reversed(ledger.all()):
        if rec.servable and rec.path and adapters.verify_version(Path(rec.path)) is None:
            return rec
    return None


class Publisher(Protocol):
    """What a follower needs of the server it feeds: the version served, and ``publish``
    (:class:`selfrl.serve.served_version.ServedVersion` is one)."""

    @property
    def served(self) -> int:
        """The version the engine serves now."""
        ...

    def publish(self, version: int, state: dict[str, Any], reason: str) -> float | None:
        """Serve ``version`` (its LoRA tensors ``state``) unless that is refused; the swap seconds, or None."""
        ...


class Follower(threading.Thread):
    """Swaps each version the owner promotes into a replica's engine (see the module docstring).

    Args:
        ledger: the run directory's version ledger, read only.
        publisher: the replica's served version (:class:`Publisher`).
        every_s: seconds between two looks at the ledger.
    """

    def __init__(self, ledger: Ledger, publisher: Publisher, every_s: float):
        super().__init__(name="selfrl-follower", daemon=True)
        self.ledger, self.publisher, self.every_s = ledger, publisher, every_s
        self._halt = threading.Event()
        self.swaps = 0
        self.error: str | None = None

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.follow()
            except Exception as e:  # keep serving the version we hold; the failure is visible in status
                self.error = f"{type(e).__name__}: {e}"

    def follow(self) -> int | None:
        """Serve the owner's newest servable version if it is not the one served; returns it
        when it was swapped in, else None."""
        rec = newest_servable(self.ledger)
        if rec is None or rec.version == self.publisher.served:
            return None
        state = self.ledger.load_state(rec.version)
        if self.publisher.publish(rec.version, state, "followed the owner's ledger") is None:
            return None
        self.swaps += 1
        self.error = None
        return rec.version

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=60)
