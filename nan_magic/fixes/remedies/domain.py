"""``eps``: the producer's operand moved into its function's domain by a small, dtype-aware eps.

``log``/``sqrt``/``rsqrt``/``pow`` of 0 or of a negative: the operand is
clamped to at least eps; a division by 0: the denominator is clamped to eps
where it is never negative (to 1 where it counts: an integer tensor), else its zeros become eps; ``acos``/``asin`` at
or beyond +-1, and ``atanh`` there (the inverse of a tanh-squashed action that rounded to 1: SAC's log-prob):
clamped into ``[-1 + eps, 1 - eps]``, as ``erfinv`` (an inverse CDF); ``logit`` of a probability that rounded to 0
or 1, and the normal quantile ``ndtri`` (a rank-gauss of rank n / n): into ``[eps, 1 - eps]``; ``log1p`` at or below
-1 (``log1p(-p)`` of a p that rounded to 1): to at least ``-1 + eps``. eps is the operand's
dtype's machine epsilon (``torch.finfo(dtype).eps``: 1.2e-7 in float32,
9.8e-4 in float16), large enough for the gradient to stay finite where the
derivative is 1/x or 1/sqrt(x), and what the suggested edit writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fix_records import BOUNDED_FUNCTIONS, FUNCTIONS, SHIFTED_FUNCTIONS, UNIT_FUNCTIONS, whole_power
from nan_magic.fixes.site import function_name

__all__ = ["Behind", "DomainFix", "behind_mask", "denominator_form", "holds_of", "parameter_operand", "power_sizes",
           "quotient_sizes"]


def _whole_power(exponent: Any) -> bool:
    """``whole_power`` (fix_records.py) for a tensor exponent too, every element whole and at least 0: its only
    non-finite is an overflow, which no clamp of the operand from below fixes (a square of -1e30 clamped to eps is
    eps squared: finite, and no longer the user's value)."""
    if isinstance(exponent, torch.Tensor) and exponent.numel():
        if exponent.is_complex():
            return False
        with torch.no_grad():  # (a bool or integer exponent is whole: ``round`` takes neither)
            whole = exponent == exponent.round() if exponent.is_floating_point() else True
            return bool((whole & (exponent >= 0)).all())
    return whole_power(exponent)


def _counts(denominator: torch.Tensor) -> bool:
    """Whether a denominator holds counts: an integer tensor (not a bool mask) never negative, all 0 too (``bincount``,
    a ``mask.sum()`` of a bool mask that masked nothing, a degree kept as integers).

    A count of 0 is clamped to 1, as the cause's hint says, not to eps: the mean of nothing is then 0, where
    ``x / count.clamp_min(1.2e-07)`` divides what little a numerator holds there by 1e-7. Floating values that
    happen to be whole on this step are not taken for counts (a fraction ``mask.float().mean(1)`` that is 0 or 1
    on this batch, a bfloat16 sum of 256 or more): clamping those to 1 would change a later batch's 0.4.
    """
    if denominator.is_floating_point() or denominator.is_complex() or denominator.dtype == torch.bool or (
            not denominator.numel()):
        return False
    with torch.no_grad():
        return bool(denominator.to(torch.int64).amin() >= 0)


def denominator_form(denominator: torch.Tensor) -> str:
    """How a denominator is moved off 0: ``clamp_min`` where it is never negative, else ``zeros``."""
    return "clamp_min" if bool((denominator >= 0).all()) else "zeros"


#: Autograd nodes that only view, reshape, copy, cast or pick values: a parameter seen through them is the operand
#: itself (a part of it: a row, a transpose, one element of a vector, the elements an index tensor or a mask picks).
_SAME_VALUES = ("ViewBackward", "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward", "TBackward",
                "TransposeBackward", "PermuteBackward", "ReshapeAlias", "AliasBackward", "CloneBackward",
                "ToCopyBackward", "UnsafeView", "SelectBackward", "SliceBackward", "SplitBackward",
                "SplitWithSizesBackward", "UnbindBackward", "RepeatBackward", "AsStridedBackward", "DiagonalBackward",
                "NarrowBackward", "UnfoldBackward", "IndexBackward", "IndexSelectBackward", "GatherBackward",
                "TakeBackward", "MaskedSelectBackward")

#: ``(the parameter's id, a bool mask of the parameter's elements the operand holds, or None: every one)``.
Behind = tuple[int, "torch.Tensor | None"]


def parameter_operand(tensor: torch.Tensor) -> Behind | None:
    """The trained leaf tensor (a parameter) that ``tensor`` is, seen through views, reshapes, copies, casts and
    picks only, and which of its elements it holds; None where the operand is computed from it (a clamp there cuts
    one batch's gradient, which may be right: ``acos`` of a cosine at 1 sits at its minimum)."""
    node = tensor.grad_fn
    if node is None:
        return (id(tensor), None) if tensor.requires_grad else None
    chain: list[tuple[Any, int, int]] = []
    output_nr = tensor.output_nr
    for _hop in range(8):
        if node is None:
            return None
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            return id(variable), _read(tensor, chain, variable)
        if not type(node).__name__.startswith(_SAME_VALUES):
            return None
        following = [(index, step, output) for index, (step, output) in enumerate(node.next_functions)
                     if step is not None]
        if len(following) != 1:
            return None
        chain.append((node, output_nr, following[0][0]))
        _index, node, output_nr = following[0]
    return None


def _read(tensor: torch.Tensor, chain: list[tuple[Any, int, int]], parameter: torch.Tensor) -> torch.Tensor | None:
    """The elements of ``parameter`` that ``tensor`` holds: a gradient of ones carried back through the ``chain`` of
    nodes that only move values (each node called on it directly: no hook runs, nothing accumulates; a split's
    other pieces get none), nonzero where read; None (every element) where a node does not answer."""
    try:
        with torch.no_grad():
            grad = torch.ones_like(tensor, memory_format=torch.contiguous_format)
            for node, output_nr, index in chain:
                count = max(len(getattr(node, "_input_metadata", ())), output_nr + 1)
                outputs: list[torch.Tensor | None] = [None] * count
                outputs[output_nr] = grad  # (a split's other pieces: no gradient)
                grads = node(*outputs)
                grad = (grads if isinstance(grads, tuple) else (grads,))[index]
                if not isinstance(grad, torch.Tensor):
                    return None
            return (grad != 0).reshape(parameter.shape) if grad.numel() == parameter.numel() else None
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None


def behind_mask(parameter: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """The elements of ``parameter`` an operand read (:func:`parameter_operand`'s place): every one where None."""
    if where is None or where.shape != parameter.shape:
        return torch.ones(parameter.shape, dtype=torch.bool, device=parameter.device)
    return where.to(parameter.device)


def quotient_sizes(numerator: Any, denominator: torch.Tensor, moved: torch.Tensor) -> tuple[float, float] | None:
    """The largest ``|numerator / moved|`` where ``moved`` differs from ``denominator`` (a clamped 0), and the largest
    finite one elsewhere (0 where there is none); None where nothing was moved or the shapes do not broadcast."""
    try:
        with torch.no_grad():
            quotient = (torch.as_tensor(numerator, device=moved.device) / moved).abs().double()
            clamped = torch.broadcast_to(moved != denominator, quotient.shape)
            if not bool(clamped.any()):
                return None
            at = quotient[clamped]
            rest = quotient[~clamped & torch.isfinite(quotient)]
            return float(at.max()), float(rest.max()) if rest.numel() else 0.0
    except (RuntimeError, TypeError, ValueError):
        return None


#: The most elements a view's offsets are compared for (:func:`holds_of`); a larger view is no use found.
_VIEW_ELEMENTS = 1 << 20


def holds_of(value: Any, operand: torch.Tensor) -> bool:
    """Whether ``value`` is ``operand``, or a view of its storage that reads only elements of it (``sigma.expand(8,
    1)``, ``sigma.view(-1)``, ``sigma[0]``): a use of the same values (every_use.py). Runs only inside a trial."""
    if value is operand:
        return True
    if not isinstance(value, torch.Tensor) or not value._is_view() or value.dtype != operand.dtype or (
            value.device != operand.device) or value.is_sparse or operand.is_sparse:
        return False
    try:
        storage = value.untyped_storage()
        if storage.data_ptr() != operand.untyped_storage().data_ptr() or storage.nbytes() == 0:
            return False
        size = storage.nbytes() // value.element_size()
        if max(size, value.numel(), operand.numel()) > _VIEW_ELEMENTS:
            return False
        with torch.no_grad():
            offsets = torch.arange(size)
            mine = offsets.as_strided(value.shape, value.stride(), value.storage_offset())
            theirs = offsets.as_strided(operand.shape, operand.stride(), operand.storage_offset())
            return bool(torch.isin(mine, theirs).all())
    except (RuntimeError, NotImplementedError, ValueError):
        return False


#: The least factor a negative power's clamp must multiply by to hide an inf (``1 / eps`` is 8e6 in float32).
_HIDES = 1000.0
#: The functions that divide 1 by their operand, and the power they raise it to (a pow's is its exponent).
_POWERS = {"reciprocal": -1.0, "reciprocal_": -1.0, **dict.fromkeys(FUNCTIONS["rsqrt"], -0.5)}
#: The torch functions (and aten ops) of a product: a negative power's numerator (``x * v ** -1``).
_PRODUCTS = frozenset({"mul", "multiply", "__mul__", "__rmul__", "mul_", "__imul__"})


def power_sizes(exponent: Any, base: torch.Tensor, moved: torch.Tensor) -> tuple[float, float] | None:
    """:func:`quotient_sizes` of a negative power, ``moved ** exponent`` (``v ** -1``, ``v.rsqrt()``: 1 over the base),
    against the base's other values; None where the exponent is no negative number or tensor, or nothing moved."""
    if isinstance(exponent, torch.Tensor):
        negative = bool((exponent < 0).any()) if exponent.numel() and not exponent.is_complex() else False
    else:
        negative = isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent < 0
    if not negative:
        return None
    try:
        with torch.no_grad():
            power = (moved.double() ** (exponent.double() if isinstance(exponent, torch.Tensor) else exponent)).abs()
            clamped = torch.broadcast_to(moved != base, power.shape)
            if not bool(clamped.any()):
                return None
            rest = power[~clamped & torch.isfinite(power)]
            return float(power[clamped].max()), float(rest.max()) if rest.numel() else 0.0
    except (RuntimeError, TypeError, ValueError):
        return None


def _inside(function: str, operand: torch.Tensor) -> torch.Tensor:
    """Where ``operand`` is inside ``function``'s open domain, where it and its derivative are finite: (-1, 1), (0, 1)
    for logit and ndtri, above -1 for log1p, above 0 for the others (a log, a sqrt, a denominator never negative)."""
    with torch.no_grad():
        if function in UNIT_FUNCTIONS:
            return (operand > 0) & (operand < 1)
        if function in BOUNDED_FUNCTIONS:
            return operand.abs() < 1
        return operand > (-1 if function in SHIFTED_FUNCTIONS else 0)


def _centred(args: Sequence[Any], index: int, divisor: torch.Tensor) -> bool:
    """Whether a division's numerator is 0 wherever its divisor is (``(x - mean) / std`` of equal values: 0 / 0), up
    to the mean's rounding: within sqrt(eps) of 0 (equal values less their mean, ``x - sum(x) / n``, are 1e-7 at
    n = 6 in float32)."""
    numerator = args[0] if index == 1 else None
    if isinstance(numerator, (int, float)):
        return numerator == 0 or not bool((divisor == 0).any())
    if not isinstance(numerator, torch.Tensor) or not numerator.is_floating_point():
        return False
    try:
        return bool(((numerator.abs() <= torch.finfo(numerator.dtype).eps ** 0.5) | (divisor != 0)).all())
    except RuntimeError:  # (shapes that do not broadcast: the division itself fails)
        return False


def _clamped_where(value: Any, output: torch.Tensor | None, moved: torch.Tensor) -> torch.Tensor | None:
    """Where ``value`` reads a clamped element of a negative power's ``output`` (``moved``: where its base was
    clamped), as ``value`` is laid out: ``output`` itself, or a view of it (``(v ** -1)[:, None]``,
    ``v.rsqrt().unsqueeze(0)``, ``torch.reciprocal(v).view(-1)``); None where ``value`` reads no element of it."""
    if output is None or not isinstance(value, torch.Tensor):
        return None
    if value is output:
        return moved
    try:
        if not value._is_view() or not output.is_contiguous() or (
                value.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()):
            return None
        laid_out = torch.broadcast_to(moved, output.shape).contiguous()
        return laid_out.as_strided(value.shape, value.stride(), value.storage_offset() - output.storage_offset())
    except (RuntimeError, NotImplementedError, ValueError):
        return None


class DomainFix:
    """The remedy for the function ``function`` (a key of :data:`FUNCTIONS`)."""

    def __init__(self, function: str, added: bool = False) -> None:
        self.function = function
        #: A divisor that is a std, a variance or a norm (the cause's ``spread-zero``) and is 0 everywhere: eps added to
        #: it (``std + eps``), as its users write it; the quotient still depends on it, so no value counts as moved.
        self.added = added and function == "div"
        self.names = FUNCTIONS[function]
        #: What it did, for the description: eps, the operand's dtype, the denominator's form.
        self.eps: float | None = None
        self.dtype: str | None = None
        self.form: str | None = None
        #: Operand values moved, of how many: every one means the output no longer depends on the operand.
        self.moved = self.total = 0
        #: The parameters (their parts: a row, one element) that were an operand whose every value was moved (a
        #: learned scale at 0 under a sqrt): the clamp passes them no gradient, so they stay where they are, step
        #: after step (step.py names those whose every element behind it got none at all: frozen).
        self.behind: list[Behind] = []
        #: The exponents, numbers, of the pows it clamped the base of (not the whole powers it left): the edit
        #: clamps a pow whose exponent the line holds in a name only where these are not all written as numbers.
        self.exponents: set[float] = set()
        #: The calls made at the line so far, and of those it left as they were, each tensor argument (where it is
        #: given: an index or a keyword) and the operands it clamped: their other uses on the line (every_use.py).
        self.calls = 0
        self.unchanged: list[tuple[int, int | str, torch.Tensor]] = []
        self.operands: list[torch.Tensor] = []
        #: The sizes of the quotients over a clamped divisor and of the others (:attr:`quotients`).
        self._quotients: tuple[float, float] | None = None
        #: Of a negative power it clamped the base of (``v ** -1``, ``v.rsqrt()``): [its output, where the base was
        #: moved, the sizes (None until a product at the line reads it: :meth:`note_product`), its factor].
        self._powers: list[list[Any]] = []
        #: Of the values moved, those that were inside the function's domain, only nearer its edge than eps (a
        #: probability of 1e-9 under a log): the clamp changes them too, healthy values (remedy_facts' ``inside``).
        self.inside = 0
        #: The largest ``|output|`` of the remedied op where it moved the operand, and of its other finite values
        #: (scale_check.py: ``(0 + eps) ** -0.5`` is 2896 where the others are about 1); None until one is read.
        self.op_sizes: tuple[float, float] | None = None

    def frozen(self, parameters: dict[str, torch.Tensor], grads: dict[int, torch.Tensor | None]) -> tuple[str, ...]:
        """The trained parameters (of the replay's ``parameters``, their gradients ``grads`` by id) whose every
        element behind an operand this remedy moved whole got no gradient at all (through every path)."""
        places: dict[int, list[torch.Tensor | None]] = {}
        for leaf, where in self.behind:
            places.setdefault(leaf, []).append(where)
        frozen = []
        for name, parameter in parameters.items():
            if id(parameter) not in places or id(parameter) not in grads:
                continue
            grad = grads[id(parameter)]
            try:
                with torch.no_grad():
                    read = torch.stack([behind_mask(parameter, where) for where in places[id(parameter)]]).any(0)
                    if grad is None or not bool((grad[read] != 0).any()):
                        frozen.append(name)
            except (RuntimeError, NotImplementedError, IndexError):  # (not read: no verdict of frozen)
                continue
        return tuple(frozen)

    def renewed(self) -> DomainFix:
        """The same remedy, nothing counted yet (for a second trial of it)."""
        return DomainFix(self.function, self.added)

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        ordinal = self.calls
        self.calls += 1
        result = self._remedied(func, args, kwargs)
        if result is None and self._powers:
            self.note_product(function_name(func), args)
        if result is None and function_name(func) != "__get__":  # (a property read, ``sigma.shape``: no use)
            given: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
            self.unchanged += [(ordinal, key, value) for key, value in given if isinstance(value, torch.Tensor)]
        return result

    def other_uses(self) -> dict[int, tuple[int | str, ...]]:
        """Where the line used an operand this remedy clamped, in calls it left as they were (``log(sigma)``'s
        sigma divided by too): ``{the call's ordinal at the line: its arguments}``; the references are let go."""
        uses: dict[int, tuple[int | str, ...]] = {}
        for ordinal, key, value in self.unchanged:
            if any(holds_of(value, operand) for operand in self.operands):
                uses[ordinal] = (*uses.get(ordinal, ()), key)
        self.unchanged, self.operands = [], []
        return uses

    def note_quotient(self, name: str, args: Sequence[Any], index: int | str, operand: torch.Tensor,
                      moved: torch.Tensor) -> None:
        """Count the sizes of the quotient whose denominator, argument ``index`` of the call ``name``, was ``operand``
        and is ``moved`` (:meth:`hidden_quotients`); nothing where the call is no division by it."""
        if index == 0 and (name in _POWERS or name in FUNCTIONS["pow"]):
            # A division spelled as a power (``x * v ** -1``, ``x * v.rsqrt()``, ``x * torch.reciprocal(v)``):
            # 1 / eps ** k where the base was clamped, until a product at the line gives it its numerator
            # (:meth:`note_product`: ``0 * v ** -1`` of a row of zeros hides nothing).
            exponent = _POWERS[name] if name in _POWERS else args[1] if len(args) > 1 else None
            sizes = power_sizes(exponent, operand, moved)
            lowest = float(exponent.min()) if isinstance(exponent, torch.Tensor) else float(exponent or 0.0)
            factor = torch.finfo(moved.dtype).eps ** lowest  # (what the clamp multiplies by: 2.9e3 for an rsqrt)
            if sizes is not None and factor >= _HIDES:  # (``v ** -0.1``'s clamp multiplies by 4.9: it hides no inf)
                self._powers.append([None, moved != operand, None, factor])
            return
        if index == FUNCTIONS["div"].get(name, FUNCTIONS["reciprocal"].get(name)):
            numerator = args[0] if index == 1 else args[1] if len(args) > 1 else 1.0  # (``2 / x``)
            sizes = quotient_sizes(numerator, operand, moved)
        else:
            return
        if sizes is not None:
            self._quotients = (max(self._quotients[0], sizes[0]), max(self._quotients[1], sizes[1])) \
                if self._quotients is not None else sizes

    def hidden_quotients(self, dominates: float) -> tuple[float, float] | None:
        """The largest size of a quotient where its denominator was clamped, and of the others (finite), where one
        outweighs the others: more than ``dominates`` times the largest other (or 1); a negative power's (its product
        at the line the quotient), whose clamp multiplies by less (an rsqrt's by 2.9e3), more than a tenth of that
        times. x / eps is x * 8e6 in float32: the inf hidden (remedy_facts' ``over_eps``). None where none does."""
        entries = [(*self._quotients, dominates)] if self._quotients is not None else []
        # A power is judged only where a product at the line gave it its numerator: its output read another way
        # (``(v ** -1)[:, None]``, ``inv = v ** -1`` then ``h * inv`` on the next line) says nothing of the numerator,
        # and ``0 * (1 / eps)`` of F.normalize's zero rows hides no inf.
        entries += [(*power[2], min(dominates, power[3] / 10)) for power in self._powers if power[2] is not None]
        found = [(at, rest) for at, rest, times in entries if at > times * max(rest, 1.0)]
        return (max(at for at, _ in found), max(rest for _, rest in found)) if found else None

    def note_output(self, result: Any) -> Any:
        """``result``, the output of a call this remedy changed: a negative power's, kept for :meth:`note_product`."""
        for power in self._powers:
            if power[0] is None:
                power[0] = result
        return result

    def note_product(self, name: str, args: Sequence[Any]) -> None:
        """A product at the line of a negative power this remedy clamped the base of, by ``args``' other factor:
        the quotient's numerator (``x * v ** -1``: 0 * 1 / eps is 0, no x / 0 hidden)."""
        if name not in _PRODUCTS or len(args) != 2:
            return
        for power in self._powers:
            found = [(arg, read) for arg in args if (read := _clamped_where(arg, power[0], power[1])) is not None]
            if len(found) != 1:
                continue
            (factor, clamped), other = found[0], args[1] if args[0] is found[0][0] else args[0]
            if not isinstance(other, torch.Tensor):
                continue  # (``2 * v ** -1`` inside ``h * (...)``: a scale, not the numerator; h's zero rows are 0)
            try:
                with torch.no_grad():
                    product = (other * factor).abs().double()
                    clamped = torch.broadcast_to(clamped, product.shape)
                    rest = product[~clamped & torch.isfinite(product)]
                    power[2] = (float(product[clamped].max()) if bool(clamped.any()) else 0.0,
                                float(rest.max()) if rest.numel() else 0.0)
            except (RuntimeError, TypeError, ValueError):
                continue

    def _remedied(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        name = function_name(func)
        index = self.names.get(name)
        if index is None or len(args) <= index or not isinstance(args[index], torch.Tensor):
            return None
        operand = args[index]
        if self.function == "pow" and _whole_power(args[1] if len(args) > 1 else kwargs.get("exponent")):
            # (x ** 2 on the line of a x ** 0.5, or of a large or negative x: defined, with a finite derivative, at
            # every base; no domain to clamp into, a clamp would only hide an overflow)
            return None
        if not operand.is_floating_point():
            # (an integer denominator: counts, clamped to 1, where it is never negative; else there is no eps)
            return self._counted(func, args, kwargs, index) if self.function in ("div", "reciprocal") else None
        eps = torch.finfo(operand.dtype).eps
        self.eps, self.dtype = eps, str(operand.dtype).removeprefix("torch.")
        if self.function == "pow" and isinstance(exponent := args[1] if len(args) > 1 else kwargs.get("exponent"),
                                                 (int, float)):
            self.exponents.add(float(exponent))
        low = eps if self.function in UNIT_FUNCTIONS else -1 + eps  # (logit's domain is (0, 1))
        if self.function in BOUNDED_FUNCTIONS:
            moved = operand.clamp(low, 1 - eps)
        elif self.added and operand.numel() and bool((operand < eps).all()) and _centred(args, index, operand):
            # A spread below eps everywhere of values centred on their mean, ``0 / 0``: clamped, the quotient would no
            # longer depend on it (its gradient cut everywhere: hidden, not fixed); ``std + eps`` keeps it. Where some
            # rows are 0, clamp as F.normalize does. A numerator not 0 where the spread is (``mse / y.var()`` of equal
            # targets, x / 0) is clamped too: ``x / (var + eps)`` is x * 1e7, which diverges, and the clamp's verdict
            # says the inf is hidden, not fixed.
            self.form, moved = "add" if self.form in (None, "add") else self.form, operand + eps
            self.total += operand.numel()
            remedied = [*args[:index], moved, *args[index + 1:]]
            return func(*remedied, **kwargs)
        elif self.function in ("div", "reciprocal"):
            form = denominator_form(operand)
            self.form = form if self.form in (None, "count") else self.form
            moved = operand.clamp_min(eps) if form == "clamp_min" else torch.where(operand == 0, eps, operand)
        elif self.function in SHIFTED_FUNCTIONS:
            moved = operand.clamp_min(low)
        else:
            moved = operand.clamp_min(eps)
        changed = int((moved != operand).sum())
        self.moved += changed
        if changed:
            self.inside += int(((moved != operand) & _inside(self.function, operand)).sum())
        self.total += operand.numel()
        if changed == operand.numel() and operand.requires_grad and (leaf := parameter_operand(operand)) is not None:
            self.behind.append(leaf)
        if index == 0 and name.endswith("_") and not name.startswith("__"):
            # ``p.log_()``: the operand is the tensor written, clamped in place first (``p.clamp_min_(eps).log_()``;
            # a copy_ of the clamp would overwrite what the clamp's own backward reads).
            if self.function in BOUNDED_FUNCTIONS:
                operand.clamp_(low, 1 - eps)
            elif self.function in SHIFTED_FUNCTIONS:
                operand.clamp_min_(low)
            else:
                operand.clamp_min_(eps)
            return func(*args, **kwargs)
        self.operands.append(operand)
        self.note_quotient(name, args, index, operand, moved)
        remedied = list(args)
        remedied[index] = moved
        result = func(*remedied, **kwargs)
        if changed:
            self._note_sizes(result, moved != operand)
        return self.note_output(result)

    def _note_sizes(self, result: Any, where: torch.Tensor) -> None:
        """Keep the remedied op's output size where the operand moved (``where``) and elsewhere (:attr:`op_sizes`)."""
        if not isinstance(result, torch.Tensor) or not result.is_floating_point():
            return
        try:
            with torch.no_grad():
                magnitude = result.detach().double().abs()
                moved = torch.broadcast_to(where, magnitude.shape)
                at = magnitude[moved & torch.isfinite(magnitude)]
                rest = magnitude[~moved & torch.isfinite(magnitude)]
                sizes = (float(at.max()) if at.numel() else 0.0, float(rest.max()) if rest.numel() else 0.0)
        except (RuntimeError, TypeError, ValueError):  # (an output not shaped as its operand: no size read)
            return
        self.op_sizes = sizes if self.op_sizes is None else (max(self.op_sizes[0], sizes[0]),
                                                              max(self.op_sizes[1], sizes[1]))

    def _counted(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], index: int) -> Any:
        """An integer denominator of counts clamped to 1 (:func:`_counts`), or None where it is not counts."""
        operand = args[index]
        if self.form not in (None, "count") or not _counts(operand) or denominator_form(operand) != "clamp_min":
            return None
        self.form, self.dtype = "count", str(operand.dtype).removeprefix("torch.")
        moved = operand.clamp_min(1)
        self.moved += int((moved != operand).sum())
        self.total += operand.numel()
        remedied = list(args)
        remedied[index] = moved
        return func(*remedied, **kwargs)
