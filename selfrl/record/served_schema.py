"""The tables of :mod:`selfrl.record.served` (``served``, ``feedback``, ``response_history``), and
:func:`init`, which creates them and brings a store written by an earlier selfrl up to date."""

from __future__ import annotations

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
    """Create the server's tables in ``store`` (idempotent; adds the ``client`` and ``family``
    columns to a store written before they existed: its turns belong to no client, and are never
    continued, and to no family; and feedback's ``correction_calls``: its corrections carry no calls;
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
        if "correction_calls" not in {r[1] for r in store.conn.execute("PRAGMA table_info(feedback)")}:
            store.conn.execute("ALTER TABLE feedback ADD COLUMN correction_calls TEXT")


def _allow_null_feedback_value(store: Store) -> None:
    """Rebuild the ``feedback`` table of a store written when its ``value`` was NOT NULL (SQLite
    cannot drop a constraint in place), in one transaction; nothing when there is no such table."""
    columns = {r[1]: r for r in store.conn.execute("PRAGMA table_info(feedback)")}
    if not columns.get("value") or not columns["value"][3]:  # no table yet, or value may be NULL
        return
    names = ", ".join(columns)  # correction_calls may be missing yet: _create adds it after
    try:
        store.conn.executescript(
            "BEGIN IMMEDIATE;"
            f"DROP TABLE IF EXISTS feedback_rebuilt; CREATE TABLE feedback_rebuilt {FEEDBACK_COLUMNS};"
            f"INSERT INTO feedback_rebuilt ({names}) SELECT {names} FROM feedback;"
            "DROP TABLE feedback; ALTER TABLE feedback_rebuilt RENAME TO feedback;"
            "CREATE INDEX IF NOT EXISTS feedback_response ON feedback(response_id, choice);"
            "COMMIT;")
    except BaseException:
        if store.conn.in_transaction:
            store.conn.rollback()
        raise
