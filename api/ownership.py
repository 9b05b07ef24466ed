"""One server per plan store: an OS file lock beside the database, held for the server's whole life.

Why a lock file and not SQLite's own locking. SQLite locks a database only for
the length of a transaction, and the server depends on that: request threads read
while the supervisor writes (WAL). What must be exclusive here is not a
transaction but the role of the server that runs start-up recovery and owns every
`queued`/`solving` row: a second server that marks those rows failed, or solves
beside the first, loses the first one's plans. `PRAGMA locking_mode=EXCLUSIVE`
would give that, but it also locks out the server's own other connections (one
per thread) and any reader such as the `sqlite3` shell.

So the server takes `flock(LOCK_EX | LOCK_NB)` on `<store>.lock` before recovery
and keeps the descriptor open until it exits. The kernel releases the lock when
the process ends however it ends (`kill -9` included), so there is never a stale
lock to clean up, and a restart after a crash recovers at once. The file holds
the owner's pid, host and address, so that a second server refuses to start
with a message that names the one that is running. The file itself is never
deleted (deleting a lock file races with the next claimant); its content is
rewritten by each owner. Solve and request processes are spawned and do not
inherit the descriptor (Python opens files non-inheritable), so they neither
hold the lock nor release it.

POSIX only (the service already is: solve processes use os.nice and getppid).
On NFS, Linux turns flock into a byte-range lock that the server's lock manager
keeps across hosts; SQLite's own advice against NFS stands.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from api.settings import Settings, default_db_path
from api.store import Store, StoreError
from planner.errors import MososError

OWNER_READ_ATTEMPTS = 20
OWNER_READ_PAUSE_S = 0.05


class StoreInUse(MososError):
    """Another live server holds this plan store."""


def lock_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


def _describe(owner: dict) -> str:
    if not owner:
        return "another mosos server (it has not written its pid and address yet)"
    where = f"pid {owner.get('pid')}"
    if owner.get("host") and owner.get("host") != socket.gethostname():
        where += f" on host {owner['host']}"
    return f"another mosos server ({where}, {owner.get('address')}, since {owner.get('started_at')})"


def _read_owner(descriptor: int) -> dict:
    """The owner's details; it writes them just after taking the lock, so an empty file is retried briefly."""
    for _ in range(OWNER_READ_ATTEMPTS):
        raw = os.pread(descriptor, 4096, 0)
        if raw.strip():
            try:
                owner = json.loads(raw)
                if isinstance(owner, dict):
                    return owner
            except ValueError:
                pass
        time.sleep(OWNER_READ_PAUSE_S)
    return {}


class StoreClaim:
    """The held lock of one plan store; `release()` (or the process's end) lets the next server have it."""

    def __init__(self, db_path: Path, address: str):
        import fcntl

        self.db_path = db_path
        self.path = lock_path(db_path)
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise StoreError(f"cannot create the lock file {self.path} of the plan store: {error.strerror}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(descriptor)
            os.close(descriptor)
            raise StoreInUse(
                f"the plan store {db_path} is in use by {_describe(owner)}; this server would fail its running "
                "plans and lose their results. Stop that server first, or give this one another --db"
            ) from None
        except OSError as error:
            os.close(descriptor)
            raise StoreError(f"cannot lock {self.path} (the plan store's lock file): {error.strerror}") from None
        self._descriptor: int | None = descriptor
        self.owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "address": address,
            "started_at": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
            "db_path": str(db_path),
        }
        payload = json.dumps(self.owner).encode()
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, payload, 0)

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the descriptor releases the flock
            self._descriptor = None


@dataclass
class OwnedStore:
    """The plan store together with the lock that makes this process its only server."""

    store: Store
    claim: StoreClaim

    @classmethod
    def open(cls, settings: Settings, address: str | None = None) -> "OwnedStore":
        """Check the path, take the lock, open the database; StoreError or StoreInUse say why not."""
        db_path = Path(settings.db_path).expanduser().resolve()  # one lock file per database, whatever the spelling
        create_directory = db_path == default_db_path().resolve()
        # Opened first (creating the schema is idempotent, and no plan is touched before the lock is held), so
        # that a file that is no database gets no lock file beside it.
        store = Store(db_path, create_directory=create_directory)
        try:
            claim = StoreClaim(db_path, address or f"http://{settings.host}:{settings.port}")
        except BaseException:
            store.close()
            raise
        return cls(store, claim)

    def close(self) -> None:
        self.store.close()
        self.claim.release()
