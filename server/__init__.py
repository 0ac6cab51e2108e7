"""The fleet service: tuned winners shared by every host of a GPU class (``tuner serve``)."""

from server.app import create_app
from server.config import Settings

__all__ = ["Settings", "create_app"]
