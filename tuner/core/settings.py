"""Settings from a config file, with the environment taking precedence.

Every setting is an environment variable ``TUNER_<NAME>``. A TOML file (``$TUNER_CONFIG``, else
``$XDG_CONFIG_HOME/tuner/config.toml``, else ``~/.config/tuner/config.toml``) may give defaults::

    mode = "record"          # TUNER_MODE
    cache = "/data/tuner.db" # TUNER_CACHE
    server = "http://tuner.internal:8080"
    buckets = "pow2"

Loading the file only fills variables the environment does not set, so the environment always
wins and every module keeps reading plain ``TUNER_*`` variables.
"""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path

log = logging.getLogger(__name__)

KNOWN = {
    "mode": "dispatch on a miss: off, lookup, record or tune",
    "cache": "the SQLite cache file",
    "buckets": "M bucket policy for untuned shapes",
    "stale": "winners measured under other versions: use or ignore",
    "server": "fleet service base URL",
    "token": "fleet service bearer token",
    "sync_interval": "seconds between background syncs",
    "server_db": "the service's own SQLite file (tuner serve)",
    "cublas_algos": "cuBLAS algorithm ids to try",
    "compile_workers": "parallel kernel compilations",
    "triton_fast_launch": "launch compiled Triton kernels directly (1/0)",
    "cutlass_jobs": "parallel CUTLASS compilations",
    "cutlass_compile_timeout": "seconds per CUTLASS compilation",
    "profile": "a folder for cProfile files of tune-all and its workers (diagnostics)",
}


def config_path() -> Path:
    if env := os.environ.get("TUNER_CONFIG"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "tuner" / "config.toml"


def read_config(path: Path) -> dict[str, str]:
    """The file's settings as environment values; ValueError naming the file and key if wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected TOML)") from None
    unknown = sorted(set(data) - set(KNOWN))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {unknown}; known: {sorted(KNOWN)}")
    for name, value in data.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"{path}: {name} must be a string or number, got {value!r}")
    return {
        f"TUNER_{name.upper()}": str(int(v) if isinstance(v, bool) else v)
        for name, v in data.items()
    }


def load_config_file() -> Path | None:
    """Fill unset TUNER_* variables from the config file; a broken file is reported and skipped."""
    path = config_path()
    if not path.is_file():
        return None
    try:
        values = read_config(path)
    except (OSError, ValueError) as e:
        log.warning("ignoring the tuner config file: %s", e)
        return None
    for name, value in values.items():
        os.environ.setdefault(name, value)
    return path
