"""How a cause's numbers are written: shared by render/cause.py and the diagnosis's legacy text.

The diagnosis still writes some causes as text (explain/cause_text.legacy_cause)
while render/ writes the typed ones; both must write a number the same way, and
neither may import the other (the independence contract), so the two helpers
live here, below both. Stdlib only.
"""

from __future__ import annotations

import math
import re

__all__ = ["counts_phrase", "fmt"]


def fmt(value: float | None) -> str:
    """``31000.0`` → ``"3.1e4"``; ``0.52`` → ``"0.52"``."""
    if value is None:
        return "?"
    if not math.isfinite(value):  # an lr of inf, a bound past float64: int() would raise
        return str(value)
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    text = f"{value:.3g}"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m.group(1) == '-' else ''}{m.group(2)}", text)


def counts_phrase(nan: int, posinf: int, neginf: int) -> str:
    """The non-zero counts only: ``"334 +inf"``; ``"non-finite"`` where none is known."""
    parts = [f"{count} {kind}" for kind, count in (("nan", nan), ("+inf", posinf), ("-inf", neginf)) if count]
    return ", ".join(parts) or "non-finite"
