"""The plan viewer in a real browser (headless Chromium via Playwright): what is drawn, where, hover, zoom, pan,
the table, a 2,001-node plan, and the page served by a real `mosos serve`. Any console error, uncaught exception,
failed request or request for anything but the page fails the test. Screenshots go to pytest's tmp_path.

Skips with its reason where no Chromium can be had (see tests/browser.py); CI requires it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.profile import parse_profile
from planner.schedule import parse_schedule
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule
from planner.viewer import write_plan_view
from tests.browser import chromium, next_frames, open_viewer, unavailable_reason
from tests.conftest import make_profile, node
from tests.viewer_plans import handmade_plan, long_plan

REPO = Path(__file__).resolve().parents[1]
REASON = unavailable_reason()
if REASON is not None:
    if os.environ.get("MOSOS_BROWSER_TESTS") == "required":
        raise RuntimeError(f"MOSOS_BROWSER_TESTS=required but {REASON}")
    pytest.skip(REASON, allow_module_level=True)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


def count(page, selector: str) -> int:
    return page.evaluate("(selector) => document.querySelectorAll(selector).length", selector)


def window(page) -> tuple[float, float]:
    return tuple(float(page.get_attribute("#chart", name)) for name in ("data-t0", "data-t1"))


def screen_y_of(page, size_bytes: float) -> float:
    """Where the memory axis puts `size_bytes` on the screen, from its drawn grid lines."""
    lines = page.evaluate(
        """() => Array.from(document.querySelectorAll('#memory-axis line[data-bytes]'))
                .map(line => [+line.dataset.bytes, line.getBoundingClientRect().top])"""
    )
    (low_bytes, low_y), (high_bytes, high_y) = lines[0], lines[-1]
    return low_y + (size_bytes - low_bytes) * (high_y - low_y) / (high_bytes - low_bytes)


def drawn_counts(page) -> dict[str, dict[str, int]]:
    return page.evaluate(
        """() => Object.fromEntries(['compute', 'd2h', 'h2d'].map(lane => [lane,
             Array.from(document.querySelectorAll('#lane-' + lane + ' rect')).reduce((counts, rect) => {
               const kind = rect.classList[0]; counts[kind] = (counts[kind] || 0) + 1; return counts; }, {})]))"""
    )


def expected_counts(result) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {"compute": {}, "d2h": {}, "h2d": {}}
    for span in result.spans:
        counts[span.stream][span.kind] = counts[span.stream].get(span.kind, 0) + 1
    return counts


def center(page, selector: str) -> tuple[float, float]:
    box = page.locator(selector).first.bounding_box()
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def test_a_known_plan_is_drawn_read_and_zoomed(browser, tmp_path):
    profile, schedule = handmade_plan()
    profile_path, schedule_path, page_path = tmp_path / "profile.json", tmp_path / "schedule.json", tmp_path / "plan.html"
    profile_path.write_text(profile.to_json())
    schedule_path.write_text(schedule.to_json())
    subprocess.run([sys.executable, "-m", "cli", "simulate", str(profile_path), str(schedule_path), "--html", str(page_path)],
                   cwd=REPO, check=True, capture_output=True)
    viewer = open_viewer(browser, page_path.as_uri())
    page = viewer.page
    result = simulate(profile, schedule)

    # Streams: one rectangle per operation of the replay, in its lane, by kind.
    assert drawn_counts(page) == expected_counts(result) == {
        "compute": {"compute": 5, "recompute": 1, "stall": 1}, "d2h": {"offload": 1}, "h2d": {"prefetch": 1}}
    plot = page.evaluate("() => document.querySelector('.lane-bg').getBoundingClientRect().toJSON()")
    recompute = page.locator("#lane-compute rect.recompute").bounding_box()
    assert recompute["x"] == pytest.approx(plot["x"] + plot["width"] * 9 / 15, abs=1)  # b recomputed 9-12 of 15 ms
    assert recompute["width"] == pytest.approx(plot["width"] * 3 / 15, abs=1)
    assert set(page.locator("#labels text").all_text_contents()) >= {"a", "b", "loss", "stall", "b:bwd"}

    # Memory: the budget line where the axis puts the budget, the curve's top at the peak, across the whole plot.
    budget_top = page.locator("#budget-line").evaluate("line => line.getBoundingClientRect().top")
    assert budget_top == pytest.approx(screen_y_of(page, schedule.budget_bytes), abs=1)
    curve = page.evaluate(
        """() => { const boxes = Array.from(document.querySelectorAll('.memory-line')).map(p => p.getBoundingClientRect());
                 return [Math.min(...boxes.map(b => b.top)), Math.min(...boxes.map(b => b.left)),
                         Math.max(...boxes.map(b => b.right))]; }"""
    )
    assert curve[0] == pytest.approx(screen_y_of(page, result.peak_memory_bytes), abs=1.5)
    assert curve[1] == pytest.approx(plot["x"], abs=1) and curve[2] == pytest.approx(plot["x"] + plot["width"], abs=1)
    assert page.locator("#time-axis text").first.text_content() == "0"

    # Hover: an operation's figures, the node's other operations outlined; memory in use at an instant.
    page.mouse.move(*center(page, "#lane-compute rect.recompute"))
    tip = page.locator("#tip")
    assert tip.is_visible()
    text = tip.inner_text()
    assert "recompute" in text and "fast (the fastest)" in text and "computed 2×" in text and "3.00 ms" in text
    assert count(page, "#hover-marks rect") == 2  # b's first computation and its recomputation
    page.mouse.move(plot["x"] + plot["width"] * 13 / 15, screen_y_of(page, 1_000_000))
    text = tip.inner_text()
    assert text.startswith("at 13.00 ms") and "in use\t3.81 MiB" in text and "compute: b:bwd" in text
    page.screenshot(path=str(tmp_path / "handmade.png"), full_page=True)

    # Zoom with the wheel around the cursor, pan by dragging, back with a double-click, buttons.
    x, y = plot["x"] + plot["width"] * 10.5 / 15, plot["y"] + plot["height"] / 2
    page.mouse.move(x, y)
    page.mouse.wheel(0, -600)
    next_frames(page)
    t0, t1 = window(page)
    assert t1 - t0 < 5 and t0 < 10.5 < t1
    zoomed = page.locator("#lane-compute rect.recompute").bounding_box()
    assert zoomed["width"] == pytest.approx(recompute["width"] * 15 / (t1 - t0), rel=0.02)
    assert page.locator("#time-axis text").count() >= 4
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x - 200, y, steps=5)
    page.mouse.up()
    next_frames(page)
    panned = window(page)
    assert panned[0] > t0 and panned[1] - panned[0] == pytest.approx(t1 - t0)
    page.mouse.dblclick(x, y)
    next_frames(page)
    assert window(page) == (0.0, 15.0)
    page.click("#zoom-in")
    next_frames(page)
    assert window(page) == (3.75, 11.25)
    page.click("#zoom-reset")

    # Table: every node with its decision; sort, filter, and a row zooms the chart to its node.
    rows = page.locator("#node-rows tr.row")
    assert rows.count() == 5
    decisions = {rows.nth(i).locator("td").nth(1).inner_text().split("\n")[0]: rows.nth(i).locator("td").nth(4).inner_text()
                 for i in range(5)}
    assert decisions == {"a": "offload", "b": "recompute", "loss": "keep", "b:bwd": "keep", "a:bwd": "keep"}
    algorithms = rows.nth(1).locator("td").nth(6)  # b: its first computation, then its recomputation
    assert algorithms.inner_text().split("\n") == ["slow", "fast"] and algorithms.get_attribute("title") == "slow, fast"
    page.click("table.nodes thead th:nth-child(4) button")  # tensor size, ascending
    assert rows.first.locator("td").nth(1).inner_text().startswith("loss")
    page.fill("#filter", "offload")
    assert rows.count() == 1 and page.locator("#shown").inner_text() == "1 of 5 nodes"
    rows.first.click()
    next_frames(page)
    t0, t1 = window(page)
    assert t0 < 1 and 9 < t1 < 15  # a: computed 0-1, offloaded 1-3, prefetched 7-9
    viewer.check()


def test_hostile_names_are_shown_as_text_and_run_nothing(browser, tmp_path):
    hostile = '</script><script>alert(1)</script><img src=x onerror=alert(2)>"\'$x$ ünï 💥'
    profile = make_profile(
        [node("a", output_bytes=1000, name=hostile,
              implementations=[{"name": '"><svg onload=alert(3)>', "time_ms": 1.0, "workspace_bytes": 0}]),
         node("loss", kind="loss", inputs=["a"], output_bytes=10, time_ms=1.0)],
        name=hostile,
    )
    page_path = tmp_path / "hostile.html"
    write_plan_view(profile, keep_all_schedule(profile), page_path)
    viewer = open_viewer(browser, page_path.as_uri())
    page = viewer.page
    assert page.title() == hostile and page.locator("h1").inner_text() == hostile
    assert page.locator("#node-rows tr.row").first.locator("td").nth(1).inner_text().split("\n")[0] == hostile
    page.mouse.move(*center(page, "#lane-compute rect.compute"))
    assert page.locator("#tip .tip-title").inner_text() == hostile
    assert '"><svg onload=alert(3)>' in page.locator("#tip").inner_text()
    assert count(page, "img") == 0 and count(page, "svg") == 1
    viewer.check()  # no dialog, no error, no request


def test_a_plan_served_by_mosos_serve(browser, tmp_path):
    spec = importlib.util.spec_from_file_location("service_bench", REPO / "benchmarks" / "service_concurrency.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import httpx

    profile_json = json.loads((REPO / "models" / "profiles" / "vgg19-b144-227-p40.json").read_text())
    request = {"profile": profile_json, "memory_ratio": 0.6, "strategy": "swap-recompute-heuristic", "wait_s": 60}
    with bench.serve(tmp_path, workers=1, busy_plugin=False) as (_, base, _log):
        plan = httpx.post(f"{base}/v1/plans", json=request, timeout=90).json()
        assert plan["status"] == "done", plan
        viewer = open_viewer(browser, base + plan["links"]["view"])
        page = viewer.page
        response = page.evaluate("() => performance.getEntriesByType('navigation')[0].responseStatus")
        assert response == 200
        profile, schedule = parse_profile(profile_json), parse_schedule(plan["schedule"])
        result = simulate(profile, schedule)
        drawn = drawn_counts(page)
        assert drawn == expected_counts(result)
        assert drawn["compute"].get("stall", 0) > 0 and drawn["d2h"]["offload"] > 0  # this plan stalls on copies
        assert page.title() == f"{profile.name} (swap-recompute-heuristic)"
        budget_top = page.locator("#budget-line").evaluate("line => line.getBoundingClientRect().top")
        assert budget_top == pytest.approx(screen_y_of(page, schedule.budget_bytes), abs=1)
        page.screenshot(path=str(tmp_path / "served.png"))
        viewer.check()


def test_a_2001_node_plan_loads_and_answers_without_freezing(browser, tmp_path):
    profile, schedule = long_plan(1000)
    page_path = tmp_path / "long.html"
    write_plan_view(profile, schedule, page_path)
    viewer = open_viewer(browser, page_path.as_uri())
    page = viewer.page
    result = simulate(profile, schedule)
    assert drawn_counts(page) == expected_counts(result)
    assert count(page, "#node-rows tr.row") < 100  # only the rows in view are in the document
    assert page.locator("#shown").inner_text() == "2,001 of 2,001 nodes"
    # Generous bounds for a busy 2-core CI machine; the figures themselves are in benchmarks/viewer.py's results.
    assert viewer.load_s < 20
    plot = page.evaluate("() => document.querySelector('.lane-bg').getBoundingClientRect().toJSON()")
    page.mouse.move(plot["x"] + plot["width"] / 2, plot["y"] + plot["height"] / 2)
    renders = []
    for _ in range(10):
        page.mouse.wheel(0, -300)
        next_frames(page)
        renders.append(float(page.get_attribute("#chart", "data-render-ms")))
    t0, t1 = window(page)
    assert (t1 - t0) < result.step_time_ms / 20
    assert max(renders) < 500, renders
    page.mouse.move(plot["x"] + plot["width"] * 0.3, plot["y"] + plot["height"] / 2)
    assert page.locator("#tip").is_visible()
    page.locator("#table-box").evaluate("box => { box.scrollTop = box.scrollHeight; }")
    next_frames(page)
    assert page.locator("#node-rows tr.row").last.locator("td").first.inner_text() == "2000"
    page.screenshot(path=str(tmp_path / "long.png"))
    viewer.check()
