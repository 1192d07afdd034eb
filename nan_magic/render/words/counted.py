"""A count with its noun in the right number: ``1 zero``, ``2 zeros``, ``1 earlier call``; a size in bytes.

Every count phrase of the report goes through :func:`counted`: a count of 1 is common (one NaN label, one
call dropped, a scalar loss of 1 element), and "1 zeros" reads as a bug in the tool.
"""

from __future__ import annotations

__all__ = ["as_written", "counted", "human_size", "noun", "ordinal"]


def noun(count: object, singular: str, plural: str | None = None) -> str:
    """``singular`` where ``count`` is 1, else ``plural`` (``singular + "s"`` unless given)."""
    return singular if count == 1 else (plural if plural is not None else singular + "s")


def counted(count: object, singular: str, plural: str | None = None) -> str:
    """``"1 zero"``, ``"3 zeros"``; a count that is not a number (a kind known, no count) is shown as it is."""
    return f"{count} {noun(count, singular, plural)}"


def ordinal(number: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``."""
    suffix = "th" if number % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def human_size(size: int) -> str:
    """``512 B``, ``3.4 KB``, ``1.2 GB``."""
    if size < 1024:
        return f"{size} B"
    value, unit = size / 1024, "KB"
    for bigger in ("MB", "GB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def as_written(value: float) -> str:
    """A Python number as the user likely wrote it: an int as it is, a float to 15 digits (Adam's ``1 - beta2`` as
    0.001, not 0.0010000000000000009; an exponent of 1 - 1e-13, NaN on a negative base, still 0.9999999999999)."""
    return str(value) if isinstance(value, int) else repr(float(f"{value:.15g}"))
