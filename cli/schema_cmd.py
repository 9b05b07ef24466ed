"""`mosos schema profile|schedule`: the JSON Schemas of the two contracts."""

from __future__ import annotations

import json
from enum import Enum

import typer

from cli.app import app, friendly
from planner.profile import GraphProfile
from planner.schedule import Schedule


class Document(str, Enum):
    profile = "profile"
    schedule = "schedule"


@app.command("schema")
@friendly
def schema(document: Document = typer.Argument(..., help="profile or schedule")) -> None:
    """Print the JSON Schema of a profile or a schedule."""
    model = GraphProfile if document is Document.profile else Schedule
    typer.echo(json.dumps(model.model_json_schema(), indent=2))
