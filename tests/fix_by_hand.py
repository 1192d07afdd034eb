"""A fix trial's remedy applied by hand, apart from the package (tests/test_fix_truth_s43.py): the eps clamp and the
max-subtracted exp written as our own function mode at the trial's line, on the failing step only."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

import nan_magic
from nan_magic.fix_records import FixTrial

__all__ = ["ByHand", "counted_steps", "failing_step", "family_of"]

_TORCH = os.path.dirname(torch.__file__)
_PACKAGE = os.path.dirname(nan_magic.__file__)
#: The torch functions of each remedied function, and the argument the eps moves.
_DIVISIONS = {"div": 1, "divide": 1, "true_divide": 1, "__truediv__": 1, "__rtruediv__": 0, "__rdiv__": 0,
              "div_": 1, "__itruediv__": 1, "reciprocal": 0}
_FAMILIES = {"log": "log", "log_": "log", "log2": "log2", "log10": "log10", "sqrt": "sqrt", "sqrt_": "sqrt",
             "rsqrt": "rsqrt", "pow": "pow", "__pow__": "pow", "exp": "exp", "exp_": "exp",
             **dict.fromkeys(_DIVISIONS, "div")}


def family_of(trial: FixTrial) -> str | None:
    """The function a trial's remedy changed, read from its facts (eps) or kind (the max-subtracted exp)."""
    if trial.kind == "stable":
        return "exp" if "max-subtracted" in trial.description else None
    function = trial.fact("function")
    return "div" if function in ("div", "reciprocal") else function


class ByHand(TorchFunctionMode):
    """The remedy written by hand at ``filename:lineno``, on the calls of ``family`` there, while ``active()``."""

    def __init__(self, filename: str, lineno: int, family: str, description: str,
                 active: Callable[[], bool]) -> None:
        super().__init__()
        self.where, self.family, self.description, self.active, self.hits = (
            (filename, lineno), family, description, active, 0)

    def _at_line(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith((_TORCH, _PACKAGE))
                                     or frame.f_code in _OWN_CODE):
            frame = frame.f_back
        return frame is not None and (frame.f_code.co_filename, frame.f_lineno) == self.where

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _FAMILIES.get(name) != self.family or not self.active() or not self._at_line():
            return func(*args, **kwargs)
        args = list(args)
        if self.family == "div":
            index = _DIVISIONS[name]
            denominator = args[index]
            if not isinstance(denominator, torch.Tensor):
                return func(*args, **kwargs)
            if not denominator.is_floating_point():
                args[index] = denominator.clamp_min(1)
            elif "plus" in self.description:
                args[index] = denominator + torch.finfo(denominator.dtype).eps
            elif bool((denominator >= 0).all()):
                args[index] = denominator.clamp_min(torch.finfo(denominator.dtype).eps)
            else:
                args[index] = torch.where(denominator == 0, torch.finfo(denominator.dtype).eps, denominator)
        elif self.family == "exp":
            args[0] = args[0] - args[0].amax(-1, keepdim=True).detach()
        else:
            args[0] = args[0].clamp_min(torch.finfo(args[0].dtype).eps)
        self.hits += 1
        return func(*args, **kwargs)


_OWN_CODE = (ByHand._at_line.__code__, ByHand.__torch_function__.__code__)


@contextmanager
def counted_steps() -> Iterator[list[int]]:
    """The optimizer steps taken so far, counted by a global hook while inside."""
    count = [0]
    handle = register_optimizer_step_post_hook(
        lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def failing_step(build: Callable[[], Any], trial: FixTrial, step: int) -> int | None:
    """The step at which a fresh, watched run of ``build()``'s scenario goes non-finite with ``trial``'s remedy
    applied by hand at the failing ``step`` only (None: it stays finite)."""
    family = family_of(trial)
    assert family is not None and trial.source is not None
    with counted_steps() as count:
        mode = ByHand(trial.source.filename, trial.source.lineno, family, trial.description,
                      lambda: count[0] == step)
        scenario = build()
        try:
            with mode, nan_magic.watch(*scenario.targets, **scenario.options):
                scenario.run()
        except nan_magic.NonFiniteError as error:
            assert mode.hits, "the remedy by hand changed nothing"
            return error.report.step
    assert mode.hits, "the remedy by hand changed nothing"
    return None
