"""What a misspelled name most likely meant: an error that says "did you mean 'mode'?" spares
the reader a scan of every name allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# other tools' names for the dtypes keys spell f16, bf16 and f32 (torch's, NumPy's, CUDA's)
DTYPE_NAMES = {
    **dict.fromkeys(("float16", "half", "fp16", "torch.float16"), "f16"),
    **dict.fromkeys(("bfloat16", "torch.bfloat16"), "bf16"),
    **dict.fromkeys(("float32", "float", "fp32", "torch.float32"), "f32"),
}


def close_match(name: str, allowed: list[str]) -> str | None:
    """The allowed name ``name`` most likely misspells or spells in another case or another
    tool's words (``BF16``, ``float16``), if one is close."""
    for other in (name.lower(), DTYPE_NAMES.get(name.lower())):
        if other in allowed and other != name:
            return other
    return next(iter(difflib.get_close_matches(name, allowed, n=1, cutoff=0.75)), None)


def with_guess(name: str, guess: str | None) -> str:
    return f"{name} (did you mean {guess!r}?)" if guess else name


def did_you_mean(value: object, allowed: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` for a string ``value`` close to one of ``allowed``, else ""."""
    if not isinstance(value, str):
        return ""
    return with_guess("", close_match(value, [str(a) for a in allowed]))
