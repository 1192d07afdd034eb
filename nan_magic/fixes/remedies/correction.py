"""``stable`` for a std or variance over one element: the same reduction with ``correction=0``.

``h.std(0)`` of a batch of one divides by N - 1 = 0 (torch's default
correction is 1, Bessel's): NaN, and its backward NaN. The population form,
``correction=0``, is 0 there and differs elsewhere by the factor
sqrt(N / (N - 1)) only: what the cause's hint says to pass, and what the
suggested edit writes. The remedy reruns the producer's call with it; a call
that says ``unbiased`` (a keyword, or the first positional flag) with
``unbiased=False``, the same choice in the older spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nan_magic.fixes.site import function_name

__all__ = ["CORRECTED", "CorrectionFix"]

#: The reductions whose correction the remedy sets to 0.
CORRECTED = frozenset({"std", "var", "std_mean", "var_mean"})


class CorrectionFix:
    """The remedy: the call with ``correction=0``; None for another function, or a call it cannot rewrite."""

    form = "correction=0"

    def __init__(self, function: str) -> None:
        self.function = function

    def renewed(self) -> CorrectionFix:
        return CorrectionFix(self.function)

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if function_name(func) != self.function:
            return None
        if "unbiased" in kwargs:  # (the older spelling of the same choice: unbiased=False is correction=0)
            return func(*args, **{**kwargs, "unbiased": False})
        flags = [index for index, value in enumerate(args) if isinstance(value, bool)]
        if flags:
            # ``std(unbiased)`` or ``std(dim, unbiased, keepdim)``: in every overload the first flag is ``unbiased``.
            return func(*(False if index == flags[0] else value for index, value in enumerate(args)), **kwargs)
        return func(*args, **{**kwargs, "correction": 0})
