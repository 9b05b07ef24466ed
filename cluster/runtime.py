"""Starting or joining Ray: a local instance sized to this machine, or a cluster by address.

Ray is an optional extra: `import_ray` says what to install when it is missing.
Connecting checks, with one tiny task, that the workers run this mosos (a
cluster whose nodes miss it, or run another version, is refused before any
solve is sent).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.errors import MososError
# Imports inside functions here are deferred for start-up time: Ray workers import the planner when a task runs on
# them.

INSTALL_HINT = "pip install 'mosos[ray]'"
PROBE_TIMEOUT_S = 120.0
REACH_TIMEOUT_S = 10.0
MIB = 2**20


class RayUnavailable(MososError):
    """Ray is not installed, or the cluster cannot be reached or cannot run mosos."""


def import_ray(what: str) -> Any:
    """The `ray` module, or a message that says `what` needs it and how to install it."""
    try:
        import ray
    except ImportError as error:
        raise RayUnavailable(f"{what} needs Ray, which is not installed here: {INSTALL_HINT} ({error})") from None
    return ray


def usable_cpus() -> int:
    """The cores this process may run on (a container's CPU set, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def total_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def local_object_store_bytes() -> int:
    """Profiles and schedules are megabytes: a tenth of the memory, between 256 MiB and 2 GiB, is plenty.

    Ray's own default (30% of memory) would reserve gigabytes of shared memory for nothing.
    """
    memory = total_memory_bytes()
    if memory is None:
        return 512 * MIB
    return int(min(2048 * MIB, max(256 * MIB, memory // 10)))


@dataclass
class RaySession:
    ray: Any
    address: str
    local: bool
    owned: bool  # this session called ray.init, so it shuts Ray down at the end
    closer: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return f"a local Ray ({self.cpus:g} CPUs)" if self.local else f"the Ray cluster at {self.address} ({self.cpus:g} CPUs)"

    @property
    def cpus(self) -> float:
        return float(self.ray.cluster_resources().get("CPU", 0))

    def largest_node_cpus(self) -> float:
        """CPUs of the largest live node: a task asking for more never starts."""
        nodes = [node for node in self.ray.nodes() if node.get("Alive")]
        return max((float(node.get("Resources", {}).get("CPU", 0)) for node in nodes), default=0.0)

    def close(self) -> None:
        if self.closer is not None:
            self.closer()
        elif self.owned and self.ray.is_initialized():
            self.ray.shutdown()


def connect(address: str | None, *, what: str, log_to_driver: bool = False) -> RaySession:
    """Join the cluster at `address` (or $RAY_ADDRESS), else start a local Ray sized to this machine.

    If Ray is already initialised in this process (tests, notebooks), that session is used and left running.
    """
    ray = import_ray(what)
    if ray.is_initialized():
        context = ray.get_runtime_context()
        session = RaySession(ray, context.gcs_address, local=address is None, owned=False)
        check_workers(session, what)
        return session
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_reachable(address, what)
    options: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=log_to_driver)
    try:
        if address is None:
            ray.init(
                address="local",
                num_cpus=usable_cpus(),
                object_store_memory=local_object_store_bytes(),
                include_dashboard=False,
                **options,
            )
        else:
            ray.init(address=address, **options)
    except Exception as error:  # ConnectionError, ValueError (bad address), RuntimeError, ...
        if ray.is_initialized():
            ray.shutdown()
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise RayUnavailable(f"{what}: cannot start or join {where}: {type(error).__name__}: {error}") from None
    session = RaySession(ray, ray.get_runtime_context().gcs_address, local=address is None, owned=True)
    try:
        check_workers(session, what)
    except BaseException:
        session.close()
        raise
    return session


def check_reachable(address: str, what: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Refuse at once an address nothing listens on (Ray itself would retry for many minutes)."""
    target = address[len("ray://"):] if address.startswith("ray://") else address
    if target in ("auto", "local") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise RayUnavailable(f"{what}: cannot read the Ray address {address!r}: write host:port, ray://host:port or auto") from None
    try:
        with socket.create_connection((host.strip("[]"), number), timeout=timeout_s):
            pass
    except OSError as error:
        raise RayUnavailable(
            f"{what}: nothing answers at the Ray address {address} ({error.strerror or error}); "
            "is the cluster started (ray start --head) and the address its GCS host:port?"
        ) from None


def connect_in_own_thread(address: str | None, *, what: str, log_to_driver: bool = False) -> RaySession:
    """`connect` from a thread that lives until the session is closed.

    A local Ray's processes die with the thread that started them (they are set to die with their parent
    thread), so a server that starts Ray from a short-lived pool thread would lose it a while later.
    """
    started = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    def own() -> None:
        try:
            box["session"] = connect(address, what=what, log_to_driver=log_to_driver)
        except BaseException as error:  # handed to the caller
            box["error"] = error
            return
        finally:
            started.set()
        stop.wait()
        box["session"].close()

    thread = threading.Thread(target=own, name="mosos-ray-owner", daemon=True)
    thread.start()
    started.wait()
    if "error" in box:
        raise box["error"]
    session: RaySession = box["session"]

    def close() -> None:
        stop.set()
        thread.join(timeout=60)

    return RaySession(session.ray, session.address, session.local, session.owned, closer=close)


def check_workers(session: RaySession, what: str) -> None:
    """One tiny task: do the workers import this mosos? Refuse a cluster that cannot run it, with the reason."""
    import planner
    from cluster import remote

    ray = session.ray
    reference = remote.probe_task(ray).remote()
    try:
        version = ray.get(reference, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(reference, force=True)
        raise RayUnavailable(
            f"{what}: no Ray worker ran a probe task within {PROBE_TIMEOUT_S:g} s (is the cluster out of resources?)"
        ) from None
    except ray.exceptions.RayError as error:
        first = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise RayUnavailable(
            f"{what}: the Ray workers cannot run mosos ({first}); install the same mosos on every node: {INSTALL_HINT}"
        ) from None
    if version != planner.__version__:
        raise RayUnavailable(
            f"{what}: the Ray workers run mosos {version}, this process {planner.__version__}: "
            "install the same version on every node"
        )
