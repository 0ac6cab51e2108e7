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
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tuner.core.guesses import close_match, with_guess

log = logging.getLogger(__name__)

KNOWN = {
    "mode": "dispatch on a miss: off, lookup, record or tune",
    "cache": "the SQLite cache file",
    "buckets": "M bucket policy for untuned shapes",
    "stale": "winners measured under other versions: use or ignore",
    "server": "fleet service base URL",
    "token": "fleet service bearer token",
    "sync_interval": "seconds between background syncs",
    "server_timeout": (
        "seconds each request to the fleet service waits for its answer: tuner sync, push and "
        "artifacts (their --timeout), the dispatcher's background sync, tuner warmup's kernel "
        "fetch, and tune-all's --queue claims and kernel fetch and push"
    ),
    "server_db": "the service's own SQLite file (tuner serve)",
    "artifacts": "the compiled-kernel store's folder (default: artifacts/ beside the cache)",
    "artifacts_max_bytes": (
        "the compiled-kernel store's size limit, least recently used out: a positive whole "
        "number of bytes, as 1000000000 or 1e9"
    ),
    "cublas_algos": "cuBLAS algorithm ids to try",
    "compile_workers": "parallel kernel compilations",
    "triton_fast_launch": "launch compiled Triton kernels directly (on/off)",
    "cutlass_jobs": "parallel CUTLASS compilations",
    "cutlass_compile_timeout": "seconds per CUTLASS compilation",
    "profile": "a folder for cProfile files of tune-all and its workers (diagnostics)",
}

# the settings that take one of a few words: a file's other word is named and left out at load
# (the modules that read them take these tuples as theirs)
CHOICES = {
    "mode": ("off", "lookup", "record", "tune"),
    "buckets": ("exact", "next_tuned_above", "pow2"),
    "stale": ("use", "ignore"),
}

# the on/off settings and their defaults, read by ``env_flag``; each takes the words of FLAG_WORDS
FLAGS = {"triton_fast_launch": True}
FLAG_WORDS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}
FLAG_HELP = "1/0, true/false, yes/no, on/off"


@dataclass(frozen=True)
class Number:
    """A setting that takes a number of ``kind`` in ``[low, high]`` (``low`` excluded where it
    is 0: a positive number) of ``unit``, named in its words. The modules that read it take
    their bounds from here, and the environment and the config file read it alike (``read``)."""

    kind: type[int] | type[float]
    low: float = 0.0
    high: float = math.inf
    unit: str = ""

    def read(self, text: str) -> int | float | None:
        """``text`` as this setting's number, None where it is none or out of bounds: a whole
        number may be written as a float (``1e9``), since TOML reads ``1e9`` as one."""
        value = whole_number(text) if self.kind is int else _float(text)
        if value is None:
            return None
        above_low = value > 0 if self.low == 0 else value >= self.low
        return value if above_low and value <= self.high else None

    def takes(self, text: str) -> bool:
        return self.read(text) is not None

    def words(self) -> str:
        what = "a whole number" if self.kind is int else "a number"
        if self.kind is float and self.high == math.inf:  # ``inf`` is no setting's value
            what = "a finite number"
        if self.unit:
            what += f" of {self.unit}"
        if self.low == 0 and self.high == math.inf:
            what = f"a positive {what.removeprefix('a ')}"
        elif self.high == math.inf:
            what += f" of at least {self.low:g}"
        else:
            what += f" from {self.low:g} to {self.high:g}"
        unbounded = self.kind is int and self.high == math.inf  # (1e9 is no bounded count)
        return f"{what} (as 1000000000 or 1e9)" if unbounded else what


def whole_number(text: str) -> int | None:
    """``text`` as an int where it names a whole number, in digits or as a float (``1e9``,
    ``1000000000.0``), None otherwise (``1.5``, ``nan``, ``inf``, ``abc``): one rule for the
    environment and the config file, whose TOML makes ``1e9`` a float."""
    try:
        return int(text)
    except ValueError:
        value = _float(text)
    return int(value) if value is not None and value.is_integer() else None


def _float(text: str) -> float | None:
    """``text`` as a finite float, else None: ``inf`` seconds or bytes is no setting's value."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# under 1 s would hammer the service; over a week is a typo (and past threading.TIMEOUT_MAX the
# sync thread dies)
SYNC_INTERVAL = Number(float, 1.0, 7 * 24 * 3600.0)
SERVER_TIMEOUT = Number(float, 0.1)
# parallel compilations: each is a process of its own (a Python interpreter, an nvcc) with its
# memory, so more than this is a typo; and past 2**31 - 2 the Triton compile pool cannot even
# be made (OverflowError)
WORKERS = Number(int, 1, 1024)
# the settings that take a number (each module reads its own, with ``env_number`` or as a
# command's option); every other setting is text (a path, a URL, a token, a list), which a file
# gives as a string
NUMBERS: dict[str, Number] = {
    "sync_interval": SYNC_INTERVAL,
    "server_timeout": SERVER_TIMEOUT,
    "artifacts_max_bytes": Number(int, unit="bytes"),
    "compile_workers": WORKERS,
    "cutlass_jobs": WORKERS,
    "cutlass_compile_timeout": Number(float),
}
# what follows from a ``NUMBERS`` variable out of its bounds (``tuner info`` says it)
NOT_A_NUMBER = {
    "server_timeout": (
        "tuner sync, push and artifacts refuse it; the background sync, warmup and tune-all "
        "use the default, and log it"
    ),
    "artifacts_max_bytes": "the compiled-kernel store refuses to open",
}
# where a refused number came from, as ``number_refused`` names it
ENV, FILE = "environment variable", "config file"
NOT_A_NUMBER_DEFAULT = "the default is used, and logged"
# one algorithm id is a list of one; a token of digits is a token
TEXT_TAKES_NUMBERS = ("cublas_algos", "token")


# the settings that name files or folders: a relative one in the file is taken from the file's
# folder, not from wherever a command happens to run
PATHS = ("cache", "server_db", "artifacts", "profile")


def config_path() -> Path:
    if env := os.environ.get("TUNER_CONFIG"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "tuner" / "config.toml"


def read_config(path: Path) -> tuple[dict[str, str], list[str]]:
    """The file's settings as environment values (its relative ``PATHS`` from its folder: a
    link's, not its target's), and what was wrong with the rest of it (an unknown name, a value
    of the wrong type for its setting, a word not among a setting's ``CHOICES``, a number out of
    one of ``NUMBERS``' bounds: each named, each left out); ValueError if the file cannot be
    read as TOML (UTF-8, a byte-order mark let by)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected TOML)") from None
    values, problems = {}, []
    for name, value in data.items():
        if isinstance(value, dict) and name not in KNOWN:
            problems.append(
                f"{path}: [{name}] is a table, and settings are read from the top of the file "
                f"only: its {sorted(value)} left out; write them above any [table] line"
            )
        elif name not in KNOWN:
            guess = close_match(name.lower().removeprefix("tuner_"), list(KNOWN))  # TUNER_CACHE
            unknown = with_guess(repr(name), guess)
            problems.append(f"{path}: unknown setting {unknown} left out; known: {sorted(KNOWN)}")
        elif not isinstance(value, (str, int, float, bool)):
            problems.append(f"{path}: {name} must be a string or number, got {value!r}; left out")
        elif name in NUMBERS:
            number = None if isinstance(value, bool) else NUMBERS[name].read(str(value))
            if number is None:
                problems.append(f"{path}: {number_refused(name, value, FILE)}; left out")
            else:
                values[f"TUNER_{name.upper()}"] = str(number)  # TOML's 1e9: 1000000000
        elif why := _wrong_type(name, value):
            problems.append(f"{path}: {name} must be {why}, got {value!r}; left out")
        elif name in CHOICES and value not in CHOICES[name]:
            problems.append(
                f"{path}: {name} must be one of {list(CHOICES[name])}, got {value!r}; left out"
            )
        elif name in FLAGS and parse_flag(_env_text(value)) is None:
            problems.append(f"{path}: {name} must be one of {FLAG_HELP}, got {value!r}; left out")
        elif name in PATHS and value:  # an empty one is unset, as in the environment
            values[f"TUNER_{name.upper()}"] = str(path.absolute().parent / Path(value).expanduser())
        else:
            values[f"TUNER_{name.upper()}"] = _env_text(value)
    return values, problems


def _wrong_type(name: str, value: str | int | float | bool) -> str | None:
    """What a file's ``value`` for text setting ``name`` should have been, or None where it is
    of the setting's type (its words and on/off values are judged apart): TOML's ``true`` is
    on/off only, the others take a string."""
    if name in FLAGS:
        return None
    if isinstance(value, bool):
        return "a string"
    if isinstance(value, (int, float)) and name not in TEXT_TAKES_NUMBERS:
        return "a string (in quotes)"
    return None


def number_refused(name: str, value: object, source: str) -> str:
    """Why number setting ``name`` refuses ``value`` from ``source`` (``ENV`` or ``FILE``): one
    message, naming the setting, where the value came from, the value and the rule, wherever
    it is read."""
    setting = f"TUNER_{name.upper()}" if source == ENV else name
    return f"{setting} ({source}) must be {NUMBERS[name].words()}, got {value!r}"


def _env_text(value: str | int | float | bool) -> str:
    """A file's value as its variable's text: TOML's ``true`` is ``1``, as in the environment."""
    return str(int(value) if isinstance(value, bool) else value)


def parse_flag(text: str) -> bool | None:
    """An on/off setting's word (any case, spaces around ignored), None for any other word: one
    reading for the environment and the config file, so ``off`` means off in both."""
    return FLAG_WORDS.get(text.strip().lower())


def refusal(name: str, value: str) -> str | None:
    """Why ``TUNER_<name>=value`` is refused, and what happens then; None where it is taken (a
    setting of free text is not judged here). For ``tuner info``, where one looks
    before the first call fails or a default silently applies. An empty value is unset: the
    config file's value or the default applies."""
    if not value:
        return None
    if (words := CHOICES.get(name)) is not None and value not in words:
        return f"not one of {', '.join(words)}: the first call fails"
    if name in FLAGS and parse_flag(value) is None:
        return f"not one of {FLAG_HELP}: {_flag_word(FLAGS[name])} (the default) is used"
    if name in NUMBERS and not NUMBERS[name].takes(value):
        return f"not {NUMBERS[name].words()}: {NOT_A_NUMBER.get(name, NOT_A_NUMBER_DEFAULT)}"
    return None


def _flag_word(value: bool) -> str:
    return "on" if value else "off"


def load_config_file(strict: bool = False) -> Path | None:
    """Fill unset (or empty) TUNER_* variables from the config file. What is wrong in it is
    logged and left out, the rest applies; a file that cannot be read is logged and skipped, as
    is a ``$TUNER_CONFIG`` that names no file (a typo there would otherwise go unnoticed).

    ``strict`` (the CLI's commands): a file that cannot be read raises ValueError instead, as a
    command run without its cache or server would write to or ask another one."""
    path = config_path()
    if not path.is_file():
        if os.environ.get("TUNER_CONFIG"):
            what = "a folder, not a file" if path.is_dir() else "no such file"
            log.warning("TUNER_CONFIG=%s: %s; no tuner config file read", path, what)
        return None
    try:
        values, problems = read_config(path)
    except (OSError, ValueError) as e:
        quotes = " (strings take quotes: mode = 'record')" * ("Invalid value" in str(e))
        _lost(strict, f"{e}{quotes}")
        return None
    for problem in problems:
        log.warning("%s", problem)
    for name, value in values.items():
        if not os.environ.get(name):  # an empty variable is an unset one, as everywhere
            os.environ[name] = value
    return path


def _lost(strict: bool, problem: str) -> None:
    """A config file that applies not at all: an error where ``strict``, else a warning."""
    if strict:
        raise ValueError(f"{problem}; mend the tuner config file or point TUNER_CONFIG elsewhere "
                         "(`tuner info` shows the settings in use)")  # fmt: skip
    log.warning("%s; the tuner config file is ignored", problem)


def env_number(name: str, default: float) -> float:
    """``$name`` read as its setting's number (``NUMBERS``), or ``default`` where it is unset;
    a value that is not one is logged, as ``number_refused`` words it, and ``default`` used (a
    typo must not stop a run that would otherwise go on, nor be taken silently)."""
    text = os.environ.get(name)
    if not text:
        return default
    setting = name.removeprefix("TUNER_").lower()
    if (value := NUMBERS[setting].read(text)) is not None:
        return value
    log.warning("%s; using %s (the default)", number_refused(setting, text, ENV), default)
    return default


def env_flag(name: str, default: bool) -> bool:
    """``$name`` read as on or off (``parse_flag``'s words), ``default`` where it is unset or
    empty; another word is logged, naming the variable and the words taken, and ``default``
    used, as ``env_number`` does (``false`` must not silently mean on)."""
    text = os.environ.get(name)
    if not text:
        return default
    if (value := parse_flag(text)) is not None:
        return value
    word = _flag_word(default)
    log.warning("%s=%r: expected one of %s; using %s (the default)", name, text, FLAG_HELP, word)
    return default
