"""The sentences of a log's domain error: log, log2, log10, log1p, xlogy and xlog1py at or past their edge."""

from __future__ import annotations

from nan_magic.records import Cause, Report
from nan_magic.render.words.causes.phrases import input_named
from nan_magic.render.words.counted import counted

__all__ = ["log_hint", "suggested_eps"]

#: -1 + torch.finfo(dtype).eps to 8 digits (float64's is -1 + 2.2e-16): the clamp the eps remedy verifies for log1p.
_SHIFTED_BOUNDS = {"float16": "-0.99902344", "bfloat16": "-0.9921875", "float64": "-1 + 2.2e-16"}


def suggested_eps(event: Report) -> str:
    """An eps to suggest in the event's dtype: 1e-12 (and 1e-8) are 0 in float16, whose smallest normal is 6.1e-5."""
    return "1e-4" if event.dtype == "float16" else "1e-12"


def log_hint(event: Report, cause: Cause) -> str:
    # A cause written before it carried its counts (a saved scene) has the event's: -inf from zeros, NaN below 0.
    zeros, negatives = cause.fact("zeros", event.neginf), cause.fact("negatives", event.nan)
    base = cause.fact("base")
    if base in ("log1p", "xlog1py"):  # log(1 + y): its edge is y = -1 (counted as zeros), its NaN below -1
        return _log1p_hint(event, base, zeros, negatives)
    bad = f"{counted(zeros, 'zero')} and {counted(negatives, 'negative')}"
    half = " (in float16 an eps below 3e-8, such as 1e-8, rounds to 0)" if event.dtype == "float16" else ""
    signs = ("xlogy(x, y) is x * log(y): ±inf where y is 0 (+inf where x < 0), NaN where y is negative"
             if base == "xlogy" else "-inf from zeros, NaN from negatives")
    return (
        f"{base} got {bad} in {input_named(event, zeros, negatives)}: {signs}; clamp to "
        f"eps first (x.clamp_min({suggested_eps(event)})){half}, or use log_softmax / logsumexp / log_ndtr / "
        "logsigmoid(z) / logsigmoid(-z) for log-probabilities (logdet for a determinant)"
    )


def _log1p_hint(event: Report, base: str, at_minus_one: int, below: int) -> str:
    # The clamp the eps remedy verifies, -1 + the dtype's eps (remedies/domain.py), as the edit writes it.
    bound = _SHIFTED_BOUNDS.get(event.dtype or "", "-0.99999988")
    got = (f"{base} got {counted(at_minus_one, 'value')} at -1 and {counted(below, 'value')} below -1 in "
           f"{input_named(event, at_minus_one, below)}")
    if base == "xlog1py":
        return (f"{got}: xlog1py(x, y) is x * log1p(y): ±inf where y is -1, NaN below it; clamp y first "
                f"(y.clamp_min({bound}))")
    return (
        f"{got}: log1p(x) is log(1 + x), -inf at -1 and NaN below it; clamp "
        f"to -1 + eps first (x.clamp_min({bound})), or compute it from logits (F.logsigmoid(-z) for log(1 - "
        "sigmoid(z)), F.binary_cross_entropy_with_logits for a BCE)"
    )
