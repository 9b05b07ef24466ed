"""The plan viewer in headless Chromium: how big the page is, how long it takes to write and to open, how fast
it answers zoom, hover and the table, and screenshots of the shipped plans.

Run: `python3 benchmarks/viewer.py [--repeats 3] [--time-limit 30]` (needs Debian's chromium and the test extra's
Playwright). Plans, each refereed by the simulator before it is drawn:

- VGG19 b144 on the P40 at 0.6 of the keep-all peak, mosos (the shipped profile the README plans);
- the transformer (24 blocks, 963 nodes) on the H100 at 0.6, mosos with --time-limit, and the
  swap/recompute heuristic (a plan that stalls on its copies, to show what the viewer shows of that);
- VGG-416 (1,681 nodes) on the Titan X at its 12 GiB, vdnn-conv (the vDNN paper's very deep case);
- a synthetic 2,001-node chain with every kind of operation (tests/viewer_plans.py).

Writes benchmarks/results/viewer.md (the table and the command) and benchmarks/results/viewer-*.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_section  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.viewer import plan_view_html  # noqa: E402
from tests.browser import chromium, next_frames, open_viewer, unavailable_reason  # noqa: E402
from tests.viewer_plans import long_plan  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
INTRO = """# The plan viewer

`mosos plan ... --html plan.html`, `mosos simulate ... --html`, `GET /v1/plans/{id}/view`: one self-contained page
per plan (planner/viewer). Figures from headless Chromium (Debian's package) driven by Playwright, on this
project's 2-core development machine, shared with other work: timings are noisy, the load average is given.

The node table holds only the rows in view: a first version that laid out all of them made the 2,001-node page
67,698 DOM nodes and 1.2-2.9 s of layout (Chrome's LayoutDuration from Performance.getMetrics, load average 7).
"""


def cases(time_limit_s: float):
    """(name, screenshot file or None, profile, schedule, how the plan was made)."""
    vgg19 = load_profile(ROOT / "models" / "profiles" / "vgg19-b144-227-p40.json")
    yield ("VGG19 b144, P40, 0.6, mosos", "viewer-vgg19-mosos.png", vgg19,
           plan(vgg19, memory_ratio=0.6, strategy="mosos", time_limit_s=time_limit_s),
           f"mosos plan models/profiles/vgg19-b144-227-p40.json --memory-ratio 0.6 --time-limit {time_limit_s:g}")
    transformer = load_profile(ROOT / "models" / "profiles" / "transformer-b64-h100.json")
    yield ("transformer b64, H100, 0.6, mosos", "viewer-transformer-mosos.png", transformer,
           plan(transformer, memory_ratio=0.6, strategy="mosos", time_limit_s=time_limit_s),
           f"mosos plan models/profiles/transformer-b64-h100.json --memory-ratio 0.6 --time-limit {time_limit_s:g}")
    yield ("transformer b64, H100, 0.6, swap-recompute-heuristic", "viewer-transformer-swap.png", transformer,
           plan(transformer, memory_ratio=0.6, strategy="swap-recompute-heuristic"),
           "mosos plan models/profiles/transformer-b64-h100.json --memory-ratio 0.6 --strategy swap-recompute-heuristic")
    vgg416 = load_profile(ROOT / "models" / "profiles" / "vgg416-b32-titanx.json")
    yield ("VGG-416 b32, Titan X, 12 GiB, vdnn-conv", None, vgg416,
           plan(vgg416, vgg416.hardware.memory_capacity_bytes, strategy="vdnn-conv"),
           "mosos plan models/profiles/vgg416-b32-titanx.json --budget 12GiB --strategy vdnn-conv")
    profile, schedule = long_plan(1000)
    yield ("synthetic chain, 2,001 nodes", None, profile, schedule, "tests/viewer_plans.py long_plan(1000)")


def measure(browser, page_path: Path, result, repeats: int, screenshot: Path | None) -> dict:
    loads, first_renders = [], []
    for _ in range(repeats):
        viewer = open_viewer(browser, page_path.as_uri())
        loads.append(viewer.load_s)
        first_renders.append(float(viewer.page.get_attribute("#chart", "data-render-ms")))
        viewer.check()
        if _ < repeats - 1:
            viewer.page.close()
    page = viewer.page
    dom_nodes = page.evaluate("() => document.getElementsByTagName('*').length")
    plot = page.evaluate("() => document.querySelector('.lane-bg').getBoundingClientRect().toJSON()")
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    x, y = plot["x"] + plot["width"] * 0.37, plot["y"] + plot["height"] / 2
    page.mouse.move(x, y)
    zoom_s, renders = [], []
    for step in range(16):  # eight in, eight out
        started = time.perf_counter()
        page.mouse.wheel(0, -250 if step < 8 else 250)
        next_frames(page)
        zoom_s.append(time.perf_counter() - started)
        renders.append(float(page.get_attribute("#chart", "data-render-ms")))
    hover_s = []
    for i in range(20):
        started = time.perf_counter()
        page.mouse.move(plot["x"] + plot["width"] * (0.05 + 0.045 * i), y)
        next_frames(page)
        hover_s.append(time.perf_counter() - started)
    started = time.perf_counter()
    page.locator("#table-box").evaluate("box => { box.scrollTop = box.scrollHeight; }")
    next_frames(page)
    scroll_s = time.perf_counter() - started
    started = time.perf_counter()
    page.fill("#filter", "backward")
    next_frames(page)
    filter_s = time.perf_counter() - started
    viewer.check()
    page.close()
    return {
        "load_s": statistics.median(loads),
        "load_max_s": max(loads),
        "first_render_ms": statistics.median(first_renders),
        "dom_nodes": dom_nodes,
        "zoom_ms": 1000 * statistics.median(zoom_s),
        "zoom_max_ms": 1000 * max(zoom_s),
        "render_ms": statistics.median(renders),
        "render_max_ms": max(renders),
        "hover_ms": 1000 * statistics.median(hover_s),
        "scroll_ms": 1000 * scroll_s,
        "filter_ms": 1000 * filter_s,
        "spans": len(result.spans),
    }


def zoomed_screenshot(browser, page_path: Path, path: Path, window_fraction: tuple[float, float]) -> None:
    """The chart zoomed into part of the step, with the tooltip of the operation in the middle."""
    viewer = open_viewer(browser, page_path.as_uri())
    page = viewer.page
    plot = page.evaluate("() => document.querySelector('.lane-bg').getBoundingClientRect().toJSON()")
    middle = (window_fraction[0] + window_fraction[1]) / 2
    x, y = plot["x"] + plot["width"] * middle, plot["y"] + plot["height"] / 2
    page.mouse.move(x, y)
    factor = window_fraction[1] - window_fraction[0]
    while True:
        t0, t1 = (float(page.get_attribute("#chart", name)) for name in ("data-t0", "data-t1"))
        total = float(page.evaluate("() => JSON.parse(document.getElementById('plan-data').textContent).domain_ms"))
        if (t1 - t0) <= total * factor * 1.05:
            break
        page.mouse.wheel(0, -120)
        next_frames(page)
    page.mouse.move(x + 1, y)
    next_frames(page)
    box = page.locator(".chart-box").bounding_box()
    page.screenshot(path=str(path), clip={"x": 0, "y": box["y"] - 90, "width": 1400, "height": box["height"] + 100})
    viewer.check()
    page.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="page loads per plan (the median is reported)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="mosos' time limit, seconds")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "mosos-viewer-bench"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    load = os.getloadavg()[0]
    with chromium() as browser:
        for name, screenshot, profile, schedule, how in cases(args.time_limit):
            started = time.perf_counter()
            result = simulate(profile, schedule)
            text = plan_view_html(profile, schedule, result)
            write_ms = 1000 * (time.perf_counter() - started)
            page_path = work / f"{len(rows)}.html"
            page_path.write_text(text, encoding="utf-8")
            figures = measure(browser, page_path, result, args.repeats, RESULTS / screenshot if screenshot else None)
            if screenshot == "viewer-vgg19-mosos.png":
                zoomed_screenshot(browser, page_path, RESULTS / "viewer-vgg19-mosos-zoomed.png", (0.45, 0.62))
            rows.append((name, how, len(profile.nodes), len(text.encode()), write_ms, figures, result, screenshot))
            load = max(load, os.getloadavg()[0])
            print(f"{name}: {len(profile.nodes)} nodes, load {figures['load_s']:.2f} s, zoom {figures['zoom_ms']:.0f} ms",
                  flush=True)
    command = f"python3 benchmarks/viewer.py --repeats {args.repeats} --time-limit {args.time_limit:g}"
    lines = [
        "## Page size, load and interaction",
        "",
        f"Command: `{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {os.cpu_count()} cores, "
        f"load average up to {load:.1f} during the run; viewport 1400x1000.",
        "",
        "Write: simulate + render the page in Python. Load: from navigation until the page's script has drawn "
        f"(median of {args.repeats}; max). Zoom: one wheel step until the next frame is drawn (median / max of 16), "
        "as Playwright sees it (its round trip and two animation frames, 33 ms at 60 frames a second), and the "
        "script's own redraw time. Hover: one mouse move until drawn (median of 20, same round trip). Table: scroll "
        "to the last row; type a filter.",
        "",
        "| plan | nodes | spans | step (simulated) | page | write | load (max) | DOM elements | zoom step (max) | "
        "redraw (max) | hover | table scroll / filter |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, how, nodes, size, write_ms, f, result, _ in rows:
        lines.append(
            f"| {name} | {nodes:,} | {f['spans']:,} | {result.step_time_ms:,.1f} ms | {size / 1024:,.0f} KiB | "
            f"{write_ms:,.0f} ms | {f['load_s']:.2f} s ({f['load_max_s']:.2f}) | {f['dom_nodes']:,} | "
            f"{f['zoom_ms']:.0f} ms ({f['zoom_max_ms']:.0f}) | {f['render_ms']:.1f} ms ({f['render_max_ms']:.1f}) | "
            f"{f['hover_ms']:.0f} ms | {f['scroll_ms']:.0f} / {f['filter_ms']:.0f} ms |"
        )
    lines += ["", "How each plan was made:", ""]
    lines += [f"- {name}: `{how}`" for name, how, *_ in rows]
    lines += ["", "Screenshots (the whole page; VGG19 also zoomed into its backward pass, hovering an operation):", ""]
    lines += [f"- {name}: `benchmarks/results/{shot}`" for name, *_, shot in rows if shot]
    lines += ["- VGG19 zoomed: `benchmarks/results/viewer-vgg19-mosos-zoomed.png`", ""]
    write_section(RESULTS / "viewer.md", INTRO, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
