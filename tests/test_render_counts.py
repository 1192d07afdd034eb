"""Every count phrase of the report in the right number: "1 earlier call not kept", "1 zero", "2 zeros".

Round 18: the phrases were f-strings with a plural noun after the count ("1 earlier calls not kept", "log got
1 zeros", "1 row(s) of 4 positions"). Each is written through render/words/counted.py now; one case per
phrase, each rendered with a count of 1 and of 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

import pytest
from faults import FORWARD_FAULTS
from watching import raised

from nan_magic.explain.evidence import event_cause
from nan_magic.fix_records import FixTrial
from nan_magic.plain import to_pairs
from nan_magic.records import (
    Cause,
    EarlyWarning,
    Note,
    Phase,
    Report,
    SourcePointer,
    TensorRef,
    TensorRole,
    TensorStats,
)
from nan_magic.render.common import RowWindow, fact_rows, skipped_line
from nan_magic.render.fixes import fix_description
from nan_magic.render.words.causes.readings import cause_evidence, cause_hint
from nan_magic.render.words.counted import counted, noun
from nan_magic.render.words.note_words import note_text
from nan_magic.render.words.warning_words import warning_text

_INPUT = TensorStats("float32", (2, 4), 8, min=-3.0, max=2.0, absmax=3.0, zeros=2, negatives=3)
_EVENT = Report(
    phase=Phase.FORWARD,
    module="fc",
    module_type="Linear",
    step=12,
    nan=4,
    posinf=2,
    neginf=1,
    numel=8,
    tensor=TensorRef.op_output("aten.div.Tensor"),
    model="Net",
    op="aten.div.Tensor",
    dtype="float32",
    source=SourcePointer("model.py", 42, "forward", "return a / b"),
    autograd_node="DivBackward0",
    output_stats=TensorStats("float32", (2, 4), 8, nan=4, posinf=2, neginf=1),
    input_stats=(
        (TensorRef.argument("input[0]"), _INPUT),
        *(
            (TensorRef(TensorRole.OPERAND, name), dataclasses.replace(_INPUT, neginf=9))
            for name in ("self", "other", "query", "key", "attn_mask")
        ),
    ),
)


def _cause_text(label: str, reading: str, event: Report = _EVENT, **numbers: object) -> str:
    cause = event_cause(label, reading, event, **numbers)
    return " | ".join((cause_hint(cause), *cause_evidence(cause)))


def _event(**counts: object) -> Report:
    return dataclasses.replace(_EVENT, **counts)


def _with_operand(name: str, **stats: object) -> Report:
    inputs = tuple(
        (ref, dataclasses.replace(s, **stats)) if ref.name == name else (ref, s) for ref, s in _EVENT.input_stats
    )
    return dataclasses.replace(_EVENT, input_stats=inputs)


@cache
def _real_report() -> Report:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    return raised(run, model)


def _layers_title_text(n: int) -> str:
    return dataclasses.replace(_real_report(), layers_dropped=n).to_text()


def _layers_title_widget(n: int) -> str:
    from nan_magic.render.widget import LayersView

    view = LayersView(_real_report().layers, n, 50)
    return str(view.widget.children[1].value)


#: phrase -> (text rendered with the count n, what it says for 1, what it says for 2)
PHRASES: dict[str, tuple[Callable[[int], str], str, str]] = {
    "layers-not-kept-text": (_layers_title_text, "(1 earlier call not kept)", "(2 earlier calls not kept)"),
    "layers-not-kept-widget": (_layers_title_widget, "1 earlier call not kept", "2 earlier calls not kept"),
    "elements-fact-row": (
        lambda n: dict(fact_rows(_event(numel=n, nan=1, posinf=0, neginf=0)))["non-finite"],
        "1 nan of 1 element (",
        "1 nan of 2 elements (",
    ),
    "elements-no-cause": (
        lambda n: _event(numel=n, nan=1, posinf=0, neginf=0, cause=None).to_text(),
        "of 1 element)",
        "of 2 elements)",
    ),
    "rows-cut": (lambda n: RowWindow(n, 10, 10).cut_message(), "1 row cut", "2 rows cut"),
    "tensors-unread": (
        lambda n: skipped_line(_event(skipped=(("nested", n),))) or "",
        "1 tensor it cannot read",
        "2 tensors it cannot read",
    ),
    "skip-batch-samples": (
        lambda n: fix_description(FixTrial("skip-batch", facts=(("left_out", 1), ("batch", n), ("dropped", (0,))))),
        "of 1 sample holding",
        "of 2 samples holding",
    ),
    "log-zeros-negatives": (
        lambda n: _cause_text("log-domain", "log-domain", _event(neginf=n, nan=n), base="log"),
        "got 1 zero and 1 negative in",
        "got 2 zeros and 2 negatives in",
    ),
    "log1p-values": (
        lambda n: _cause_text("log-domain", "log-domain", _event(neginf=n, nan=n), base="log1p"),
        "got 1 value at -1 and 1 value below -1",
        "got 2 values at -1 and 2 values below -1",
    ),
    "gamma-zeros-negatives": (
        lambda n: _cause_text("log-domain", "gamma-pole", base="lgamma", zeros=n, negatives=n),
        "got 1 zero and 1 negative",
        "got 2 zeros and 2 negatives",
    ),
    "atanh-values": (
        lambda n: _cause_text("log-domain", "atanh-edge", _event(posinf=n, neginf=0), base="atanh"),
        "got 1 value at ±1",
        "got 2 values at ±1",
    ),
    "sqrt-negatives": (
        lambda n: _cause_text("sqrt-domain", "sqrt-negative", _event(nan=n)),
        "sqrt got 1 negative in",
        "sqrt got 2 negatives in",
    ),
    "rsqrt-zeros": (
        lambda n: _cause_text("division-by-zero", "rsqrt-zero", _event(posinf=n, neginf=0)),
        "rsqrt got 1 zero in",
        "rsqrt got 2 zeros in",
    ),
    "pow-zeros": (
        lambda n: _cause_text("pow-domain", "pow-zero-base", zeros=n),
        "pow raised 1 zero of",
        "pow raised 2 zeros of",
    ),
    "exp-elements": (
        lambda n: _cause_text("exp-overflow", "exp-overflow", _event(posinf=n), threshold=88.72),
        "in 1 element:",
        "in 2 elements:",
    ),
    "ctc-samples": (
        lambda n: _cause_text("ctc-infeasible", "ctc-infeasible", _event(posinf=1, numel=n)),
        "for 1 of 1 sample:",
        "for 1 of 2 samples:",
    ),
    "masked-rows-positions": (
        lambda n: _cause_text("masked-softmax", "masked-softmax", rows=n, positions=n),
        "1 row of 1 position",
        "2 rows of 2 positions",
    ),
    "padding-samples-keys": (
        lambda n: _cause_text("masked-softmax", "masked-padding", rows=n, positions=n, masked=5),
        "attended over no key for 1 sample",
        "attended over no key for 2 samples",
    ),
    "padding-keys": (
        lambda n: _cause_text("masked-softmax", "masked-padding", rows=1, positions=n, masked=5),
        "every one of the 1 key of some row",
        "every one of the 2 keys of some row",
    ),
    "masked-sum-infinities": (
        lambda n: _cause_text("masked-softmax", "masked-sum", rows=5, masked=n),
        "held 1 infinity of one sign",
        "held 2 infinities of one sign",
    ),
    "masked-max-rows": (
        lambda n: _cause_text("masked-softmax", "masked-max", rows=n, masked=6),
        "reduced 1 row whose",
        "reduced 2 rows whose",
    ),
    "masked-pick-positions": (
        lambda n: _cause_text("masked-softmax", "masked-pick", picked=n, masked=6),
        "picked 1 position masked",
        "picked 2 positions masked",
    ),
    "masked-pick-infinities": (
        lambda n: _cause_text("masked-softmax", "masked-pick", picked=1, masked=n),
        "held 1 infinity of one sign",
        "held 2 infinities of one sign",
    ),
    "weight-norm-values": (
        lambda n: _cause_text("division-by-zero", "weight-norm-zero", zeros=n),
        "1 value of v is 0",
        "2 values of v are 0",
    ),
    "attention-mask-keys": (
        lambda n: _cause_text("masked-softmax", "masked-attention", rows=None, positions=n, bound=18.0, limit=3.4e38),
        "every one of the 1 key of some row",
        "every one of the 2 keys of some row",
    ),
    "attention-unmatched-keys": (
        lambda n: _cause_text(
            "unclassified", "attention-unmatched", bound=(36.0, 18.0), limit=3.4e38, masked=False, keys=n
        ),
        "fewer than the 1 key of one row",
        "fewer than the 2 keys of one row",
    ),
    "division-zeros": (
        lambda n: _cause_text("division-by-zero", "division-by-zero", _with_operand("other", zeros=n), divisor="other"),
        "held 1 zero of 8",
        "held 2 zeros of 8",
    ),
    "division-rows": (
        lambda n: _cause_text(
            "division-by-zero",
            "division-by-zero",
            dataclasses.replace(
                _with_operand("other", zeros=n),
                input_stats=tuple(
                    (ref, dataclasses.replace(s, shape=(8, 1)) if ref.name == "other" else s)
                    for ref, s in _with_operand("other", zeros=n).input_stats
                ),
            ),
            divisor="other",
        ),
        "0 for 1 row)",
        "0 for 2 rows)",
    ),
    "overflow-elements": (
        lambda n: _cause_text(
            "half-precision-overflow",
            "half-overflow",
            _event(posinf=n, neginf=0),
            limit=65504.0,
            signs=(),
            matmul=False,
            attention=False,
        ),
        "in 1 element;",
        "in 2 elements;",
    ),
    "buffer-elements": (
        lambda n: " | ".join(
            cause_evidence(
                Cause(
                    "overflow",
                    "buffer-overflow",
                    (
                        ("subject", to_pairs(TensorRef(TensorRole.BUFFER, "0.avg_sq"))),
                        ("module", "0"),
                        ("module_type", "RunningMean"),
                        ("statistic", "avg_sq"),
                        ("dtype", "float32"),
                        ("limit", 3.4e38),
                        ("bound", 3.4e38),
                        ("momentum", None),
                        ("nan", 0),
                        ("posinf", 1),
                        ("neginf", 0),
                        ("numel", n),
                        ("siblings", ()),
                        ("read_before", True),
                    ),
                )
            )
        ),
        "of 1 element |",
        "of 2 elements |",
    ),
    "scaler-skipped-steps": (
        lambda n: cause_hint(Cause("grad-scaler-collapse", "grad-scaler-collapse", (("skipped", n), ("scale", 0.5)))),
        "skipped 1 step in a row",
        "skipped 2 steps in a row",
    ),
    "scale-falling-steps": (
        lambda n: warning_text("scale-falling", (("falls", n), ("scale", 0.5))),
        "the last 1 step,",
        "the last 2 steps,",
    ),
    "constant-features": (
        lambda n: warning_text(
            "constant-feature",
            (
                ("tensor", to_pairs(TensorRef.argument("x"))),
                ("axis", "feature"),
                ("count", n),
                ("features", n),
                ("rows", n),
                ("constant", ((2, 3.0),)),
            ),
        ),
        "1 of 1 feature is constant over the batch of 1 row:",
        "2 of 2 features are constant over the batch of 2 rows:",
    ),
    "refetch-samples": (
        lambda n: note_text(Note.of("refetch-finite", count=n, dataset="ds")),
        "the batch's 1 sample from",
        "the batch's 2 samples from",
    ),
    "scaler-skips": (
        lambda n: note_text(Note.of("scaler-collapsing", skips=n)),
        "(1 skip in a row",
        "(2 skips in a row",
    ),
    "needs-ranks": (
        lambda n: note_text(Note.of("needs-ranks", ranks=n, reason=("ranks-sharded", ()))),
        "a process group of 1 rank:",
        "a process group of 2 ranks:",
    ),
}


def test_counted_says_one_in_the_singular() -> None:
    assert [counted(n, "zero") for n in (0, 1, 2)] == ["0 zeros", "1 zero", "2 zeros"]
    assert counted(1, "infinity", "infinities") == "1 infinity" and noun(3, "is", "are") == "are"


@pytest.mark.parametrize("phrase", list(PHRASES))
def test_a_count_phrase_agrees_with_its_count(phrase: str) -> None:
    render, one, two = PHRASES[phrase]
    assert one in render(1)
    assert two in render(2)


def test_an_early_warning_of_one_constant_feature_reads_in_the_singular_in_the_report() -> None:
    warning = EarlyWarning(
        3,
        "constant-feature",
        (
            ("tensor", to_pairs(TensorRef.argument("x"))),
            ("axis", "feature"),
            ("count", 1),
            ("features", 4),
            ("rows", 8),
            ("constant", ((2, 3.0),)),
        ),
    )
    text = dataclasses.replace(_real_report(), warnings=(warning,)).to_text()
    assert "x: 1 of 4 features is constant over the batch of 8 rows" in text
