"""What a step really holds on its device, beside what its tensors take.

A GPU runs out of memory at what the process holds: the caching allocator's
reserved segments (live tensors plus cached and fragmented blocks) and what
lives outside that allocator (the CUDA context, cuBLAS and cuDNN handles and
workspaces). The ledger counts tensors; this module reads the allocator and
the device around every planned step, so that a step holding more than its
budget is a finding in `report()`, not a silent success.

`DeviceMemory` is the interface (a test gives a fake caching allocator);
`CudaMemory` reads torch.cuda's statistics and `mem_get_info`. The CPU has no
caching allocator to read (glibc returns large blocks to the system), so it
has none: there the ledger's allocated bytes are what the step holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from planner.units import format_bytes


@dataclass(frozen=True)
class HeldMemory:
    """One step: its peak of allocated bytes, of the allocator's reserved segments, and what the device held
    outside the allocator at its end."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    outside_allocator_bytes: int

    @property
    def held_peak_bytes(self) -> int:
        """What the device held for this process at the step's worst: reserved segments plus the rest."""
        return self.reserved_peak_bytes + self.outside_allocator_bytes


class DeviceMemory(Protocol):
    def outside_allocator_bytes(self) -> int:
        """What the process holds on the device outside PyTorch's allocator now (the CUDA context, libraries)."""

    def begin_step(self) -> None:
        """Start a step's peaks afresh."""

    def end_step(self) -> HeldMemory:
        """The step's figures, read once it has ended."""


class CudaMemory:
    """torch.cuda's caching allocator and the device's own count. `mem_get_info` counts every process on the
    device, so on a shared GPU the outside figure includes the others' memory too (it errs towards more)."""

    def __init__(self, device: torch.device):
        self.device = device

    def outside_allocator_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))

    def begin_step(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> HeldMemory:
        torch.cuda.synchronize(self.device)
        return HeldMemory(allocated_peak_bytes=torch.cuda.max_memory_allocated(self.device),
                          reserved_peak_bytes=torch.cuda.max_memory_reserved(self.device),
                          outside_allocator_bytes=self.outside_allocator_bytes())


def device_memory_of(device: torch.device) -> DeviceMemory | None:
    return CudaMemory(device) if device.type == "cuda" else None


@dataclass
class HeldRecord:
    """Every step's held memory against the budget, summed up for the report (kept small: a few numbers)."""

    budget_bytes: int | None  # what the device may hold: the plan's budget and what was outside the allocator at start
    steps: int = 0
    steps_over_budget: int = 0
    worst: HeldMemory | None = None
    first_over_step: int | None = None
    replans: list[str] = field(default_factory=list)  # re-plans within less, started by a step over the budget

    def add(self, held: HeldMemory) -> bool:
        """Count one step; True where it held more than the budget."""
        self.steps += 1
        if self.worst is None or held.held_peak_bytes > self.worst.held_peak_bytes:
            self.worst = held
        over = self.budget_bytes is not None and held.held_peak_bytes > self.budget_bytes
        if over:
            self.steps_over_budget += 1
            if self.first_over_step is None:
                self.first_over_step = self.steps
        return over

    def describe(self) -> str:
        worst = self.worst
        if worst is None:
            return "held memory: no step measured yet"
        text = (f"held memory over {self.steps} step(s): at worst {format_bytes(worst.held_peak_bytes)} "
                f"(allocator reserved {format_bytes(worst.reserved_peak_bytes)}, allocated "
                f"{format_bytes(worst.allocated_peak_bytes)}, outside the allocator "
                f"{format_bytes(worst.outside_allocator_bytes)})")
        if self.steps_over_budget:
            text += (f"; OVER THE BUDGET of {format_bytes(self.budget_bytes)} in {self.steps_over_budget} step(s), "
                     f"first at step {self.first_over_step}: on a device of that size these steps run out of memory")
        elif self.budget_bytes is not None:
            text += f"; within the budget of {format_bytes(self.budget_bytes)} in every step"
        for replan in self.replans:
            text += f"; {replan}"
        return text
