"""What an exception's traceback says about a non-finite value before it: its frames' tensors, and whether a
forward that raised is worth a replay.

A top-level forward that raised is replayed to find a non-finite value that came first (``torch.multinomial`` on
NaN probabilities, an index computed from a NaN: replay/tiered/step.py, replay/producer_call.py). A replay runs the
user's forward again, their hooks and their module code with it: a feature extractor whose forward hook raises its
own ``StopForward`` to end the forward early would see that hook fire twice, and whatever it appends, counts or
prints twice, every step. So (:class:`RaisedForwards`) the replay runs only for an error a bad value can cause
(:func:`may_follow_nonfinite`: an error of the kinds a bad value raises, an exception whose name or message speaks
of one, a non-finite tensor the traceback's frames hold), and a place that raised so and was found healthy (no
non-finite value came first) is not looked at again while the watch lasts: the control flow of a loop raises from
the same line every step, a NaN from a line that raised healthy before is still seen by the step's own checks.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator

import torch

from nan_magic.errors.frames import is_library_code
from nan_magic.hot.reads import is_checkable
from nan_magic.hot.stats import tensor_stats

__all__ = ["RaisedForwards", "may_follow_nonfinite", "traceback_tensors"]

#: What ops and Python raise on a value a NaN or an inf made: torch's errors (RuntimeError and its kin), an index
#: or a key out of range, a conversion (``int(nan)``: ValueError; ``int(inf)``: OverflowError), a failed assert.
_BAD_VALUE_ERRORS = (RuntimeError, ValueError, LookupError, ArithmeticError, AssertionError)


#: Words of an exception's class name or message that speak of a bad value: ``NaNError``, ``LossDiverged``,
#: ``NonFiniteLoss``, "loss is nan", "inf in the logits" (a word part, as a class name joins its words).
_SPEAKS_OF_A_BAD_VALUE = re.compile(r"NaN|Inf(?![a-z])|\b(?i:nan|inf)\b|(?i:infinit|finite|diverg|overflow|explod)")


class RaisedForwards:
    """The places top-level forwards raised from that were found healthy, per watch (the module docstring)."""

    def __init__(self) -> None:
        self._healthy: set[tuple[type, str, int]] = set()

    def worth_replaying(self, error: BaseException) -> bool:
        """Whether the forward that raised ``error`` is replayed to look for a non-finite value before it."""
        site = _site(error)
        if site in self._healthy:
            return False
        if may_follow_nonfinite(error):
            return True
        self._healthy.add(site)
        return False

    def found_healthy(self, error: BaseException) -> None:
        """A replay found no non-finite value before ``error``: its place is not replayed again."""
        self._healthy.add(_site(error))


def _site(error: BaseException) -> tuple[type, str, int]:
    """Where the user's code raised ``error``: its innermost frame of the user's (an ``IndexError`` inside
    ``F.embedding`` is at the line that called it: every embedding's error shares torch's line)."""
    site: tuple[str, int] = ("", 0)
    tb = error.__traceback__
    while tb is not None:
        if not is_library_code(tb.tb_frame.f_code):
            site = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return type(error), *site


def may_follow_nonfinite(error: BaseException) -> bool:
    """Whether a non-finite value may have come before ``error``: an error of the kinds a bad value raises, one
    whose class name or message speaks of a bad value (the user's own ``Diverged``, raised on a check of theirs),
    or any other whose traceback's frames hold a NaN or a +inf (a local, in a list, tuple or dict, or a module's
    attribute). Else the exception is the user's own control flow (a hook's ``StopForward``)."""
    if isinstance(error, FloatingPointError):  # (our own NonFiniteError on its way out)
        return False
    if isinstance(error, torch.linalg.LinAlgError):
        # linalg's verdict on its matrix (singular, not positive-definite): the NaN its ``_ex`` kernel made inside
        # never reached the user's code, and ``except LinAlgError`` must still catch it; unless the matrix the
        # user's code built already held a NaN or a +inf (a kernel matrix of a lengthscale that underflowed to 0):
        # then the first non-finite value came before, where ops=True stops
        return _frames_hold_nonfinite(error)
    if isinstance(error, _BAD_VALUE_ERRORS) or _SPEAKS_OF_A_BAD_VALUE.search(f"{type(error).__name__} {error}"):
        return True
    return _frames_hold_nonfinite(error)


def _frames_hold_nonfinite(error: BaseException) -> bool:
    """Whether the traceback's frames hold a NaN or a +inf (-inf alone is an attention mask's, the user's own: no
    evidence of a bad value)."""
    return any(tensor_stats(tensor).kinds - {"-inf"} for _function, tensor in traceback_tensors(error, inside=True))


def traceback_tensors(error: BaseException, inside: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(function, tensor)`` for the floating tensors the traceback's frames hold as locals, innermost frame first
    (each tensor once; nan_magic's own frames left out); ``inside``: also those a local list, tuple or dict holds,
    and a module's attributes (``self.h``)."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    seen: set[int] = set()
    for frame in reversed(frames):
        if frame.f_code.co_filename.startswith(_OURS):
            continue
        for value in _held(list(frame.f_locals.values()), inside):
            if isinstance(value, torch.Tensor) and id(value) not in seen and is_checkable(value):
                seen.add(id(value))
                yield frame.f_code.co_qualname, value


def _held(values: list[object], inside: bool) -> Iterator[object]:
    for value in values:
        yield value
        if not inside:
            continue
        if isinstance(value, (list, tuple)):
            yield from value
        elif isinstance(value, dict):
            yield from list(value.values())
        elif isinstance(value, torch.nn.Module):
            yield from list(vars(value).values())


#: Where nan_magic's own code lives: its frames in a traceback hold no tensor of the user's.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
