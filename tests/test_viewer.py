"""The plan viewer page (planner/viewer) without a browser: it draws what the simulator replayed, keeps untrusted
names as text, allows only its own script and style, and is written by the CLI (--html). The service's route is
tested in tests/test_api.py, the page in a real browser in tests/test_viewer_browser.py."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from collections import Counter
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from cli import app
from planner.schedule import load_schedule
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule
from planner.viewer import content_security_policy, plan_facts, plan_view_html
from planner.viewer.chart import AXIS_Y, MEMORY_HEIGHT
from planner.viewer.text import clean, format_ms, json_for_script, ticks
from tests.conftest import make_profile, node
from tests.viewer_plans import handmade_plan, long_plan

runner = CliRunner()


class Page(HTMLParser):
    """Every element with its attributes, the text of each <script> and <style>, and the text under each id."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict, list[str]]] = []  # tag, attributes, ancestors' ids
        self.scripts: list[tuple[dict, str]] = []
        self.styles: list[str] = []
        self.texts: dict[str, str] = {}
        self._stack: list[tuple[str, dict]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        ids = [a["id"] for _, a in self._stack if "id" in a]
        self.elements.append((tag, attributes, ids))
        if tag in ("script", "style"):
            self._raw = (tag, attributes, [])
        if tag not in ("meta", "link", "col", "input", "rect", "line", "path", "br", "wbr"):
            self._stack.append((tag, attributes))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), [a["id"] for _, a in self._stack if "id" in a]))

    def handle_endtag(self, tag):
        if tag in ("script", "style") and getattr(self, "_raw", None):
            kind, attributes, parts = self._raw
            if kind == "script":
                self.scripts.append((attributes, "".join(parts)))
            else:
                self.styles.append("".join(parts))
            self._raw = None
        while self._stack:
            open_tag, _ = self._stack.pop()
            if open_tag == tag:
                break

    def handle_data(self, data):
        if getattr(self, "_raw", None):
            self._raw[2].append(data)
        for _, attributes in self._stack:
            if "id" in attributes:
                self.texts[attributes["id"]] = self.texts.get(attributes["id"], "") + data

    def data_block(self) -> dict:
        return json.loads(next(text for attrs, text in self.scripts if attrs.get("type") == "application/json"))

    def rects(self, lane: str) -> Counter:
        """Rectangles per kind (their first class) in one stream's lane."""
        return Counter(
            attrs["class"].split()[0] for tag, attrs, ids in self.elements if tag == "rect" and f"lane-{lane}" in ids
        )


def span_counts(result) -> dict[str, Counter]:
    counts = {"compute": Counter(), "d2h": Counter(), "h2d": Counter()}
    for span in result.spans:
        counts[span.stream][span.kind] += 1
    return counts


# What the simulator tells the page ------------------------------------------------------------------------


def test_simulator_spans_name_their_kind_node_and_algorithm():
    profile, schedule = handmade_plan()
    spans = [(s.stream, s.kind, s.node, s.implementation, s.start_ms, s.end_ms) for s in simulate(profile, schedule).spans]
    assert spans == [
        ("compute", "compute", "a", "default", 0.0, 1.0),
        ("d2h", "offload", "a", None, 1.0, 3.0),
        ("compute", "compute", "b", "slow", 1.0, 6.0),
        ("compute", "compute", "loss", "default", 6.0, 7.0),
        ("h2d", "prefetch", "a", None, 7.0, 9.0),
        ("compute", "stall", "a", None, 7.0, 9.0),
        ("compute", "recompute", "b", "fast", 9.0, 12.0),
        ("compute", "compute", "b:bwd", "default", 12.0, 14.0),
        ("compute", "compute", "a:bwd", "default", 14.0, 15.0),
    ]


def test_decisions_and_algorithms_come_from_the_replay():
    profile, schedule = handmade_plan()
    facts = plan_facts(profile, simulate(profile, schedule))
    by_id = {node.id: node for node in facts.nodes}
    assert {node_id: node.decision for node_id, node in by_id.items()} == {
        "a": "offload", "b": "recompute", "loss": "keep", "b:bwd": "keep", "a:bwd": "keep"
    }
    b = by_id["b"]
    assert (b.computations, b.implementations, b.fastest) == (2, ["slow", "fast"], "fast")
    assert b.algorithm_changed and b.time_ms == 5.0 and b.slower_than_fastest_ms == 2.0 and b.workspace_bytes == 0
    assert not by_id["a"].algorithm_changed and by_id["a"].offloads == by_id["a"].prefetches == 1
    assert facts.decisions() == {"keep": 3, "offload": 1, "recompute": 1, "offload + recompute": 0}
    assert facts.count("stall") == 1 and facts.total_ms("stall") == 2.0


# The page ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [handmade_plan, lambda: long_plan(40)], ids=["handmade", "chain-81"])
def test_the_page_draws_every_span_of_the_replay_in_its_lane(plan):
    profile, schedule = plan()
    result = simulate(profile, schedule)
    page = Page(plan_view_html(profile, schedule, result))
    expected = span_counts(result)
    for lane in ("compute", "d2h", "h2d"):
        assert page.rects(lane) == expected[lane], lane
    assert sum(expected["compute"].values()) == len(schedule.compute_order) + expected["compute"]["stall"]
    data = page.data_block()
    drawn = [(row[0], data["nodes"][row[1]][0], row[2], row[3]) for lane in ("compute", "d2h", "h2d")
             for row in data["spans"][lane]]
    # Times travel with 9 significant digits (a nanosecond in a 1,000 ms step).
    assert sorted(drawn) == sorted((s.kind, s.node, float(f"{s.start_ms:.9g}"), float(f"{s.end_ms:.9g}"))
                                   for s in result.spans)
    assert max(data["memory"][1]) <= result.peak_memory_bytes
    assert data["budget_bytes"] == schedule.budget_bytes and data["domain_ms"] == result.step_time_ms


def test_the_budget_line_sits_where_the_memory_axis_puts_its_value():
    profile, schedule = handmade_plan()
    page = Page(plan_view_html(profile, schedule))
    ticks_at = sorted(
        (int(attrs["data-bytes"]), float(attrs["y"]) - 4)
        for tag, attrs, ids in page.elements
        if tag == "text" and "memory-axis" in ids and "data-bytes" in attrs
    )
    assert ticks_at[0] == (0, AXIS_Y) and len(ticks_at) >= 3
    (low_bytes, low_y), (high_bytes, high_y) = ticks_at[0], ticks_at[-1]
    line = next(attrs for tag, attrs, _ in page.elements if attrs.get("id") == "budget-line")
    expected_y = low_y + (schedule.budget_bytes - low_bytes) * (high_y - low_y) / (high_bytes - low_bytes)
    assert float(line["y1"]) == pytest.approx(expected_y, abs=0.01) and line["y1"] == line["y2"]
    assert AXIS_Y - MEMORY_HEIGHT <= float(line["y1"]) < AXIS_Y
    assert "budget 9.54 MiB" in page.texts["budget-label"]


def test_hostile_names_stay_text():
    hostile = '</script><script>alert(1)</script>"\'$x$ & ünï 💥 \u202eevil'
    profile = make_profile(
        [
            node("<img src=x onerror=alert(2)>", output_bytes=1000, name=hostile, op_type="<b>op</b>",
                 implementations=[{"name": '"><svg onload=alert(3)>', "time_ms": 1.0, "workspace_bytes": 0}]),
            node("loss", kind="loss", inputs=["<img src=x onerror=alert(2)>"], output_bytes=10, time_ms=1.0),
        ],
        name=hostile,
    )
    text = plan_view_html(profile, keep_all_schedule(profile))
    page = Page(text)
    tags = Counter(tag for tag, _, _ in page.elements)
    assert tags["script"] == 2 and tags["svg"] == 1 and tags["img"] == 0 and tags["b"] == 0
    assert not [name for _, attrs, _ in page.elements for name in attrs if name.startswith("on")]
    assert page.texts["plan-data"].count("</") == 0 and "<" not in page.texts["plan-data"]
    title = hostile  # a schedule without a summary names no strategy
    assert html.unescape(re.search(r"<title>(.*?)</title>", text).group(1)) == title
    assert html.unescape(re.search(r"<h1>(.*?)</h1>", text).group(1)) == title
    data = page.data_block()
    assert data["nodes"][0][:2] == ["<img src=x onerror=alert(2)>", hostile]
    assert data["spans"]["compute"][0][5] == '"><svg onload=alert(3)>'
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;$x$ &amp; ünï 💥" in text


def test_the_policy_allows_exactly_the_inline_script_and_style():
    profile, schedule = handmade_plan()
    page = Page(plan_view_html(profile, schedule))
    code = [text for attrs, text in page.scripts if "type" not in attrs]
    assert len(code) == 1 and len(page.styles) == 1

    def sha(text: str) -> str:
        return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()

    meta = next(attrs["content"] for tag, attrs, _ in page.elements if attrs.get("http-equiv") == "Content-Security-Policy")
    assert meta == content_security_policy()
    assert f"script-src '{sha(code[0])}'" in meta and f"style-src '{sha(page.styles[0])}'" in meta
    assert meta.startswith("default-src 'none';") and "unsafe" not in meta and "frame-ancestors" not in meta
    assert content_security_policy(header=True) == meta + "; frame-ancestors 'none'"
    assert not [attrs for _, attrs, _ in page.elements if "style" in attrs]  # inline style attributes would be blocked
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", plan_view_html(profile, schedule))


def test_a_step_without_time_or_budget_still_has_an_axis():
    profile = make_profile([node("a", time_ms=0.0), node("loss", kind="loss", inputs=["a"], time_ms=0.0)])
    schedule = keep_all_schedule(profile)
    page = Page(plan_view_html(profile, schedule))
    data = page.data_block()
    assert data["domain_ms"] == 1.0 and data["budget_bytes"] is None
    assert not [attrs for _, attrs, _ in page.elements if attrs.get("id") == "budget-line"]
    assert page.rects("compute") == Counter(compute=2)
    assert "no offloads" in page.texts["chart"] and "no prefetches" in page.texts["chart"]


def test_text_helpers():
    assert clean("a\x00b\ud800c\u202e") == "a\ufffdb\ufffdc\u202e"
    assert json.loads(json_for_script({"x": "</script><!--&"})) == {"x": "</script><!--&"}
    assert "<" not in json_for_script({"x": "</script>"}) and "&" not in json_for_script({"x": "&"})
    assert [format_ms(v) for v in (1305.8, 2.5, 0.0, 0.25, 0.0005)] == ["1,305.8 ms", "2.50 ms", "0.00 ms",
                                                                        "250.0 µs", "500 ns"]
    assert ticks(0.0, 15.0, 10) == ([0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], 0)
    assert ticks(0.0, 0.03, 5) == ([0.0, 0.01, 0.02, 0.03], 2) and ticks(0.0, 0.03, 10)[1] == 3


# The command line ---------------------------------------------------------------------------------------------


def test_plan_and_simulate_write_the_page(tmp_path, offload_profile):
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(offload_profile.to_json())
    page_path, schedule_path = tmp_path / "plan.html", tmp_path / "schedule.json"
    result = runner.invoke(app, ["plan", str(profile_path), "--strategy", "keep-all", "-o", str(schedule_path),
                                 "--html", str(page_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["html_path"] == str(page_path)
    expected = plan_view_html(offload_profile, load_schedule(schedule_path))
    assert page_path.read_text(encoding="utf-8") == expected
    again = tmp_path / "again.htm"
    result = runner.invoke(app, ["simulate", str(profile_path), str(schedule_path), "--html", str(again)])
    assert result.exit_code == 0 and f"wrote {again}" in result.output
    assert again.read_text(encoding="utf-8") == expected


@pytest.mark.parametrize(
    ("name", "message"),
    [("missing/plan.html", "does not exist"), ("plan.txt", "must end in .html or .htm"), (".", "is a directory")],
)
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_bad_page_path_is_refused_before_any_work(tmp_path, offload_profile, command, name, message):
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(offload_profile.to_json())
    # The schedule does not even exist: the path check must come first.
    arguments = [str(profile_path), "--strategy", "keep-all"] if command == "plan" else [str(profile_path), "nowhere.json"]
    result = runner.invoke(app, [command, *arguments, "--html", str(tmp_path / name)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.htm*"))


@pytest.mark.parametrize("time_ms", [5e-324, 1e-310, 0.0])
def test_a_step_of_a_vanishing_time_is_drawn(time_ms):
    """A node of 5e-324 ms (schemathesis sent one): the tick step's division underflowed to 0, and log10 failed."""
    profile = make_profile([node("a", time_ms=time_ms), node("loss", kind="loss", inputs=["a"], time_ms=time_ms)])
    schedule = keep_all_schedule(profile)
    page = plan_view_html(profile, schedule, simulate(profile, schedule))
    assert "<svg" in page
    assert ticks(0.0, time_ms, 8)[0][0] == 0.0
