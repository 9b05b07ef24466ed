"""The SQLite store: one row per plan, profiles kept once by digest, one transaction per change.

WAL mode keeps status reads fast while a result is written; each thread has
its own connection. After a crash, anything left queued or solving is marked
failed on startup, so no plan is ever stuck.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import MososError

ACTIVE = ("queued", "solving")
TERMINAL = ("done", "failed", "cancelled")
INTERRUPTED = "interrupted by restart"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS profiles (
    digest TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    node_count INTEGER NOT NULL,
    profile_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS plans (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    request_hash TEXT NOT NULL,
    profile_digest TEXT NOT NULL REFERENCES profiles(digest),
    profile_name TEXT NOT NULL,
    strategy TEXT NOT NULL,
    options_json TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    progress_json TEXT,
    feasible INTEGER,
    minimum_budget_bytes TEXT,
    proven INTEGER,
    reason TEXT,
    schedule_json TEXT,
    solve_seconds REAL
);
CREATE INDEX IF NOT EXISTS plans_by_hash ON plans(request_hash, status);
CREATE INDEX IF NOT EXISTS plans_by_status ON plans(status);
"""


@dataclass
class PlanRow:
    seq: int
    id: str
    request_hash: str
    profile_digest: str
    profile_name: str
    strategy: str
    options: dict[str, Any]
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: dict[str, Any] | None
    feasible: bool | None
    minimum_budget_bytes: int | None
    proven: bool | None  # infeasible: proven so (or a heuristic's one plan); False: the solver's time ran out
    reason: str | None
    schedule_json: str | None
    solve_seconds: float | None

    @classmethod
    def from_sql(cls, row: sqlite3.Row) -> "PlanRow":
        return cls(
            seq=row["seq"],
            id=row["id"],
            request_hash=row["request_hash"],
            profile_digest=row["profile_digest"],
            profile_name=row["profile_name"],
            strategy=row["strategy"],
            options=json.loads(row["options_json"]),
            status=row["status"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            progress=json.loads(row["progress_json"]) if row["progress_json"] else None,
            feasible=None if row["feasible"] is None else bool(row["feasible"]),
            minimum_budget_bytes=int(row["minimum_budget_bytes"]) if row["minimum_budget_bytes"] is not None else None,
            proven=None if row["proven"] is None else bool(row["proven"]),
            reason=row["reason"],
            schedule_json=row["schedule_json"],
            solve_seconds=row["solve_seconds"],
        )


_SUMMARY_COLUMNS = (
    "seq, id, request_hash, profile_digest, profile_name, strategy, options_json, status, created_at, started_at, "
    "finished_at, progress_json, feasible, minimum_budget_bytes, proven, reason, NULL AS schedule_json, solve_seconds"
)


_ADDED_COLUMNS = {"proven": "INTEGER"}  # columns added to the plans table after its first version


class StoreError(MososError):
    """The plan store cannot be used where it was asked for: which file, and why."""


def check_store_path(path: Path, *, create_directory: bool = False) -> None:
    """Refuse, with the reason, a path where SQLite could not keep the store (it also writes `-wal` and `-shm` files
    beside it). A missing directory is created only when asked (the default location): an explicit path in a missing
    directory is more often a typo or an unmounted disk than a wish."""
    if path.is_dir():
        raise StoreError(f"the plan store {path} is a directory; give the path of a file, e.g. {path / 'plans.sqlite3'}")
    directory = path.parent
    if not directory.exists():
        if not create_directory:
            raise StoreError(
                f"the directory {directory} of the plan store {path} does not exist; create it, or give another --db"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(f"cannot create the directory {directory} for the plan store: {error.strerror}") from None
    if not directory.is_dir():
        raise StoreError(f"the plan store {path} cannot be kept there: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StoreError(
            f"cannot write in the directory {directory}: the plan store needs to create {path.name} there, "
            "and SQLite its -wal and -shm files beside it"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise StoreError(f"cannot write the plan store {path}: permission denied")


class Store:
    def __init__(self, path: str | Path, *, create_directory: bool = True):
        """Open (or create) the store; StoreError says why it cannot be used."""
        self.path = Path(path)
        check_store_path(self.path, create_directory=create_directory)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        try:
            self._db().executescript(_SCHEMA)  # executescript manages its own transaction
            self._add_missing_columns()
        except sqlite3.DatabaseError as error:
            self.close()
            if "not a database" in str(error) or "malformed" in str(error):
                raise StoreError(f"{self.path} is not a SQLite database of plans ({error}); give another --db") from None
            raise StoreError(f"cannot open the plan store {self.path}: {error}") from None

    def _add_missing_columns(self) -> None:
        """A store made by an earlier version: its plans table gains the columns added since (NULL in old rows)."""
        columns = {row["name"] for row in self._db().execute("PRAGMA table_info(plans)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in columns:
                self._db().execute(f"ALTER TABLE plans ADD COLUMN {name} {kind}")

    # Connections -------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            connection.row_factory = sqlite3.Row
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("PRAGMA foreign_keys=ON")
            self._local.connection = connection
            with self._connections_lock:
                self._connections.append(connection)
        return connection

    class _Transaction:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, kind, value, traceback) -> None:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")

    def _transaction(self) -> "_Transaction":
        return self._Transaction(self._db())

    def close(self) -> None:
        with self._connections_lock:
            for connection in self._connections:
                try:
                    connection.close()
                except sqlite3.Error:
                    pass
            self._connections.clear()
        self._local = threading.local()

    # Writes: each is one transaction ------------------------------------

    def recover(self) -> int:
        """Mark what a crash left queued or solving as failed; returns how many."""
        now = time.time()
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE plans SET status='failed', reason=?, finished_at=? WHERE status IN ('queued', 'solving')",
                (INTERRUPTED, now),
            )
            return cursor.rowcount

    def insert(
        self,
        *,
        plan_id: str,
        request_hash: str,
        profile_digest: str,
        profile_name: str,
        profile_json: str,
        node_count: int,
        strategy: str,
        options: dict[str, Any],
    ) -> PlanRow:
        now = time.time()
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO profiles (digest, name, node_count, profile_json) VALUES (?, ?, ?, ?)",
                (profile_digest, profile_name, node_count, profile_json),
            )
            db.execute(
                "INSERT INTO plans (id, request_hash, profile_digest, profile_name, strategy, options_json, status, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, 'queued', ?)",
                (plan_id, request_hash, profile_digest, profile_name, strategy, json.dumps(options), now),
            )
        row = self.get(plan_id)
        assert row is not None
        return row

    def mark_solving(self, plan_id: str) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE plans SET status='solving', started_at=? WHERE id=? AND status='queued'", (time.time(), plan_id)
            )

    def save_progress(self, plan_id: str, progress: dict[str, Any]) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE plans SET progress_json=? WHERE id=? AND status='solving'", (json.dumps(progress), plan_id)
            )

    def finish(
        self,
        plan_id: str,
        status: str,
        *,
        schedule_json: str | None = None,
        feasible: bool | None = None,
        minimum_budget_bytes: int | None = None,
        proven: bool | None = None,
        reason: str | None = None,
        solve_seconds: float | None = None,
        progress: dict[str, Any] | None = None,
    ) -> bool:
        """Record the outcome of a plan that is still active; False if it had already ended (e.g. cancelled)."""
        assert status in TERMINAL
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE plans SET status=?, schedule_json=?, feasible=?, minimum_budget_bytes=?, proven=?, reason=?, "
                "solve_seconds=?, finished_at=?, progress_json=COALESCE(?, progress_json) "
                "WHERE id=? AND status IN ('queued', 'solving')",
                (
                    status,
                    schedule_json,
                    None if feasible is None else int(feasible),
                    None if minimum_budget_bytes is None else str(minimum_budget_bytes),
                    None if proven is None else int(proven),
                    reason,
                    solve_seconds,
                    time.time(),
                    json.dumps(progress) if progress is not None else None,
                    plan_id,
                ),
            )
            return cursor.rowcount == 1

    def delete(self, plan_id: str) -> bool:
        """Forget a plan, and its profile when no other plan uses it; False if there was no such plan."""
        with self._transaction() as db:
            row = db.execute("SELECT profile_digest FROM plans WHERE id=?", (plan_id,)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM plans WHERE id=?", (plan_id,))
            db.execute(
                "DELETE FROM profiles WHERE digest=? AND NOT EXISTS (SELECT 1 FROM plans WHERE profile_digest=?)",
                (row["profile_digest"], row["profile_digest"]),
            )
            return True

    # Reads ---------------------------------------------------------------

    def get(self, plan_id: str) -> PlanRow | None:
        row = self._db().execute("SELECT * FROM plans WHERE id=?", (plan_id,)).fetchone()
        return PlanRow.from_sql(row) if row else None

    def find_done(self, request_hash: str) -> PlanRow | None:
        """The stored answer to an identical request: a finished plan, feasible or not, but not a solver's "none found
        in time" (a machine less busy may find one: the request is solved again)."""
        row = self._db().execute(
            "SELECT * FROM plans WHERE request_hash=? AND status='done' "
            "AND NOT (COALESCE(feasible, 1) = 0 AND COALESCE(proven, 1) = 0) ORDER BY seq DESC LIMIT 1",
            (request_hash,),
        ).fetchone()
        return PlanRow.from_sql(row) if row else None

    def profile_json(self, digest: str) -> str | None:
        row = self._db().execute("SELECT profile_json FROM profiles WHERE digest=?", (digest,)).fetchone()
        return row["profile_json"] if row else None

    def list(self, limit: int, before_seq: int | None) -> list[PlanRow]:
        """Newest first, without schedules; `before_seq` is the cursor of the previous page."""
        if before_seq is None:
            rows = self._db().execute(f"SELECT {_SUMMARY_COLUMNS} FROM plans ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = self._db().execute(
                f"SELECT {_SUMMARY_COLUMNS} FROM plans WHERE seq < ? ORDER BY seq DESC LIMIT ?", (before_seq, limit)
            )
        return [PlanRow.from_sql(row) for row in rows.fetchall()]

    def count(self, status: str | None = None) -> int:
        if status is None:
            return self._db().execute("SELECT COUNT(*) FROM plans").fetchone()[0]
        return self._db().execute("SELECT COUNT(*) FROM plans WHERE status=?", (status,)).fetchone()[0]
