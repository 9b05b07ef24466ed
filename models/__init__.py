"""Reference networks (VGG, U-Net, ResNet, transformer), a GPU table and a profile estimator.

This package needs torch; the planner never imports it.
"""

from models.registry import ModelSpec, get_model, list_models

__all__ = ["ModelSpec", "get_model", "list_models"]
