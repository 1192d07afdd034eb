"""Robustness on real code: re-entered decorators, unreadable tensors, complex and sparse values."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError

# -- a decorator-made watch, re-entered (issue 15, item 13) --------------------------------------


class Logs(nn.Module):
    """``log`` of its input: NaN for a negative value, the module that produces it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def log_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Logs())


def test_recursion_runs_inside_the_watch_the_outermost_call_entered() -> None:
    model = log_model()
    w = nan_magic.watch(model)
    depths_active: list[bool] = []

    @w
    def descend(x: torch.Tensor, depth: int) -> torch.Tensor:
        depths_active.append(w.active)
        if depth == 0:
            return model(x)
        return descend(x, depth - 1)

    healthy = torch.full((2, 4), 0.01)
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.fill_(1.0)
    expected = model(healthy)
    assert torch.equal(descend(healthy, 3), expected)
    assert depths_active == [True] * 4 and not w.active
    # The innermost call is watched: its NaN is caught and named there.
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    with pytest.raises(NonFiniteError) as caught:
        descend(healthy, 3)
    assert (caught.value.report.module, caught.value.report.phase) == ("1", "forward")
    assert not w.active  # left once, by the outermost call


def test_an_explicit_second_enter_still_says_already_active() -> None:
    w = nan_magic.watch(log_model())

    @w
    def enter_again() -> None:
        with w:
            pass

    with pytest.raises(RuntimeError, match="already active"):
        enter_again()
    assert not w.active


def test_a_second_thread_runs_unwatched_while_the_first_holds_the_watch() -> None:
    model = log_model()
    w = nan_magic.watch(model)
    inside, second_done = threading.Event(), threading.Event()
    results: dict[str, Any] = {}
    bad = torch.full((2, 4), -100.0)  # Linear's output goes negative: log makes NaN

    @w
    def run(x: torch.Tensor, first: bool) -> torch.Tensor:
        if first:
            inside.set()
            assert second_done.wait(timeout=30), "the second thread did not finish"
        return model(x)

    def first() -> None:
        try:
            run(bad, True)
        except BaseException as error:  # the NonFiniteError the first thread must get
            results["first"] = error

    def second() -> None:
        assert inside.wait(timeout=30), "the first thread never entered"
        try:
            results["second"] = run(bad, False)
        except BaseException as error:
            results["second"] = error
        finally:
            second_done.set()

    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    # The second call ran while the watch was active on the first thread: unwatched, no error.
    assert isinstance(results["second"], torch.Tensor), results["second"]
    assert torch.isnan(results["second"]).all()
    # The first thread's own call was watched and named its producer.
    assert isinstance(results["first"], NonFiniteError), results.get("first")
    assert results["first"].report.module == "1"
    assert len(w.events) == 1 and not w.active
