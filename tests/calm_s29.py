"""The harness of the twenty-ninth round's healthy rows (tests/test_calm_s29*.py).

A row is a loop a user writes, built from a seed and run twice: unwatched, then under ``watch`` in one of the five
modes. ``run(watching)`` runs the loop with ``with watching(): ...`` around the part the user watches (a row may
enter it more than once, nest it, or leave it by a KeyboardInterrupt); unwatched, ``watching()`` is a null context.
Asserted: no exception of ours, no warning naming nan_magic (nor one the unwatched run does not give), no report
and no event that is not benign (``quiet``: no event at all), the outputs, parameters, gradients, buffers,
optimizer state and the RNG state after the loop bit-identical, and nothing left on the held objects: hooks,
instance attributes, weak references to modules and parameters, ``requires_grad``, parameter types.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from contract import MODE_OPTIONS
from contract.calm26 import Leftovers, state_of
from test_contract import same

import nan_magic

MODES = ["default", "defer", "full", "ops", "ops-defer"]


@dataclass
class Row:
    """``targets``: what the user passes to ``watch``; ``held``: the objects compared after and checked for
    leftovers; ``run(watching)``: the loop, returning its outputs (tensors, floats, nested lists of them)."""

    targets: tuple
    held: tuple
    run: Callable[[Callable[..., Any]], Any]
    quiet: bool = False  # no event at all, not even a benign one
    watches: list = field(default_factory=list)


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach().clone()]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _flat(item)]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _flat(out[key])]
    if isinstance(out, (bool, int, float)):
        return [torch.tensor(out)]
    if out is None:
        return []
    raise TypeError(type(out))


def _dynamo_tag(module: torch.nn.Module) -> int:
    """1 where Dynamo tagged ``module`` (watched or not, it weakly keys every module made after its first compile
    in the process: mutation_guard.GenerationTracker), so that which run compiled first changes no count."""
    guard = sys.modules.get("torch._dynamo.mutation_guard")
    return 0 if guard is None else int(module in guard.GenerationTracker.generation_values)


def _weak_refs(*objs: Any) -> list[int]:
    for _ in range(3):  # (a cycle through autograd is freed over two passes: the first frees a view's base)
        gc.collect()
    found = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            found += [weakref.getweakrefcount(m) - _dynamo_tag(m) for m in obj.modules()]
            found += [weakref.getweakrefcount(p) for p in obj.parameters()]
        elif isinstance(obj, torch.optim.Optimizer):
            found.append(weakref.getweakrefcount(obj))
    return found


def _ours(w: warnings.WarningMessage) -> bool:
    return "nan_magic" in str(w.message) or "nan_magic" in str(w.filename)


@dataclass
class Ran:
    outputs: list[torch.Tensor]
    state: list[torch.Tensor]
    rng: torch.Tensor
    leftovers: Leftovers
    weak: list[int]
    warned: set[str]


def _run(build: Callable[[], Row], options: dict | None) -> tuple[Ran, Row]:
    torch.manual_seed(0)
    row = build()

    @contextlib.contextmanager
    def watching(*targets: Any, **more: Any) -> Iterator[Any]:
        if options is None:
            yield None
            return
        with nan_magic.watch(*(targets or row.targets), **{**options, **more}) as w:
            row.watches.append(w)
            yield w

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = _flat(row.run(watching))
    ran = Ran(outputs, state_of(*row.held), torch.get_rng_state(), Leftovers(*row.held), [],
              {f"{w.category.__name__}: {w.message}" for w in caught})
    ours = [w for w in caught if _ours(w)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    return ran, row


def check(build: Callable[[], Row], mode: str) -> None:
    """Unwatched and watched runs of ``build()`` are the same; the watches were calm and left nothing."""
    expected, expected_row = _run(build, None)
    got, row = _run(build, MODE_OPTIONS[mode])
    assert row.watches, "the row never entered the watch"
    for w in row.watches:
        assert w.report is None, w.report
        assert all(event.benign for event in w.events), w.events
        if row.quiet:
            assert not w.events, w.events
    assert got.warned <= expected.warned, got.warned - expected.warned
    assert len(got.outputs) == len(expected.outputs)
    assert all(same(a, b) for a, b in zip(got.outputs, expected.outputs, strict=True)), "outputs differ"
    assert len(got.state) == len(expected.state)
    assert all(same(a, b) for a, b in zip(got.state, expected.state, strict=True)), "state differs"
    assert torch.equal(got.rng, expected.rng), "the RNG state after the loop differs"
    assert got.leftovers == expected.leftovers, "hooks or attributes left on the model"
    # A Watch the user keeps holds its targets (their weak references die with it): counted once it is gone.
    expected.weak = _weak_refs(*expected_row.held)
    row.watches.clear()
    del w
    got.weak = _weak_refs(*row.held)
    assert got.weak == expected.weak, ("weak references left on modules or parameters", got.weak, expected.weak)


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_of: Callable[[int], torch.Tensor],
          n: int = 3) -> Callable[[Callable[..., Any]], list[torch.Tensor]]:
    """A plain watched loop: ``n`` steps of ``loss_of(step)``; outputs the losses."""

    def run(watching: Callable[..., Any]) -> list[torch.Tensor]:
        losses = []
        with watching():
            for step in range(n):
                loss = loss_of(step)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    return run
