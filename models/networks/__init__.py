"""Plain torch.nn reference networks (no torchvision: it has no CPU build here)."""
