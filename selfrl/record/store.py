"""The run's record: one SQLite file holding tasks, trajectories, adapter versions,
metrics, events and held-out evaluations.

Every write runs inside one transaction (``with self.conn:``), so a crash or an
exception in the middle of a write leaves nothing half-written: a list of
trajectories is stored whole or not at all. The database runs in WAL mode with
``synchronous=NORMAL`` (a reader, such as a dashboard, never blocks the writer;
a power cut may lose the last commits but never corrupts the file) and with
foreign keys enforced.

JSON columns are written with ``json.dumps(allow_nan=False)`` after NaN and
infinities have been replaced by ``None``; REAL columns get NULL for them too.
So a non-finite value is stored as "unknown", never as a crash or as invalid JSON.

A run directory is self-contained and can be moved: an adapter version's folder is stored
relative to the store's own folder (``adapters/v000003``) and read back resolved against
where the store is now (:func:`resolve_version_path`). Rows that older versions of selfrl
wrote (the folder as given: absolute, or relative to the working directory) are read the
same way when they follow the layout ``.../adapters/v<N>``, and a writable store rewrites
them to the relative form when it opens.
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from selfrl.record.rundir import resolve_version_path, run_relative, storable_path
from selfrl.core.trajectory import Trajectory

SPLITS = ("train", "val")


class NotAStore(ValueError):
    """``selfrl.db`` exists but is not a selfrl store: not SQLite, damaged, or without a ``runs`` table."""

    def __init__(self, path: Path):
        super().__init__(f"{path} is not a selfrl store (not SQLite, or damaged / no runs table): give a run "
                         "directory made by selfrl run/serve, or restore it from a backup")
        self.path = path
VERSION_STATUSES = ("candidate", "promoted", "rejected", "rolled_back", "base")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at  REAL NOT NULL,
    config_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    id            TEXT PRIMARY KEY,
    source        TEXT,
    split         TEXT NOT NULL CHECK (split IN ('train', 'val')),
    question      TEXT NOT NULL,
    answer        TEXT,
    metadata_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS trajectories (
    id                    TEXT PRIMARY KEY,
    run_id                INTEGER NOT NULL REFERENCES runs(id),
    iteration             INTEGER NOT NULL,
    task_id               TEXT NOT NULL,
    group_id              TEXT NOT NULL,
    adapter_version       INTEGER NOT NULL,
    reward                REAL,
    correct               INTEGER,
    error                 TEXT,
    num_completion_tokens INTEGER NOT NULL,
    created_at            REAL NOT NULL,
    data_json             TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS trajectories_run_iter ON trajectories(run_id, iteration);
CREATE TABLE IF NOT EXISTS rewards (
    trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
    name          TEXT NOT NULL,
    value         REAL,
    PRIMARY KEY (trajectory_id, name)
);
CREATE TABLE IF NOT EXISTS adapter_versions (
    version      INTEGER PRIMARY KEY,
    parent       INTEGER REFERENCES adapter_versions(version),
    path         TEXT,
    status       TEXT NOT NULL
                 CHECK (status IN ('candidate', 'promoted', 'rejected', 'rolled_back', 'base')),
    created_at   REAL NOT NULL,
    metrics_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id    INTEGER NOT NULL REFERENCES runs(id),
    step      INTEGER NOT NULL,
    name      TEXT NOT NULL,
    value     REAL,
    wall_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS metrics_run_step ON metrics(run_id, step);
CREATE TABLE IF NOT EXISTS events (
    run_id    INTEGER REFERENCES runs(id),
    time      REAL NOT NULL,
    kind      TEXT NOT NULL,
    message   TEXT NOT NULL,
    data_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS evaluations (
    version INTEGER NOT NULL REFERENCES adapter_versions(version),
    task_id TEXT NOT NULL,
    correct INTEGER NOT NULL,
    answer  TEXT,
    PRIMARY KEY (version, task_id)
);
"""


def finite_or_none(x: Any) -> Any:
    """Replace NaN and +-inf floats by None, recursively through dicts, lists and tuples."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


def to_json(x: Any) -> str:
    """Strict JSON with non-finite floats as null; TypeError for unserializable objects."""
    return json.dumps(finite_or_none(x), allow_nan=False)


def real(x: float | None) -> float | None:
    """A value for a REAL column: float, or None for None / NaN / inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def locked(method):
    """Run a :class:`Store` method under the store's own lock (an ``RLock``: a caller may hold it
    around several calls to make them one)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return call


class Store:
    """SQLite-backed record of one or more runs.

    Usable as a context manager (closes on exit). Every method takes the store's own
    lock (``self.lock``, reentrant), so with ``shared=True`` one ``Store`` serves several
    threads (the server's); hold ``self.lock`` yourself only to make several calls one
    step, or around ``self.conn`` used directly. Without ``shared`` it belongs to the
    thread that opened it.

    About 370 lines, past the 300 we aim for: it is the one place that writes the run's SQLite
    file, a short method per table's read or write, each one transaction under ``self.lock``;
    kept together, every write and the lock it takes are read beside the schema above. What
    is not a table's read or write lives beside it (``selfrl.record.rundir``'s paths, the
    serve tables in ``selfrl.record.served``, the ledger's rules in ``selfrl.record.versions``).

    Args:
        path: database file; created, with its parent folder, if missing. Its folder is the
            run directory that stored version paths are relative to.
        shared: allow use from several threads (serialised by ``self.lock``).
        readonly: open an existing store for reading only (SQLite ``mode=ro``); a
            writer, such as a run in progress, may keep writing meanwhile.

    Raises:
        FileNotFoundError: ``readonly`` and there is no file at ``path``.
        NotAStore: the file at ``path`` is not SQLite or is damaged, or (``readonly``, or a
            non-empty file) has no ``runs`` table.
    """

    def __init__(self, path: str | Path, shared: bool = False, readonly: bool = False):
        self.path = Path(path)
        self.lock = threading.RLock()
        if readonly:  # a report of a run in progress (or of someone else's run) writes nothing
            if not self.path.exists():
                raise FileNotFoundError(f"no store at {self.path}")
            self.conn = self._open_readonly(shared)
            self._check_is_store(self.conn)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existing = self.path.is_file() and self.path.stat().st_size > 0
        self.conn = sqlite3.connect(self.path, check_same_thread=not shared)
        self.conn.row_factory = sqlite3.Row
        if existing:  # a file that is there already must be a store, never be turned into one
            self._check_is_store(self.conn)
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            with self.conn:
                self.conn.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            self.conn.close()
            raise NotAStore(self.path) from e
        self.migrate_version_paths()

    def _check_is_store(self, conn: sqlite3.Connection) -> None:
        """Raise :class:`NotAStore` (closing ``conn``) unless the file is SQLite with a ``runs`` table."""
        try:
            found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone()
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            conn.close()
            raise NotAStore(self.path) from e
        if found is None:
            conn.close()
            raise NotAStore(self.path)

    @property
    def root(self) -> Path:
        """The run directory: the store's folder, which stored version paths are relative to."""
        return self.path.parent

    @locked
    def migrate_version_paths(self) -> int:
        """Rewrite version paths stored by older selfrl (absolute, or relative to the working
        directory) that follow the layout ``.../adapters/v<N>`` to the relative form; returns
        how many rows changed. Reading needs no migration (:func:`resolve_version_path`)."""
        rows = self.conn.execute("SELECT version, path FROM adapter_versions WHERE path IS NOT NULL").fetchall()
        fix = [(rel, r["version"]) for r in rows if (rel := run_relative(r["path"])) not in (None, r["path"])]
        if fix:
            with self.conn:
                self.conn.executemany("UPDATE adapter_versions SET path = ? WHERE version = ?", fix)
        return len(fix)

    def _open_readonly(self, shared: bool) -> sqlite3.Connection:
        """A ``mode=ro`` connection. A process killed inside a write of a store that is not in WAL
        mode yet (its first transaction) leaves a hot journal, which a read-only connection may not
        roll back ("attempt to write a readonly database"); an ordinary connection rolls it back
        once, as SQLite does on any open, and then the store is read."""
        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=not shared)
            conn.row_factory = sqlite3.Row
            return conn

        conn = connect()
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        except sqlite3.DatabaseError as e:
            conn.close()
            if not isinstance(e, sqlite3.OperationalError):  # "file is not a database", a damaged file
                raise NotAStore(self.path) from e
            if "readonly" not in str(e):
                raise
            recover = sqlite3.connect(self.path)
            try:
                recover.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # rolls the hot journal back
            finally:
                recover.close()
            conn = connect()
        return conn

    @locked
    def close(self) -> None:
        """Close the connection (all writes are already committed)."""
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs and tasks -------------------------------------------------------

    @locked
    def start_run(self, config: dict[str, Any]) -> int:
        """Record a new run with its config; return the run id (1, 2, ...)."""
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO runs (created_at, config_json) VALUES (?, ?)", (time.time(), to_json(config))
            )
        return int(cur.lastrowid)

    @locked
    def runs(self) -> list[dict[str, Any]]:
        """Every session recorded in this store, in order: dicts ``{id, created_at, config}``
        (``created_at`` in seconds since the epoch). A resumed run adds a session."""
        rows = self.conn.execute("SELECT id, created_at, config_json FROM runs ORDER BY id")
        return [{"id": r["id"], "created_at": r["created_at"], "config": json.loads(r["config_json"])} for r in rows]

    @locked
    def add_tasks(self, tasks: Iterable[dict[str, Any]], split: str) -> None:
        """Insert or update tasks, all in one transaction.

        Each task is a dict with ``id`` and ``question`` (required), ``answer``
        and ``source`` (optional), and ``metadata`` (optional dict); any other
        keys are folded into the metadata. Re-adding an id overwrites it.

        Raises:
            ValueError: unknown ``split``.
            KeyError: a task without ``id`` or ``question`` (nothing is written).
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        with self.conn:
            for t in tasks:
                meta = dict(t.get("metadata") or {})
                meta.update({k: v for k, v in t.items() if k not in ("id", "question", "answer", "source", "metadata")})
                answer = t.get("answer")
                self.conn.execute(
                    "INSERT OR REPLACE INTO tasks (id, source, split, question, answer, metadata_json)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        str(t["id"]),
                        t.get("source"),
                        split,
                        t["question"],
                        None if answer is None else str(answer),
                        to_json(meta),
                    ),
                )

    @locked
    def task_ids(self, split: str) -> set[str]:
        """Ids of the stored tasks in ``split`` ('train' or 'val')."""
        rows = self.conn.execute("SELECT id FROM tasks WHERE split = ?", (split,))
        return {r["id"] for r in rows}

    # --- trajectories ---------------------------------------------------------

    @locked
    def add_trajectories(self, run_id: int, iteration: int, trajs: Iterable[Trajectory]) -> None:
        """Store a list of trajectories and their reward breakdowns, all or none.

        The full record goes to ``data_json`` (non-finite floats become null);
        the indexed columns and the ``rewards`` rows are derived from it.

        Raises:
            sqlite3.IntegrityError: a duplicate trajectory id or unknown run id.
            TypeError: a trajectory holds something JSON cannot encode.
            In both cases nothing from the list is stored.
        """
        now = time.time()
        with self.conn:
            for t in trajs:
                self.insert_trajectory(run_id, iteration, t, now)

    @locked
    def insert_trajectory(self, run_id: int, iteration: int, t: Trajectory, now: float) -> None:
        """Insert one trajectory and its reward rows *without committing*; for callers
        that write it together with rows of their own in one transaction (``with store.conn:``)."""
        self.conn.execute(
            "INSERT INTO trajectories (id, run_id, iteration, task_id, group_id, adapter_version,"
            " reward, correct, error, num_completion_tokens, created_at, data_json)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                t.id, run_id, iteration, t.task_id, t.group_id, t.adapter_version, real(t.reward),
                None if t.correct is None else int(bool(t.correct)), t.error, t.num_completion_tokens,
                now, to_json(t.to_dict()),
            ),
        )
        self.conn.executemany(
            "INSERT INTO rewards (trajectory_id, name, value) VALUES (?, ?, ?)",
            [(t.id, name, real(v)) for name, v in t.rewards.items()],
        )

    @locked
    def remove_trajectories(self, ids: Iterable[str]) -> int:
        """Delete trajectories and their reward rows by id *without committing*; for callers that
        delete the rows of their own tables that point at them in the same transaction (``with
        store.conn:``; :func:`selfrl.record.served.delete_turns`). Returns how many trajectories
        were deleted (an unknown id counts nothing).

        Raises:
            sqlite3.IntegrityError: a row that stays still references one of them (the caller's
                transaction then rolls back, and nothing is deleted).
        """
        n = 0
        for tid in ids:
            self.conn.execute("DELETE FROM rewards WHERE trajectory_id = ?", (tid,))
            n += self.conn.execute("DELETE FROM trajectories WHERE id = ?", (tid,)).rowcount
        return n

    @locked
    def trajectories(self, run_id: int | None = None, iteration: int | None = None) -> list[Trajectory]:
        """Stored trajectories, optionally filtered, in insertion order.

        Floats that were NaN or infinite when stored come back as None.
        """
        sql, args = "SELECT data_json FROM trajectories", []
        where = []
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)
        if iteration is not None:
            where.append("iteration = ?")
            args.append(iteration)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self.conn.execute(sql + " ORDER BY rowid", args)
        return [Trajectory.from_dict(json.loads(r["data_json"])) for r in rows]

    @locked
    def trajectory_index(self) -> list[dict[str, Any]]:
        """One light row per stored trajectory, in insertion order, without its record:
        ``{run_id, iteration, adapter_version, created_at, reward, correct}`` (``reward``
        None when unknown, ``correct`` None or 0/1). For counting and plotting rollouts."""
        rows = self.conn.execute(
            "SELECT run_id, iteration, adapter_version, created_at, reward, correct FROM trajectories ORDER BY rowid"
        )
        return [dict(r) for r in rows]

    @locked
    def trained_task_ids(self) -> set[str]:
        """Ids of the tasks any stored trajectory was sampled on: the tasks the run trained on
        (held-out evaluations are stored apart, in ``evaluations``)."""
        return {r["task_id"] for r in self.conn.execute("SELECT DISTINCT task_id FROM trajectories")}

    @locked
    def count_trajectories(self) -> int:
        """Number of stored trajectories over all runs."""
        return int(self.conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0])

    # --- adapter versions -----------------------------------------------------

    @locked
    def add_version(
        self,
        version: int,
        parent: int | None,
        path: str | Path | None,
        status: str,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Record adapter ``version`` (trained from ``parent``, saved at ``path``; a path inside
        the run directory is stored relative to it).

        Raises:
            ValueError: unknown ``status``.
            sqlite3.IntegrityError: ``version`` exists already or ``parent`` does not.
        """
        check_status(status)
        with self.conn:
            self.conn.execute(
                "INSERT INTO adapter_versions (version, parent, path, status, created_at, metrics_json)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (version, parent, None if path is None else storable_path(path, self.root), status, time.time(),
                 to_json(metrics or {})),
            )

    @locked
    def set_version_status(self, version: int, status: str, metrics: dict[str, Any] | None = None) -> None:
        """Change a version's status; ``metrics`` (if given) are merged into its metrics.

        Raises:
            ValueError: unknown ``status``.
            KeyError: no such version.
        """
        check_status(status)
        with self.conn:
            row = self.conn.execute(
                "SELECT metrics_json FROM adapter_versions WHERE version = ?", (version,)
            ).fetchone()
            if row is None:
                raise KeyError(f"no adapter version {version}")
            merged = {**json.loads(row["metrics_json"]), **(metrics or {})}
            self.conn.execute(
                "UPDATE adapter_versions SET status = ?, metrics_json = ? WHERE version = ?",
                (status, to_json(merged), version),
            )

    @locked
    def versions(self) -> list[dict[str, Any]]:
        """All versions in order: dicts with version, parent, path (resolved against the run
        directory: :func:`resolve_version_path`), status, created_at, metrics."""
        rows = self.conn.execute("SELECT * FROM adapter_versions ORDER BY version")
        return [version_dict(r, self.root) for r in rows]

    @locked
    def version(self, version: int) -> dict[str, Any] | None:
        """The row of ``version`` as :meth:`versions` gives it, or None."""
        row = self.conn.execute("SELECT * FROM adapter_versions WHERE version = ?", (version,)).fetchone()
        return None if row is None else version_dict(row, self.root)

    @locked
    def latest_promoted(self) -> dict[str, Any] | None:
        """The highest version whose status is 'promoted' or 'base', or None.

        'base' counts so that a run without any promotion yet still has a
        version to serve and roll back to.
        """
        row = self.conn.execute(
            "SELECT * FROM adapter_versions WHERE status IN ('promoted', 'base') ORDER BY version DESC LIMIT 1"
        ).fetchone()
        return None if row is None else version_dict(row, self.root)

    @locked
    def next_version(self) -> int:
        """One more than the highest recorded version (0 when there is none)."""
        row = self.conn.execute("SELECT MAX(version) FROM adapter_versions").fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    # --- metrics and events ---------------------------------------------------

    @locked
    def log_metrics(self, run_id: int, step: int, metrics: dict[str, float | None]) -> None:
        """Record scalar metrics for ``step``; NaN, inf and None are stored as NULL."""
        now = time.time()
        with self.conn:
            self.conn.executemany(
                "INSERT INTO metrics (run_id, step, name, value, wall_time) VALUES (?, ?, ?, ?, ?)",
                [(run_id, step, name, real(v), now) for name, v in metrics.items()],
            )

    @locked
    def metrics(self, run_id: int | None = None) -> list[dict[str, Any]]:
        """Metric rows ``{run_id, step, name, value, wall_time}`` ordered by step, then insertion."""
        sql = "SELECT run_id, step, name, value, wall_time FROM metrics"
        args: tuple[Any, ...] = ()
        if run_id is not None:
            sql, args = sql + " WHERE run_id = ?", (run_id,)
        return [dict(r) for r in self.conn.execute(sql + " ORDER BY step, rowid", args)]

    @locked
    def log_event(self, run_id: int | None, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        """Record a timestamped event (e.g. kind 'promote', 'reject', 'rollback', 'error')."""
        with self.conn:
            self.conn.execute(
                "INSERT INTO events (run_id, time, kind, message, data_json) VALUES (?, ?, ?, ?, ?)",
                (run_id, time.time(), kind, message, to_json(data or {})),
            )

    @locked
    def events(self, run_id: int | None = None) -> list[dict[str, Any]]:
        """Event dicts ``{run_id, time, kind, message, data}`` in the order they were logged."""
        sql = "SELECT run_id, time, kind, message, data_json FROM events"
        args: tuple[Any, ...] = ()
        if run_id is not None:
            sql, args = sql + " WHERE run_id = ?", (run_id,)
        out = []
        for r in self.conn.execute(sql + " ORDER BY rowid", args):
            d = dict(r)
            d["data"] = json.loads(d.pop("data_json"))
            out.append(d)
        return out

    # --- held-out evaluations -------------------------------------------------

    @locked
    def add_evaluation(self, version: int, results: Iterable[tuple[str, bool, str | None]]) -> None:
        """Record per-task held-out results ``(task_id, correct, answer)`` of ``version``.

        Re-adding a task for the same version replaces its result.

        Raises:
            sqlite3.IntegrityError: ``version`` is not a recorded adapter version
                (record it with :meth:`add_version` first); nothing is written.
        """
        with self.conn:
            self.conn.executemany(
                "INSERT OR REPLACE INTO evaluations (version, task_id, correct, answer) VALUES (?, ?, ?, ?)",
                [(version, str(tid), int(bool(ok)), answer) for tid, ok, answer in results],
            )

    @locked
    def evaluation(self, version: int) -> dict[str, bool]:
        """Per-task results ``{task_id: correct}`` of ``version`` (empty if never evaluated)."""
        rows = self.conn.execute(
            "SELECT task_id, correct FROM evaluations WHERE version = ? ORDER BY task_id", (version,)
        )
        return {r["task_id"]: bool(r["correct"]) for r in rows}


def check_status(status: str) -> None:
    """Raise ValueError, listing the valid ones, when ``status`` is not a version status."""
    if status not in VERSION_STATUSES:
        raise ValueError(f"unknown adapter status {status!r}; valid: {', '.join(VERSION_STATUSES)}")


def version_dict(row: sqlite3.Row, root: Path) -> dict[str, Any]:
    """An ``adapter_versions`` row as a dict with ``metrics`` decoded and ``path`` resolved
    against the run directory ``root``."""
    d = dict(row)
    d["metrics"] = json.loads(d.pop("metrics_json"))
    d["path"] = resolve_version_path(d["path"], root)
    return d
