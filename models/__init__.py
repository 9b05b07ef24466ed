"""Reference networks (VGG, U-Net, ResNet, transformer), a GPU table and a profile estimator.

This package needs torch (the planner never imports it); `models.gpus` and `models.names` do not, and importing them
does not import torch: the package's own names load on first use.
"""

__all__ = ["ModelSpec", "get_model", "list_models"]


def __getattr__(name: str):
    if name in __all__:
        from models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
