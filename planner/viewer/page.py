"""The HTML page: summary figures, legend, the chart, the node table, the data block and the script.

The page fetches nothing: its style and script are inline and allowed by their
SHA-256 in a Content-Security-Policy (the same policy goes in the page's <meta>
and, from the service, in the response header), so nothing else can run in it
even if an escaping bug let markup through.
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from importlib import resources

from planner import __version__
from planner.schedule import Schedule
from planner.simulator import peak_at_optimizer_step
from planner.viewer.chart import MemoryScale, chart_svg, layout, memory_instants
from planner.viewer.facts import SPAN_KINDS, PlanFacts
from planner.viewer.text import escape, format_ms, format_size, json_for_script

_KIND_TITLES = {
    "compute": "compute",
    "recompute": "recompute",
    "offload": "offload (device → host)",
    "prefetch": "prefetch (host → device)",
    "stall": "stall (waiting for a copy)",
}


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    return resources.files("planner.viewer").joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


def content_security_policy(*, header: bool = False) -> str:
    """Only the page's own inline style and script, by hash; no fetches, no forms, no base URL.

    frame-ancestors is honoured only in a header (a <meta> policy with it logs an error), so it is added there.
    """
    policy = (
        f"default-src 'none'; script-src '{_sha256(_asset('viewer.js'))}'; "
        f"style-src '{_sha256(_asset('viewer.css'))}'; img-src data:; base-uri 'none'; form-action 'none'"
    )
    return policy + "; frame-ancestors 'none'" if header else policy


def _round(value: float) -> float:
    return float(f"{value:.9g}")


def _data(facts: PlanFacts, scale: MemoryScale) -> dict:
    result, profile = facts.result, facts.profile
    # The field order is the script's N table.
    nodes = [
        [n.id, n.label, n.kind, n.op_type, n.size_bytes, n.decision, n.computations, n.fastest, n.fastest_time_ms,
         n.implementations, n.time_ms, n.workspace_bytes, n.position]
        for n in facts.nodes
    ]
    spans = {}
    for stream, stream_spans in facts.spans.items():
        rows = []
        for span in stream_spans:
            node_index = facts.node_index[span.node]
            if span.kind in ("compute", "recompute"):
                extra = profile.node_by_id[span.node].implementation(span.implementation).workspace_bytes
            elif span.kind == "stall":
                extra = span.label.removeprefix("stall: ")
            else:
                extra = None
            rows.append(
                [span.kind, node_index, _round(span.start_ms), _round(span.end_ms), span.stage, span.implementation, extra]
            )
        spans[stream] = rows
    instants = memory_instants(facts)
    step_bytes = facts.profile.fixed_memory.optimizer_step_bytes
    return {
        "domain_ms": facts.domain_ms,
        "layout": layout(facts, scale),
        "budget_bytes": result.budget_bytes,
        "fixed_bytes": result.fixed_memory_bytes,
        "nodes": nodes,
        "spans": spans,
        # the hover reads what is in use after each instant; at the step's end, the optimizer's step instead, which
        # holds for no simulated time but is what the budget must hold
        "memory": [[_round(time_ms) for time_ms, _, _ in instants],
                   [last for _, _, last in instants[:-1]] + [instants[-1][1 if step_bytes else 2]]],
    }


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def _figure(title: str, value: str, note: str = "", *, bad: bool = False) -> str:
    small = f" <small>{escape(note)}</small>" if note else ""
    return f'<div class="figure{" bad" if bad else ""}"><dt>{escape(title)}</dt><dd>{escape(value)}{small}</dd></div>'


def _figures(facts: PlanFacts, schedule: Schedule) -> str:
    result = facts.result
    budget = result.budget_bytes
    figures = [
        _figure("step time", format_ms(result.step_time_ms), f"compute busy {format_ms(result.compute_busy_ms)}"),
        _figure("stall", format_ms(result.stall_time_ms), "compute waits for copies", bad=result.stall_time_ms > 0),
        _figure("recompute", format_ms(result.recompute_time_ms), _count(facts.count("recompute"), "computation")),
    ]
    at_step = ", at the optimizer's step" if peak_at_optimizer_step(facts.profile, result) else ""
    if budget is not None:
        share = f"{100 * result.peak_memory_bytes / budget:.1f}% of the budget" if budget else ""
        figures.append(_figure("peak memory", format_size(result.peak_memory_bytes), share + at_step,
                               bad=result.peak_memory_bytes > budget))
        figures.append(_figure("budget", format_size(budget), f"{budget:,} bytes"))
    else:
        figures.append(_figure("peak memory", format_size(result.peak_memory_bytes), "no budget" + at_step))
    step_bytes = facts.profile.fixed_memory.optimizer_step_bytes
    step_note = f"; {format_size(step_bytes)} more during the optimizer's step" if step_bytes else ""
    figures += [
        _figure("fixed memory", format_size(result.fixed_memory_bytes),
                "parameters, gradients, optimizer, inputs" + step_note),
        _figure("offloaded / prefetched", f"{format_size(result.offloaded_bytes)} / {format_size(result.prefetched_bytes)}"),
        _figure("copy streams busy", f"{format_ms(result.d2h_busy_ms)} / {format_ms(result.h2d_busy_ms)}",
                "device → host / host → device"),
        _figure("algorithms changed", f"{result.implementations_changed:,}", "computations not on the fastest"),
    ]
    solver = schedule.summary.solver if schedule.summary is not None else None
    if solver is not None:
        gap = f", gap {100 * solver.gap:.2f}%" if solver.gap is not None else ""
        figures.append(_figure("solver (its own report)", solver.status, f"{solver.wall_time_s:.1f} s{gap}"))
    return f'<dl class="figures">{"".join(figures)}</dl>'


def _legend(facts: PlanFacts, scale: MemoryScale) -> str:
    items = []
    for kind in SPAN_KINDS:
        count = facts.count(kind)
        items.append(
            f'<li data-kind="{kind}"><span class="swatch {kind}"></span>{escape(_KIND_TITLES[kind])} '
            f'<span class="count">{count:,} · {escape(format_ms(facts.total_ms(kind)))}</span></li>'
        )
    result = facts.result
    items.append('<li><span class="swatch memory"></span>memory in use</li>')
    if result.budget_bytes is not None:
        items.append('<li><span class="swatch budget"></span>budget</li>')
    items.append('<li><span class="swatch fixed"></span>fixed memory</li>')
    at_step = " (the optimizer's step)" if peak_at_optimizer_step(facts.profile, result) else ""
    items.append(
        f'<li><span class="swatch peak"></span>peak {escape(format_size(result.peak_memory_bytes))} '
        f'at {escape(format_ms(result.peak_time_ms))}{escape(at_step)}</li>'
    )
    return f'<ul class="legend">{"".join(items)}</ul>'


def _table(facts: PlanFacts) -> str:
    """The table's frame; the script fills in the rows in view from the data block (see viewer.js)."""
    columns = [("#", True), ("node", False), ("op", False), ("tensor", True), ("decision", False), ("computed", True),
               ("algorithm", False), ("fastest", False), ("time", True), ("vs fastest", True), ("workspace", True)]
    widths = "".join(f'<col class="w-{index}">' for index in range(len(columns)))
    head = "".join(
        f'<th{" class=num" if numeric else ""} scope="col" aria-sort="none"><button type="button">{escape(title)}</button></th>'
        for title, numeric in columns
    )
    counts = " · ".join(f"{escape(decision)} {count:,}" for decision, count in facts.decisions().items() if count)
    return (
        '<div class="table-tools">'
        '<input id="filter" type="search" placeholder="filter: name, id, op, decision, algorithm" '
        'aria-label="filter the nodes">'
        f'<span id="shown">{len(facts.nodes):,} of {len(facts.nodes):,} nodes</span>'
        f'<span class="decision-counts">{counts}</span><span class="hint">click a heading to sort, a row to zoom to it</span>'
        "</div>"
        f'<div class="table-box" id="table-box"><table class="nodes"><colgroup>{widths}</colgroup>'
        f'<thead><tr>{head}</tr></thead><tbody id="node-rows"></tbody></table>'
        "<noscript><p>The node table and the chart's zoom and hover need JavaScript.</p></noscript></div>"
    )


def render_page(facts: PlanFacts, schedule: Schedule, title: str) -> str:
    scale = MemoryScale(facts)
    profile = facts.profile
    hardware = profile.hardware
    strategy = schedule.summary.strategy if schedule.summary is not None else "unknown strategy"
    links = (
        f"{hardware.d2h_bandwidth_gb_per_s:g} / {hardware.h2d_bandwidth_gb_per_s:g} GB/s"
        if hardware.can_transfer
        else "no host link"
    )
    subtitle = (
        f"strategy {strategy} · {len(profile.nodes):,} nodes · {hardware.name} "
        f"({format_size(hardware.memory_capacity_bytes)}, {links}) · profile {profile.provenance.source}"
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{escape(content_security_policy())}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{escape(title)}</title>"
        '<link rel="icon" href="data:,">'
        f"<style>{_asset('viewer.css')}</style></head><body>"
        f"<header><h1>{escape(title)}</h1><p class=\"subtitle\">{escape(subtitle)}</p>{_figures(facts, schedule)}</header>"
        '<section id="timeline"><h2>Streams and memory over the step</h2>'
        '<div class="toolbar"><button id="zoom-in" type="button">zoom in</button>'
        '<button id="zoom-out" type="button">zoom out</button><button id="zoom-reset" type="button">whole step</button>'
        f'<span id="window" class="window">{escape(format_ms(0.0))} – {escape(format_ms(facts.domain_ms))}</span>'
        '<span class="hint">wheel: zoom · drag: pan · double-click: whole step · click an operation: its row</span></div>'
        f"{_legend(facts, scale)}"
        f'<div class="chart-box">{chart_svg(facts, scale)}<div id="tip" hidden></div></div></section>'
        '<section id="nodes"><h2>Nodes and their decisions</h2>'
        f"{_table(facts)}</section>"
        f"<footer>mosos {escape(__version__)}. Every figure on this page comes from the simulator's replay of the "
        "schedule (planner/simulator.py), except the solver's own report. Click a row to zoom to its node.</footer>"
        f'<script type="application/json" id="plan-data">{json_for_script(_data(facts, scale))}</script>'
        f"<script>{_asset('viewer.js')}</script>"
        "</body></html>\n"
    )
