"""schemathesis, every check and every phase, against a real `mosos serve`: the schema and the server agree.

Starts a server on a loopback port (1 solve process, small limits so that
generated plans stay quick), runs `schemathesis run --checks all` over its own
OpenAPI document (examples, coverage, fuzzing and stateful phases, positive and
negative data) with a bearer token or without, and reads three witnesses:
schemathesis's JSON report (test cases, failures, errors), the server's own
/metrics (every request it answered, by status: a 5xx is counted even if no check
saw it), and the plan store (plans by status; a solve that failed with an internal
planner error is counted too). Prints a table and writes its section of
benchmarks/results/service.md.

    python3 benchmarks/service_schemathesis.py [--max-examples 100] [--seed 1] [--token] [--no-write]

The generated profiles keep the rules JSON Schema cannot state (node references,
unique ids) through tests/schemathesis_hooks.py; 413 (over max_nodes) counts as a
rejection of schema-violating data, like 422 (and, for a max-batch search, a valid answer:
its model's size is known only once traced). tests/test_api_schema.py runs the
same thing in CI with few examples.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "service.md"

from benchmarks.results_file import write_section  # noqa: E402
from benchmarks.service_concurrency import serve  # noqa: E402

# The server's limits during the run: small, so that thousands of generated plans stay quick.
SERVER_LIMITS = ["--workers", "1", "--request-processes", "1", "--queue-size", "4", "--max-nodes", "60",
                 "--max-time-limit", "2", "--default-time-limit", "1", "--max-wait", "1", "--max-body-bytes", "4194304"]
# schemathesis's default statuses for refused invalid data, and 413: a profile over max_nodes is refused with it.
REJECTION_STATUSES = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
# A max-batch search of a valid request is refused with 413 when its model's estimated profile has more nodes than
# max_nodes: the size is known only once the model is traced, so no schema can state it (the answer names the limit).
MAX_BATCH_ACCEPTANCE = ["2xx", "3xx", "401", "403", "404", "409", "413", "429", "5xx"]


def _statuses(codes: list[str]) -> str:
    return "[" + ", ".join(f'"{code}"' for code in codes) + "]"


CONFIG = (f"[checks.negative_data_rejection]\nexpected-statuses = {_statuses(REJECTION_STATUSES)}\n\n"
          f"[[operations]]\ninclude-path = \"/v1/max-batch\"\ninclude-method = \"POST\"\n"
          f"checks.positive_data_acceptance.expected-statuses = {_statuses(MAX_BATCH_ACCEPTANCE)}\n")
TOKEN = "schemathesis-token"
REQUEST_TIMEOUT_S = 30


def _server_statuses(base: str, headers: dict) -> dict[str, int]:
    """Requests the server answered, by status code, from its own Prometheus counter."""
    counts: dict[str, int] = {}
    for line in httpx.get(f"{base}/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith("mosos_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            code = labels.split('status="', 1)[1].split('"', 1)[0]
            counts[code] = counts.get(code, 0) + int(float(value))
    return counts


def _stored_plans(db: Path) -> tuple[dict[str, int], int]:
    """Plans by status, and how many failed with an internal planner error (a bug the schema cannot excuse)."""
    with sqlite3.connect(db) as connection:
        by_status = dict(connection.execute("SELECT status, COUNT(*) FROM plans GROUP BY status").fetchall())
        internal = connection.execute(
            "SELECT COUNT(*) FROM plans WHERE status='failed' AND reason LIKE 'internal planner error%'"
        ).fetchone()[0]
    return by_status, internal


def run_schemathesis(workdir: Path, *, max_examples: int, seed: int, token: bool, timeout_s: float = 3600) -> dict:
    """One schemathesis run against a fresh server; every figure the table and the CI test need."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "schemathesis.toml").write_text(CONFIG)
    extra = list(SERVER_LIMITS)
    headers: dict[str, str] = {}
    if token:
        (workdir / "token").write_text(TOKEN + "\n")
        extra += ["--token-file", str(workdir / "token")]
        headers = {"Authorization": f"Bearer {TOKEN}"}
    db = workdir / "plans.sqlite3"
    report = workdir / "report.json"
    with serve(workdir, workers=1, queue_size=4, extra=extra, db=db, busy_plugin=False) as (_, base, log_path):
        command = [
            sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
            "--config-file", str(workdir / "schemathesis.toml"), "run", f"{base}/openapi.json",
            "--checks", "all", "--max-examples", str(max_examples), "--seed", str(seed), "--workers", "1",
            "--generation-database", "none", "--report", "json", "--report-json-path", str(report),
            # No answer takes long here (plans wait at most --max-wait 1 s): a request left unanswered is an error.
            "--request-timeout", str(REQUEST_TIMEOUT_S),
            "--no-color", "--output-truncate", "true",
        ]
        for name, value in headers.items():
            command += ["--header", f"{name}: {value}"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks"}
        started = time.monotonic()
        finished = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall_s = time.monotonic() - started
        statuses = _server_statuses(base, headers)
        server_log = log_path.read_text(errors="replace")
    plans, internal_errors = _stored_plans(db)
    data = json.loads(report.read_text()) if report.exists() else {}
    return {
        "exit_code": finished.returncode,
        "output": finished.stdout + finished.stderr,
        "complete": data.get("complete", False),
        "generated": data.get("test_cases", {}).get("generated", 0),
        "with_failures": data.get("test_cases", {}).get("with_failures", 0),
        "failures": data.get("failures", []),
        "errors": data.get("errors", []),
        "phases": {name: phase["status"] for name, phase in data.get("phases", {}).items()},
        "operations": data.get("operations", {}).get("tested", 0),
        "wall_s": wall_s,
        "server_requests": sum(statuses.values()),
        "server_5xx": sum(count for code, count in statuses.items() if code.startswith("5")),
        "statuses": dict(sorted(statuses.items())),
        "plans": plans,
        "internal_errors": internal_errors,
        "tracebacks_in_server_log": server_log.count("Traceback"),
        "token": token,
        "max_examples": max_examples,
        "seed": seed,
    }


def _row(result: dict) -> str:
    failures = sum(failure["count"] for failure in result["failures"])
    statuses = ", ".join(f"{code}: {count}" for code, count in result["statuses"].items())
    plans = ", ".join(f"{status} {count}" for status, count in sorted(result["plans"].items()))
    phases = "/".join("ok" if status == "success" else status for status in result["phases"].values())
    return (
        f"| {'yes' if result['token'] else 'no'} | {result['max_examples']} | {result['seed']} | {result['generated']} | "
        f"{result['server_requests']} | {failures} | {len(result['errors'])} | {result['server_5xx']} | "
        f"{result['internal_errors']} | {phases} | {statuses} | {plans} | {result['wall_s']:.0f} |"
    )


HEADER = (
    "| token | max examples per operation | seed | test cases generated | requests the server answered | failures | "
    "errors | 5xx | internal planner errors | phases (examples/coverage/fuzzing/stateful) | answers by status | "
    "plans stored by status | wall (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--seed", type=int, action="append", help="repeatable; default 1")
    parser.add_argument("--token", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    seeds = args.seed or [1]
    tokens = {"yes": [True], "no": [False], "both": [False, True]}[args.token]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="mosos-schemathesis-") as directory:
        for token in tokens:
            for seed in seeds:
                result = run_schemathesis(Path(directory) / f"{seed}-{token}", max_examples=args.max_examples,
                                          seed=seed, token=token)
                rows.append(_row(result))
                print(rows[-1], flush=True)
                if result["failures"] or result["errors"] or result["server_5xx"] or not result["complete"]:
                    ok = False
                    print(result["output"][-6000:], flush=True)
    load = " / ".join(f"{value:.2f}" for value in os.getloadavg())
    command = "python3 benchmarks/service_schemathesis.py " + " ".join(sys.argv[1:])
    section = (
        f"## schemathesis, all checks, {args.max_examples} examples per operation\n\n"
        f"Command: `{command.strip()}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. schemathesis "
        f"{_version()}, all four phases, positive and negative data, server limits `{' '.join(SERVER_LIMITS)}`. "
        f"Machine: 2 cores; load average at the end {load}.\n\n{HEADER}\n" + "\n".join(rows) + "\n"
    )
    print(section)
    if not args.no_write:
        write_section(RESULTS, _intro(), section)
    sys.exit(0 if ok else 1)


def _version() -> str:
    from importlib.metadata import version

    return version("schemathesis")


def _intro() -> str:
    text = RESULTS.read_text() if RESULTS.exists() else "# Planning service\n"
    return text.split("\n## ", 1)[0].rstrip() + "\n"


if __name__ == "__main__":
    main()
