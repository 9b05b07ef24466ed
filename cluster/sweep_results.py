"""A sweep's results as files: one CSV row and one JSON object per solve, the schedules beside them."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from cluster.sweep import COLUMNS, SweepResult
from cluster.sweep_spec import LoadedSpec
# Imports inside functions here are deferred for start-up time: the planner loads when results are read, not when a
# sweep's spec is.

RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
SCHEDULES = "schedules"
SWEEP_SCHEDULE_NAME = re.compile(r"\d{4,}-.*\.json")


def csv_text(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in COLUMNS})
    return buffer.getvalue()


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: a figure that is not finite is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def json_document(result: SweepResult, loaded: LoadedSpec) -> dict[str, Any]:
    spec = loaded.spec
    return {
        "spec": str(loaded.path),
        "name": spec.name,
        "ray": result.where,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_time_s": result.wall_time_s,
        "interrupted": result.interrupted,
        "solves": len(result.rows),
        "counts": result.counts,
        "time_limit_s": spec.time_limit_s,
        "hard_timeout_s": spec.hard_timeout_s,
        "workers_per_solve": spec.workers,
        "retries": spec.retries,
        "rows": [_finite({key: row.get(key) for key in [*COLUMNS, "history"]}) for row in result.rows],
    }


def write_results(out_dir: Path, result: SweepResult, loaded: LoadedSpec) -> tuple[Path, Path]:
    """results.csv and results.json in `out_dir` (written whole, each replacing the previous one at once)."""
    csv_path = out_dir / RESULTS_CSV
    json_path = out_dir / RESULTS_JSON
    for path, text in ((csv_path, csv_text(result.rows)),
                       (json_path, json.dumps(json_document(result, loaded), indent=1, allow_nan=False) + "\n")):
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(text)
        partial.replace(path)
    return csv_path, json_path


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Before any work: an empty or new folder, or with --force one that holds only an earlier sweep's results."""
    from planner.errors import MososError

    if out_dir.exists() and not out_dir.is_dir():
        raise MososError(f"--out {out_dir} is a file; give a folder")
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if not parent.is_dir():
        raise MososError(f"--out {out_dir}: the folder {parent} does not exist")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        ours = {RESULTS_CSV, RESULTS_JSON, SCHEDULES}
        others = sorted(item.name for item in out_dir.iterdir() if item.name not in ours)
        if not force:
            raise MososError(f"--out {out_dir} is not empty; give a new folder, or --force to replace "
                             "an earlier sweep's results there")
        schedules = out_dir / SCHEDULES
        if schedules.exists() and not schedules.is_dir():
            others.append(SCHEDULES)
        elif schedules.is_dir():
            others += sorted(f"{SCHEDULES}/{item.name}" for item in schedules.iterdir() if not _is_sweep_schedule(item))
        if others:
            raise MososError(f"--out {out_dir} holds files that are not a sweep's results ({', '.join(others[:3])}); "
                             "give another folder")


def _is_sweep_schedule(path: Path) -> bool:
    """A schedule a sweep wrote (`cluster.sweep`: row number, profile, strategy, budget): the only files --force
    removes from schedules/."""
    return path.is_file() and not path.is_symlink() and SWEEP_SCHEDULE_NAME.fullmatch(path.name) is not None


def prepare_out_dir(out_dir: Path, force: bool) -> Path:
    """Check the folder again (it may have changed while Ray started), clear an earlier sweep's results, make it."""
    check_out_dir(out_dir, force)
    schedules = out_dir / SCHEDULES
    if out_dir.is_dir():
        for item in (out_dir / RESULTS_CSV, out_dir / RESULTS_JSON):
            item.unlink(missing_ok=True)
        if schedules.is_dir():
            for item in schedules.iterdir():
                if _is_sweep_schedule(item):
                    item.unlink()
    schedules.mkdir(parents=True, exist_ok=True)
    return schedules
