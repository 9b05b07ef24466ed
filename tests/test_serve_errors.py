"""`mosos serve` mistakes an operator makes end with exit code 2 and a sentence, never a traceback.

Each case runs the real command in a fresh process (`python -m cli serve`) and
fails at start-up, before any port is bound.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("platformdirs")

REPO = Path(__file__).resolve().parents[1]


def serve(*args: str, env: dict | None = None, preexec_fn=None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`mosos serve ARGS`, which must refuse to start (a server that starts is stopped after `timeout_s`)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for key, value in list(environment.items()):
        if value is None:
            del environment[key]
    command = [sys.executable, "-m", "cli", "serve", "--port", "1", "--workers", "1", "--request-processes", "1", *args]
    try:
        return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, timeout=timeout_s,
                              preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"") + (expired.stderr or b"")
        raise AssertionError(f"mosos serve {' '.join(args)} started instead of refusing:\n{output.decode(errors='replace')}")


def assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    output = (result.stdout + result.stderr).decode("utf-8", "replace")
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    flat = " ".join(output.split())
    for fragment in fragments:
        assert fragment in flat, output
    return flat


# Tokens --------------------------------------------------------------------------------------


def test_a_token_file_that_is_not_utf8_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(b"cl\xe9\n")  # latin-1
    assert_refused(serve("--db", str(tmp_path / "p.sqlite3"), "--token-file", str(token_file)),
                   f"the token file {token_file} is not valid UTF-8")


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_an_empty_token_file_is_refused_not_taken_as_no_token(tmp_path, content):
    """An empty token file started a server that answered everyone, with no word: the operator asked for a token."""
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    assert_refused(serve("--db", str(tmp_path / "p.sqlite3"), "--token-file", str(token_file)),
                   f"the token file {token_file} is empty (or only whitespace)")


def test_a_token_no_http_client_can_send_is_refused(tmp_path):
    result = serve("--db", str(tmp_path / "p.sqlite3"), env={"MOSOS_API_TOKEN": "abc\x01def"})
    assert_refused(result, "$MOSOS_API_TOKEN contains a control character", "position 3")


def test_a_non_utf8_environment_token_is_refused(tmp_path):
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    environment.pop("MOSOS_API_TOKEN", None)
    raw_environment = {key.encode(): value.encode() for key, value in environment.items()}
    raw_environment[b"MOSOS_API_TOKEN"] = b"cl\xe9"
    command = [sys.executable, "-m", "cli", "serve", "--port", "1", "--db", str(tmp_path / "p.sqlite3")]
    result = subprocess.run(command, cwd=REPO, env=raw_environment, capture_output=True, timeout=60)
    assert_refused(result, "$MOSOS_API_TOKEN is not valid UTF-8")


def test_token_reading_keeps_non_ascii_tokens(tmp_path, monkeypatch):
    from api.settings import TOKEN_ENV, read_token

    token = "clé-секрет-🔑"
    monkeypatch.setenv(TOKEN_ENV, f" {token}\n")
    assert read_token(None) == token
    token_file = tmp_path / "token"
    token_file.write_bytes(f"{token}\n".encode())
    assert read_token(token_file) == token


# Plugins -------------------------------------------------------------------------------------


def test_a_plugin_path_that_is_not_a_module_is_refused(tmp_path):
    db = ["--db", str(tmp_path / "p.sqlite3")]
    text_file = tmp_path / "strategies.txt"
    text_file.write_text("not python\n")
    assert_refused(serve(*db, "--plugin", str(text_file)), f"plugin {text_file}", "not a Python file")
    missing = tmp_path / "missing.py"
    assert_refused(serve(*db, "--plugin", str(missing)), f"plugin {missing}", "no such file")
    assert_refused(serve(*db, "--plugin", str(tmp_path)), f"plugin {tmp_path}", "is a directory")
    assert_refused(serve(*db, "--plugin", "no_such_module.strategies"), "plugin no_such_module.strategies",
                   "no module named 'no_such_module'")


@pytest.mark.parametrize(
    "source, fragments",
    [
        ("raise RuntimeError('the licence server is down')\n", ["failed while it was imported",
                                                                 "RuntimeError: the licence server is down", "line 1"]),
        ("def broken(:\n", ["is not valid Python", "line 1"]),
        ("import sys\nsys.exit(1)\n", ["exited (SystemExit: 1) while it was imported"]),
        ("import module_nobody_has\n", ["failed while it was imported", "No module named 'module_nobody_has'"]),
    ],
    ids=["raises", "syntax-error", "exits", "imports-missing-module"],
)
def test_a_plugin_that_fails_to_import_is_refused(tmp_path, source, fragments):
    plugin = tmp_path / "my_strategies.py"
    plugin.write_text(source)
    assert_refused(serve("--db", str(tmp_path / "p.sqlite3"), "--plugin", str(plugin)), f"plugin {plugin}", *fragments)


# The plan store (--db) ---------------------------------------------------------------------------


def test_db_in_a_missing_directory_is_refused_and_nothing_is_created(tmp_path):
    missing = tmp_path / "not-mounted" / "mosos"
    flat = assert_refused(serve("--db", str(missing / "plans.sqlite3")), f"the directory {missing}", "does not exist")
    assert "--db" in flat
    assert not (tmp_path / "not-mounted").exists()


def test_db_on_a_directory_is_refused(tmp_path):
    assert_refused(serve("--db", str(tmp_path)), f"the plan store {tmp_path} is a directory",
                   f"{tmp_path}/plans.sqlite3")


def test_db_under_a_file_is_refused(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert_refused(serve("--db", str(a_file / "plans.sqlite3")), f"{a_file} is not a directory")


def test_db_that_is_not_a_sqlite_file_is_refused_and_left_alone(tmp_path):
    other = tmp_path / "notes.sqlite3"
    other.write_bytes(b"these are someone's notes, not a database\n" * 100)
    before = other.read_bytes()
    assert_refused(serve("--db", str(other)), f"{other} is not a SQLite database")
    assert other.read_bytes() == before


def _without_root_overrides() -> None:
    """preexec_fn: drop root's power to write anywhere (CAP_DAC_OVERRIDE), so file modes apply as to anyone."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "cannot drop a capability")


def _unprivileged_preexec():
    if os.geteuid() != 0:
        return None
    if not sys.platform.startswith("linux"):
        pytest.skip("running as root on a system where the test cannot give up root's file permissions")
    try:  # check it can be done at all, in a child
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_without_root_overrides, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE here: {error}")
    return _without_root_overrides


def test_db_in_an_unwritable_directory_is_refused(tmp_path):
    preexec = _unprivileged_preexec()
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert_refused(serve("--db", str(locked / "plans.sqlite3"), preexec_fn=preexec),
                       f"cannot write in the directory {locked}", "-wal")
    finally:
        locked.chmod(0o755)


def test_a_read_only_db_file_is_refused(tmp_path):
    preexec = _unprivileged_preexec()
    from api.store import Store

    db = tmp_path / "plans.sqlite3"
    Store(db).close()
    db.chmod(0o444)
    try:
        assert_refused(serve("--db", str(db), preexec_fn=preexec), f"cannot write the plan store {db}")
    finally:
        db.chmod(0o644)


def test_a_store_from_before_the_proven_column_is_upgraded_and_its_plans_kept(tmp_path):
    import sqlite3

    from api.store import _SCHEMA, Store

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_SCHEMA.replace("    proven INTEGER,\n", ""))
        db.execute("INSERT INTO profiles VALUES ('d', 'p', 1, '{}')")
        db.execute("INSERT INTO plans (id, request_hash, profile_digest, profile_name, strategy, options_json, status, "
                   "created_at, feasible, minimum_budget_bytes) VALUES ('a', 'h', 'd', 'p', 'mosos', '{}', 'done', 1.0, "
                   "0, '5')")
    store = Store(path)
    row = store.find_done("h")
    assert row is not None and row.id == "a" and row.proven is None and row.minimum_budget_bytes == 5
    store.close()


def test_a_port_in_use_is_refused_before_the_solve_processes_start(tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environment = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run([sys.executable, "-m", "cli", "serve", "--port", str(port), "--workers", "1",
                                 "--request-processes", "1", "--db", str(tmp_path / "plans.sqlite3")], cwd=REPO,
                                env=environment, capture_output=True, timeout=60)
    assert_refused(result, f"cannot listen on http://127.0.0.1:{port}: the port is in use", "choose another --port")
    assert list(tmp_path.iterdir()) == []  # the new store it had opened, and its lock, are not left behind
