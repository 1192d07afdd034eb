"""The frames from the loop to a producer inside a model read in call order, in both timings.

A module's producer is named by a replay of the model call (localize/replay/tiered/root_calls.py), so the traceback
the user gets does not hold the forwards between the loop and the producing line: they ran in the replay. The
replay notes the frames it passed (localize/ops/sources.replayed_calls) and the line the loop called the
model from (RootCall.caller), and the traceback is rebuilt from them: the loop's line that called the model
(not ``opt.step()``, where the deferred check judged it), each forward that called the next, the producing
line. The report's "frames from your code to the producer" and ``%debug``'s ``up`` read that chain.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def producer_line(marker: str) -> int:
    return marked_line(marker, where=sys.modules[__name__])


def call_line(marker: str) -> int:
    return marked_line(marker, kind="call", where=sys.modules[__name__])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.log(h * 0 if self.broken else h.abs() + 1)  # producer: log in the block


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))  # call: the net calls its block


def _net() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _frames(error: NonFiniteError) -> list[tuple[str, int]]:
    return [(frame.function, frame.lineno) for frame in error.report.frames]


def _traceback(error: NonFiniteError) -> list[tuple[str, int]]:
    return [(entry.name, entry.lineno) for entry in traceback.extract_tb(error.__traceback__)]


def _loop(model: Net, opt: torch.optim.Optimizer, options: dict) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            model.block.broken = step == 2
            out = model(torch.randn(8, 4))  # call: the loop calls the model
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value


@pytest.mark.parametrize("options", TIMINGS)
def test_the_frames_run_from_the_model_call_through_each_forward_to_the_producer(options) -> None:
    error = _loop(*_net(), options)
    report = error.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "block", 2, "aten.log.default")
    chain = [("_loop", call_line("the loop calls the model")), ("forward", call_line("the net calls its block")),
             ("forward", producer_line("log in the block"))]
    assert _frames(error)[-3:] == chain
    assert _traceback(error)[-3:] == chain  # what %debug's up and down walk
    assert report.debug_frame is not None and report.debug_frame.lineno == producer_line("log in the block")
    text = report.to_text()
    block = text[text.index("Frames from your code to the producer:"):].splitlines()
    assert "out = model(torch.randn(8, 4))  # call: the loop calls the model" in [line.strip() for line in block]
    assert not any("opt.step()" in line for line in block)  # the deferred check's line is not a caller


@pytest.mark.parametrize("options", TIMINGS)
def test_a_model_in_a_library_container_reads_from_the_call_to_the_producing_forward(options) -> None:
    torch.manual_seed(0)
    block = Block()
    model = nn.Sequential(nn.Linear(4, 4), block, nn.Linear(4, 1))  # torch's forward: no frame of its own
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            block.broken = step == 2
            loss = model(torch.randn(8, 4)).pow(2).mean()  # call: the loop calls the sequential
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _frames(caught.value)[-2:] == [
        ("test_a_model_in_a_library_container_reads_from_the_call_to_the_producing_forward",
         call_line("the loop calls the sequential")),
        ("forward", producer_line("log in the block"))]


def forward_pass(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # call: a helper calls the model


@pytest.mark.parametrize("options", TIMINGS)
def test_a_model_called_by_a_helper_keeps_the_producer_and_never_names_a_wrong_caller(options) -> None:
    model, opt = _net()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            model.block.broken = step == 2
            loss = forward_pass(model, torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    frames = _frames(caught.value)
    assert frames[-1] == ("forward", producer_line("log in the block"))
    if not options:
        # Immediate: judged while the helper runs, so its line and the net's are in the chain.
        assert frames[-3:-1] == [("forward_pass", call_line("a helper calls the model")),
                                 ("forward", call_line("the net calls its block"))]
    else:
        # Deferred: the helper had returned when opt.step() judged the step; its frame is not made up.
        assert "forward_pass" not in [function for function, _line in frames]

