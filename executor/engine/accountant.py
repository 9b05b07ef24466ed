"""The CPU's stand-in for torch.cuda.max_memory_allocated: a byte-exact ledger of what the executor holds.

Every amount comes from the real tensors (the distinct storages a node's
entry holds after it computes or is prefetched), plus fixed memory and the
workspace of the implementation that runs. When things happen follows the
simulator's rules with the profile's times, because that is what the device
does: a copy takes time on its own stream, a tensor freed while its offload
runs stays allocated until the copy ends, and a prefetch owns its buffer from
the moment it is issued. On the CPU, where copies are synchronous, this is
the only way the ledger can mean the same thing as on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.profile import GraphProfile


@dataclass
class Accountant:
    profile: GraphProfile
    fixed_bytes: int
    compute_ms: float = 0.0
    d2h_ms: float = 0.0
    h2d_ms: float = 0.0
    events: list[tuple[float, int, int, str]] = field(default_factory=list)  # (time, delta, sequence, label)
    offload_end_ms: dict[str, float] = field(default_factory=dict)
    prefetch_end_ms: dict[str, float] = field(default_factory=dict)
    resident_bytes: dict[str, int] = field(default_factory=dict)

    def _event(self, time_ms: float, delta: int, label: str) -> None:
        self.events.append((time_ms, delta, len(self.events), label))

    def compute(self, node_id: str, time_ms: float, output_bytes: int, workspace_bytes: int) -> None:
        start, end = self.compute_ms, self.compute_ms + time_ms
        self._event(start, output_bytes, f"compute {node_id}")
        if workspace_bytes:
            self._event(start, workspace_bytes, f"workspace {node_id}")
            self._event(end, -workspace_bytes, f"workspace {node_id}")
        self.resident_bytes[node_id] = output_bytes
        self.compute_ms = end

    def transient(self, label: str, size_bytes: int) -> None:
        """Memory allocated and released at one instant of the compute stream (counted in the peak)."""
        self._event(self.compute_ms, size_bytes, label)
        self._event(self.compute_ms, -size_bytes, label)

    def offload(self, node_id: str) -> None:
        size = self.resident_bytes[node_id]
        start = max(self.compute_ms, self.d2h_ms)
        self.d2h_ms = start + self.profile.hardware.offload_time_ms(size)
        self.offload_end_ms[node_id] = self.d2h_ms

    def prefetch(self, node_id: str, size_bytes: int) -> None:
        self._event(self.compute_ms, size_bytes, f"prefetch {node_id}")
        start = max(self.compute_ms, self.h2d_ms, self.offload_end_ms.get(node_id, 0.0))
        self.h2d_ms = start + self.profile.hardware.prefetch_time_ms(size_bytes)
        self.prefetch_end_ms[node_id] = self.h2d_ms
        self.resident_bytes[node_id] = size_bytes

    def wait(self, node_id: str, transfer: str) -> None:
        ends = self.prefetch_end_ms if transfer == "prefetch" else self.offload_end_ms
        self.compute_ms = max(self.compute_ms, ends.get(node_id, 0.0))

    def free(self, node_id: str) -> None:
        release = max(self.compute_ms, self.offload_end_ms.get(node_id, 0.0))
        self._event(release, -self.resident_bytes.pop(node_id), f"free {node_id}")

    def peak_bytes(self) -> int:
        used = peak = self.fixed_bytes
        # Equal times keep program order, as in the simulator: a zero-time node's output still counts.
        for _, delta, _, _ in sorted(self.events, key=lambda e: (e[0], e[2])):
            used += delta
            peak = max(peak, used)
        return peak

    def held_bytes(self) -> int:
        """What is still allocated after the step (beyond fixed memory)."""
        return sum(delta for _, delta, _, _ in self.events)
