"""What an exception's traceback says about a non-finite value before it: its frames' tensors, and whether a
forward that raised is worth a replay.

A top-level forward that raised is replayed to find a non-finite value that came first (``torch.multinomial`` on
NaN probabilities, an index computed from a NaN: replay/tiered/step.py, replay/producer_call.py). A replay runs the
user's forward again, their hooks and their module code with it: a feature extractor whose forward hook raises its
own ``StopForward`` to end the forward early would see that hook fire twice, and whatever it appends, counts or
prints twice. So the replay runs only for an error a bad value can cause (:func:`may_follow_nonfinite`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from nan_magic.hot.reads import is_checkable
from nan_magic.hot.stats import tensor_stats

__all__ = ["may_follow_nonfinite", "traceback_tensors"]

#: What ops and Python raise on a value a NaN or an inf made: torch's errors (RuntimeError and its kin), an index
#: or a key out of range, a conversion (``int(nan)``: ValueError; ``int(inf)``: OverflowError), a failed assert.
_BAD_VALUE_ERRORS = (RuntimeError, ValueError, LookupError, ArithmeticError, AssertionError)


def may_follow_nonfinite(error: BaseException) -> bool:
    """Whether a non-finite value may have come before ``error``: an error of the kinds a bad value raises, or any
    other (the user's own exception class, raised on a check of theirs) whose traceback's frames hold a non-finite
    tensor. Else the exception is the user's own control flow (a hook's ``StopForward``): no replay of the call."""
    if isinstance(error, _BAD_VALUE_ERRORS):
        return True
    return any(tensor_stats(tensor).kinds for _function, tensor in traceback_tensors(error))


def traceback_tensors(error: BaseException) -> Iterator[tuple[str, torch.Tensor]]:
    """``(function, tensor)`` for the floating tensors the traceback's frames hold as locals, innermost frame first
    (each tensor once; nan_magic's own frames left out)."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    seen: set[int] = set()
    for frame in reversed(frames):
        if frame.f_code.co_filename.startswith(_OURS):
            continue
        for value in list(frame.f_locals.values()):
            if isinstance(value, torch.Tensor) and id(value) not in seen and is_checkable(value):
                seen.add(id(value))
                yield frame.f_code.co_qualname, value


#: Where nan_magic's own code lives: its frames in a traceback hold no tensor of the user's.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
