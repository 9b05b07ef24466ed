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


def autocast_regions() -> list[str]:
    """The device types torch.autocast is on for, here and now."""
    import torch

    return [device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]


def refuse_autocast(what: str) -> None:
    """Mixed precision changes which kernels run (casts, lower-precision matmuls); the captured graph and its replay
    run the model's own dtypes. Running the plan under autocast would give another model's gradients silently."""
    regions = autocast_regions()
    if regions:
        import torch

        dtypes = ", ".join(f"{device} {torch.get_autocast_dtype(device)}" for device in regions)
        raise ReplayError(
            f"{what} under torch.autocast ({dtypes}): the planned step replays the model in its own dtypes and would "
            "not compute what eager autocast computes, so it is refused rather than run differently. Call it outside "
            "the autocast region (mixed precision is not supported yet), or cast the model and its inputs to the "
            "precision you want (model.to(torch.bfloat16)) and plan that"
        )

