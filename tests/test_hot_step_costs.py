"""What the backward and the optimizer step's boundary cost on a healthy step: counted, not timed (hotstep-s36).

Counted with cProfile, so it holds on a busy machine: over steady healthy steps of the default (immediate) watch,
the gradient into the model's output is summed without a ``detach`` first (it needs no gradient: a detach is an op,
a view with autograd's metadata, each step). A gradient that does need one (a ``create_graph=True`` backward) is
still detached, and judged: the last test.
"""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic
from nan_magic.errors.exceptions import NonFiniteError

SETTLE, STEPS = 8, 12


def _profile_steps(**options: object) -> tuple[pstats.Stats, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    with nan_magic.watch(model, optimizer, **options) as watch:
        for _ in range(SETTLE):
            step()
        profile = cProfile.Profile()
        profile.enable()
        try:
            for _ in range(STEPS):
                step()
        finally:
            profile.disable()
    assert not watch.events
    return pstats.Stats(profile), watch


def _calls_from(stats: pstats.Stats, callee: str, caller_file: str) -> int:
    """Calls of functions named ``callee`` (a builtin method too) made from ``caller_file``'s functions."""
    total = 0
    for (_file, _line, name), (_cc, _nc, _tt, _ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if callee not in name:
            continue
        total += sum(counts[0] for (file, _l, _n), counts in callers.items() if file.endswith(caller_file))
    return total


def _calls_of(stats: pstats.Stats, file: str, function: str) -> int:
    return sum(primitive for (name_file, _line, name), (primitive, *_rest) in stats.stats.items()  # type: ignore[attr-defined]
               if name_file.endswith(file) and name == function)


def test_output_gradient_is_summed_without_a_detach() -> None:
    stats, _watch = _profile_steps()
    assert _calls_of(stats, "hot/timing.py", "finite_by_sum") >= STEPS  # the read ran: one a step
    assert _calls_from(stats, "detach", "hot/timing.py") == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_gradient_that_needs_one_is_still_judged(defer: bool) -> None:
    """A double backward's output gradient (create_graph=True) requires grad: detached, then judged as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteError) as raised, nan_magic.watch(model, optimizer, defer=defer):
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            # At step 2 the loss is sqrt(0) = 0, finite, and its gradient into the output 1 / (2 sqrt(0)) = inf,
            # exactly: a gradient that requires grad (create_graph) and is not finite, the gradient check's read.
            loss = (out - out.detach()).sum().sqrt() if step == 2 else out.square().mean()
            loss.backward(create_graph=True)
            optimizer.step()
    report = raised.value.report
    assert report.step == 2
    assert report.phase == "backward"
