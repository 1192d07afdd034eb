"""The traceback and the report's frames read through each function that called the next, in every mode.

A forward that calls a helper which makes the NaN (``return step(h, self.b)``, ``def step(x, lin): return
torch.log(lin(x))``): the default watch replays the step and rebuilds the chain (loop, forward, helper). Under
``mode="full"`` and ``ops=True`` the value is judged at the model's output (or a child's input) after the helper
returned: the chain lost the forward (``<module> -> step``), or, where the forward still ran and was replayed to
name the op, it stood twice (``forward`` at the child's line, then ``forward`` at the helper's call). Every mode
now gives the same frames: the loop's line, the forward at the line that called the helper, the helper's op line.
"""

from __future__ import annotations

import inspect
import traceback

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.errors.frames import is_library_file
from nan_magic.errors.line_state import one_call

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
         "ops+defer": {"ops": True, "defer": True}}


def step(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return torch.log(layer(x))  # the producer, where the layer gives a negative


class ReturnsTheHelper(nn.Module):
    """The helper called twice, the second call (at the forward's last line) making the NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.a.bias.fill_(10.0)  # the first call stays finite

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = step(x, self.a)
        return step(h, self.b)  # the call that made it


class HelperThenChild(nn.Module):
    """The helper makes the NaN first; a child reads it after (a per-module check judges it there, live)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = step(x, self.b)  # the call that made it
        out = self.a(h)
        return out * 2


def _line(model: type[nn.Module], marker: str) -> int:
    lines, first = inspect.getsourcelines(model.forward)
    return first + next(index for index, text in enumerate(lines) if marker in text)


def _user_frames(model: nn.Module, options: dict[str, object]) -> tuple[list[tuple[str, int]], nan_magic.Report]:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(x).sum().backward()  # the loop's line
    frames = [(entry.name, entry.lineno) for entry in traceback.extract_tb(caught.value.__traceback__)
              if not is_library_file(entry.filename)]
    return frames, caught.value.report


@pytest.mark.parametrize("model_type", [ReturnsTheHelper, HelperThenChild])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_reads_loop_forward_helper(mode: str, model_type: type[nn.Module]) -> None:
    loop_line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
    frames, report = _user_frames(model_type(), MODES[mode])
    helper_line = inspect.getsourcelines(step)[1] + 1
    loop = next(line for name, line in frames if name == _user_frames.__name__)
    assert loop > loop_line or loop < loop_line  # (the loop's line in _user_frames, not this test's)
    assert frames == [(_user_frames.__name__, loop), ("forward", _line(model_type, "the call that made it")),
                      ("step", helper_line)], frames
    assert (report.op, report.source.lineno) == ("aten.log.default", helper_line)
    assert [(frame.function, frame.lineno) for frame in report.frames][-2:] == [
        ("forward", _line(model_type, "the call that made it")), ("step", helper_line)], report.frames


def test_a_recursion_is_not_merged_into_one_call() -> None:
    """Two live calls of one function with different arguments stay two (what the merge of a call and its replay
    must not take for one)."""
    def depth(n: int) -> tuple[object, object]:
        return (inspect.currentframe(), depth(n - 1)[0]) if n else (inspect.currentframe(), None)
    outer, inner = depth(1)
    assert not one_call(outer, inner)
