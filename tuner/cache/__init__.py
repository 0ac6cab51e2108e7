"""The local results store (SQLite)."""

from tuner.cache.sqlite import BusyError, ReadOnlyError, WriteFailedError
from tuner.cache.store import Store, StoreError, cache_file, default_path

__all__ = [
    "BusyError",
    "ReadOnlyError",
    "Store",
    "StoreError",
    "WriteFailedError",
    "cache_file",
    "default_path",
]
