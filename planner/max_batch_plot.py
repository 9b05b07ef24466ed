"""Throughput and overhead against batch size, one line per strategy, from a `max_batch` result."""

from __future__ import annotations

import textwrap
from pathlib import Path

from planner.max_batch import MaxBatchResult


def plot_max_batch(result: MaxBatchResult, path: str | Path, title: str = "largest batch") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", "-.", ":")
    markers = ("o", "s", "^", "D", "v", "P")
    for index, answer in enumerate(result.strategies):
        colour = colours[index % len(colours)]
        line = dict(color=colour, linestyle=styles[index % len(styles)], marker=markers[index % len(markers)],
                    markersize=4, label=answer.strategy)
        plans = [p for p in answer.probes if p.step_time_ms is not None and p.outcome in ("fits", "over-overhead")]
        if not plans:
            continue
        batches = [p.batch_size for p in plans]
        top.plot(batches, [p.throughput_samples_per_s for p in plans], **line)
        bottom.plot(batches, [100 * p.overhead for p in plans], **line)
        if answer.max_batch_size is not None:
            for axes in (top, bottom):
                axes.axvline(answer.max_batch_size, color=colour, linestyle=":", linewidth=1)
        if answer.best_throughput_batch_size is not None:
            top.plot([answer.best_throughput_batch_size], [answer.best_throughput_samples_per_s], marker="*",
                     markersize=12, color=colour)
    limits = {p.overhead_limit for a in result.strategies for p in a.probes if p.overhead_limit is not None}
    if result.max_overhead is not None and len(limits) == 1:
        bottom.axhline(100 * limits.pop(), color="tab:red", linestyle="--", label="overhead limit")
    top.set_ylabel("throughput (samples/s, simulated)")
    bottom.set_ylabel("overhead over the lower bound (%)")
    bottom.set_xlabel("batch size (dotted: largest that fits; star: best throughput)")
    bottom.set_xscale("log", base=2)
    top.set_title("\n".join(textwrap.wrap(title, 90)), parse_math=False, fontsize="medium")
    top.legend(loc="best", fontsize="small")
    bottom.legend(loc="best", fontsize="small")
    bottom.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
