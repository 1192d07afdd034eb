"""Early warnings: signs that a run is heading for a non-finite value.

Fed one :class:`StepSummary` per completed step (and, in immediate mode, each
floating tensor entering a watched model), they compare against running
statistics and return :class:`EarlyWarning` records; the watch shows them in
the report and, in ``warn`` mode, as they happen.

Kinds (exact strings)
---------------------
``overflow-risk``
    A float16/bfloat16 module output came within :data:`HEADROOM_LIMIT` of the
    dtype's largest finite value.
``loss-spike``, ``grad-norm-spike``
    After :data:`WARMUP` finite steps, the loss (gradient norm) exceeded
    :data:`SPIKE_FACTOR` times the median of the last :data:`WINDOW` steps and
    every value of the warm-up.
``extreme-input``
    A batch held a finite ``|x| >`` :data:`EXTREME_INPUT` (seen as it enters
    the model in immediate mode, from the step summary otherwise).
``constant-feature``
    A feature (last dim of a 2-D batch, channel of a 4-D or 5-D one) took one
    value over a batch of more than one row (checked at the first step of a
    watch, then every :data:`BATCH_RULE_EVERY`-th).
``scale-falling``
    A GradScaler's scale fell between each of :data:`SCALE_FALLS` consecutive
    completed steps.
``grad-norm-overflow``
    A gradient norm overflowed float32 while every element of the gradient
    was finite: the gradients are near the float32 limit. Not an event (no
    value the program uses is non-finite), the step before one.

Each kind warns at most once per :data:`WARN_EVERY` steps, so a run that
stays near a limit gets a reminder, not a flood.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from nan_magic.hot.reads import read_probe
from nan_magic.plain import to_pairs
from nan_magic.records import EarlyWarning, StepSummary, TensorRef

__all__ = [
    "BATCH_RULE_EVERY",
    "EXTREME_INPUT",
    "HEADROOM_LIMIT",
    "SCALE_FALLS",
    "SPIKE_FACTOR",
    "WARMUP",
    "WARN_EVERY",
    "WINDOW",
    "EarlyWarnings",
]

#: Headroom (``finfo.max / |x|``) below which a half-precision output is at risk:
#: under 8x, three more doublings (one residual add of a like-sized value, a
#: squared norm, a few steps of growth) overflow it. float16 values above
#: 8188 are rare in healthy models.
HEADROOM_LIMIT = 8.0

#: The per-feature batch rule runs at the first step and then every this many steps.
BATCH_RULE_EVERY = 8
#: A loss or gradient norm this many times its running median is a spike:
#: healthy runs move within a few-fold; a diverging one multiplies every step.
SPIKE_FACTOR = 10.0
#: Finite steps needed before spikes are judged: the first steps set the scale.
WARMUP = 5
#: Steps in the running median: long enough to ignore one noisy batch.
WINDOW = 50
#: Largest |x| a batch may hold without a warning: normalised features are
#: O(1), and squares or products of 1e6 (1e12) already pass float16's limit by
#: far and float32's after a few layers of gain.
EXTREME_INPUT = 1e6
#: Consecutive completed steps with a falling GradScaler scale that warn: one
#: fall (the first steps finding a scale) is normal, a scale that falls again
#: and again between steps that run means overflows keep coming back.
SCALE_FALLS = 3
#: Steps between two warnings of the same kind.
WARN_EVERY = 100

_HALF = ("float16", "bfloat16")
#: Constant features listed in one warning message.
_SHOWN_FEATURES = 3
#: Features up to this many are compared on the host (:func:`_constant_feature`).
_COMPARED_ON_HOST = 64


class _Spikes:
    """Running median and warm-up maximum of one positive series (|loss|, grad norm)."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.seen = 0
        self.warmup_max = 0.0

    def observe(self, value: float | None) -> float | None:
        """The ratio of ``|value|`` to the running median when it is a spike, else None.

        A spike must also exceed every warm-up value: a converged loss near 0
        that jumps 10x from noise is still below where training started.
        """
        # (Comparisons, not math.isfinite and abs: two calls less, twice a step; NaN fails both comparisons.)
        if value is None or not -math.inf < value < math.inf:
            return None
        magnitude = value if value > 0 else -value
        ratio = None
        if self.seen < WARMUP:
            self.warmup_max = max(self.warmup_max, magnitude)
        elif magnitude > self.warmup_max:  # else no spike, and no median to take (most steps)
            median = statistics.median(self.recent)
            if median > 0 and magnitude > SPIKE_FACTOR * median:
                ratio = magnitude / median
        self.seen += 1
        self.recent.append(magnitude)
        return ratio


class EarlyWarnings:
    """Running state of the early-warning rules for one watch."""

    def __init__(self) -> None:
        self._loss = _Spikes()
        self._grad_norm = _Spikes()
        self._scale: float | None = None
        self._scale_falls = 0
        self._last_warned: dict[str, int] = {}

    def observe_step(self, summary: StepSummary) -> list[EarlyWarning]:
        """Warnings raised by one completed step.

        Every step's: each rule is asked only where its first test could pass (a rule's call each, on a
        healthy step, is most of this).
        """
        step = summary.step
        found: list[EarlyWarning | None] = []
        if summary.headroom_dtype in _HALF:
            found.append(_overflow_risk(step, "output", summary.headroom, summary.headroom_dtype,
                                        summary.headroom_module))
        if summary.grad_headroom_dtype in _HALF:
            found.append(_overflow_risk(step, "gradient", summary.grad_headroom, summary.grad_headroom_dtype,
                                        summary.grad_headroom_module))
        if (ratio := self._loss.observe(summary.loss)) is not None:
            found.append(_spike("loss-spike", step, summary.loss, ratio))
        if (ratio := self._grad_norm.observe(summary.grad_norm)) is not None:
            found.append(_spike("grad-norm-spike", step, summary.grad_norm, ratio))
        if summary.scale is not None or self._scale is not None:
            found.append(self._scale_falling(summary))
        else:
            self._scale_falls = 0
        # Where batches are not observed one by one (deferred mode), the
        # step's largest input still shows an extreme batch, a step later.
        if (absmax := summary.input_absmax) is not None and absmax > EXTREME_INPUT:
            found.append(_extreme_input(step, None, absmax))
        return [warning for warning in found if warning is not None and self._due(warning)] if found else []

    def observe_batch(
        self, step: int, path: str, tensor: torch.Tensor, probe: tuple[float, float] | None = None
    ) -> list[EarlyWarning]:
        """Warnings about one floating tensor entering a watched model, the argument at ``path`` (``input[0]``).

        ``probe`` is the tensor's ``(min, max)`` when the watch already read
        it. The per-feature rule reads the batch once more, so it runs at the
        first step of a watch and then on every :data:`BATCH_RULE_EVERY`-th:
        a constant column of a dataset shows in every batch, and a cell that
        runs a few steps at a time should not pay for it at each.
        """
        # Only detached tensors are read: no graph is recorded, without the
        # cost of entering ``no_grad`` at every step.
        if probe is None:
            low, high = read_probe(tensor)
        else:
            low, high = probe
        absmax = high if high > -low else -low  # (max(-low, high) without its call: every batch)
        found = [_extreme_input(step, path, absmax)] if absmax > EXTREME_INPUT else []
        # Features are columns of a dense real batch; a sparse or complex one has no such columns to compare.
        if (step % BATCH_RULE_EVERY == 0 and tensor.layout is torch.strided and not tensor.is_complex()
                and tensor.dim() in (2, 4, 5) and tensor.shape[0] > 1):
            # (float8, an MX block scale given to a module: no reduction kernels; float32 holds its values)
            feature_low, feature_high = _feature_ranges(tensor.detach() if tensor.itemsize != 1 else tensor.float())
            found.append(_constant_feature(step, path, tensor, feature_low, feature_high))
        return [warning for warning in found if warning is not None and self._due(warning)] if found else []

    # -- per-step rules --------------------------------------------------------------

    def _scale_falling(self, summary: StepSummary) -> EarlyWarning | None:
        scale, previous = summary.scale, self._scale
        self._scale = scale
        if scale is None or previous is None or scale >= previous:
            self._scale_falls = 0
            return None
        self._scale_falls += 1
        if self._scale_falls < SCALE_FALLS:
            return None
        return EarlyWarning(step=summary.step, kind="scale-falling",
                            facts=(("falls", self._scale_falls), ("scale", scale)), value=scale)

    def observe_norm_overflow(self, step: int, optimizer: str, names: list[str]) -> list[EarlyWarning]:
        """Gradients about to be applied whose norm overflowed, every element finite."""
        warning = EarlyWarning(step=step, kind="grad-norm-overflow",
                               facts=(("parameters", tuple(names)), ("optimizer", optimizer)), value=math.inf)
        return [warning] if self._due(warning) else []

    def _due(self, warning: EarlyWarning) -> bool:
        """At most one warning of a kind per :data:`WARN_EVERY` steps."""
        last = self._last_warned.get(warning.kind)
        if last is not None and warning.step - last < WARN_EVERY:
            return False
        self._last_warned[warning.kind] = warning.step
        return True


# -- per-batch rules ------------------------------------------------------------------


def _feature_ranges(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature ``(min, max)``: over the rows of a 2-D batch, per channel of a 4-D/5-D one.

    Other shapes give the whole tensor's range. One pair of reductions serves
    both batch rules, and it reads the tensor without copying it.
    """
    if tensor.dim() == 2 and tensor.shape[0] > 1:
        # (amin and amax, not aminmax: along a dimension, aminmax runs a scalar loop on the CPU, 13 times the time of
        # the two for a 512 x 1024 batch, torch 2.13; the same for a small one.)
        return torch.amin(tensor, dim=0), torch.amax(tensor, dim=0)
    if tensor.dim() in (4, 5) and tensor.shape[0] > 1:
        dims = (0, *range(2, tensor.dim()))
        return torch.amin(tensor, dim=dims), torch.amax(tensor, dim=dims)
    return torch.aminmax(tensor)


def _batch_tensor(path: str) -> tuple[tuple[str, object], ...]:
    """A batch tensor as a warning's fact: the model call's argument at ``path``, a typed reference as plain pairs."""
    return to_pairs(TensorRef.argument(path))


def _spike(kind: str, step: int, value: float | None, ratio: float) -> EarlyWarning | None:
    """A loss or gradient-norm spike: ``ratio`` to the running median (:meth:`_Spikes.observe`)."""
    if value is None:
        return None
    return EarlyWarning(step=step, kind=kind, facts=(("value", value), ("ratio", ratio)), value=value)


def _extreme_input(step: int, path: str | None, absmax: float | None) -> EarlyWarning | None:
    # ``path``: the batch's argument (``input[0]``), None for the step's largest input (render/words says which).
    # A non-finite batch is an event of its own (phase data), not a warning.
    if absmax is None or not math.isfinite(absmax) or absmax <= EXTREME_INPUT:
        return None
    tensor = None if path is None else _batch_tensor(path)
    return EarlyWarning(step=step, kind="extreme-input",
                        facts=(("tensor", tensor), ("absmax", absmax), ("limit", EXTREME_INPUT)), value=absmax)


def _constant_feature(
    step: int, path: str, tensor: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> EarlyWarning | None:
    if low.numel() <= _COMPARED_ON_HOST:
        # An image's channels, a small table's columns: compared as Python floats, no kernel (every 8th step).
        lows, highs = low.tolist(), high.tolist()
        constant = [index for index, (least, most) in enumerate(zip(lows, highs)) if least == most]
    else:
        equal = low == high
        constant = equal.nonzero().flatten().tolist() if equal.any() else []  # (no nonzero where none is constant)
    if not constant:
        return None
    facts = (
        ("tensor", _batch_tensor(path)),
        ("axis", "feature" if tensor.dim() == 2 else "channel"),
        ("count", len(constant)),
        ("features", low.numel()),
        ("rows", tensor.shape[0]),
        ("constant", tuple((index, float(low[index])) for index in constant[:_SHOWN_FEATURES])),
    )
    return EarlyWarning(step=step, kind="constant-feature", facts=facts, value=float(len(constant)))


def _overflow_risk(
    step: int, what: str, headroom: float | None, dtype: str | None, module: str | None
) -> EarlyWarning | None:
    """A half-precision value of the step within HEADROOM_LIMIT of its dtype's limit.

    ``what`` is ``"output"`` (a module's forward output) or ``"gradient"``
    (the gradient flowing through the module in backward).
    """
    if headroom is None or dtype not in _HALF or headroom >= HEADROOM_LIMIT:
        return None
    facts = (("dtype", dtype), ("what", what), ("module", module), ("headroom", headroom),
             ("limit", torch.finfo(getattr(torch, dtype)).max))
    return EarlyWarning(step=step, kind="overflow-risk", facts=facts, module=module, value=headroom)
