"""``stable``: the producer's exp max-subtracted, or the log of a softmax, sigmoid or normal CDF fused.

A hand-written softmax (``e = x.exp(); e / e.sum(-1, keepdim=True)``)
overflows in ``exp``; ``exp(x - x.amax(-1, keepdim=True))`` gives the same
ratios and cannot. ``torch.log(torch.softmax(x, -1))`` is -inf where the
softmax underflowed to 0; ``torch.log_softmax(x, -1)`` is finite there, and
``F.logsigmoid(z)`` where ``torch.log(torch.sigmoid(z))`` is -inf, ``special.log_ndtr(z)`` where
``torch.log(special.ndtr(z))`` is (a probit's or Tobit's likelihood of a sample far in the tail), ``torch.logdet(S)``
where ``torch.log(torch.det(S))`` is (the determinant of a 48-dimensional covariance underflowed to 0). The
remedy sees every softmax and sigmoid the producing module (or the loss code)
runs (its output may be logged on a later line) and replaces a log of one of them.

The max-subtracted exp is the same computation only where the max cancels: a
softmax, a logsumexp, a Sinkhorn's normalisation, where ``exp(x)`` is divided
by its own sum. A PPO probability ratio ``exp(logp - old)``, a logit scale's
``exp(s)`` or an exp activation is not normalised: divided by ``exp(max)``
it is another value, finite or not. So a finite trial is run once more with
the exp multiplied by 8 or 16 row by row (:func:`changes_value`): a power of
two scales exactly (a float16 subnormal too; the max-subtracted exp is at
most 1), so where the exp is normalised the step computes the same bits in
any dtype (bfloat16 under autocast too); where the step's loss or outputs
move, the trial is no fix and says so.

A softplus by hand, ``torch.log(1 + torch.exp(x))`` (or ``log1p(exp(x))``), is
not normalised either; the form a person writes is ``F.softplus(x)``, the
same value, finite where the exp overflows. So an exp is first tried in that
form (:func:`stable_replay`): where the line's exp feeds ``log(1 + ...)``,
that log is computed as ``softplus`` of the exp's operand; where it does not,
the max-subtracted exp is tried as before.

Every fused form (``log_softmax``, ``logsigmoid``, ``log_ndtr``, ``softplus``) is computed from the input of the
tensor the line takes the log of, so it is the line's value only while that tensor is the function of its input it
was made as: it is used only where neither was written in place since (their ``_version``; a Tobit's
``p.masked_fill_(~censored, 1.0)``) and where it equals the line's own value wherever that is finite; a call given
a keyword that changes its value (``out=``, ``alpha=-1``) is not read as the function at all. Otherwise the trial
is not run, and says why (:func:`declined`).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nan_magic.fixes.site import Site, function_name
from nan_magic.fixes.step import FailingStep, StepOutcome, replay_at_line, replay_step
from nan_magic.note_records import Note

__all__ = ["StableFix", "changes_value", "declined", "stable_replay"]

#: The torch functions (and the aten ops' names) that add two values: ``1 + e``, ``e + 1``, ``torch.add(e, 1)``.
_ADDS = frozenset({"add", "__add__", "__radd__"})
#: ... and that multiply them.
_MULS = frozenset({"mul", "__mul__", "__rmul__"})
#: The torch functions that take a tensor from a number: ``1 - p`` (``Tensor.__rsub__(p, 1)``, ``torch.rsub(p, 1)``).
_RSUBS = frozenset({"__rsub__", "rsub"})
#: The determinants whose log is ``torch.logdet`` of their matrix (``torch.det``, ``S.det()``, ``torch.linalg.det``).
_DETS = frozenset({"det", "linalg_det"})


@dataclass
class _Logged:
    """A softmax's, sigmoid's or normal CDF's output the code made, whose log is fused (or a stage of an erf's CDF).

    Fused only while neither it nor its input was written in place since it was made (their versions then): a CDF
    written in place (``p.masked_fill_(~censored, 1.0)``, ``p *= 0.5``) is no longer the function of its input that
    the fused form computes, and neither is one whose input was written after.
    """

    ref: weakref.ref[torch.Tensor]
    version: int
    source: torch.Tensor
    source_version: int
    form: str
    #: The fused form of its log, from its input (None: an erf's stage, not yet a CDF).
    fused: Callable[[], torch.Tensor] | None
    #: Whether the op was torch's own, called at the producer's line (its name then on the line: the edit's).
    at_line: bool
    #: Whether a stage before it (an erf's output, its ``1 + erf``) was written in place.
    written: bool = False
    stage: int = 2

    def is_written(self, tensor: torch.Tensor) -> bool:
        return self.written or tensor._version != self.version or self.source._version != self.source_version


class StableFix:
    """The remedy for an ``exp`` (max-subtracted) or a ``log`` (of a softmax: fused)."""

    def __init__(self, function: str, offsets: bool = False, softplus: bool = False) -> None:
        self.function = function
        #: Whether the exp is left as it is and a ``log(1 + exp(x))`` of it computed as ``softplus(x)`` instead.
        self.softplus = softplus
        #: The exp outputs, and the ``1 + exp(x)`` sums, the code made: ``id(result)`` -> (a weak reference to it, x,
        #: whether it is the sum: a log of the sum, a log1p of the exp, is ``softplus(x)``; its version then: one
        #: written in place since, ``exp(x).mul_(w)``, is no longer ``exp(x)``; x's version when the exp was taken).
        self._exps: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, bool, int, int]] = {}
        #: Whether the max-subtracted exp is multiplied by 8 or 16 row by row (its max moved by 3 or 4 ln 2, exactly):
        #: the check of changes_value.
        self.offsets = offsets
        #: The softmax, sigmoid and normal CDF outputs the module made, and the stages of a CDF computed by erf (the
        #: erf: 0, its ``1 + erf``: 1): ``id(output)`` -> what it is. ``log(ndtr(z))`` is -inf where the CDF
        #: underflowed to 0 (z < -38 in float32), ``special.log_ndtr(z)`` finite there.
        self._logged: dict[int, _Logged] = {}
        #: Why a form met at the line was not used: ``"written"`` (it or its input written in place since it was
        #: made), ``"differs"`` (the form is not the line's own value where that is finite); :func:`declined`.
        self.declined: str | None = None
        #: Whether every op fused was torch's own, called at the line itself (the suggested edit rewrites it there).
        self.at_line: bool | None = None
        #: The form used, for the description: ``"max-subtracted exp"``, ``"log_softmax"``, ``"logsigmoid"`` or
        #: ``"log_ndtr"``.
        self.form: str | None = None
        #: Whether :attr:`form` and :attr:`at_line` are a fused log's whose operand held a 0 (its -inf).
        self._from_zero = False
        #: The seconds :func:`changes_value`'s second replay took (the trial's time includes them).
        self.checked = 0.0

    def renewed(self) -> StableFix:
        """A fresh remedy of this form, tried in every module that runs the line where the producing module's trial
        stays non-finite (step.replay_at_line): two repeated attention blocks whose exps overflow in one step are
        both fixed by an edit of the line. :func:`changes_value` then checks the trial at that wider site."""
        return type(self)(self.function, offsets=self.offsets, softplus=self.softplus)

    def seen(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], result: Any, at_line: bool = False
             ) -> None:
        """A call the producing module made (anywhere in it; ``at_line``: at the producer's line): a softmax's,
        sigmoid's or normal CDF's output is remembered. One given a keyword that changes its value (``out=``, an
        ``alpha``) is not: its fused form would compute another value."""
        name = function_name(func)
        if self.softplus and isinstance(result, torch.Tensor) and args:
            self._exp_or_sum(name, args, kwargs, result)
            return
        if name in _DETS and isinstance(result, tuple) and result:  # (aten's _linalg_det: the det, its LU, pivots)
            result = result[0]
        if not isinstance(result, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        if name == "softmax" and set(kwargs) <= {"dim", "dtype", "_stacklevel"} and len(args) <= 3:  # (F.softmax's)
            dim, dtype = kwargs.get("dim", args[1] if len(args) > 1 else None), kwargs.get(
                "dtype", args[2] if len(args) > 2 else None)
            if isinstance(dtype, bool):  # (aten's _softmax(x, dim, half_to_float))
                dtype = torch.float32 if dtype else None
            if isinstance(dim, int) and (dtype is None or isinstance(dtype, torch.dtype)):
                self._remember(result, x, "log_softmax", at_line, lambda: torch.log_softmax(x, dim, dtype=dtype))
        elif name == "sigmoid" and not kwargs and len(args) == 1:
            self._remember(result, x, "logsigmoid", at_line, lambda: torch.nn.functional.logsigmoid(x))
        elif name in _RSUBS and not kwargs and len(args) == 2 and _is(args[1], 1.0):
            self._complement(x, result)
        elif name in _DETS and not kwargs and len(args) == 1 and x.dim() >= 2:
            # (its log by LU, a sum of logs: finite where the product of a covariance's eigenvalues underflowed)
            self._remember(result, x, "logdet", at_line, lambda: torch.logdet(x))
        else:
            self._cdf(name, args, kwargs, result, at_line)

    def _complement(self, p: torch.Tensor, result: torch.Tensor) -> None:
        """Remembers ``1 - p`` of a sigmoid's output ``p = sigmoid(z)``: its log is ``logsigmoid(-z)`` (a hand-written
        BCE's ``log(1 - p)``, -inf where the sigmoid rounded to 1), computed from z as the fused log of p is. Never
        at the line for the suggested edit (the log's argument there is ``1 - p``, not a sigmoid's call)."""
        known = self._logged.get(id(p))
        if known is None or known.ref() is not p or known.form != "logsigmoid" or known.fused is None:
            return
        z = known.source
        self._remember(result, z, "logsigmoid(-x)", False, lambda: torch.nn.functional.logsigmoid(-z),
                       written=known.is_written(p))
        self._logged[id(result)].source_version = known.source_version

    def _remember(self, result: torch.Tensor, source: torch.Tensor, form: str, at_line: bool,
                  fused: Callable[[], torch.Tensor] | None, written: bool = False, stage: int = 2) -> None:
        self._logged[id(result)] = _Logged(weakref.ref(result), result._version, source, source._version, form,
                                           fused, at_line, written, stage)

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        name = function_name(func)
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return None
        operand = args[0]
        if self.softplus:
            known_exp = self._exps.get(id(operand))
            # log of 1 + exp(x) (a sum remembered), log1p of exp(x) (an exp remembered), neither written since
            if (name in ("log", "log1p") and known_exp is not None and known_exp[0]() is operand
                    and (name == "log") == known_exp[2] and not kwargs):
                self.form = "softplus"
                if operand._version != known_exp[3] or known_exp[1]._version != known_exp[4]:
                    self.declined = "written"
                    return None
                softplus = torch.nn.functional.softplus(known_exp[1])
                if _same_where_finite(softplus, torch.log(operand) if name == "log" else torch.log1p(operand)):
                    return softplus
                self.declined = "differs"
            return None
        if self.function == "exp" and name == "exp":
            self.form = "max-subtracted exp"
            shift = operand.detach().amax(dim=-1, keepdim=True) if operand.dim() else operand.detach()
            if self.offsets:  # (8 and 16 are exact in every float dtype, and so is a product by them up to 16)
                rows = torch.arange(shift.numel(), device=shift.device).reshape(shift.shape)
                return torch.exp(operand - shift) * (2.0 ** (3 + rows % 2)).to(operand.dtype)
            return torch.exp(operand - shift)
        if self.function == "log" and name == "log" and not kwargs and len(args) == 1:
            known = self._logged.get(id(operand))
            if known is None or known.ref() is not operand or known.fused is None:
                return None
            # (a BCE's two logs, log(p) and log(1 - p), both fused: the form said, and whether the edit is at the
            # line, are those of the log whose operand held the 0 that made the -inf, not of the one finite as it was)
            zero = bool((operand.detach() == 0).any())
            said = zero or not self._from_zero
            if said:
                self.form = known.form
            if known.is_written(operand):
                self.declined = "written"
                return None
            fused = known.fused()
            if not _same_probability(fused, operand):
                self.declined = "differs"
                return None
            if zero and not self._from_zero:
                self.at_line, self._from_zero = known.at_line, True
            elif said:
                self.at_line = known.at_line and self.at_line is not False
            return fused
        return None


    def _cdf(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], result: torch.Tensor,
             at_line: bool) -> None:
        """Remembers a normal CDF: ``special.ndtr(z)``, or as it is computed, ``0.5 * (1 + erf(z / sqrt(2)))`` (the
        recorded ops of ndtr, ``Normal.cdf``): the erf (stage 0), the 1 added (1), the half taken (the CDF of z).
        A stage written in place is carried as written: the log of the CDF is then said not to be fused, and why."""
        if name in ("special_ndtr", "erf") and not kwargs and len(args) == 1:
            z = args[0]
            if name == "erf":
                self._remember(result, z, "log_ndtr", at_line, None, stage=0)
            else:
                self._remember(result, z, "log_ndtr", at_line, functools.partial(_log_ndtr, z, 1.0))
            return
        stage = 0 if name in _ADDS else 1 if name in _MULS else None
        if stage is None or len(args) != 2 or (kwargs and kwargs != {"alpha": 1}):
            return
        for tensor, other in ((args[0], args[1]), (args[1], args[0])):
            known = self._logged.get(id(tensor))
            if (known is None or not isinstance(tensor, torch.Tensor) or known.ref() is not tensor
                    or known.fused is not None or known.stage != stage or not _is(other, 1.0 - 0.5 * stage)):
                continue
            # (every stage at the line: torch's ndtr there, as the loss code's recorded ops compute it)
            z, written, at_line = known.source, known.is_written(tensor), known.at_line and at_line
            if stage == 0:
                self._remember(result, z, "log_ndtr", at_line, None, written, stage=1)
            else:
                self._remember(result, z, "log_ndtr", at_line, functools.partial(_log_ndtr, z, math.sqrt(2.0)),
                               written)
            return

    def _exp_or_sum(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], result: torch.Tensor) -> None:
        """Remembers an exp's output (its key the output itself) and a ``1 + exp(x)`` (x)."""
        if name == "exp" and isinstance(args[0], torch.Tensor):
            self._exps[id(result)] = (weakref.ref(result), args[0], False, result._version, args[0]._version)
            return
        if name not in _ADDS or len(args) != 2 or kwargs.get("alpha", 1) != 1:
            return
        for tensor, other in ((args[0], args[1]), (args[1], args[0])):
            known = self._exps.get(id(tensor))
            if (known is not None and isinstance(tensor, torch.Tensor) and known[0]() is tensor and not known[2]
                    and tensor._version == known[3] and _one(other)):
                self._exps[id(result)] = (weakref.ref(result), known[1], True, result._version, known[4])
                return


class _Softplus(StableFix):
    """The softplus form alone (:func:`stable_replay` tries it first)."""

    def __init__(self) -> None:
        super().__init__("exp", softplus=True)

    def renewed(self) -> _Softplus:
        return _Softplus()


def _log_ndtr(z: torch.Tensor, scale: float) -> torch.Tensor:
    """``special.log_ndtr`` of z (times the scale that makes an erf's input z: sqrt(2))."""
    return torch.special.log_ndtr(z * scale if scale != 1.0 else z)


def _one(value: Any) -> bool:
    """Whether ``value`` is the constant 1: a number, or a one-element tensor holding it that no gradient reaches
    (a learned ``c`` in ``log(c + exp(x))`` that is 1 today is not a softplus: its gradient would be lost)."""
    return _is(value, 1.0)


def _is(value: Any, constant: float) -> bool:
    """Whether ``value`` is ``constant``, a number or a one-element tensor no gradient reaches (as :func:`_one`)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.requires_grad and float(value) == constant
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == constant


def _same_where_finite(softplus: torch.Tensor, line: torch.Tensor) -> bool:
    """Whether ``softplus(x)`` is the line's own value wherever that is finite (within the dtype's rounding: the
    sum ``1 + exp(x)`` rounds): the form computes what the line means, not another value that happens to be finite."""
    finite = torch.isfinite(line)
    tolerance = 16 * torch.finfo(line.dtype).eps
    return bool(torch.isclose(softplus[finite], line[finite], rtol=tolerance, atol=tolerance).all())


def _same_probability(fused: torch.Tensor, line: torch.Tensor) -> bool:
    """Whether a fused log (``log_softmax``, ``logsigmoid``, ``log_ndtr``) is the log of the line's own operand
    wherever that log is finite: compared as probabilities, ``exp(fused)`` with the operand, within the dtype's
    rounding (a ``1 + erf`` rounds to eps absolutely, a subnormal CDF coarsely: both are close there). Where the
    operand is 0 too: a true underflow's fused probability is far below the tolerance, a 0 written by the user (a
    class banned through ``.data``, which moves no version) is not."""
    with torch.no_grad():
        line = line.detach()
        if fused.shape != line.shape:
            return False
        finite = torch.isfinite(line) & (line >= 0)
        tolerance = 32 * torch.finfo(line.dtype).eps
        mine = fused.detach().exp().to(line.dtype)
        return bool(torch.isclose(mine[finite], line[finite], rtol=tolerance, atol=tolerance).all())


def declined(remedy: object) -> Note | None:
    """Why a fused form met at the line was not tried (:attr:`StableFix.declined`: ``why``), or None."""
    if not isinstance(remedy, StableFix) or remedy.declined is None:
        return None
    return Note.of("fused-declined", why=remedy.declined, form=remedy.form)


def stable_replay(step: FailingStep, site: Site, remedy: Any) -> tuple[StepOutcome, Any, bool]:
    """:func:`replay_at_line`, an exp first tried as a softplus (the module docstring): where its line's exp
    feeds no ``log(1 + ...)`` the softplus form changed nothing, and ``remedy`` (the max-subtracted exp) is tried."""
    if not isinstance(remedy, StableFix) or remedy.function != "exp" or remedy.softplus:
        return replay_at_line(step, site, remedy)
    outcome, softplus, every = replay_at_line(step, site, _Softplus())
    if outcome.applied:
        return outcome, softplus, every
    tried = replay_at_line(step, site, remedy)
    tried[0].seconds += outcome.seconds
    return tried


def changes_value(step: FailingStep, site: Site, fix: StableFix, outcome: StepOutcome, every: bool = False
                  ) -> Note | None:
    """Why ``fix``'s finite max-subtracted exp (``outcome``) computes another value than the user's line, or None.

    The step is replayed with the exp multiplied by 8 or 16 row by row (its max moved, with no rounding of its own):
    where the max cancels (the exp is normalised by its own sum) the loss and the outputs are the same; where they
    move, the rewrite changed what the line means, and the step was made finite by computing something else.
    ``every``: the trial ran in every module that runs the line, whose moved value may be another module's (a
    softmax producer sharing its line with an exp gate): the reason does not say the producer's exp is unnormalised.
    """
    if fix.form != "max-subtracted exp" or outcome.failed is not None:
        return None
    moved = replay_step(step, site, StableFix(fix.function, offsets=True))
    fix.checked = moved.seconds
    if moved.failed is not None:
        return Note("exp-scaled-nonfinite")
    # (what moved: ``(its kind, its name)``, the output's path or the buffer's name)
    pairs: list[tuple[tuple[str, str | None], torch.Tensor, torch.Tensor]] = [
        (("output", path), outcome.outputs[path], after) for path, after in moved.outputs.items()
        if path in outcome.outputs]
    if outcome.loss is not None and moved.loss is not None:
        pairs.append((("loss", None), torch.tensor(outcome.loss, dtype=torch.float64),
                      torch.tensor(moved.loss, dtype=torch.float64)))
    if len(outcome.gradients) == len(moved.gradients):  # (a float16 loss may round a changed term away: a PPO ratio's)
        known = [(before, after) for before, after in zip(outcome.gradients, moved.gradients)
                 if before is not None and after is not None]
        pairs.append((("gradients", None), torch.tensor([before for before, _ in known], dtype=torch.float64),
                      torch.tensor([after for _, after in known], dtype=torch.float64)))
    # (a buffer the forward wrote, a running statistic of the exp another module sharing the line keeps)
    pairs += [(("buffer", name), outcome.buffers[name], after) for name, after in moved.buffers.items()
              if name in outcome.buffers]
    for (what, name), before, after in pairs:
        if before.shape != after.shape:
            continue
        tolerance = max(1e-4, 4 * torch.finfo(before.dtype).eps) if before.is_floating_point() else 0.0
        if what == "gradients":  # (summed in float64 from float16 ones: a float16 backward's own rounding)
            tolerance = max(tolerance, 4 * outcome.gradient_eps)
        if not torch.allclose(after.double(), before.double(), rtol=tolerance, atol=1e-6, equal_nan=True):
            change = float((after.double() - before.double()).abs().max())
            return Note.of("max-does-not-cancel", moved=what, name=name, change=change, every=every)
    return None
