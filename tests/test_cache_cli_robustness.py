"""`mosos cache list` / `mosos cache clear` on a cache someone damaged: a malformed entry is a row saying it cannot
be read, `clear` removes it without reading it, and nothing that is not the cache's own is touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from cli import app  # noqa: E402
from cli.app import console  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory) -> Path:
    """One entry as optimize() keeps it, made once: each test damages a copy."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import executor

    cache = tmp_path_factory.mktemp("made")
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=cache,
                      progress=False)
    (entry,) = (cache / "plans-v1").iterdir()
    return entry


@pytest.fixture(autouse=True)
def _wide_table(monkeypatch):
    """Wide enough that a row's words are not folded across lines."""
    monkeypatch.setattr(console, "_width", 400)


def mosos(*args) -> tuple[int, str]:
    result = runner.invoke(app, ["cache", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _edit_json(path: Path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def _set_key_summary(meta, value):
    meta["key"]["summary"] = value


DAMAGES = {  # what the user's test wrote, and its relatives: each valid JSON (or a missing file), none well formed
    "schedule is a list": lambda e: (e / "schedule.json").write_text("[]"),
    "created is a word": lambda e: _edit_json(e / "entry.json", lambda m: m.update(created="yesterday")),
    "last_used is NaN": lambda e: _edit_json(e / "entry.json", lambda m: m.update(last_used=float("nan"))),
    "key summary is a string": lambda e: _edit_json(e / "entry.json", lambda m: _set_key_summary(m, "notadict")),
    "created is past any date": lambda e: _edit_json(e / "entry.json", lambda m: m.update(created=1e300)),
    "created is missing": lambda e: _edit_json(e / "entry.json", lambda m: m.pop("created")),
    "budget is empty": lambda e: _edit_json(e / "entry.json", lambda m: m["key"]["summary"].update(budget={})),
    "entry is a list": lambda e: (e / "entry.json").write_text("[]"),
    "entry is not text": lambda e: (e / "entry.json").write_bytes(b"\xff\xfe{"),
    "quoted step time": lambda e: _edit_json(
        e / "schedule.json", lambda s: s["summary"].update(predicted_step_time_ms="fast", peak_memory_bytes="big")),
    "schedule is missing": lambda e: (e / "schedule.json").unlink(),
    "entry.json is a folder": lambda e: ((e / "entry.json").unlink(), (e / "entry.json").mkdir()),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_malformed_entry_is_listed_as_unreadable_and_cleared_unread(tmp_path, real_entry, damage):
    plans = tmp_path / "plans-v1"
    plans.mkdir()
    shutil.copytree(real_entry, plans / real_entry.name)
    damaged = plans / ("f" * 64)
    shutil.copytree(real_entry, damaged)
    DAMAGES[damage](damaged)

    code, output = mosos("list", "--dir", tmp_path)
    assert code == 0, output
    assert output.count("(unreadable entry)") == 1, output
    assert "Sequential" in output and "float32[4,8]" in output and "keep-all" in output  # the whole one still shows

    code, output = mosos("clear", "--dir", tmp_path)
    assert code == 0, output
    assert "removed 2 kept plans" in output
    assert not plans.exists() or list(plans.iterdir()) == []


def test_clear_leaves_what_is_not_the_caches_own(tmp_path, real_entry):
    plans = tmp_path / "plans-v1"
    plans.mkdir()
    shutil.copytree(real_entry, plans / real_entry.name)
    staging = plans / f".{real_entry.name[:12]}-k3x9"  # a store cut short: the cache's own
    staging.mkdir()
    (staging / "capture.json").write_text("{")
    (plans / "notes.txt").write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(real_entry, elsewhere)
    (plans / "linked").symlink_to(elsewhere, target_is_directory=True)

    code, output = mosos("clear", "--dir", tmp_path)
    assert code == 0 and "removed 1 kept plan " in output, output
    assert sorted(p.name for p in plans.iterdir()) == ["linked", "notes.txt"]
    assert (plans / "notes.txt").read_text() == "mine"
    assert (elsewhere / "entry.json").exists()  # a link is not followed into someone else's folder


@pytest.mark.parametrize("command", ["list", "clear"])
def test_plans_folder_that_is_a_file_is_an_error_naming_it(tmp_path, command):
    (tmp_path / "plans-v1").write_text("not a cache")
    code, output = mosos(command, "--dir", tmp_path)
    assert code != 0
    assert "is not a folder" in output and "plans-v1" in output
    assert "removed" not in output and "no plans kept" not in output
    assert (tmp_path / "plans-v1").read_text() == "not a cache"


def test_optimize_replans_when_the_kept_entry_json_is_not_an_object(tmp_path, real_entry):
    """load() reads entry.json through the same check: a list there is a stale entry, not a crash after the hit."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import executor

    plans = tmp_path / "plans-v1"
    plans.mkdir()
    shutil.copytree(real_entry, plans / real_entry.name)
    (plans / real_entry.name / "entry.json").write_text("[]")
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    messages: list[str] = []
    executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=tmp_path,
                      progress=messages.append)
    assert any("is not usable" in m and "planning again" in m for m in messages), messages
    code, output = mosos("list", "--dir", tmp_path)
    assert code == 0 and "(unreadable entry)" not in output and "Sequential" in output, output
