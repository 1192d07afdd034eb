"""``float32``: the producer's line computed in float32 (a half or bfloat16 overflow, an autocast region).

Every floating operand of a call at the producer's line is cast to float32
and the call runs with autocast off, so its result stays float32 (an
autocast region would cast a matmul back to half). In-place calls are left
alone: an upcast copy would not write where the user's code reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import function_name
from nan_magic.localize.replay.module_run import map_tensors

__all__ = ["HALF", "float32"]

HALF = (torch.float16, torch.bfloat16)


def _upcast(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.dtype in HALF else value


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


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
