"""Memory over time with the budget line, for people to look at."""

from __future__ import annotations

from pathlib import Path

from planner.simulator import SimulationResult

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def plot_memory(result: SimulationResult, path: str | Path, title: str = "device memory") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The axis unit follows the peak, so a small profile is not drawn as "0.00 GiB".
    scale, unit = next(((size, name) for size, name in _UNITS if result.peak_memory_bytes >= size), (1, "B"))
    times = [point.time_ms for point in result.memory_timeline]
    used = [point.used_bytes / scale for point in result.memory_timeline]
    figure, axes = plt.subplots(figsize=(10, 4), dpi=110)
    axes.step(times, used, where="post", color="tab:blue", label="in use")
    axes.fill_between(times, used, step="post", alpha=0.2, color="tab:blue")
    axes.axhline(result.fixed_memory_bytes / scale, color="grey", linestyle=":", label="fixed memory")
    if result.budget_bytes is not None:
        axes.axhline(result.budget_bytes / scale, color="tab:red", linestyle="--", label="budget")
    axes.axvline(result.peak_time_ms, color="tab:orange", linewidth=0.8, label=f"peak {result.peak_memory_bytes / scale:.2f} {unit}")
    axes.set_xlabel("time (ms)")
    axes.set_ylabel(unit)
    axes.set_title(title, parse_math=False)  # profile names are text, not TeX: '$' must not start a formula
    axes.set_xlim(0, max(result.step_time_ms, 1e-9))
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
