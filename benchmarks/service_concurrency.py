"""Concurrency of the planning service: 50 requests in flight against a real `mosos serve` with 2 solve processes.

Mixed load (plan, status, simulate) fired at once, then status calls timed while
every solve process is busy. Solves are CPU-bound: the `mosos` strategy when it is
registered (--strategy mosos), else a plugin strategy that burns CPU for its time
limit. Prints a table and writes benchmarks/results/service.md.

    python3 benchmarks/service_concurrency.py [--requests 50] [--solve-seconds 3] [--strategy bench-busy]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "service.md"

from benchmarks.results_file import write_section  # noqa: E402

BUSY_PLUGIN = textwrap.dedent(
    '''
    """bench-busy: burns one core for time_limit_s (stops when asked), then returns the keep-all plan."""
    import time

    from planner.builder import certify
    from planner.strategies import strategy
    from planner.strategies.keep_all import keep_all_schedule


    @strategy("bench-busy", "CPU-bound stand-in for a solver: spins for time_limit_s", uses_budget=False)
    def busy(profile, budget_bytes, options):
        started = last = time.monotonic()
        spins = 0
        while time.monotonic() - started < options.time_limit_s:
            if options.should_stop is not None and options.should_stop():
                break
            for _ in range(20000):
                spins += 1
            if options.progress is not None and time.monotonic() - last > 0.1:
                last = time.monotonic()
                options.progress({"strategy": "bench-busy", "objective": 1.0 + 1.0 / spins, "bound": 1.0, "gap": 0.0})
        return certify(profile, keep_all_schedule(profile, None), "bench-busy")
    '''
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chain_profile(layers: int = 20) -> dict:
    """A conv/relu chain with its backward pass: enough nodes to make plans and simulations non-trivial."""
    mib = 2**20
    nodes = []
    previous = None
    for i in range(layers):
        nodes.append({"id": f"f{i}", "kind": "forward", "op_type": "conv2d", "output_bytes": 32 * mib,
                      "inputs": [previous] if previous else [],
                      "implementations": [{"name": "gemm", "time_ms": 1.0 + i % 3, "workspace_bytes": 0},
                                          {"name": "fft", "time_ms": 0.6 + i % 3, "workspace_bytes": 64 * mib}]})
        previous = f"f{i}"
    nodes.append({"id": "loss", "kind": "loss", "op_type": "loss", "output_bytes": mib, "inputs": [previous],
                  "implementations": [{"name": "default", "time_ms": 0.1}]})
    grad = "loss"
    for i in reversed(range(layers)):
        reads = [grad] + ([f"f{i - 1}"] if i > 0 else [f"f{i}"])
        nodes.append({"id": f"b{i}", "kind": "backward", "op_type": "conv2d_backward", "output_bytes": 32 * mib,
                      "forward_node": f"f{i}", "inputs": reads,
                      "implementations": [{"name": "default", "time_ms": 2.0, "workspace_bytes": 16 * mib}]})
        grad = f"b{i}"
    return {
        "name": f"chain of {layers} convolutions",
        "hardware": {"name": "bench GPU", "memory_capacity_bytes": 16 * 2**30, "d2h_bandwidth_gb_per_s": 12.0,
                     "h2d_bandwidth_gb_per_s": 12.0, "transfer_latency_ms": 0.01},
        "fixed_memory": {"parameters_bytes": 256 * mib},
        "nodes": nodes,
        "provenance": {"source": "handmade", "notes": "service benchmark"},
    }


@contextlib.contextmanager
def serve(workdir: Path, *, workers: int = 2, queue_size: int = 32, extra: list[str] | None = None, db: Path | None = None,
          port: int | None = None, busy_plugin: bool = True):
    """A real `mosos serve` on a loopback port in its own session; always killed (whole session) on exit.

    The bench-busy plugin is left out when real strategies are measured: mosos runs every registered
    strategy inside itself, and would spin through bench-busy too.
    """
    plugins = []
    if busy_plugin:
        plugin = workdir / "bench_busy_plugin.py"
        plugin.write_text(BUSY_PLUGIN)
        plugins = ["--plugin", str(plugin)]
    port = port or free_port()
    log_path = workdir / f"serve-{port}.log"
    command = [
        sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--db", str(db or workdir / "plans.sqlite3"), "--workers", str(workers), "--queue-size", str(queue_size),
        *plugins, "--log-level", "warning", "--max-solver-workers", "1", *(extra or []),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MOSOS_API_TOKEN", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mosos serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mosos serve did not answer in 90 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield process, base, log_path
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def _status_server_mean_s(before: str, after: str) -> float:
    """Mean time the server itself spent on status calls between two /metrics scrapes."""

    def sample(text: str, name: str) -> float:
        key = name + '{route="/v1/plans/{plan_id}"}'
        for line in text.splitlines():
            if line.startswith(key):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    count = sample(after, "mosos_http_request_seconds_count") - sample(before, "mosos_http_request_seconds_count")
    total = sample(after, "mosos_http_request_seconds_sum") - sample(before, "mosos_http_request_seconds_sum")
    return total / count if count else float("nan")


PROBE = textwrap.dedent(
    """
    import json, sys, threading, time

    import httpx

    base, plan_id = sys.argv[1], sys.argv[2]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    calls = []
    with httpx.Client(base_url=base, timeout=60.0) as client:
        client.get(f"/v1/plans/{plan_id}")
        print("ready", flush=True)
        while not stop.is_set():
            started = time.monotonic()
            code = client.get(f"/v1/plans/{plan_id}").status_code
            calls.append((started, time.monotonic(), code))
            time.sleep(0.002)
    print(json.dumps(calls), flush=True)
    """
)


def start_probe(base: str, plan_id: str) -> subprocess.Popen:
    """A separate client (own process, own connection) polling a plan's status one call at a time.

    It shares no CPU or event loop with the client that fires the burst, so its latencies are what a training
    job polling its plan would see while the burst is in flight. `stop_probe` ends it.
    """
    probe = subprocess.Popen([sys.executable, "-c", PROBE, base, plan_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    if probe.stdout.readline().strip() != "ready":
        probe.kill()
        raise RuntimeError("the status probe did not start")
    return probe


def stop_probe(probe: subprocess.Popen) -> list[tuple[float, float, int]]:
    """(start, end, status code) of every probe call, on the monotonic clock (shared by processes on Linux)."""
    out, _ = probe.communicate("stop\n", timeout=60)
    return [tuple(call) for call in json.loads(out.strip().splitlines()[-1])]


def _json_content(body: dict) -> dict:
    """Request arguments with the body encoded now, so that the burst does not time the client's JSON encoding."""
    return {"content": json.dumps(body).encode(), "headers": {"content-type": "application/json"}}


def _process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of one process (its children not included), from /proc; nan where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return float("nan")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


class _RawResponse:
    def __init__(self, status_code: int, headers: dict[str, str], content: bytes):
        self.status_code = status_code
        self.headers = headers
        self.content = content

    def json(self):
        return json.loads(self.content)


class RawClient:
    """A minimal HTTP/1.1 client on asyncio streams: one new connection per request, as separate clients would.

    httpx spends 1.5-2 ms of CPU per call in the client, more than the server spends answering a status call;
    fired 50 at once from one process, that client work is what the burst's latencies would measure. This
    client spends ~0.1 ms, so the burst's latencies are the server's (plus connecting, which real clients pay).
    """

    def __init__(self, base_url: str, timeout_s: float = 60.0):
        host_port = base_url.split("://", 1)[1].rstrip("/")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.timeout_s = timeout_s

    async def request(self, method: str, url: str, content: bytes = b"", headers: dict[str, str] | None = None) -> _RawResponse:
        return await asyncio.wait_for(self._request(method, url, content, headers or {}), self.timeout_s)

    async def _request(self, method: str, url: str, content: bytes, headers: dict[str, str]) -> _RawResponse:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            lines = [f"{method} {url} HTTP/1.1", f"host: {self.host}:{self.port}", f"content-length: {len(content)}",
                     "connection: close", *(f"{key}: {value}" for key, value in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + content)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            response_headers = {}
            for line in head[1:]:
                if ":" in line:
                    key, value = line.split(":", 1)
                    response_headers[key.strip().lower()] = value.strip()
            if "content-length" in response_headers:
                body = await reader.readexactly(int(response_headers["content-length"]))
            elif response_headers.get("transfer-encoding", "").lower() == "chunked":
                chunks = []
                while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)) > 0:
                    chunks.append(await reader.readexactly(size))
                    await reader.readexactly(2)
                body = b"".join(chunks)
            else:
                body = await reader.read()
            return _RawResponse(status, response_headers, body)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as error:
            raise httpx.TransportError(f"{method} {url}: {error!r}") from error
        finally:
            writer.close()


async def _timed(client: httpx.AsyncClient | RawClient, kind: str, method: str, url: str, **kwargs) -> dict:
    started = time.perf_counter()
    try:
        response = await client.request(method, url, **kwargs)
        return {"kind": kind, "status": response.status_code, "seconds": time.perf_counter() - started,
                "body": response.json() if response.headers.get("content-type", "").startswith("application/json") else None}
    except (httpx.HTTPError, asyncio.TimeoutError) as error:
        return {"kind": kind, "status": None, "seconds": time.perf_counter() - started, "error": repr(error)}


async def run_mix(base: str, *, requests: int = 50, plans: int = 10, simulates: int = 10, solve_seconds: float = 3.0,
                  strategy: str = "bench-busy", budget_ratio: float | None = None, server_pid: int | None = None, layers: int = 20,
                  client_kind: str = "raw") -> dict:
    """Fire `requests` at once (plans, status, simulate), then time status calls while the solves run.

    The timed calls go through `RawClient` (client_kind "raw") or one shared httpx.AsyncClient ("httpx").

    During the burst a probe in its own process polls a status one call at a time (see `start_probe`); with
    `server_pid`, the server process's own CPU time over the burst is measured too.
    """
    profile = chain_profile(layers)
    async with httpx.AsyncClient(base_url=base, timeout=60.0, limits=httpx.Limits(max_connections=requests + 10)) as client:
        seed_plan = await client.post("/v1/plans", json={"profile": profile, "strategy": "keep-all", "wait_s": 20, "workers": 1})
        seed_plan.raise_for_status()
        timed_client = RawClient(base) if client_kind == "raw" else client
        known = seed_plan.json()
        schedule = known["schedule"]
        run_tag = int(time.time() * 1000) % 1_000_000  # fresh seeds: every plan of this run is a real solve
        simulate_body = _json_content({"profile": profile, "schedule": schedule})
        calls = []
        for i in range(requests):
            if i % 5 == 0 and len([c for c in calls if c[0] == "plan"]) < plans:
                body = {"profile": profile, "strategy": strategy, "time_limit_s": solve_seconds, "workers": 1,
                        "seed": run_tag * 100 + i, "wait_s": 0}
                if budget_ratio is not None:
                    body["memory_ratio"] = budget_ratio
                calls.append(("plan", "POST", "/v1/plans", _json_content(body)))
            elif i % 5 == 1 and len([c for c in calls if c[0] == "simulate"]) < simulates:
                calls.append(("simulate", "POST", "/v1/simulate", simulate_body))
            else:
                calls.append(("status", "GET", f"/v1/plans/{known['id']}", {}))
        while len(calls) < requests:
            calls.append(("status", "GET", f"/v1/plans/{known['id']}", {}))
        probe = start_probe(base, known["id"])
        await asyncio.sleep(0.05)
        server_cpu_before = _process_cpu_s(server_pid)
        started = time.perf_counter()
        burst_started = time.monotonic()
        burst = await asyncio.gather(*(_timed(timed_client, kind, method, url, **kw) for kind, method, url, kw in calls))
        burst_ended = time.monotonic()
        burst_seconds = time.perf_counter() - started
        server_cpu_burst_s = _process_cpu_s(server_pid) - server_cpu_before
        probe_calls = stop_probe(probe)
        probe_during = [(end - start, code) for start, end, code in probe_calls if start >= burst_started and end <= burst_ended]
        plan_ids = [r["body"]["id"] for r in burst if r["kind"] == "plan" and r["status"] in (200, 202)]
        # Status calls while every solve process is busy.
        health = (await client.get("/healthz")).json()
        busy_during = health["solves_running"]
        before = (await client.get("/metrics")).text
        sequential = []
        for i in range(40):  # one at a time, as a training job polling its plan would
            sequential.append(await _timed(timed_client, "status", "GET", f"/v1/plans/{plan_ids[i % len(plan_ids)]}"))
        during = []
        for _ in range(3):
            wave = await asyncio.gather(*(_timed(timed_client, "status", "GET", f"/v1/plans/{pid}") for pid in plan_ids))
            during.extend(wave)
            await asyncio.sleep(0.05)
        after = (await client.get("/metrics")).text
        health_after = (await client.get("/healthz")).json()
        # Every plan must end: none lost, none stuck.
        finals = {}
        deadline = time.monotonic() + solve_seconds * (plans + 2) + 60
        while len(finals) < len(plan_ids) and time.monotonic() < deadline:
            for pid in plan_ids:
                if pid not in finals:
                    body = (await client.get(f"/v1/plans/{pid}")).json()
                    if body["status"] not in ("queued", "solving"):
                        finals[pid] = body["status"]
            await asyncio.sleep(0.2)
        metrics = (await client.get("/metrics")).text
    burst_status = [r["seconds"] for r in burst if r["kind"] == "status"]
    during_status = [r["seconds"] for r in during]
    sequential_status = [r["seconds"] for r in sequential]
    return {
        "requests": len(burst),
        "answered": sum(1 for r in burst if r["status"] is not None),
        "errors": [r for r in burst if r["status"] is None or r["status"] >= 500],
        "codes": sorted({(r["kind"], r["status"]) for r in burst}),
        "wrong": [r for r in burst if (r["kind"], r["status"]) not in {("plan", 200), ("plan", 202), ("status", 200), ("simulate", 200)}
                  or (r["kind"] == "simulate" and not r["body"]["valid"])],
        "burst_seconds": burst_seconds,
        "plans": len(plan_ids),
        "finals": finals,
        "busy_during": min(busy_during, health_after["solves_running"]),
        "status_p50_burst_ms": 1000 * percentile(burst_status, 0.5),
        "probe_calls_burst": len(probe_during),
        "probe_p50_burst_ms": 1000 * percentile([seconds for seconds, _ in probe_during], 0.5),
        "probe_p95_burst_ms": 1000 * percentile([seconds for seconds, _ in probe_during], 0.95),
        "probe_errors": [code for _, code in probe_during if code != 200],
        "server_cpu_burst_ms": 1000 * server_cpu_burst_s,
        "status_p95_burst_ms": 1000 * percentile(burst_status, 0.95),
        "status_p50_during_ms": 1000 * percentile(during_status, 0.5),
        "status_p95_during_ms": 1000 * percentile(during_status, 0.95),
        "status_calls_during": len(during_status),
        "status_server_mean_ms": 1000 * _status_server_mean_s(before, after),
        "status_p50_sequential_ms": 1000 * percentile(sequential_status, 0.5),
        "status_p95_sequential_ms": 1000 * percentile(sequential_status, 0.95),
        "status_errors_during": [r for r in during + sequential if r["status"] != 200],
        "simulate_p50_ms": 1000 * percentile([r["seconds"] for r in burst if r["kind"] == "simulate"], 0.5),
        "plan_post_p50_ms": 1000 * percentile([r["seconds"] for r in burst if r["kind"] == "plan"], 0.5),
        "metrics_has_solves": "mosos_solves_total" in metrics,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--plans", type=int, default=10)
    parser.add_argument("--simulates", type=int, default=10)
    parser.add_argument("--solve-seconds", type=float, default=3.0)
    parser.add_argument("--strategy", default="bench-busy", help="bench-busy, or mosos once it is registered")
    parser.add_argument("--memory-ratio", type=float, default=None, help="budget for strategies that need one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=20,
                        help="convolutions in the chain profile (2 * layers + 1 nodes): more makes every body heavier")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="client of the timed calls: a minimal HTTP/1.1 client (raw), or httpx (its own CPU shows)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, serve(Path(tmp), workers=2, busy_plugin=args.strategy == "bench-busy") as (server, base, _log):
        for repeat in range(args.repeats):
            stats = asyncio.run(run_mix(base, requests=args.requests, plans=args.plans, simulates=args.simulates,
                                        solve_seconds=args.solve_seconds, strategy=args.strategy,
                                        budget_ratio=args.memory_ratio, server_pid=server.pid, layers=args.layers,
                                        client_kind=args.client))
            stats["repeat"] = repeat + 1
            rows.append(stats)
            lost = stats["plans"] - len(stats["finals"])
            print(f"run {repeat + 1}: {stats['answered']}/{stats['requests']} answered, {len(stats['wrong'])} wrong, "
                  f"{lost} lost, busy {stats['busy_during']}/2, status p50 {stats['status_p50_sequential_ms']:.1f} ms one at a time, "
                  f"{stats['status_p50_during_ms']:.1f} ms 10 at a time while solving, burst p50 {stats['status_p50_burst_ms']:.1f} ms, "
                  f"probe p50 in the burst {stats['probe_p50_burst_ms']:.1f} ms ({stats['probe_calls_burst']} calls, "
                  f"{len(stats['probe_errors'])} errors), server CPU in the burst {stats['server_cpu_burst_ms']:.0f} ms")
    header = ("| run | in flight | answered | wrong | plans done / lost | solves busy | status p50 / p95 while solving, one at a time (ms) "
              "| status p50 / p95 while solving, 10 at a time (ms) | server time per status call, mean (ms) | status p50 / p95 in the 50-request burst (ms) "
              "| probe status p50 / p95 during the burst, separate client (ms) | server process CPU in the burst (ms) "
              "| simulate p50 (ms) | plan POST p50 (ms) |")
    lines = [header, "|" + "---|" * 14]
    for s in rows:
        lines.append(
            f"| {s['repeat']} | {s['requests']} | {s['answered']} | {len(s['wrong'])} "
            f"| {sum(1 for v in s['finals'].values() if v == 'done')} / {s['plans'] - len(s['finals'])} "
            f"| {s['busy_during']}/2 | {s['status_p50_sequential_ms']:.1f} / {s['status_p95_sequential_ms']:.1f} "
            f"| {s['status_p50_during_ms']:.1f} / {s['status_p95_during_ms']:.1f} | {s['status_server_mean_ms']:.1f} "
            f"| {s['status_p50_burst_ms']:.1f} / {s['status_p95_burst_ms']:.1f} "
            f"| {s['probe_p50_burst_ms']:.1f} / {s['probe_p95_burst_ms']:.1f} ({s['probe_calls_burst']} calls) "
            f"| {s['server_cpu_burst_ms']:.0f} | {s['simulate_p50_ms']:.1f} "
            f"| {s['plan_post_p50_ms']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    cpu = os.cpu_count()
    load = os.getloadavg()
    nodes = len(chain_profile(args.layers)["nodes"])
    section = (
        f"## strategy `{args.strategy}`" + (f", {nodes}-node profile" if args.layers != 20 else "")
        + (f", {args.client} client" if args.client != "raw" else "") + "\n\n"
        f"Command: `python3 benchmarks/service_concurrency.py --requests {args.requests} --plans {args.plans} "
        f"--simulates {args.simulates} --solve-seconds {args.solve_seconds:g} --strategy {args.strategy}"
        + (f" --memory-ratio {args.memory_ratio:g}" if args.memory_ratio is not None else "")
        + (f" --layers {args.layers}" if args.layers != 20 else "")
        + (f" --client {args.client}" if args.client != "raw" else "")
        + f" --repeats {args.repeats}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"Machine: {cpu} cores; load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}.\n\n"
        f"{table}\n"
    )
    intro = (
        "# Planning service under concurrent load\n\n"
        "A real `mosos serve` on 127.0.0.1 with 2 solve processes. Each run fires 50 requests at once: 10 plans "
        f"of a {len(chain_profile()['nodes'])}-node profile unless the section says otherwise (fresh seeds, so every one is a real solve), 10 "
        "simulations and 30 status calls. Then, while both solve processes are busy, it times status calls of "
        "the new plans: 40 one at a time (as a training job polling its plan does), then 3 waves of 10 at once. "
        "Finally it polls every plan until it ends. Latencies are measured by the client on the same machine: "
        "unless a section says otherwise, a minimal HTTP/1.1 client on asyncio streams (`RawClient`, one new "
        "connection per request, as 50 separate clients would open), because httpx spends 1.5-2 ms of CPU per call "
        "in the client, more than the server spends answering a status call, and fired 50 at once from one process "
        "that client work is what the burst would measure (`--client httpx` shows it). 10 at a time includes the "
        "queueing of 10 calls on one event loop; the server's own time per status call (from its "
        "`mosos_http_request_seconds` histogram) is given too. During the burst a probe in a process of its own "
        "(own httpx connection) polls a status one call at a time, as a training job polling its plan does. The "
        "server process's own CPU time over the burst (from /proc, request and solve processes not included) says "
        "how much work "
        "was left on its event loop and GIL. `bench-busy` is a plugin strategy that spins one core for the time "
        "limit (a CPU-bound stand-in with a known duration); `mosos` is the real CP-SAT planner. The machine's 2 "
        "cores are shared with other engineers' jobs: each section gives the load average at its end.\n\n"
        "wrong: answers other than 200/202 for plans and 200 for status and simulate. plans done / lost: plans that "
        "ended done (of 10), and plans that never reached done, failed or cancelled. solves busy: solve processes running when the status calls "
        "were timed.\n"
    )
    write_section(RESULTS, intro, section)
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
