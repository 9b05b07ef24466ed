"""A sweep of >= 40 solves: `mosos sweep` on a local Ray against the same solves sent to `mosos serve` (its local
solve processes, and its Ray backend), in one run; then the sweep again with a Ray worker killed by pid mid-run.

The sweep: the four small shipped profiles x memory ratios x strategies (48 solves by default), 1 solver thread
per solve, as many solves at once as the machine has cores (2 here) in every configuration. Each configuration
starts from nothing (a fresh process and a fresh Ray or fresh solve processes): "total" includes starting Ray or
the server, "solves" is the time from the first solve sent to the last one ended. The same rows must come out of
every configuration (status per solve; step times within the solver's time limit noise).

Kill runs: the sweep in this process on a fresh local Ray; once a few rows are done, the Ray worker running a
mosos solve is killed with SIGKILL (its pid from the SolveControl actor); the table lists what happened to that
solve (retried on another worker, or reported failed when retries is 0) and that every row still has an answer.

    python3 benchmarks/sweep_ray.py [--time-limit 5] [--ratios 0.7,0.8,0.9,1.0] [--no-kill]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "sweep.md"
PROFILES = ["vgg19-small-cpu.json", "unet-small-cpu.json", "resnet18-small-cpu.json", "transformer-small-cpu.json"]
STRATEGIES = ["mosos", "checkmate-auto", "chen-sqrt"]
MOSOS = [str(REPO / ".venv" / "bin" / "mosos")] if (REPO / ".venv" / "bin" / "mosos").exists() else [sys.executable, "-m", "cli"]

from benchmarks.results_file import write_section  # noqa: E402

INTRO = """# Sweeps on Ray

`mosos sweep` runs every solve of a sweep as a Ray task. This file compares it with sending the same solves to
`mosos serve` (local solve processes, the default, and `--backend ray`), and shows what happens to a solve whose
Ray worker is killed mid-sweep. All on this project's 2-core development machine, shared with other engineers' jobs
(each section gives the load average); the command is in each section.
"""


def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def write_spec(directory: Path, ratios: list[float], time_limit_s: float, retries: int = 1) -> Path:
    profiles = "\n".join(f"  - {REPO / 'models' / 'profiles' / name}" for name in PROFILES)
    spec = directory / f"sweep-r{retries}.yaml"
    spec.write_text(
        f"name: benchmark sweep\nprofiles:\n{profiles}\nmemory_ratios: {json.dumps(ratios)}\n"
        f"strategies: {json.dumps(STRATEGIES)}\ntime_limit_s: {time_limit_s}\nworkers: 1\nretries: {retries}\n"
    )
    return spec


def solves(ratios: list[float]) -> list[dict]:
    """The sweep's solves in its own order (profile, strategy, ratio)."""
    return [{"profile": name, "strategy": strategy, "memory_ratio": ratio}
            for name in PROFILES for strategy in STRATEGIES for ratio in ratios]


# mosos sweep ------------------------------------------------------------------------------------------


def run_cli_sweep(spec: Path, out: Path) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    started = time.monotonic()
    done = subprocess.run([*MOSOS, "sweep", str(spec), "--out", str(out), "--json"], capture_output=True, text=True,
                          env=environment, timeout=3600)
    total = time.monotonic() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"mosos sweep failed ({done.returncode}): {done.stderr[-2000:]}")
    document = json.loads(done.stdout)
    rows = [{"status": row["status"], "step_ms": row["predicted_step_time_ms"], "solve_s": row["solve_seconds"]}
            for row in document["rows"]]
    return {"total_s": total, "solves_s": document["wall_time_s"], "rows": rows}


# mosos serve --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_service(ratios: list[float], time_limit_s: float, directory: Path, backend: str) -> dict:
    import httpx

    port = free_port()
    count = len(solves(ratios))
    command = [*MOSOS, "serve", "--port", str(port), "--db", str(directory / f"plans-{backend}.sqlite3"),
               "--workers", str(os.cpu_count() or 2), "--queue-size", str(count + 8), "--max-solver-workers", "1",
               "--backend", backend, "--log-level", "warning"]
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    started = time.monotonic()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(directory / f"serve-{backend}.log", "w"),
                              env=environment, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    health = client.get("/healthz").json()
                    if health["solve_processes_ready"] == health["solve_processes"]:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mosos serve --backend {backend} did not start: see {directory}/serve-{backend}.log")
                time.sleep(0.2)
            profiles = {name: json.loads((REPO / "models" / "profiles" / name).read_text()) for name in PROFILES}
            first_sent = time.monotonic()
            ids = []
            for item in solves(ratios):
                body = {"profile": profiles[item["profile"]], "memory_ratio": item["memory_ratio"],
                        "strategy": item["strategy"], "time_limit_s": time_limit_s, "workers": 1, "seed": 0, "wait_s": 0}
                response = client.post("/v1/plans", json=body)
                if response.status_code not in (200, 202):
                    raise SystemExit(f"POST /v1/plans answered {response.status_code}: {response.text[:500]}")
                ids.append(response.json()["id"])
            answers: dict[str, dict] = {}
            while len(answers) < len(ids):
                for plan_id in ids:
                    if plan_id not in answers:
                        body = client.get(f"/v1/plans/{plan_id}").json()
                        if body["status"] not in ("queued", "solving"):
                            answers[plan_id] = body
                time.sleep(0.2)
            solves_s = time.monotonic() - first_sent
            total = time.monotonic() - started
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    rows = []
    for plan_id in ids:
        body = answers[plan_id]
        status = body["status"]
        if status == "done":
            status = "done" if body["feasible"] else "infeasible"
        step = body["schedule"]["summary"]["predicted_step_time_ms"] if body.get("schedule") else None
        rows.append({"status": status, "step_ms": step, "solve_s": body.get("solve_seconds")})
    return {"total_s": total, "solves_s": solves_s, "rows": rows}


# Killing a worker ------------------------------------------------------------------------------------------


def run_with_a_kill(spec: Path, out: Path) -> dict:
    """The sweep in this process; SIGKILL the Ray worker of a running mosos solve once 5 rows are done."""
    from cluster.runtime import connect
    from cluster.sweep import SweepRunner
    from cluster.sweep_spec import load_spec

    loaded = load_spec(spec)
    session = connect(None, what="benchmark")
    out.mkdir(parents=True, exist_ok=True)
    finished = [0]
    killed: dict = {}
    runner = SweepRunner(loaded, session, schedules_dir=out, on_row=lambda row: finished.__setitem__(0, finished[0] + 1))

    def killer() -> None:
        ray = session.ray
        while runner.control is None or finished[0] < 5:
            time.sleep(0.1)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            snapshot = ray.get(runner.control.snapshot.remote())
            for index, entry in snapshot.items():
                row = runner.rows[index]
                if row["status"] == "pending" and row["strategy"] == "mosos" and entry.get("pid"):
                    time.sleep(0.5)  # well into its solve
                    if runner.rows[index]["status"] != "pending":
                        continue
                    os.kill(entry["pid"], signal.SIGKILL)
                    killed.update(index=index, pid=entry["pid"], at_s=time.monotonic() - started, rows_done=finished[0])
                    return
            time.sleep(0.2)

    started = time.monotonic()
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        result = runner.run()
    finally:
        session.close()
    thread.join(timeout=5)
    return {"result": result, "killed": killed}


# Report ------------------------------------------------------------------------------------------------------


def counts(rows: list[dict]) -> str:
    found: dict[str, int] = {}
    for row in rows:
        found[row["status"]] = found.get(row["status"], 0) + 1
    return ", ".join(f"{count} {status}" for status, count in sorted(found.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=5.0, help="solver time limit per solve, seconds")
    parser.add_argument("--ratios", default="0.7,0.8,0.9,1.0", help="memory ratios of the sweep")
    parser.add_argument("--no-kill", action="store_true", help="skip the runs that kill a Ray worker")
    args = parser.parse_args()
    ratios = [float(item) for item in args.ratios.split(",")]
    count = len(solves(ratios))
    command = "python3 benchmarks/sweep_ray.py" + (f" --time-limit {args.time_limit:g}" if args.time_limit != 5 else "") + (
        f" --ratios {args.ratios}" if args.ratios != "0.7,0.8,0.9,1.0" else "") + (" --no-kill" if args.no_kill else "")
    load_before = load()
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        spec = write_spec(directory, ratios, args.time_limit)
        print(f"{count} solves; load {load_before}", flush=True)
        runs = {}
        print("mosos sweep (local Ray) ...", flush=True)
        runs["mosos sweep, local Ray"] = run_cli_sweep(spec, directory / "sweep-out")
        print("mosos serve (local processes) ...", flush=True)
        runs["mosos serve, local processes"] = run_service(ratios, args.time_limit, directory, "local")
        print("mosos serve --backend ray ...", flush=True)
        runs["mosos serve --backend ray (local Ray)"] = run_service(ratios, args.time_limit, directory, "ray")
        load_after_timing = load()
        kills = {}
        if not args.no_kill:
            for retries in (1, 0):
                print(f"sweep with a worker killed, retries {retries} ...", flush=True)
                kills[retries] = run_with_a_kill(write_spec(directory, ratios, args.time_limit, retries),
                                                 directory / f"kill-{retries}")
    reference = runs["mosos sweep, local Ray"]["rows"]
    lines = [
        f"## {count} solves: mosos sweep on Ray and mosos serve ({time.strftime('%Y-%m-%d')})",
        "",
        f"The four small shipped profiles ({', '.join(PROFILES)}) x memory ratios {', '.join(f'{r:g}' for r in ratios)} "
        f"x strategies {', '.join(STRATEGIES)}: {count} solves, time limit {args.time_limit:g} s, 1 solver thread each, "
        f"{os.cpu_count()} at once. Run one after the other in one run of the script; load average {load_before} "
        f"before, {load_after_timing} after.",
        "",
        "| configuration | total (s) | solves (s) | rows | same status as the sweep | step time differs (of done) | sum of solve times (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        same = sum(1 for mine, theirs in zip(run["rows"], reference) if mine["status"] == theirs["status"])
        differ = sum(1 for mine, theirs in zip(run["rows"], reference)
                     if mine["status"] == theirs["status"] == "done" and abs(mine["step_ms"] - theirs["step_ms"]) > 1e-6 * theirs["step_ms"])
        done = sum(1 for row in run["rows"] if row["status"] == "done")
        busy = sum(row["solve_s"] or 0 for row in run["rows"])
        lines.append(f"| {name} | {run['total_s']:.1f} | {run['solves_s']:.1f} | {counts(run['rows'])} | "
                     f"{same}/{len(reference)} | {differ}/{done} | {busy:.1f} |")
    lines += [
        "",
        "total: from starting the command (or the server) to the last answer, Ray's or the server's start included. "
        "solves: from the first solve sent to the last one ended. step time differs: done rows whose simulated step "
        "time is not the sweep's (a solve stopped by its time limit on a loaded machine may end at another "
        "solution). sum of solve times: the planner's own time per solve, added up.",
        "",
    ]
    lines += [f"Command: `{command}`", ""]
    write_section(RESULTS, INTRO, "\n".join(lines))
    print("\n".join(lines))
    if kills:
        lines = [
            f"## {count} solves with a Ray worker killed mid-sweep ({time.strftime('%Y-%m-%d')})",
            "",
            "The same sweep in the script's process on a fresh local Ray; once 5 rows were done, the Ray worker "
            "running a mosos solve was killed with SIGKILL, by the pid the SolveControl actor reported for it. "
            f"Load average {load()} at the end.",
            "",
            "| retries | killed | that solve's row | attempts (pids) | rows | wall (s) |",
            "|---|---|---|---|---|---|",
        ]
        for retries, run in kills.items():
            result, killed = run["result"], run["killed"]
            if not killed:
                lines.append(f"| {retries} | nothing killed (no mosos solve was found running) | | | {counts(result.rows)} | "
                             f"{result.wall_time_s:.1f} |")
                continue
            row = result.rows[killed["index"]]
            what = row["status"] + (f": {row['reason']}" if row.get("reason") else
                                    f", {row['predicted_step_time_ms']:.3f} ms" if row.get("predicted_step_time_ms") else "")
            lines.append(
                f"| {retries} | pid {killed['pid']} at {killed['at_s']:.1f} s (row {killed['index']}: {row['source'].split('/')[-1]}, "
                f"{row['strategy']}, {row['budget']}; {killed['rows_done']} rows done) | {what} | "
                f"{row['attempts']} ({row['pids']}) | {counts(result.rows)} of {len(result.rows)} | {result.wall_time_s:.1f} |"
            )
        for retries, run in kills.items():
            lines.append("")
            result, killed = run["result"], run["killed"]
            answered = sum(1 for row in result.rows if row["status"] in ("done", "infeasible", "failed", "timed_out"))
            fate = result.rows[killed["index"]]["status"] if killed else "-"
            lines.append(f"retries {retries}: {answered} of {len(result.rows)} solves have a row with their answer or why they failed; "
                         f"the killed solve's row: {fate}.")
        lines += ["", f"Command: `{command}`", ""]
        write_section(RESULTS, INTRO, "\n".join(lines))
        print("\n".join(lines))


if __name__ == "__main__":
    main()
