"""The tables of :mod:`selfrl.record.served` (``served``, ``feedback``, ``response_history``), and
:func:`init`, which creates them and brings a store written by an earlier selfrl up to date."""

from __future__ import annotations

import json

from selfrl.record import served_feedback
from selfrl.record.store import Store

# ``value`` NULL: a message that judges nothing (a comment alone: served.apply_feedback)
FEEDBACK_COLUMNS = """(
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id TEXT NOT NULL,
    choice      INTEGER NOT NULL,
    source      TEXT NOT NULL CHECK (source IN ('explicit', 'implicit')),
    value       REAL,
    rating      REAL,
    corrected   INTEGER NOT NULL,
    correction  TEXT,
    correction_calls TEXT,
    comment     TEXT,
    created_at  REAL NOT NULL
)"""

SERVE_SCHEMA = """
CREATE TABLE IF NOT EXISTS served (
    trajectory_id   TEXT PRIMARY KEY REFERENCES trajectories(id),
    response_id     TEXT NOT NULL,
    choice          INTEGER NOT NULL,
    conversation_id TEXT NOT NULL,
    parent_id       TEXT REFERENCES trajectories(id),
    group_key       TEXT NOT NULL,
    continuation    TEXT NOT NULL,
    created_at      REAL NOT NULL,
    status          TEXT NOT NULL CHECK (status IN ('pending', 'trained', 'skipped')),
    trained_in      INTEGER,
    feedback        REAL,
    feedback_source TEXT CHECK (feedback_source IN ('explicit', 'inherited', 'implicit')),
    client          TEXT NOT NULL DEFAULT '',
    family          TEXT,
    tools           TEXT,
    UNIQUE (response_id, choice)
);
CREATE INDEX IF NOT EXISTS served_continuation ON served(continuation);
CREATE INDEX IF NOT EXISTS served_status ON served(status, created_at);
CREATE INDEX IF NOT EXISTS served_created ON served(created_at);
CREATE INDEX IF NOT EXISTS served_parent ON served(parent_id);
CREATE TABLE IF NOT EXISTS feedback {FEEDBACK_COLUMNS};
CREATE TABLE IF NOT EXISTS response_history (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id   TEXT NOT NULL UNIQUE,
    client        TEXT NOT NULL,
    created_at    REAL NOT NULL,
    bytes         INTEGER NOT NULL,
    messages_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_response ON feedback(response_id, choice);
""".replace("{FEEDBACK_COLUMNS}", FEEDBACK_COLUMNS)


def init(store: Store) -> None:
    """Create the server's tables in ``store`` (idempotent; adds the ``client``, ``family`` and
    ``tools`` columns to a store written before they existed: its turns belong to no client, and are
    never continued, to no family, and their offered tools are unknown (NULL); and feedback's
    ``correction_calls``: its corrections carry no calls;
    and rebuilds a ``feedback`` table whose ``value`` may not be NULL, rows and ids kept, so that a
    comment alone can be stored without a value). Takes ``store.lock``.

    Raises:
        sqlite3.Error: the store cannot be written (a rebuild that fails is rolled back whole).
    """
    with store.lock:
        _allow_null_feedback_value(store)
        _create(store)


def _create(store: Store) -> None:
    with store.conn:
        store.conn.executescript(SERVE_SCHEMA)
        columns = {r[1] for r in store.conn.execute("PRAGMA table_info(served)")}
        if "client" not in columns:
            store.conn.execute("ALTER TABLE served ADD COLUMN client TEXT NOT NULL DEFAULT ''")
        if "family" not in columns:
            store.conn.execute("ALTER TABLE served ADD COLUMN family TEXT")
        if "tools" not in columns:
            store.conn.execute("ALTER TABLE served ADD COLUMN tools TEXT")
        if "correction_calls" not in {r[1] for r in store.conn.execute("PRAGMA table_info(feedback)")}:
            store.conn.execute("ALTER TABLE feedback ADD COLUMN correction_calls TEXT")


def _allow_null_feedback_value(store: Store) -> None:
    """Rebuild the ``feedback`` table of a store written when its ``value`` was NOT NULL (SQLite
    cannot drop a constraint in place), in one transaction; nothing when there is no such table.
    Its rows and ids are kept, and its AUTOINCREMENT counter (an id once handed out, then deleted,
    is never handed out again); the value 0 it gave a comment alone is taken back
    (:func:`_take_back_comment_values`)."""
    conn = store.conn
    columns = {r[1]: r for r in conn.execute("PRAGMA table_info(feedback)")}
    if not columns.get("value") or not columns["value"][3]:  # no table yet, or value may be NULL
        return
    names = ", ".join(columns)  # correction_calls may be missing yet: _create adds it after
    try:
        conn.execute("BEGIN IMMEDIATE")
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feedback'").fetchone()
        conn.execute("DROP TABLE IF EXISTS feedback_rebuilt")
        conn.execute(f"CREATE TABLE feedback_rebuilt {FEEDBACK_COLUMNS}")
        conn.execute(f"INSERT INTO feedback_rebuilt ({names}) SELECT {names} FROM feedback")
        conn.execute("DROP TABLE feedback")
        conn.execute("ALTER TABLE feedback_rebuilt RENAME TO feedback")
        conn.execute("CREATE INDEX IF NOT EXISTS feedback_response ON feedback(response_id, choice)")
        if seq is not None:  # the copy's counter is its highest id: the old one may be past it
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'feedback'")
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('feedback', MAX(?, COALESCE("
                         "(SELECT MAX(id) FROM feedback), 0)))", (seq[0],))
        _take_back_comment_values(conn, has_calls="correction_calls" in columns)
        conn.commit()
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise


def _take_back_comment_values(conn, has_calls: bool) -> None:
    """Store a comment alone as judging nothing (``value`` NULL), as :func:`served.apply_feedback
    <selfrl.record.served.apply_feedback>` does now: an older store gave it the value 0 (an explicit
    row with value 0 and no rating, not corrected, no correction, no correction calls). The turns
    still pending that such a value reached (the judged turn and its earlier turns) get their value
    again from the messages left, replayed in the order they came (:func:`served_feedback.attach
    <selfrl.record.served_feedback.attach>`): none left, no value. A turn trained or skipped keeps
    its value as history. Inside the caller's transaction."""
    calls = "AND COALESCE(correction_calls, '[]') = '[]'" if has_calls else ""
    nulled = conn.execute(
        "SELECT s.trajectory_id FROM feedback f JOIN served s ON s.response_id = f.response_id AND s.choice = f.choice"
        " WHERE f.id IN (SELECT id FROM feedback WHERE source = 'explicit' AND value = 0 AND rating IS NULL"
        f" AND corrected = 0 AND correction IS NULL {calls})").fetchall() if _has_served(conn) else []
    conn.execute("UPDATE feedback SET value = NULL WHERE source = 'explicit' AND value = 0 AND rating IS NULL"
                 f" AND corrected = 0 AND correction IS NULL {calls}")
    if not nulled:
        return
    reached = {tid for (own,) in nulled for tid in served_feedback.chain(conn, own)}
    pending = {r[0] for r in conn.execute(
        "SELECT trajectory_id FROM served WHERE status = 'pending' AND trajectory_id IN (SELECT value FROM json_each(?))",
        (json.dumps(sorted(reached)),))}
    if not pending:
        return
    conn.execute("UPDATE served SET feedback = NULL, feedback_source = NULL WHERE trajectory_id IN "
                 "(SELECT value FROM json_each(?))", (json.dumps(sorted(pending)),))
    rows = conn.execute(  # the messages on those turns and on their later turns, as they came
        "WITH RECURSIVE later(id) AS (SELECT value FROM json_each(?) UNION"
        " SELECT s.trajectory_id FROM served s JOIN later ON s.parent_id = later.id)"
        " SELECT s.trajectory_id, f.source, f.value FROM feedback f JOIN served s"
        " ON s.response_id = f.response_id AND s.choice = f.choice"
        " WHERE f.value IS NOT NULL AND s.trajectory_id IN later ORDER BY f.id", (json.dumps(sorted(pending)),))
    for own, source, value in rows.fetchall():
        served_feedback.attach(conn, own, source, value, only=pending)


def _has_served(conn) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'served'").fetchone() is not None
