"""A replay runs the user's forward again; the user's run must go on as if it had not.

Beyond the model's tensors and Python attributes (localize/replay/untouched.py, tests in test_fixes.py and
test_compiled.py): the global random generators a forward may draw from. A stochastic depth by Python's
``random.random()`` drew again in the step replay and the fix trials, so a run left on under ``on_detect="warn"``
went on with other random numbers than the same run unwatched.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import numpy
import pytest
import torch
from torch import nn

import nan_magic

MODES = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred"),
         pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops"),
         pytest.param({"ops": True, "defer": True}, id="ops-deferred")]


class DrawsInForward(nn.Module):
    """A stochastic depth by Python's and numpy's generators, and a noise by torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5 and numpy.random.rand() < 0.9:
            return x
        return x + self.lin(x) + 0.01 * torch.randn_like(x)


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # a batch shifted below 0 makes NaN


def _draws_after_training(options: dict[str, object] | None) -> tuple[float, float, float, int]:
    """Six steps, a NaN at the fourth (warned, training goes on); the generators' next draws, and the events."""
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(DrawsInForward(), Log(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = nan_magic.watch(model, opt, on_detect="warn", **options) if options is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch if watch is not None else contextlib.nullcontext():
            for step in range(6):
                batch = torch.rand(3, 4) + (-2.0 if step == 3 else 0.1)
                loss = model(batch).nan_to_num().pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    events = len(watch.events) if watch is not None else 0
    return random.random(), float(numpy.random.rand()), float(torch.rand(1)), events


@pytest.mark.parametrize("options", MODES)
def test_a_replay_leaves_the_users_random_generators_where_the_run_left_them(options) -> None:
    *unwatched, _ = _draws_after_training(None)
    *watched, events = _draws_after_training(options)
    assert events >= 1  # the NaN was met (and replayed in the modes that replay)
    assert watched == unwatched


class RootOfScaled(nn.Module):
    """sqrt(|x * w|): at a zero batch its gradient is 0 * inf, NaN in w's; the forward counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x * self.w).abs().sqrt()  # the forward line %debug opens a replay of (line_replay.py)


def _after_a_backward_event(options: dict[str, object] | None) -> tuple[float, float, float, int, list[str], int]:
    """Six steps, a backward NaN at the fourth (warned, training goes on): the generators' next draws, the calls
    the forward counted, the loss of each step and the events. The replay to the forward line runs the forward once
    more: none of it may show."""
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    root = RootOfScaled()
    model = nn.Sequential(root, DrawsInForward(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = nan_magic.watch(model, opt, on_detect="warn", **options) if options is not None else None
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch if watch is not None else contextlib.nullcontext():
            for step in range(6):
                batch = torch.rand(3, 4) * (step != 3)
                loss = model(batch).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(repr(loss.item()))  # (as text: NaN from the event on equals NaN)
    events = [event for event in watch.events if event.phase == "backward"] if watch is not None else []
    if events and events[0].source is not None:  # (ops=True names no op for this gradient: the report has no line)
        # (pdb.pm() outside IPython, %debug in it: tests/test_report_debugger.py)
        assert any(" opens a replay of " in note and note.endswith(
            "at the report's line; its locals are the replay's, as that line left them") for note in events[0].notes
                   ), events[0].notes
    return random.random(), float(numpy.random.rand()), float(torch.rand(1)), root.calls, losses, len(events)


@pytest.mark.parametrize("options", MODES)
def test_the_replay_to_a_backward_producers_forward_line_leaves_no_trace(options) -> None:
    *unwatched, _ = _after_a_backward_event(None)
    *watched, events = _after_a_backward_event(options)
    assert events >= 1
    assert watched == unwatched


class _Doubled(nn.Module):
    """A parametrization: the weight used is twice the one stored."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_a_replay_computes_parametrizations_afresh_and_puts_the_users_cache_back() -> None:
    """Inside the user's ``with parametrize.cached():`` a replay runs the parametrization itself (the cached weight
    would hide the op that made it non-finite: hunt21's row-stochastic row, tiered) and leaves the cache as it was."""
    from torch.nn.utils import parametrize

    from nan_magic.localize.replay.untouched import untouched

    model = nn.Linear(2, 2)
    parametrize.register_parametrization(model, "weight", _Doubled())
    with parametrize.cached():
        cached = model.weight
        cache = parametrize._cache
        with untouched(model):
            assert model.weight is not cached  # computed afresh
            assert not parametrize._cache  # and not left in the user's cache
        assert parametrize._cache is cache and model.weight is cached
    assert not parametrize._cache_enabled
