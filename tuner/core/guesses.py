"""What a misspelled name most likely meant: an error that says "did you mean 'mode'?" spares
the reader a scan of every name allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_match(name: str, allowed: list[str]) -> str | None:
    """The allowed name ``name`` most likely misspells, if one is close."""
    return next(iter(difflib.get_close_matches(name, allowed, n=1, cutoff=0.75)), None)


def with_guess(name: str, guess: str | None) -> str:
    return f"{name} (did you mean {guess!r}?)" if guess else name


def did_you_mean(value: object, allowed: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` for a string ``value`` close to one of ``allowed``, else ""."""
    if not isinstance(value, str):
        return ""
    return with_guess("", close_match(value, [str(a) for a in allowed]))
