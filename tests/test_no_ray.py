"""Without Ray installed: `mosos sweep` and `mosos serve --backend ray` say what to install (exit 2, no
traceback); a dry run, the local service and everything else work as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

HIDE_RAY = """
import sys
class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError("No module named 'ray' (hidden for this test)", name=name)
sys.meta_path.insert(0, _NoRay())
from typer.testing import CliRunner
from cli import app
"""


def run_without_ray(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_RAY + textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=180)


def test_the_ray_commands_say_how_to_install_ray(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"profiles: [{REPO / 'models' / 'profiles' / 'vgg19-small-cpu.json'}]\nmemory_ratios: [0.5]\n")
    done = run_without_ray(
        f"""
        sweep = CliRunner().invoke(app, ["sweep", {str(spec)!r}, "--out", "out"])
        print("sweep", sweep.exit_code, repr(sweep.output))
        serve = CliRunner().invoke(app, ["serve", "--backend", "ray", "--port", "1"])
        print("serve", serve.exit_code, repr(serve.output))
        dry = CliRunner().invoke(app, ["sweep", {str(spec)!r}, "--dry-run"])
        print("dry", dry.exit_code, repr(dry.output))
        assert "ray" not in sys.modules
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    results = {line.split(" ", 1)[0]: line.split(" ", 2)[1:] for line in done.stdout.splitlines()}
    for command, what in (("sweep", "mosos sweep"), ("serve", "mosos serve --backend ray")):
        code, output = results[command]
        assert code == "2", output
        assert f"{what} needs Ray" in output and "pip install 'mosos[ray]'" in output
        assert "Traceback" not in output
    assert not (tmp_path / "out").exists()
    assert results["dry"][0] == "0" and "1 solve; dry run" in results["dry"][1]


def test_the_local_service_needs_no_ray(tmp_path):
    done = run_without_ray(
        f"""
        from fastapi.testclient import TestClient
        from api import Settings, create_app
        settings = Settings(db_path={str(tmp_path / 'plans.sqlite3')!r}, solve_processes=1, request_processes=1)
        with TestClient(create_app(settings)) as client:
            health = client.get("/healthz").json()
        assert health["backend"] == "local" and health["solve_processes_ready"] == 1, health
        assert "ray" not in sys.modules
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
