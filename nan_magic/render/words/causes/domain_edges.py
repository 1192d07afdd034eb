"""The sentence of a function read at an edge of its domain, where it is infinite (atanh at ±1, logit at 0 or 1,
the inverse CDFs erfinv and ndtri): where the edges are, what lies beyond, and the usual mend."""

from __future__ import annotations

from nan_magic.records import Cause, Report
from nan_magic.render.words.causes.phrases import where
from nan_magic.render.words.counted import counted

__all__ = ["edge_hint"]

#: A function whose domain has edges where it is infinite (its base, as op_function names it): where they are, where
#: it is NaN, and the sentence after the counts. The inverse CDFs (erfinv, ndtri) are read like logit and atanh.
_EDGES: dict[str, tuple[str, str, str]] = {
    "atanh": ("±1", "past them", "artanh(x) = log((1 + x) / (1 - x)) / 2 is ±inf at ±1 and NaN beyond; clamp its input "
              "to (-1 + eps, 1 - eps) (1 - 1e-5 in float32; a norm projected onto a unit ball's edge rounds to 1)"),
    "logit": ("0 or 1", "outside [0, 1]", "logit(p) = log(p / (1 - p)) is -inf at 0, +inf at 1 and NaN beyond (a "
              "sigmoid rounds to exactly 1 in float32 past x = 17); clamp its input to (eps, 1 - eps) (torch.logit(p, "
              "eps=1e-6)), or keep the logits the sigmoid was computed from"),
    "erfinv": ("±1", "past them", "the inverse error function is ±inf at ±1 and NaN beyond (an inverse CDF: "
               "2 * rank / n - 1 at the top rank, a CDF that rounded to 1); map ranks into the open interval "
               "((rank - 0.5) / n) or clamp its input to (-1 + eps, 1 - eps)"),
    "special_ndtri": ("0 or 1", "outside [0, 1]", "ndtri(p), the normal distribution's quantile, is -inf at 0, +inf at "
                      "1 and NaN beyond (an inverse CDF: rank / n at the top rank, a CDF that rounded to 1); map ranks "
                      "into the open interval ((rank - 0.5) / n) or clamp its input to (eps, 1 - eps)"),
}


_WRITTEN = {"special_ndtri": "ndtri"}


def edge_hint(event: Report, cause: Cause) -> str:
    base = cause.fact("base")
    edges, beyond, text = _EDGES.get(base, _EDGES["atanh" if cause.reading == "atanh-edge" else "logit"])
    # (the aten name of torch.special.ndtri is special_ndtri: said as the user wrote it)
    return (f"{_WRITTEN.get(base, base)} in {where(event)} got {counted(event.posinf + event.neginf, 'value')} "
            f"at {edges} and {event.nan} {beyond}: {text}")
