"""The mosos planning service (FastAPI): POST a profile and a budget, get a schedule."""

from api.app import create_app
from api.settings import Settings

__all__ = ["Settings", "create_app"]
