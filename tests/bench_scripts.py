"""Load a script of bench/ (a folder of scripts, not a package) as a module.

The benchmark tests call the scripts' functions, and the drop-in tests build their model from
bench/dropin_decoder.py; both load it through here, once per session.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_script(name: str) -> ModuleType:
    """bench/<name>.py as the module ``name``, registered in sys.modules before it runs (its
    dataclasses look their module up there)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
