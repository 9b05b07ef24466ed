"""Every fenced code block of README.md runs, so the guide cannot drift from the code.

- ```bash blocks run through bash (-e -o pipefail), with .venv/bin first on PATH, in a temporary folder whose entries
  link to this checkout's (so `models/profiles/...`, `examples/...` and `.venv/bin/...` resolve and every output lands
  in the temporary folder);
- ```python blocks run with the venv's python in a fresh process, in such a folder;
- ```json blocks parse; the service's answer also matches what the service block printed (same keys) and the
  schedule summary model;
- ```yaml blocks parse and equal the file named on their first line;
- ```text blocks (diagrams, output) are not run. A block with any other language, or none, fails the test.

Two blocks are special. The quick start's set-up and test command (`bash scripts/setup.sh --dev && .venv/bin/python -m
pytest -q`) is not run here (it is the whole suite, this test included): the test checks that .ci/run runs exactly it.
The first quick-start command runs without its set-up (this checkout is set up already; see SUBSTITUTIONS).

Commands that take minutes run at reduced sizes. Each change is in SUBSTITUTIONS, with why; a substitution that no
longer matches exactly one block fails the test, so a block cannot silently run as written when it was meant to be
reduced (or the other way round).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
VENV_BIN = Path(sys.executable).parent

TEST_COMMAND = "bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q"

# (old, new, why). `old` must occur in exactly one runnable block. {port} becomes a free TCP port.
SUBSTITUTIONS = [
    ("bash scripts/setup.sh && .venv/bin/mosos plan", ".venv/bin/mosos plan",
     "the quick start's set-up is done already: the test runs in this set-up checkout"),
    ("--compare all --time-limit 20", "--compare all --time-limit 5",
     "the quick start's comparison: 5 s instead of 20"),
    ("time_limit_s=10,      #", "time_limit_s=3,      #",
     "optimize()'s solve: 3 s instead of 10"),
    ("--steps 3", "--steps 3 --time-limit 5",
     "examples/train.py's planner time limit: 5 s instead of its default 30"),
    ("--time-limit 20 -o schedule.json", "--time-limit 5 -o schedule.json",
     "mosos plan in the CLI section: 5 s instead of 20"),
    ("transformer.json --memory-ratio 0.6 --time-limit 10", "transformer.json --memory-ratio 0.6 --time-limit 3",
     "planning the profiled transformer: 3 s instead of 10"),
    ("--gpu v100 --time-limit 60", "--gpu v100 --strategy mosos --batch-limit 64 --time-limit 60",
     "mosos max-batch: one strategy and batches up to 64, a search that completes in about 15 s; the time limit "
     "stays 60 s, so that a loaded machine (its profiles alone take 5-20 s) does not run out of it"),
    ("mosos sweep examples/sweep.yaml --out sweep-results", "mosos sweep examples/sweep.yaml --dry-run --out sweep-results",
     "a real sweep starts Ray and runs 48 solves of up to 30 s: here the spec and the command line are checked "
     "(tests/test_sweep.py runs real sweeps)"),
    ("8000", "{port}",
     "the service listens on a free port, not 8000, which another process may hold"),
    ("time_limit_s: 10, wait_s: 60", "time_limit_s: 2, wait_s: 60",
     "the service's solve: 2 s instead of 10"),
]

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
RUNNABLE = ("bash", "python")
KNOWN = (*RUNNABLE, "json", "yaml", "text")
BLOCK_TIMEOUT_S = 240


def readme_blocks() -> list[tuple[int, str, str]]:
    """(line number, language, body) of every fenced block of the README, in order."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start()) + 1, match.group(1).strip(), match.group(2))
            for match in FENCE.finditer(text)]


BLOCKS = readme_blocks()


def block_id(block) -> str:
    line, language, _ = block
    return f"line{line}-{language or 'none'}"


def _is_test_command(body: str) -> bool:
    return body.strip() == TEST_COMMAND


def substituted(body: str, port: int | None = None) -> str:
    for old, new, _why in SUBSTITUTIONS:
        if old in body:
            body = body.replace(old, new)
    return body.replace("{port}", str(port)) if port is not None else body


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A folder whose entries link to the checkout's, so paths in the README resolve and outputs land here."""
    folder = tmp_path / "checkout"
    folder.mkdir()
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (folder / entry.name).symlink_to(entry)
    return folder


def _environment(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["MOSOS_CACHE_DIR"] = str(tmp_path / "mosos-cache")  # no plan of the user's cache, none left in it
    env.pop("MOSOS_API_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    return env


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run in a session of its own, and end whatever the block left running (a server) with it."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the block ran past {BLOCK_TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_every_block_has_a_known_language():
    unknown = [f"line {line}: ```{language}" for line, language, _ in BLOCKS if language not in KNOWN]
    assert not unknown, f"give each README block one of {KNOWN} (a diagram or output is text): {unknown}"
    assert sum(1 for _, language, _ in BLOCKS if language in RUNNABLE) >= 5, "the README lost its commands"


def test_every_substitution_matches_exactly_one_block():
    runnable = [body for _, language, body in BLOCKS if language in RUNNABLE and not _is_test_command(body)]
    for old, _new, why in SUBSTITUTIONS:
        holders = [body for body in runnable if old in body]
        assert len(holders) == 1, (f"substitution {old!r} ({why}) matches {len(holders)} README blocks, not one: "
                                   f"update SUBSTITUTIONS with the README")


def test_the_quick_start_test_command_is_what_ci_runs():
    quick_start = [body for _, language, body in BLOCKS if language == "bash" and _is_test_command(body)]
    assert len(quick_start) == 1, f"the README shows the test command `{TEST_COMMAND}` once, as a block of its own"
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci_lines, f".ci/run no longer runs `{TEST_COMMAND}` exactly, as the README says"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[1] in RUNNABLE and not _is_test_command(b[2])],
                         ids=block_id)
def test_the_block_runs(block, workdir, tmp_path):
    line, language, body = block
    needs_port = "{port}" in substituted(body)
    if needs_port:
        for tool in ("curl", "jq"):
            assert any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(os.pathsep)), \
                f"the README block at line {line} needs {tool}: install it (apt-get install {tool})"
    script = substituted(body, _free_port() if needs_port else None)
    env = _environment(tmp_path)
    if language == "bash":
        result = _run(["bash", "-e", "-o", "pipefail", "-c", script], workdir, env)
    else:
        path = workdir / f"readme_block_{line}.py"
        path.write_text(script)
        result = _run([str(VENV_BIN / "python"), str(path)], workdir, env)
    assert result.returncode == 0, (f"README block at line {line} failed (exit {result.returncode}):\n{script}\n"
                                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    if needs_port:  # the service block prints the answer the README's JSON block shows
        _check_answer_against_readme(_last_json_document(result.stdout, line), line)


def _last_json_document(stdout: str, line: int) -> dict:
    """The JSON object the block printed last (a server's log lines may come before it)."""
    start = 0 if stdout.startswith("{") else stdout.rfind("\n{") + 1
    try:
        return json.loads(stdout[start:])
    except json.JSONDecodeError as error:
        pytest.fail(f"the README block at line {line} printed no JSON answer ({error}):\n{stdout[-3000:]}")


def _answer_example() -> tuple[int, dict]:
    examples = [(line, json.loads(body)) for line, language, body in BLOCKS
                if language == "json" and '"summary"' in body]
    assert len(examples) == 1, "the README shows one answer of the service (a json block with its summary)"
    return examples[0]


def _check_answer_against_readme(answer: dict, line: int) -> None:
    example_line, example = _answer_example()
    assert set(answer) == set(example), (f"the service block (line {line}) printed keys {sorted(answer)}; the "
                                         f"README's answer (line {example_line}) shows {sorted(example)}")
    assert answer["status"] == "done" and answer["feasible"] is True, answer


def test_json_blocks_parse_and_the_answer_is_a_current_summary():
    from planner.schedule import Summary

    for line, language, body in BLOCKS:
        if language == "json":
            try:
                json.loads(body)
            except json.JSONDecodeError as error:
                pytest.fail(f"README json block at line {line} does not parse: {error}")
    _, example = _answer_example()
    Summary.model_validate(example["summary"])  # every field of the example is one the schedule has, today


def test_yaml_blocks_parse_and_are_the_files_they_name():
    import yaml
    blocks = [(line, body) for line, language, body in BLOCKS if language == "yaml"]
    for line, body in blocks:
        yaml.safe_load(body)
        named = re.match(r"#\s*(\S+)", body)
        assert named, f"README yaml block at line {line}: its first line names the file it shows (# path)"
        assert (REPO / named.group(1)).read_text() == body, f"README yaml block at line {line} is not {named.group(1)}"


def test_the_readme_is_a_guide_not_a_notebook():
    lines = README.read_text().splitlines()
    assert len(lines) < 500, f"README.md has {len(lines)} lines: move reference detail to docs/, history to CHANGELOG.md"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (REPO / target).exists(), f"the README links to {target}, which does not exist"
