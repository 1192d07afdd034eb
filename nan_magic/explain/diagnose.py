"""The likely cause of an event, with its evidence and a concrete fix.

:func:`diagnose` runs the checklist of people who debug non-finite training
runs on the evidence a :class:`Report` carries: the producer's op, the dtype,
the phase, the statistics of the producer's inputs and output, the autograd
node and the optimizer the watch named (fields, never read back from the
notes), the batch of the failing step and the history of earlier steps.
When the evidence does not single out one cause the label is
``"unclassified"`` and the hint gives the facts, never a confident guess.

Labels (exact strings: tests, renderers and users rely on them)
----------------------------------------------------------------
``half-precision-overflow``
    A float16/bfloat16 op made ±inf from finite inputs (a matmul, a product,
    a sum, a quotient without a zero divisor, optimizer state), and no
    op-specific rule below explains it.
``exp-overflow``
    ``exp``/``exp2``/``expm1``/``sinh``/``cosh`` made +inf: its input passed
    ``log(finfo.max)`` (11.09 in float16, 88.72 in float32); or the backward
    of such an op; or ``i0``/``i1``, which grow as exp(|x|) / sqrt(2 pi |x|).
``division-by-zero``
    A division whose divisor held zeros, or that made NaN (from finite values
    only 0/0 does); ``rsqrt`` of zeros; a std/var over N elements with
    ``N - correction == 0``; the backward of a norm or std at zero; the
    backward of ``eigh``'s eigenvectors (or ``svd``'s singular vectors) at a
    repeated value, 1/(λi - λj); a layer, group or batch norm with eps=0 over a
    slice of equal values. Covers a zero variance or norm.
``log-domain``
    ``log``/``log2``/``log10`` of zeros (-inf) or negatives (NaN), ``log1p``
    of values <= -1; the backward of a log at 0; ``lgamma``/``digamma`` at
    their poles, 0 and the negative integers (lgamma(x) ~ -log(x) near 0);
    ``atanh`` at ±1 or past them (log((1 + x) / (1 - x)) / 2); the log-determinant
    of a singular matrix (``logdet``, ``slogdet``).
``sqrt-domain``
    ``sqrt``/``rsqrt`` of negatives; the backward of ``sqrt`` at 0, and of
    ``acos``/``asin`` at ±1 (whose derivatives are 1/sqrt(1 - x²)).
``pow-domain``
    ``pow`` of a negative base with a fractional exponent (NaN), of zero with
    a negative exponent (inf, with the base's zeros seen); its backward at 0.
``overflow``
    A float32/float64 op made ±inf (or NaN from an inf - inf inside it) from
    finite inputs, with the evidence of an overflow: a product, sum or matmul
    (which make inf from finite values no other way), operands or finite
    outputs near the dtype's max, a square (a variance, a norm) of values
    above sqrt(max), or attention scores q·kᵀ that can pass the max. Or an
    optimizer's float32 state (Adam's ``exp_avg_sq``) past the max while its
    parameter stays finite: gradients of about 1e19 and more. Or, set by the
    watch (``hot/checks/optimizer/running_stats.py``), a BatchNorm's running statistic
    past the max while training went on with the batch's own statistics. Also the upstream reading a rising loss
    would otherwise call divergence: an overflow in the loop's code outside the model of a value far larger than the
    model's outputs (a multiplier or scale the loop grows each step) or a quotient by a number the loop shrank (a
    temperature); and an optimizer state overflow in a step whose loss the loss's own code made far larger than the
    model's outputs and batch (a division by a near-zero schedule value): ``loss_scaled``.
``masked-softmax``
    A softmax or attention op made NaN where every position of a row was
    masked: a softmax whose input held a -inf at each NaN position (over
    finite and -inf values it is NaN only in rows all -inf); an attention op
    whose float mask holds enough -inf to fill a row and whose q and k bound
    the scores below the dtype's max (so they did not overflow).
``learning-rate-too-high``
    The loss or gradient norm of the earlier steps grew at least
    :data:`DIVERGENCE_FACTOR`-fold over its median, rising on each of the last
    :data:`DIVERGENCE_RISES` steps, and the event is an overflow or has no
    op-specific cause: the overflow is the divergence arriving (with the ``decay`` fact where a watched
    optimizer's ``lr * weight_decay`` reaches :data:`DECAY_BOUND`: the decay alone flips the weights). Or an
    optimizer step whose learning rate is itself past the parameter dtype's
    max (fused, foreach or for-loop alike).
``optimizer-eps-underflow``
    Phase ``optimizer``, an optimizer that divides by ``sqrt(v) + eps``
    (Adam family, RMSprop, Adagrad, Adadelta, or an ``addcdiv``/``div`` op in
    the step), and an eps that is 0, or rounds to 0 in the parameter's dtype
    (the default 1e-8 in float16): 0/0 where a gradient is 0.
``bad-input-data``
    Phase ``data`` (the batch already held the values), or an overflow in a
    step whose batch held ``|x| >`` :data:`~nan_magic.hot.checks.early.EXTREME_INPUT`.
``empty-reduction``
    ``mean`` or a mean-reduced loss (``nll_loss``, ``mse_loss``, …) made NaN
    from finite inputs, or a one-element 0/0: an average over an empty
    selection, e.g. a loss whose every target is ``ignore_index``.
``ctc-infeasible``
    ``ctc_loss`` made +inf (and nothing else): a sample whose target no
    alignment fits, a target longer than its input (or than its input less
    the blanks its repeated labels need). ``nn.CTCLoss`` returns inf there
    unless ``zero_infinity=True``.
``parameter-already-nonfinite``
    A module read a parameter or buffer that already held non-finite values.
``nonfinite-number``
    The op was given a Python number that is not finite (``mask * float("-inf")``, a scale or temperature set to
    inf in a config): no tensor op made the value; the number the code passed did. Or an optimizer step's learning
    rate that the loop set non-finite where no recorded op made it (a schedule computed in Python, a tensor rate made
    before the records that reach the step): the loop's line that set it is named (``localize/outside/lr_lines.py``),
    with no op even where one made it out of the records' reach.
``handled-input``
    Set by the watch (``explain/handled.py``) on a benign event: a batch entering a watched model carried
    non-finite values and the step's outputs, loss, gradients and parameters stayed finite (the model imputes
    NaN-coded missing values itself); one event for the run, counting the steps.
``grad-scaler-collapse``
    Set by the watch (``step_checks.py``) when a GradScaler's scale keeps
    collapsing; :func:`diagnose` is only called where no cause is set.
``unclassified``
    No rule matches, or more than one reading fits; the hint says which.
    Benign events (a GradScaler skip, a deliberate infinity) are not
    diagnosed: their hint starts with ``benign:``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

from nan_magic.explain.evidence import HALF, event, event_cause, node_function, plain_cause
from nan_magic.explain.forward import forward_cause
from nan_magic.explain.optimizer import optimizer_cause
from nan_magic.explain.overflow import half_overflow
from nan_magic.hot.checks.early import EXTREME_INPUT
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Phase, Report, StepSummary, TensorRef, TensorRole
from nan_magic.tensor_refs import op_function

__all__ = ["DIVERGENCE_FACTOR", "DIVERGENCE_RISES", "LABELS", "diagnose"]

#: Every label :func:`diagnose` (or the watch) can give.
LABELS = (
    "half-precision-overflow",
    "overflow",
    "exp-overflow",
    "division-by-zero",
    "log-domain",
    "sqrt-domain",
    "pow-domain",
    "masked-softmax",
    "learning-rate-too-high",
    "optimizer-eps-underflow",
    "bad-input-data",
    "empty-reduction",
    "ctc-infeasible",
    "parameter-already-nonfinite",
    "nonfinite-number",
    "grad-scaler-collapse",
    "handled-input",
    "unclassified",
)

#: Growth of the loss (or gradient norm) over the median of the earlier steps
#: that counts as divergence. Healthy runs move their loss within a few-fold;
#: a too-high learning rate multiplies it every step.
DIVERGENCE_FACTOR = 10.0
#: ... and it must have risen on each of this many last steps: one bad batch
#: spikes once, a diverging run keeps climbing.
DIVERGENCE_RISES = 3
#: A run that blows up within a few steps (a learning rate orders of magnitude
#: too high: the loss 1.2 -> 4e23 -> overflow) has no such history; rising on
#: every step it has, by this factor over the median before, is divergence too.
EXPLOSION_FACTOR = 1e6
#: ``lr * weight_decay`` from which the decay term alone (``w -= lr * weight_decay * w``, SGD's and AdamW's) zeroes or
#: flips the weights each step instead of shrinking them: a 5e4 typed for 5e-4 (usual products are below 1e-3).
DECAY_BOUND = 1.0
#: An overflow in the loop's code outside the model whose operand is this many times the largest output the model
#: made (its modules' outputs, in the steps the history holds and in the failing one) was not made by the model's
#: outputs growing: the loop computes a value of its own (a multiplier, a running product) that grew.
OUTSIDE_FACTOR = 1e6
#: The phases loop code outside the model runs in: the loss, and what runs between one step and the next's forward.
_LOOP_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.DATA)
#: ... and the loss (or gradient norm) rose at least this power of the model outputs' own growth: a loss made from
#: the outputs (a square error, a cross-entropy) grows as their square at most, one with a term of its own does not.
OUTSIDE_POWER = 4.0
#: A loss this many times the square of the largest value the model and its batch held in the step (a squared error
#: or a cross-entropy of those is about their square at most, per element) was scaled up by the loss's own code.
LOSS_FACTOR = 1e12

def diagnose(report: Report) -> Cause:
    """The likely cause of ``report``'s event: one of :data:`LABELS`, a hint naming the tensor, parameter or module
    concerned with its numbers, and the evidence behind it (the watch sets ``grad-scaler-collapse`` itself)."""
    if report.benign:
        return event_cause("unclassified", "benign", report)
    cause = _with_absorbed(report, _local_cause(report))
    if cause.reading == "optimizer-state-overflow-wide" and (scaled := _loss_scaled(report)) is not None:
        # The loss's own code made the gradients huge in one step: not a rate, not the model's outputs growing.
        return dataclasses.replace(cause, facts=(*cause.facts, ("loss_scaled", scaled)))
    growth = _growth(report.history)
    if cause.label in ("half-precision-overflow", "overflow", "exp-overflow", "unclassified"):
        # These readings describe how the value overflowed, not why the
        # values were that large: an extreme batch or a diverging run is the
        # cause upstream, when the evidence shows one.
        extreme = _extreme_batch(report)
        if extreme is not None:
            return _bad_batch(report, cause, *extreme)
        if growth is not None:
            return _outside_growth(report, cause, growth) or _learning_rate(report, cause, growth)
    if growth is not None:
        return dataclasses.replace(cause, facts=(*cause.facts, ("rising", growth)))
    if cause.reading == "wide-overflow" and report.module is None and (far := _far_operand(report)) is not None:
        return dataclasses.replace(cause, facts=(*cause.facts, ("far_operand", far)))
    return cause


def _with_absorbed(report: Report, cause: Cause) -> Cause:
    """Say so where the producer read a forward infinity that no boundary saw (PRODUCT.md: event)."""
    absorbed = report.absorbed
    if absorbed is None:
        return cause
    source = absorbed.source
    fact = (
        absorbed.op, source.filename if source is not None else None, source.lineno if source is not None else None,
        absorbed.module, absorbed.nan, absorbed.posinf, absorbed.neginf,
    )
    return dataclasses.replace(cause, facts=(*cause.facts, ("absorbed", fact)))


def _local_cause(report: Report) -> Cause:
    """The cause the event itself shows, before looking upstream."""
    if report.phase == Phase.OPTIMIZER:
        cause = optimizer_cause(report)
        if cause.label == "unclassified" and report.op is not None:
            # A hand-written update (loop code, no optimizer) is read by its op, as forward code is; so is an
            # optimizer's op where the op's own rule says why (a hand-written LARS's |w| / |g| of 0 / 0).
            by_op = _given_a_number(report) or forward_cause(report)
            if report.optimizer is None or by_op.label not in ("unclassified", "overflow", "half-precision-overflow"):
                return by_op
        return cause
    if report.op not in _LIFTS and (given := _given_a_number(report)) is not None:
        return given
    if report.tensor.role is TensorRole.PARAMETER and report.op is not None and report.inputs_finite and (
            (by_op := forward_cause(report)).label != "unclassified"):
        return by_op  # a forward's in-place write made it (a max-norm constraint's 0 / 0): the op says why
    if report.tensor.role is TensorRole.PARAMETER or (
        # Optimizer state a bounded step found non-finite (hot/checks/optimizer/step_reports.py): loaded so, or written.
        report.tensor.role is TensorRole.OPTIMIZER_STATE and report.phase == Phase.DATA
    ) or (
        # A buffer the module read non-finite (localize/producer.py), not one a check found after the step.
        report.tensor.role is TensorRole.BUFFER and any(note.kind == "already-bad" for note in report.note_facts)
    ):
        return event_cause("parameter-already-nonfinite", "parameter-nonfinite", report)
    if report.phase == Phase.DATA:
        if report.op is not None and report.inputs_finite:
            # A batch the loop computed, its producing op named (a standardisation by a zero std): the op says
            # why, as in forward code; a batch that came in non-finite, or an op no rule reads, is the data's.
            cause = forward_cause(report)
            if cause.label != "unclassified":
                return cause
        return event_cause("bad-input-data", "bad-batch", report)
    if report.phase == Phase.BACKWARD:
        return _backward(report)
    return forward_cause(report)


#: The ops a number the code wrote into a tensor is lifted by (``x[0, 0] = float("inf")``): a batch holding it is bad
#: input data, as one loaded so is; the report's op and line say where it was written (localize/ops/tracer.py).
_LIFTS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default")


def _given_a_number(report: Report) -> Cause | None:
    """The op read a Python number that was not finite: that number, not the op, made the value."""
    return event_cause("nonfinite-number", "nonfinite-number", report) if report.nonfinite_numbers else None


# -- backward ---------------------------------------------------------------------------


def _backward(report: Report) -> Cause:
    if report.op in _LIFTS and (given := _given_a_number(report)) is not None:
        return given  # the code wrote a number into the gradient (``p.grad[0, 0] = inf``): that number made it
    node = report.autograd_node
    pole = _POLES.get(node_function(node)) if node else None
    if pole is not None:
        # A backward through a function whose derivative has a pole: the function names the reading.
        return event_cause(_POLE_LABELS[pole], "derivative-pole", report, function=pole)
    if report.posinf + report.neginf and report.dtype in HALF:
        return half_overflow(report)
    if report.tensor.role is TensorRole.PARAMETER_GRADIENT and report.op is None:
        return event_cause("unclassified", "gradient-unwatched", report)
    if node is not None and report.op is not None and (_python_backward(node) or any(
            note.kind == "python-backward" for note in report.note_facts)):
        # A custom autograd.Function's or custom op's backward is the user's own code: its node says nothing,
        # the op it ran does (a division by the zero root of a registered derivative), read as forward code is. So
        # is a gradient hook's, which runs under the node of the tensor it hooks (``AddmmBackward0``).
        cause = forward_cause(report)
        if cause.label != "unclassified":
            return cause
    if node is None and report.op is not None and report.op_inputs and (
            cause := forward_cause(report)).label != "unclassified":
        return cause  # loop code between backward() and the step wrote the gradient (a rescale): its operands say why
    if node is not None and node_function(node) in _LINEAR and report.op is not None and report.op_inputs and (
            cause := forward_cause(report)).label == "division-by-zero":
        # A division by an exact 0 under a node whose backward formula divides by nothing (a matmul's): not that
        # formula's, but a Hessian-vector product's second backward differentiating a norm's ``grad / ||h||`` at
        # ``||h|| = 0`` while the engine runs ``MmBackward0``. Its operands say why, as where the deferred check's
        # replay names no node. (A node whose formula divides, hypot's or acosh's, keeps the node's reading:
        # test_review_s33_defer_user.py.)
        return cause
    return event_cause("unclassified", "backward-unmatched", report)


#: Forward functions whose backward formulas divide by nothing (products, sums, views): a division that runs under
#: their node is some other formula's, differentiated again (``create_graph=True``).
_LINEAR = frozenset({"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "matmul", "add", "sub", "neg", "sum", "t",
                     "transpose", "permute", "view", "reshape", "expand", "unsqueeze", "squeeze", "cat", "stack"})


def _python_backward(node: str) -> bool:
    """Whether an autograd node is a Python backward (``MyFunctionBackward``; torch's own end ``Backward0``...)."""
    return node.endswith("Backward")


#: The kind of each function whose derivative has a pole (render/words/causes/without_op_rule.py writes the derivative).
_POLE_LABELS = {
    "sqrt": "sqrt-domain", "acos": "sqrt-domain", "asin": "sqrt-domain", "log": "log-domain",
    "div": "division-by-zero", "pow": "pow-domain", "norm": "division-by-zero", "std": "division-by-zero",
    "exp": "exp-overflow", "eigh": "division-by-zero", "svd": "division-by-zero", "qr": "division-by-zero",
    "gamma": "log-domain",  # (the Gamma function's pole at 0, as lgamma's in forward: explain/forward.py)
    "xlogy": "log-domain",  # (x·log(y): finite at y = 0 where x = 0, but its derivative in y, x/y, is not)
}
#: The function of each autograd node that has a pole, by the node's forward function.
_POLES = {
    **{function: function for function in _POLE_LABELS},
    "rsqrt": "sqrt", "log2": "log", "log10": "log", "log1p": "log", "reciprocal": "div",
    "linalgvectornorm": "norm", "cdist": "norm", "var": "std", "stdmean": "std",
    "linalgeigh": "eigh", "symeig": "eigh", "linalgsvd": "svd", "linalgqr": "qr",
    "standardgamma": "gamma", "sampledirichlet": "gamma",  # Gamma(...).rsample(), Dirichlet(...).rsample()
}


# -- upstream causes ------------------------------------------------------------------------


def _extreme_batch(report: Report) -> tuple[TensorRef, float] | None:
    """The batch entering the model in the failing step, when it held ``|x| > EXTREME_INPUT``."""
    for layer in report.layers:
        absmax = layer.stats.absmax if layer.stats is not None else None
        if layer.phase == Phase.DATA and layer.tensor is not None and absmax is not None and absmax > EXTREME_INPUT:
            return layer.tensor, absmax
    return None


def _bad_batch(report: Report, downstream: Cause, tensor: TensorRef, absmax: float) -> Cause:
    return Cause("bad-input-data", "extreme-batch", (
        ("batch", to_pairs(tensor)), ("absmax", absmax), ("bound", EXTREME_INPUT), event(report),
        ("then", plain_cause(downstream)),
    ))


def _growth(history: tuple[StepSummary, ...]) -> tuple[str, float, int, float, float, int, int] | None:
    """The loss or gradient norm diverging before the event, or None.

    As plain values: what rose, to which value at which step, how many times
    its median, the median, the first step, over how many steps in a row.
    """
    for field, label in (("loss", "loss"), ("grad_norm", "gradient norm")):
        series = [(entry.step, abs(value)) for entry in history
                  if (value := getattr(entry, field)) is not None and math.isfinite(value)]
        if len(series) < 2:
            continue
        recent = [value for _step, value in series[-DIVERGENCE_RISES - 1:]]
        median = statistics.median(value for _step, value in series[:-1])
        (first, _), (last_step, last) = series[0], series[-1]
        factor = DIVERGENCE_FACTOR if len(series) > DIVERGENCE_RISES + 1 else EXPLOSION_FACTOR
        if all(b > a for a, b in itertools.pairwise(recent)) and median > 0 and last >= factor * median:
            return label, last, last_step, last / median, median, first, len(recent) - 1
    return None


def _learning_rate(report: Report, downstream: Cause, growth: tuple[str, float, int, float, float, int, int]) -> Cause:
    decay = report.optimizer_decay
    wild = (("decay", decay),) if decay is not None and decay[0] * decay[1] >= DECAY_BOUND else ()
    return Cause("learning-rate-too-high", "diverging", (("growth", growth), event(report),
                                                          ("then", plain_cause(downstream)), *wild))




def _outside_growth(report: Report, downstream: Cause,
                    growth: tuple[str, float, int, float, float, int, int]) -> Cause | None:
    """An overflow in the loop's own code, outside the model, of a value far larger than anything the model made.

    The loss rising is then that value rising (``loss + lam * violation`` with ``lam *= exp(violation)``), not the
    model diverging: a lower learning rate would not stop it. None where the evidence does not show it: the producer
    in a module, operands that the model's outputs reach, outputs that grew with the loss."""
    if report.module is not None or report.op is None or report.phase not in _LOOP_PHASES or (
            downstream.label not in ("overflow", "half-precision-overflow")):
        return None
    operands = [(ref, stats.absmax) for ref, stats in report.op_inputs if stats.absmax is not None]
    divisor = report.operand("other") if op_function(report.op) in ("div", "div_") else None
    if divisor is not None and divisor.absmax is not None and 0 < divisor.absmax < 1:
        # A quotient: what grew is 1 / the divisor (``logits / tau`` with ``tau *= 1e-6`` each step).
        operands = [(ref, 1 / stats.absmax if ref.name == "other" else stats.absmax) for ref, stats in
                    report.op_inputs if stats.absmax is not None and stats.absmax > 0]
    outputs = [(entry.step, entry.absmax) for entry in report.history
               if entry.absmax is not None and math.isfinite(entry.absmax) and entry.absmax > 0]
    if not operands or len(outputs) < 2:
        return None
    now = [layer.stats.absmax for layer in report.layers if layer.phase == Phase.FORWARD and layer.module is not None
           and layer.stats is not None and layer.stats.absmax is not None]
    largest = max(absmax for _step, absmax in outputs)
    if not all(math.isfinite(absmax) for absmax in now):
        return None
    largest = max([largest, *now])
    ref, operand = max(operands, key=lambda pair: pair[1])
    held = report.operand(ref.name) if ref.name is not None else None
    if held is None or held.numel != 1:
        # A single number the loop carries (a multiplier, a scale, a temperature), not a tensor of the step's values:
        # a head the loop applies itself (``feats @ w``, w trained) diverges with the learning rate, far above the
        # model's bounded outputs (a Tanh's, a LayerNorm's), and is no value of the loop's own.
        return None
    outputs_grew = outputs[-1][1] / outputs[0][1]
    quotient = divisor is not None and ref.name == "other"
    # A single number the loss is divided by scales the gradients of everything before it: the model's outputs grow
    # with it (logits / tau, tau *= 1e-6 each step), and that growth is the divisor's.
    scalar = quotient and divisor is not None and divisor.numel == 1
    if scalar:
        # ... and it shrank: the first loss is far below what this divisor makes of the first outputs (a constant
        # divisor of 1e-7 would have made the first loss about as large as it makes it now).
        first_loss = next((entry.loss for entry in report.history
                           if entry.loss is not None and math.isfinite(entry.loss)), None)
        scalar = first_loss is not None and abs(first_loss) * OUTSIDE_FACTOR <= operand * outputs[0][1]
    if (scalar and operand < OUTSIDE_FACTOR * outputs[0][1]) or (not scalar and (operand < OUTSIDE_FACTOR * largest or (
            math.log(growth[3]) < OUTSIDE_POWER * math.log(max(outputs_grew, 1.0))))):
        return None
    return Cause(downstream.label, "outside-growth", (
        event(report), ("growth", growth), ("operand", (to_pairs(ref), 1 / operand if quotient else operand)),
        ("divisor", quotient),
        ("outputs", (largest, outputs[0][0], outputs[0][1], outputs[-1][0], outputs[-1][1])),
        ("then", plain_cause(downstream)),
    ))


def _loss_scaled(report: Report) -> tuple[float, int, float, float, int | None, float | None] | None:
    """The failing step's loss, where the loss's own code (after the model) made it far larger than the model's
    outputs and batch can: ``(loss, step, outputs' absmax, batch's absmax, an earlier step, its loss)``. From the
    step's summary where the history holds it (a deferred check), else from the step's own layers."""
    summary = next((entry for entry in report.history if entry.step == report.step), None)
    if summary is not None:
        loss, largest, held = summary.loss, summary.absmax, summary.input_absmax or 0.0
    else:
        losses = [layer.stats.absmax for layer in report.layers if layer.tensor is not None and layer.stats is not None
                  and layer.tensor.role is TensorRole.LOSS and layer.stats.absmax is not None]
        outputs = [layer.stats.absmax for layer in report.layers if layer.phase == Phase.FORWARD
                   and layer.module is not None and layer.stats is not None and layer.stats.absmax is not None]
        batch = [layer.stats.absmax for layer in report.layers if layer.phase == Phase.DATA
                 and layer.stats is not None and layer.stats.absmax is not None]
        loss = losses[0] if len(losses) == 1 else None
        largest, held = max(outputs, default=None), max(batch, default=0.0)
    if loss is None or largest is None or not all(math.isfinite(value) for value in (loss, largest, held)):
        return None
    if abs(loss) < LOSS_FACTOR * max(1.0, largest, held) ** 2:
        return None
    earlier = [(entry.step, entry.loss) for entry in report.history
               if entry.loss is not None and entry.step < report.step and math.isfinite(entry.loss)]
    step, before = earlier[0] if earlier else (None, None)
    return abs(loss), report.step, largest, held, step, before


def _far_operand(report: Report) -> tuple[tuple[tuple[str, object], ...], float, float] | None:
    """An operand of a float32/64 overflow in the loop's code that is far larger than anything the model output in
    this step (a target of 3e20 in a square error): ``(operand, its absmax, the model's largest output)``."""
    outputs = [layer.stats.absmax for layer in report.layers if layer.phase == Phase.FORWARD
               and layer.module is not None and layer.stats is not None and layer.stats.absmax is not None]
    operands = [(ref, stats.absmax) for ref, stats in report.op_inputs if stats.absmax is not None]
    if not outputs or not operands or not math.isfinite(largest := max(outputs)):
        return None
    ref, operand = max(operands, key=lambda pair: pair[1])
    if ref.name != "target" or operand < OUTSIDE_FACTOR * max(largest, 1.0):
        # (Only a loss function's target: a square or an exp of the model's output is far larger than the output
        # too, and the model grew it.)
        return None
    return to_pairs(ref), operand, largest
