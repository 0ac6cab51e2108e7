"""``make demo``: tune a handful of problems into the SQLite cache, show the winners, and
dispatch them from a fresh dispatcher as an application would.

On a machine without a GPU this is the CPU path: torch baselines and Triton kernels through
Triton's interpreter, on small shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

from tuner.cache import Store, default_path
from tuner.cli.main import app
from tuner.core.console import output_console
from tuner.core.keys import GemmKey
from tuner.measure import samples
from tuner.offline.problem_list import load_problems
from tuner.serving.dispatcher import Dispatcher
from tuner.tuning.engine import current_device

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "problems"
console = output_console()


def main() -> None:
    device = current_device()
    config = CONFIGS / f"demo-{'gpu' if device == 'cuda' else 'cpu'}.yaml"
    cache = default_path()
    console.rule(f"tuner demo on {device}: cache {cache}")
    app(["info"], standalone_mode=False)
    app(["tune-all", "--config", str(config), "--budget", "0.05"], standalone_mode=False)
    app(["show", "--cache", str(cache)], standalone_mode=False)

    console.rule("dispatch from the stored winners (a fresh dispatcher, as in a new process)")
    dispatcher = Dispatcher(cache, mode="lookup")
    gen = torch.Generator(device=device).manual_seed(7)
    for key in load_problems(config):
        inputs = samples.make_inputs(key, device, gen)
        if isinstance(key, GemmKey):
            out = dispatcher.matmul(*inputs)
        else:
            out = dispatcher.sdpa(
                *inputs,
                causal={"none": False, "top_left": True}.get(key.causal, key.causal),
                scale=key.scale,
                enable_gqa=True,  # a key's kv heads may divide its q heads
            )
        err = samples.relative_error(out, samples.reference(key, inputs))
        ok = err <= samples.tolerance(key)
        console.print(
            f"{'[green]ok[/green]' if ok else '[red]WRONG[/red]'}  rel err {err:.1e}  {dispatcher.choices.get(str(key), '?'):<28} {key.label}"
        )
    Store(cache).close()


if __name__ == "__main__":
    main()
