"""Formatting shared by every renderer: numbers, names, the summary sentence.

Stdlib only, so that the text report (used in exception messages and logs)
never pulls in pandas or matplotlib.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
from dataclasses import dataclass

from nan_magic.locations import name_location
from nan_magic.records import (
    LayerCall,
    Report,
    Sample,
    SourcePointer,
    StepSummary,
    TensorRef,
    TensorRole,
    TensorStats,
    module_label,
)
from nan_magic.render.words.causes.readings import cause_evidence, cause_hint, hint_opens_sentence
from nan_magic.render.words.counted import as_written, counted, ordinal
from nan_magic.render.words.message import UNCOUNTED, count_words, uncounted
from nan_magic.render.words.operands import op_expression, operand_label, operand_names, written_line
from nan_magic.render.words.optimizer_replay_words import replayed_inputs
from nan_magic.tensor_refs import op_function

__all__ = ["module_label"]  # re-exported: renderers spell modules through common

#: Largest finite value of each floating dtype, keyed by its short name.
FINITE_LIMITS: dict[str, float] = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}

#: Columns of the per-layer table, in order (the DataFrame and the text table).
COLUMNS = (
    "call", "phase", "module", "type", "tensor", "dtype", "shape",
    "min", "max", "mean", "std", "absmax", "nan", "+inf", "-inf", "status",
)


#: StepSummary fields a history can show, with labels that say what was measured.
#: Loss and the largest output always; the others where the watch recorded them.
HISTORY_FIELDS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("absmax", "max |output|"),
    ("grad_norm", "grad norm"),
    ("headroom", "headroom to overflow, every module"),
    ("input_absmax", "max |input batch|"),
    ("scale", "loss scale"),
)
_ALWAYS_SHOWN = frozenset({"loss", "absmax"})


def measured(entry: StepSummary) -> str:
    """What a step's ``max |output|`` covers: every module's output on a full-check step, else the model's."""
    return "every module" if entry.full else "model outputs"


def history_value(entry: StepSummary, field: str) -> float | None:
    """A step's value of ``field``; a headroom only where every module was checked.

    A step that read the model's outputs only cannot say how close the
    layers inside came to overflowing (a float16 ``q @ k`` at 65,504 under
    a model output of 48): claiming a headroom from it would reassure wrongly.
    """
    if field == "headroom" and not entry.full:
        return None
    value: float | None = getattr(entry, field)
    return value


def history_fields(history: tuple[StepSummary, ...]) -> list[tuple[str, str]]:
    """The :data:`HISTORY_FIELDS` worth a column: always shown, or recorded somewhere."""
    return [
        (field, label)
        for field, label in HISTORY_FIELDS
        if field in _ALWAYS_SHOWN or any(history_value(entry, field) is not None for entry in history)
    ]


def plotted_history_fields(history: tuple[StepSummary, ...]) -> list[tuple[str, str]]:
    """The :data:`HISTORY_FIELDS` with a finite value at two steps at least: a line, not a dot."""
    return [
        (field, label)
        for field, label in HISTORY_FIELDS
        if sum(
            1 for entry in history
            if (value := history_value(entry, field)) is not None and math.isfinite(value)
        ) >= 2
    ]


#: Early warnings listed in a report; older ones are counted, not listed.
MAX_WARNINGS = 10


def skipped_line(report: Report) -> str | None:
    """What the watch could not read, or None: ``"12 tensors it cannot read (nested: 12)"``."""
    if not report.skipped:
        return None
    total = sum(count for _reason, count in report.skipped)
    reasons = ", ".join(f"{reason}: {count}" for reason, count in report.skipped)
    return f"{counted(total, 'tensor')} it cannot read, left unchecked ({reasons})"


def warning_lines(report: Report) -> list[str]:
    """The report's last early warnings, one line each, plus what was left out.

    ``"step 12, encoder.3: activations within 4x of float16's max"``.
    """
    shown = report.warnings[-MAX_WARNINGS:]
    lines = [
        f"step {w.step}{f', {w.module}' if w.module else ''}: {w.message}" for w in shown
    ]
    if len(report.warnings) > len(shown):
        lines.insert(0, f"({len(report.warnings) - len(shown)} earlier warnings not listed)")
    return lines


def finite_limit(dtype: str | None) -> float | None:
    return FINITE_LIMITS.get(dtype) if dtype else None


def fmt_number(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.4g}"


def fmt_count(value: int | None) -> str:
    return "?" if value is None else str(value)


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(size) for size in shape) if shape else "scalar"


def fmt_fraction(part: int, whole: int) -> str:
    if whole <= 0:
        return "?%"
    return f"{100.0 * part / whole:.3g}%"


def counts_phrase(nan: int | None, posinf: int | None, neginf: int | None) -> str:
    """The counts that are not zero: ``"3 nan, 1 -inf"``; ``"? nan"`` where not counted; ``""`` if none."""
    return ", ".join(
        f"{fmt_count(count)} {kind}"
        for kind, count in (("nan", nan), ("+inf", posinf), ("-inf", neginf))
        if count != 0
    )


#: Short dtype names, as lovely-tensors and PyTorch's own reprs abbreviate them.
_SHORT_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def tensor_title(dtype: str | None, shape: tuple[int, ...]) -> str:
    """``"f16[32,64,64]"``: dtype and shape in one word."""
    name = dtype or ""
    return f"{_SHORT_DTYPES.get(name, name)}[{','.join(str(size) for size in shape)}]"


def stats_phrase(stats: TensorStats) -> str:
    """One line about a tensor, counts only where not zero: ``"f16[32,64,64] 31691 +inf, finite in [-236, 296]"``."""
    parts = [counts_phrase(stats.nan, stats.posinf, stats.neginf)]
    if stats.min is not None and stats.max is not None:
        parts.append(f"finite in [{fmt_number(stats.min)}, {fmt_number(stats.max)}]")
    return " ".join(filter(None, (tensor_title(stats.dtype, stats.shape), ", ".join(filter(None, parts)))))


def cause_sentence(report: Report) -> str:
    """The one sentence under the headline: the likely cause and its fix.

    Without a diagnosis, what was seen instead: the counts, the phase and
    whether the inputs were finite.
    """
    if report.cause is not None:
        hint = cause_hint(report.cause)
        if hint_opens_sentence(report.cause):  # one that starts with an op or a name keeps its case
            hint = hint[:1].upper() + hint[1:]
        return f"Likely cause: {report.cause.label}. {hint}"
    inputs = (
        "from finite inputs" if report.inputs_finite
        else "from inputs that already held non-finite values of another kind"
    )
    return (
        f"No cause recognised: {report.where} produced "
        f"{counts_phrase(report.nan, report.posinf, report.neginf)} "
        f"({fmt_fraction(report.nonfinite, report.numel)} of {counted(report.numel, 'element')}) "
        f"in its {report.tensor} {inputs}."
    )


def op_phrase(report: Report) -> str:
    """The op as the user wrote it, then its aten name: ``"q @ k.transpose(-2, -1)  (aten.bmm.default)"``."""
    assert report.op is not None  # (its one caller asks only for a report that names an op)
    expression = op_expression(report.op, written_line(report))
    return f"{expression}  ({report.op})" if expression else report.op


def headline(report: Report) -> str:
    """The report's title, short enough for one line: counts, phase and step, the producer, the op.

    ``"2 +inf in forward step 3: blocks.0.attn (SelfAttention), q @ k.transpose(-2, -1)"``. The
    error above a notebook's report already says the whole sentence (:attr:`Report.message`,
    with the op's line and file); the facts under this title hold the rest.
    """
    what = count_words(report)
    if report.benign:
        what += " (benign)"
    title = f"{what} in {report.phase} step {report.step}: {report.where}"
    if report.op:
        expression = op_expression(report.op, written_line(report))
        title += f", {expression or report.op}"
    return title


def labelled_inputs(report: Report) -> list[tuple[str, TensorStats]]:
    """The producer's inputs with the names the user wrote where the line says them.

    The op's operands come labelled by aten schema name (``self``,
    ``mat2``); :func:`~nan_magic.render.words.operands.operand_names` reads the
    user's expressions from the source line: ``x (self)``.
    """
    names = operand_names(report.op, written_line(report), _tensor_operands(report))
    return [(operand_label(name, names), stats) for name, stats in report.input_stats]


def _tensor_operands(report: Report) -> set[str]:
    """The op's operands that were tensors (by schema name; the others were Python numbers)."""
    return {ref.name for ref, _stats in report.input_stats if ref.role is TensorRole.OPERAND and ref.name}


def fact_rows(report: Report) -> list[tuple[str, str]]:
    """The facts under the summary, as ``(label, value)`` rows; text and HTML share them.

    Producer, op and its line, phase and step, the bad tensor and its three
    counts, the inputs (the user's names for the op's operands where the
    line says them), the cause's evidence, notes and early warnings. A
    label repeated for a second value is ``""``.
    """
    # A replay that did not reproduce the event leaves only where the boundary check saw it: a module whose
    # gradient was non-finite may have been handed it by the backward of another (a propagator, not the producer).
    label = "producer" if report.reproduced is not False or report.unlocated else "seen in"
    rows: list[tuple[str, str]] = [(label, "unknown" if report.unlocated else report.where)]
    if report.op:
        rows.append(("op", op_phrase(report)))
    if report.source is not None:
        rows.append(("source", str(report.source)))
        if report.source.line:
            rows.append(("line", report.source.line.strip()))
    rows.append(("phase", str(report.phase)))
    nth = ordinal(report.model_call) if report.model_call else None
    # (Not "its 2nd micro-batch": a siamese pair's two calls of one encoder feed one loss, nothing accumulated.)
    rows.append(("step", str(report.step) if nth is None else f"{report.step} (the step's {nth} model call)"))
    if report.rank is not None:
        rows.append(("rank", f"{report.rank} of {report.world_size}"))
    tensor = str(report.tensor)
    if report.output_stats is not None:
        tensor += f" {tensor_title(report.dtype, report.output_stats.shape)}"
    elif report.dtype:
        tensor += f" {report.dtype}"
    if not report.unlocated:  # (no check saw the value: no tensor, no counts to show)
        rows.append(("tensor", tensor))
        # Counts not read (a gradient the deferred check found freed): the kinds known, and why no number.
        if uncounted(report):
            rows.append(("non-finite", f"{count_words(report)} among {counted(report.numel, 'element')} ({UNCOUNTED})"))
        else:
            share = fmt_fraction(report.nonfinite, report.numel)
            rows.append(("non-finite", f"{count_words(report)} of {counted(report.numel, 'element')} ({share})"))
    if report.first_bad_index:  # None, or () for a 0-d tensor: nothing to point at
        rows.append(("first at", f"index {report.first_bad_index}"))
    if report.module_output is not None:
        name, stats = report.module_output
        # Where the op's value reached a boundary: a module's output, or another ("module out" misnamed the loss).
        label = "swapped in" if stand_in_name(report, name) else (
            "module out" if name.role is TensorRole.MODULE_OUTPUT else "reached")
        read = None not in (stats.nan, stats.posinf, stats.neginf)
        rows.append((label, f"{module_value(report, name)}: {stats_phrase(stats)}{'' if read else ', not counted'}"))
    inputs = "finite" if report.inputs_finite else "already non-finite (another kind)"
    if report.inputs_finite and report.absorbed is not None:
        # A backward op that read a forward infinity no boundary kept: its inputs are finite but for that one
        # (the row below shows it), as the rule for an absorbed infinity counts them.
        inputs = "finite, but for an infinity absorbed in forward (absorbed, below)"
    elif report.inputs_finite and any((stats.posinf or 0) + (stats.neginf or 0) for _ref, stats in report.op_inputs):
        # The op tracer starts an origin at an op whose inputs are finite or benign: an infinity among them is a
        # deliberate one (a mask's -inf), which this op turned into a new kind (0 * -inf in a KL divergence).
        inputs = "finite, but for a deliberate infinity (a mask's, below)"
    if report.nonfinite_numbers:
        inputs = "tensors finite; a Python number was not"
    if report.inputs_finite and report.outputs_unread:
        inputs = "finite where read; some module outputs could not be read (note)"
    # A data event with no op has no inputs that could be finite: the value itself came in (the evidence row
    # says so). One the loop's code computed ((raw - mean) / std) has its op, and the op its operands.
    if not report.unlocated and not (str(report.phase) == "data" and report.op is None):
        rows.append(("inputs", inputs + replayed_inputs(report)))
    names = operand_names(report.op, written_line(report), _tensor_operands(report))
    rows.extend(("", f"{operand_label(TensorRef(TensorRole.OPERAND, name), names)}: {value} (a Python number)")
                for name, value in report.nonfinite_numbers)
    rows.extend(("", f"{name}: {stats_phrase(stats)}") for name, stats in labelled_inputs(report))
    # The finite Python numbers after the tensors, as the op read them (``logits / t``: t = 0.0 from a config).
    rows.extend(("", f"{operand_label(TensorRef(TensorRole.OPERAND, name), names)}: {as_written(value)} "
                     "(a Python number)")
                for name, value in report.numbers if math.isfinite(value))
    if report.absorbed is not None:
        absorbed = report.absorbed
        at = f" at {name_location(absorbed.source.filename, absorbed.source.lineno)}" if absorbed.source else ""
        rows.append((
            "absorbed",
            f"{absorbed.op}{at} made {counts_phrase(absorbed.nan, absorbed.posinf, absorbed.neginf)} in forward "
            "that reached no boundary; this op read it",
        ))
    if report.benign:
        rows.append(("benign", "yes: recorded, not raised"))
    if report.cause is not None:
        rows.extend(
            ("evidence" if position == 0 else "", line)
            for position, line in enumerate(cause_evidence(report.cause))
        )
    rows.extend(("note", note) for note in report.notes)
    rows.extend(("warning", line) for line in warning_lines(report))
    skipped = skipped_line(report)
    if skipped:
        rows.append(("skipped", skipped))
    return rows


#: Causes about zeros: their histograms say how many elements are exactly 0.
ZERO_CAUSES = frozenset({"division-by-zero", "log-domain"})
_ZERO_OPS = frozenset({"div", "log", "log2", "log10", "reciprocal", "rsqrt", "pow"})


def about_zeros(report: Report) -> bool:
    """Whether the cause is about zeros (``log(0)``, ``0/0``)."""
    if report.cause is not None and report.cause.label in ZERO_CAUSES:
        return True
    return report.op is not None and op_function(report.op) in _ZERO_OPS


def labelled_samples(report: Report) -> tuple[Sample, ...]:
    """The report's samples in the order that tells the story, titled as the user knows them.

    The producing op's operands first (the user's expression for each where
    the line says it: ``x (self of aten.log.default)``), then the op's
    output, then the producer module's own inputs and output (``input[0] of
    encoder.1 (Linear)``); the other layers' samples after them, as they are.
    """
    names = operand_names(report.op, written_line(report))
    module_output = report.module_output[0] if report.module_output else None
    operands, op_output, module_inputs, module_outputs, others = [], [], [], [], []
    for sample in report.samples:
        ref = sample.tensor
        if not sample.producer or ref is None:
            others.append(_in_its_model(sample) if report.models_watched > 1 else sample)
        elif ref == module_output and report.module_output is not None:
            module_outputs.append(_titled(sample, module_value(report, ref)))
        elif report.op and ref == report.tensor:
            op_output.append(sample)
        elif ref.role is TensorRole.INPUT:  # the module's arguments (an op's operand named `input` is no argument)
            module_inputs.append(_titled(sample, f"{ref} of {report.where}"))
        elif report.op:
            operands.append(_titled(sample, operand_label(ref, names, report.op)))
        else:  # no op named: the module's own output
            module_outputs.append(_titled(sample, f"{ref} of {report.where}"))
    return tuple(operands + op_output + module_inputs + module_outputs + others)


def module_value(report: Report, ref: TensorRef) -> str:
    """``output of encoder.1 (Linear)``; a value the producer's own code passed on says whose it is
    (``input[0] of blocks.0.attn.proj``), as an op's output does."""
    stand_in = stand_in_name(report, ref)
    if stand_in:  # no module's output and no parameter: the loop's own tensor (localize/swapped.py)
        return f"the loop's tensor torch.func.functional_call passed as {stand_in}"
    owned = ref.role in (TensorRole.MODULE_OUTPUT, TensorRole.LOSS, TensorRole.PARAMETER, TensorRole.BUFFER)
    if owned or (ref.role is TensorRole.INPUT and ref.name is None):
        return f"{ref} of {report.where}"
    return str(ref)


def stand_in_name(report: Report, ref: TensorRef) -> str | None:
    """The parameter slot ``ref`` stood in for, where ``functional_call`` swapped the loop's tensor into it."""
    if ref.role is not TensorRole.INPUT or ref.name is not None:
        return None
    named = {note.fact("name") for note in report.note_facts if note.kind == "swapped-in"}
    return ref.path if ref.path in named else None


def _in_its_model(sample: Sample) -> Sample:
    """Another layer's sample of a step that called several models, titled with its model: a GAN's G and D were
    both ``(root) input[0]`` in the Histograms tab's list; now ``input[0] of D``, ``output of 0 in G``."""
    if sample.model is None or sample.module is None or sample.tensor is None:
        return sample
    where = f"{sample.module} in {sample.model}" if sample.module else sample.model
    return _titled(sample, f"{sample.tensor} of {where}")


def _titled(sample: Sample, title: str) -> Sample:
    return dataclasses.replace(sample, title=title)


def in_call_order(layers: tuple[LayerCall, ...]) -> tuple[LayerCall, ...]:
    """The rows in the order the calls *started*: a parent before its children.

    The engine records a call when it returns (children first); its
    ``index`` numbers the calls as they began, which is how people read a
    model's forward. A row without a call of its own (a module the step did
    not measure, index None) keeps its place after the row before it.
    """
    keyed, last = [], -1
    for layer in layers:
        last = layer.index if layer.index is not None else last
        keyed.append((last, layer))
    return tuple(layer for _key, layer in sorted(keyed, key=lambda pair: pair[0]))


def producer_position(layers: tuple[LayerCall, ...]) -> int | None:
    """Position (not call index) of the producer's row in ``layers``, if any."""
    for position, layer in enumerate(layers):
        if layer.status == "producer":
            return position
    return None


@dataclass(frozen=True)
class RowWindow:
    """Which rows of a long table are shown, and how many were cut."""

    start: int
    stop: int
    total: int

    @property
    def cut_before(self) -> int:
        return self.start

    @property
    def cut_after(self) -> int:
        return self.total - self.stop

    @property
    def cut(self) -> int:
        return self.cut_before + self.cut_after

    def cut_message(self) -> str:
        """``"1800 rows cut (1200 before, 600 after the rows shown)"``, or ``""``."""
        if not self.cut:
            return ""
        return (
            f"{counted(self.cut, 'row')} cut ({self.cut_before} before, "
            f"{self.cut_after} after the rows shown)"
        )


def row_window(total: int, focus: int | None, limit: int) -> RowWindow:
    """At most ``limit`` consecutive rows of ``total``, placed around ``focus``.

    Two thirds of the room go to rows before the focus: how the values got
    there matters more than the propagation after it.
    """
    if total <= limit:
        return RowWindow(0, total, total)
    if focus is None:
        return RowWindow(0, limit, total)
    start = max(0, min(focus - (2 * limit) // 3, total - limit))
    return RowWindow(start, start + limit, total)


def near_rows(layers: tuple[LayerCall, ...], radius: int) -> tuple[LayerCall, ...]:
    """The rows within ``radius`` positions of the producer (all rows if none)."""
    focus = producer_position(layers)
    if focus is None:
        return layers
    return layers[max(0, focus - radius): focus + radius + 1]


def source_excerpt(pointer: SourcePointer) -> list[tuple[int, str]]:
    """Lines ``lineno - 3 .. lineno + 3`` of the pointer's file.

    Uses :mod:`linecache`, which also knows IPython cells. Empty when the
    file cannot be read (a frozen module, a deleted temp file).
    """
    lines = linecache.getlines(pointer.filename)
    if not lines or not 1 <= pointer.lineno <= len(lines):
        return []
    first, last = max(1, pointer.lineno - 3), min(len(lines), pointer.lineno + 3)
    return [(number, lines[number - 1].rstrip("\n")) for number in range(first, last + 1)]
