"""Shared fixtures: small profiles built in code, and the path to ../shared when it exists."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from planner.profile import GraphProfile, parse_profile

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
CHECKMATE_GRAPHS = SHARED / "data" / "checkmate-graphs"


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory, monkeypatch):
    """Each test (and every process it starts) keeps plans in a cache of its own: a plan kept by one test never
    stands in for the capture, profile and solve another test is about."""
    monkeypatch.setenv("MOSOS_CACHE_DIR", str(tmp_path_factory.mktemp("mosos-cache")))


@pytest.fixture
def still_heap():
    """For a test that times a deadline in wall-clock seconds: an hour into the suite the process holds millions
    of objects, and one full collection of them can stall a step of the code under test for about a second. What
    exists when the test starts is frozen out of the collector's reach until it ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def requires_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not here (../shared/ exists only beside the project's own checkout)")
    return path


def node(node_id, kind="forward", inputs=(), output_bytes=1000, time_ms=1.0, workspace_bytes=0, **extra):
    implementations = extra.pop("implementations", None) or [
        {"name": "default", "time_ms": time_ms, "workspace_bytes": workspace_bytes}
    ]
    return {
        "id": node_id,
        "kind": kind,
        "inputs": list(inputs),
        "output_bytes": output_bytes,
        "implementations": implementations,
        **extra,
    }


def profile_data(nodes, fixed_bytes=0, d2h=None, h2d=None, latency_ms=0.0, capacity=10**12, name="test"):
    return {
        "schema_version": "1.0",
        "name": name,
        "hardware": {
            "name": "test device",
            "memory_capacity_bytes": capacity,
            "d2h_bandwidth_gb_per_s": d2h,
            "h2d_bandwidth_gb_per_s": h2d,
            "transfer_latency_ms": latency_ms,
        },
        "fixed_memory": {"parameters_bytes": fixed_bytes},
        "nodes": nodes,
        "provenance": {"source": "handmade"},
    }


def make_profile(nodes, **options) -> GraphProfile:
    return parse_profile(profile_data(nodes, **options))


@pytest.fixture
def offload_profile() -> GraphProfile:
    """Five nodes, 1 GB/s each way: 1e6 bytes move in 1 ms."""
    return make_profile(
        [
            node("a", output_bytes=2_000_000, time_ms=1.0),
            node("b", inputs=["a"], output_bytes=1_000_000, time_ms=3.0, workspace_bytes=500_000),
            node("loss", kind="loss", inputs=["b"], output_bytes=10, time_ms=1.0),
            node("b:bwd", kind="backward", inputs=["loss", "a"], output_bytes=1_000_000, time_ms=2.0, forward_node="b"),
            node("a:bwd", kind="backward", inputs=["b:bwd"], output_bytes=2_000_000, time_ms=1.0),
        ],
        fixed_bytes=100,
        d2h=1.0,
        h2d=1.0,
    )


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for each module that asks for it (its start costs seconds): 2 CPUs, a small object store.
    Not one for the whole session: its processes (raylet, log monitor, idle workers) took a few percent of a core
    from every test in between, the timed ones included.

    `mosos sweep` and the service's Ray backend find it already running in this process and use it; a command
    run in a subprocess joins it with --address.
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, object_store_memory=128 * 2**20, include_dashboard=False,
                 logging_level="warning", log_to_driver=False)
    yield ray
    ray.shutdown()
