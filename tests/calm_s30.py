"""The harness of the thirtieth round's healthy rows (tests/test_calm_s30*.py).

The rows are built and compared as in tests/calm_s29.py (``check``: no exception or warning of ours, no report or
event that is not benign, outputs, parameters, gradients, buffers, optimizer state and RNG state bit-identical to
the unwatched run, no hooks, attributes or weak references left). ``check`` here also runs the row once more under
the watch and drops it: the watches, the held objects (the model, its optimizers) and the row itself must then be
freed by the garbage collector, as they are after an unwatched run.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from calm_s29 import MODES, Row, steps
from calm_s29 import check as compare
from contract import MODE_OPTIONS
from torch import nn

import nan_magic

__all__ = ["MODES", "Row", "check", "data", "mlp", "sgd", "steps"]


def mlp(d_in: int = 6, d_out: int = 3) -> nn.Sequential:
    """The rows' small model (tests/test_calm_s32*.py)."""
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _refs_once_run(build: Callable[[], Row], options: dict | None) -> list[weakref.ref]:
    row = build()
    watches: list[Any] = []

    class _Watching:
        def __init__(self, *targets: Any, **more: Any) -> None:
            self.w = None if options is None else nan_magic.watch(*(targets or row.targets), **{**options, **more})

        def __enter__(self) -> Any:
            if self.w is None:
                return None
            watches.append(self.w)
            return self.w.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return None if self.w is None else self.w.__exit__(*exc)

    row.run(_Watching)
    return [weakref.ref(obj) for obj in (*watches, *row.held)]


def _alive_once_run(build: Callable[[], Row], options: dict | None) -> list[str]:
    refs = _refs_once_run(build, options)
    for _ in range(3):
        gc.collect()
    return [type(ref()).__name__ for ref in refs if ref() is not None]


def check(build: Callable[[], Row], mode: str, all_freed: bool = False) -> None:
    """``compare`` (tests/calm_s29.py), then: once dropped, the watch, the model and its optimizers are freed
    (``all_freed``: every one of them, where the unwatched run frees them all)."""
    compare(build, mode)
    # (What the unwatched run leaves alive, a compiled model in torch's caches, is not ours.)
    alive, alive_unwatched = _alive_once_run(build, MODE_OPTIONS[mode]), _alive_once_run(build, None)
    assert alive == alive_unwatched, f"still alive once the loop and the watch are gone: {alive}"
    assert not (all_freed and alive), f"still alive once the loop and the watch are gone: {alive}"
