"""``float32``: the producer's line computed in float32 (a half or bfloat16 overflow, an autocast region).

Every floating operand of a call at the producer's line is cast to float32
and the call runs with autocast off, so its result stays float32 (an
autocast region would cast a matmul back to half). In-place calls are left
alone: an upcast copy would not write where the user's code reads.

The line's float32 result goes on to the code after it, as the user's edit
would. Where that code mixes it with tensors still in half (``attn @ v``, a
half layer) torch refuses (``expected scalar type Float but found Half``):
the trial then says the line alone cannot be computed in float32 there
(:func:`refused_upcast`), rather than that the replay raised.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import function_name
from nan_magic.localize.replay.module_run import map_tensors
from nan_magic.note_records import Note

__all__ = ["HALF", "Float32", "float32", "refused_upcast"]

HALF = (torch.float16, torch.bfloat16)


def _upcast(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.dtype in HALF else value


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


class Float32:
    """The remedy: each call at the line in float32, autocast off (None for an in-place call, or one without a half
    operand under no autocast); it records which positional arguments were Python numbers, for the edit."""

    def __init__(self) -> None:
        #: ``(function name, argument index, value)`` of the Python numbers the line's calls were given
        #: (``torch.mul(h, scale)`` with ``scale = 0.5``: ``("mul", 1, 0.5)``): the edit writes no ``.float()`` on a
        #: name that holds one (a value not written out on the line).
        self.numbers: set[tuple[str, int, float]] = set()
        #: ``(function name, positional arguments, a keyword argument was a tensor)`` of each call: F.leaky_relu
        #: hands torch its slope as a keyword (``negative_slope``) where the line wrote it second.
        self.positional: set[tuple[str, int, bool]] = set()

    def renewed(self) -> Float32:
        """The same remedy, nothing recorded yet (step.py's second trial of it, in every module that runs the line)."""
        return Float32()

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        # (every call at the line: one the trial left as it was, its operand already float32, is edited too)
        name = function_name(func)
        self.numbers |= {(name, index, float(value)) for index, value in enumerate(args)
                         if isinstance(value, (int, float))}  # (a bool too: True.float() raises as 0.5 does)
        self.positional.add((name, len(args), any(isinstance(value, torch.Tensor) for value in kwargs.values())))
        return float32(func, args, kwargs)


def float32(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The call in float32, autocast off; None for an in-place call or one without a half operand under no autocast."""
    name = function_name(func)
    if _in_place(name) or name in ("float", "to", "type", "half", "bfloat16", "__get__"):
        return None
    halves: list[bool] = []
    map_tensors(lambda tensor: halves.append(tensor.dtype in HALF), (tuple(args), kwargs))
    autocast = [device for device in ("cuda", "cpu") if torch.is_autocast_enabled(device)]
    if not any(halves) and not autocast:
        return None
    args, kwargs = map_tensors(_upcast, tuple(args)), map_tensors(_upcast, kwargs)
    with contextlib.ExitStack() as stack:
        for device in autocast:
            stack.enter_context(torch.autocast(device, enabled=False))
        return func(*args, **kwargs)


#: What torch says where an op is given float32 and half operands together (matmul, a layer's weight, addmm).
_MIXED = re.compile(r"expected scalar type|same dtype|dtype .* and .* dtype|type \(.*\) and .* type|"
                    r"should be the same|found (Half|BFloat16)", re.IGNORECASE)


def refused_upcast(error: tuple[str, str] | None, dtype: str | None) -> Note | None:
    """Why the float32 trial could not run: the code after the line refused its float32 result (``error``, what
    the replay raised); None for any other outcome."""
    if error is None or error[0] != "RuntimeError" or not _MIXED.search(error[1]):
        return None
    return Note.of("float32-refused", error=error[0], message=error[1], dtype=dtype)
