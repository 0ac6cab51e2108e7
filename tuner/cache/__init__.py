"""The local results store (SQLite)."""

from tuner.cache.store import Store, StoreError, default_path

__all__ = ["Store", "StoreError", "default_path"]
