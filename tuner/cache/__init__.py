"""The local results store (SQLite)."""

from tuner.cache.sqlite import ReadOnlyError
from tuner.cache.store import Store, StoreError, cache_file, default_path

__all__ = ["ReadOnlyError", "Store", "StoreError", "cache_file", "default_path"]
