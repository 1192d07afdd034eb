"""Whose hooks: ``Watch.here.mine`` (hot/watched/owner.py), the attribute every hook reads instead of asking the watch.

True only on the thread that entered the watch, while it is active and no replay of its own runs; set where
those change (entered, left, paused, resumed, a replay standing aside), never computed by a hook.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import nan_magic

TIMINGS = [pytest.param(False, id="immediate"), pytest.param(True, id="deferred")]


def _elsewhere(read: object) -> bool:
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(read()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize("defer", TIMINGS)
def test_the_hooks_are_the_watchs_own_on_its_thread_while_it_is_active(defer: bool) -> None:
    model = nn.Linear(2, 2)
    w = nan_magic.watch(model, defer=defer)
    assert not w.here.mine  # not entered yet
    with w:
        assert w.here.mine
        assert not _elsewhere(lambda: w.here.mine)  # another thread's calls are not the watch's
        model(torch.randn(3, 2)).sum().backward()
        assert w.here.mine
    assert not w.here.mine


@pytest.mark.parametrize("defer", TIMINGS)
def test_a_replay_standing_aside_turns_them_off_and_back_nested(defer: bool) -> None:
    model = nn.Linear(2, 2)
    with nan_magic.watch(model, defer=defer) as w:
        with w.call_replay.standing_aside():
            assert not w.here.mine
            with w.call_replay.standing_aside():
                assert not w.here.mine
            assert not w.here.mine  # the outer replay still runs
        assert w.here.mine
        out = model(torch.randn(3, 2))  # and the hooks act again: the step's call is recorded
        assert any(call.module is model for call in w.log.calls)
        out.sum().backward()


def test_pausing_and_resuming_the_run_turns_them_off_and_on() -> None:
    model = nn.Linear(2, 2)
    w = nan_magic.watch(model)
    w.resume()
    assert w.here.mine
    w.pause()
    assert not w.here.mine and w.paused
    w.resume()
    assert w.here.mine
    w.__exit__(None, None, None)
    assert not w.here.mine
