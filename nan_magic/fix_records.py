"""The record of one fix trial (nan_magic.fixes): stdlib only, below the records that hold it.

Its sentence is written by ``nan_magic.render.fixes``, which sits above:
reached through the describer ``nan_magic/__init__.py`` installs, as a
TensorRef's label is (tensor_refs.install_labeler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from nan_magic.locations import SourcePointer
from nan_magic.note_records import Note

__all__ = ["AFTER_THE_LOSS", "BOUNDED_FUNCTIONS", "DOMAIN_USES", "FUNCTIONS", "SHIFTED_FUNCTIONS", "UNIT_FUNCTIONS",
           "FailedAt", "FixSite", "FixTrial", "install_describer", "whole_power"]

#: Where a replayed step first went non-finite, or that it raised (``FixTrial.error`` says what). ``"next forward"``:
#: the step was finite, but the updated parameters made the same call's forward non-finite (fixes/step.py).
FailedAt = Literal["forward", "loss", "backward", "optimizer step", "next forward", "raised"]
#: The places a trial fails after its loss was computed: where a stand-in loss (a backward from ones) says nothing.
AFTER_THE_LOSS: tuple[FailedAt, ...] = ("backward", "optimizer step", "next forward")

#: The functions whose operand the eps remedy clamps into [-1 + eps, 1 - eps], not above eps (their domain is bounded).
BOUNDED_FUNCTIONS = ("acos", "asin", "atanh", "logit", "erfinv", "special_ndtri")
#: ... of them, those whose domain is (0, 1), clamped into [eps, 1 - eps]: logit(p) = log(p / (1 - p)), -inf at 0
#: and +inf at 1 (a sigmoid that rounded to 0 or 1), and the normal quantile ndtri (a rank-gauss of rank n / n).
UNIT_FUNCTIONS = ("logit", "special_ndtri")
#: The functions whose domain is (-1, inf), their operand clamped to at least -1 + eps: log1p(u) is -inf at -1 (a
#: survival log(1 - p) written log1p(-p) of a p that rounded to 1), NaN below.
SHIFTED_FUNCTIONS = ("log1p",)


_OUT_OF_PLACE: dict[str, dict[str, int]] = {
    "log": {"log": 0, "log2": 0, "log10": 0},
    "log2": {"log2": 0},
    "log10": {"log10": 0},
    "log1p": {"log1p": 0, "special_log1p": 0},  # (torch.special.log1p: aten.log1p too)
    "sqrt": {"sqrt": 0},
    "rsqrt": {"rsqrt": 0},
    "pow": {"pow": 0, "__pow__": 0},
    "div": {"div": 1, "divide": 1, "true_divide": 1, "__truediv__": 1, "__rtruediv__": 0, "__rdiv__": 0},
    "reciprocal": {"reciprocal": 0, "__rtruediv__": 0, "__rdiv__": 0},
    "acos": {"acos": 0, "arccos": 0},
    "asin": {"asin": 0, "arcsin": 0},
    "atanh": {"atanh": 0, "arctanh": 0},
    "logit": {"logit": 0, "special_logit": 0},  # (torch.special.logit: aten.logit too)
    "erfinv": {"erfinv": 0, "special_erfinv": 0},  # (torch.special.erfinv: aten.erfinv)
    "special_ndtri": {"special_ndtri": 0, "ndtri": 0},  # (torch.special.ndtri's __name__ is ndtri)
}
#: The producer's function -> the torch functions that compute it, and which argument is the operand; the
#: in-place forms too (``x.div_(n)``, ``x /= n``, ``p.log_()``).
FUNCTIONS: dict[str, dict[str, int]] = {
    function: {**names, **{f"{name}_": index for name, index in names.items() if not name.startswith("__")},
               **({"__itruediv__": 1, "__idiv__": 1} if function == "div" else {})}
    for function, names in _OUT_OF_PLACE.items()
}
#: The ``(torch call, argument)`` pairs where a 0 (or a value past the bound) is out of the function's domain: the
#: uses of an operand the eps remedy may clamp (fixes/remedies/every_use.py, render/edits.py); not a comparison, a
#: ``where``'s condition, ``zeros_like``: a guard the user wrote around the same operand stays as written.
DOMAIN_USES: frozenset[tuple[str, int]] = frozenset(
    (name, index) for names in FUNCTIONS.values() for name, index in names.items())


def whole_power(exponent: object) -> bool:
    """Whether ``exponent`` is a number that is a whole power, 0 or more (``x ** 2``, ``x.pow(3)``): such a pow is
    defined, with a finite derivative, at every finite base, 0 and negatives too, so clamping its base is no remedy;
    it changes what the line computes (``(a - b) ** 2`` of a negative difference) where a ``** 0.5`` beside it
    is the producer."""
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
        return False
    return exponent >= 0 and float(exponent).is_integer()


class FixSite(NamedTuple):
    """Where a remedy was applied: the op at the line inside the module (each None where the trial has none;
    an optimizer's remedy has no op or line)."""

    op: str | None
    module: str | None
    source: SourcePointer | None


@dataclass(frozen=True)
class FixTrial:
    """One remedy (``kind``) tried on a replay of the failing step at ``op``/``module``/``source``.

    ``facts``: the plain values render/fixes.py describes it from. ``finite``: True only when the replayed
    step (forward, backward, optimizer step, on copies) came out finite end to end; ``failed`` says where
    it did not (``error``: what it raised), ``reason`` why it was not run or not counted (``finite`` None): a
    :class:`~nan_magic.note_records.Note`, its kind and its numbers, whose sentence render/ writes (``untried``).
    ``output_change``: the largest change of the model's output against the unremedied replay's finite part.
    """

    kind: str
    op: str | None = None
    module: str | None = None
    source: SourcePointer | None = None
    facts: tuple[tuple[str, Any], ...] = ()
    finite: bool | None = None
    loss: float | None = None
    output_change: float | None = None
    seconds: float = 0.0
    failed: FailedAt | None = None
    #: The exception a step that ``failed`` with ``"raised"`` raised: ``(type name, its message's first line)``.
    error: tuple[str, str] | None = None
    reason: Note | None = None

    def fact(self, name: str, default: Any = None) -> Any:
        """The value of the fact ``name``, or ``default``."""
        return next((value for key, value in self.facts if key == name), default)

    @property
    def where(self) -> FixSite:
        """Where the remedy was applied (``op``, ``module``, ``source``), as one value: PRODUCT.md's ``where``."""
        return FixSite(self.op, self.module, self.source)

    @property
    def untried(self) -> str | None:
        """Why the remedy was not run, or not counted as a fix, in words (``reason``'s sentence, written by render/)."""
        return None if self.reason is None else self.reason.text

    @property
    def description(self) -> str:
        """What the remedy changed, in one line (written by render/)."""
        return _describer[0](self)


_describer: list[Callable[[FixTrial], str]] = []


def install_describer(describer: Callable[[FixTrial], str]) -> None:
    """Describe every FixTrial with ``describer`` (its ``description``)."""
    _describer[:] = [describer]
