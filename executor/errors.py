"""Errors of the PyTorch side; all are MososError so the CLI prints them without a traceback."""

from __future__ import annotations

from planner.errors import MososError


class CaptureError(MososError):
    """The model (with its loss) cannot be captured as one ATen training graph; the message names the module,
    the source line and what to change."""


class ProfileMismatch(MososError):
    """A profile or schedule that was made for another model, or for other input shapes."""


class ReplayError(MososError):
    """A schedule step the executor cannot carry out (its state disagrees with the schedule)."""

