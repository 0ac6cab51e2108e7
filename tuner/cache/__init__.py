"""The local results store (SQLite)."""

from tuner.cache.sqlite import ReadOnlyError
from tuner.cache.store import Store, StoreError, default_path

__all__ = ["ReadOnlyError", "Store", "StoreError", "default_path"]
