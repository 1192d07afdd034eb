"""Facts are typed: a report names its tensors by role, name and path, and stores as plain data.

Each test stands for a place that once read a fact back out of a label the
package wrote ("parameter fc.weight".removeprefix, "input[" prefixes, the
"(before)" suffix of an in-place op's operand): the typed field carries it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from faults import FORWARD_FAULTS
from torch import nn
from watching import raised

import nan_magic
from nan_magic import TensorRef, TensorRole
from nan_magic.explain.evidence import event, event_cause, plain_cause
from nan_magic.plain import from_plain, to_pairs, to_plain
from nan_magic.records import Cause, EarlyWarning, EventRef, Note, Phase, Report, SourcePointer, TensorStats
from nan_magic.render.common import labelled_samples
from nan_magic.render.words.causes.readings import cause_evidence, cause_hint


@pytest.mark.parametrize(("ref", "label"), [
    (TensorRef.output(), "output"),
    (TensorRef.output("output['logits']"), "output['logits']"),
    (TensorRef.argument("kwargs['mask']"), "kwargs['mask']"),
    (TensorRef(TensorRole.INPUT, "blocks.0.proj", "input[0]"), "input[0] of blocks.0.proj"),
    (TensorRef.op_output("aten.div.Tensor"), "output of aten.div.Tensor"),
    (TensorRef(TensorRole.OPERAND, "self", before=True), "self (before)"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, None, "input[1]"), "grad of input[1]"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output"), "grad of model output"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, "enc", "output[0]"), "grad of enc output[0]"),
    (TensorRef.gradient("fc.weight"), "gradient of fc.weight"),
    (TensorRef.parameter("fc.weight"), "parameter fc.weight"),
    (TensorRef(TensorRole.BUFFER, "attn.causal"), "buffer attn.causal"),
    (TensorRef(TensorRole.OPTIMIZER_STATE, "fc.weight", "exp_avg_sq"), "state exp_avg_sq of fc.weight"),
    (TensorRef(TensorRole.LOSS), "loss"),
])
def test_every_role_has_its_label(ref: TensorRef, label: str) -> None:
    assert str(ref) == label
    assert TensorRef(**to_plain(ref)) == ref  # a role given as its value is the role


def test_a_role_that_is_none_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="'weight' is not a valid TensorRole"):
        TensorRef("weight", "fc.weight")  # type: ignore[arg-type]


class _Adam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _huge_learning_rate() -> Report:
    """The report of SGD at lr 1e38 making a parameter non-finite within three steps."""
    model = _Adam()
    opt = torch.optim.SGD(model.parameters(), lr=1e38)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            model(torch.full((2, 4), 1e3)).square().sum().backward()
            opt.step()

    return raised(run, model, opt)


def test_a_parameter_the_optimizer_made_non_finite_is_named_by_its_reference() -> None:
    # step_checks.py took the parameter's name from the label's last word, and its owner from the name.
    report = _huge_learning_rate()
    assert report.phase == "optimizer" and report.tensor.role is TensorRole.PARAMETER
    assert report.tensor.name in ("fc.weight", "fc.bias") and report.module == "fc"
    assert report.tensor.name in report.cause.hint  # the cause names the parameter, not "parameter fc.weight"


def test_the_producer_s_inputs_say_which_are_the_module_s_arguments_and_which_the_op_s_operands() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model, mode="full")
    roles = {ref.role for ref, _stats in report.input_stats}
    assert roles == {TensorRole.INPUT, TensorRole.OPERAND}
    # The op's operand's histogram is titled by the user's expression, the argument by the module.
    titles = [sample.label for sample in labelled_samples(report) if sample.producer]
    assert any(title.endswith("of 1 (LogLayer)") and title.startswith("input[0]") for title in titles), titles
    assert all(sample.tensor is not None for sample in report.samples if sample.producer)


def test_an_in_place_op_s_operand_before_it_is_marked_not_suffixed() -> None:
    model = nn.Sequential(nn.Linear(3, 3))

    class DivInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone().div_(torch.zeros_like(x))

    model.append(DivInPlace())
    report = raised(lambda: model(torch.ones(2, 3)), model, ops=True)
    before = [ref for ref, _stats in report.input_stats if ref.before]
    assert before and all(ref.role is TensorRole.OPERAND and ref.name == "self" for ref in before)


def test_a_report_is_plain_data_both_ways() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model)
    plain = to_plain(report)
    assert plain["tensor"] == {"role": "op output", "name": report.op, "path": "output", "before": False}
    back = from_plain(Report, plain)
    assert back.tensor == report.tensor and back.input_stats == report.input_stats
    assert back.layers == report.layers and back.message == report.message
    assert json.loads(report.to_json())["tensor"]["role"] == "op output"


def test_an_event_after_the_first_holds_a_reference_to_it_and_every_view_names_it(tmp_path) -> None:
    """``follows`` once held the first event's sentence; it is the first's reference, its words written by render/."""
    later = dataclasses.replace(_EVENT, phase=Phase.OPTIMIZER, step=13, tensor=TensorRef.parameter("fc.weight"),
                                op=None, source=None, follows=_EVENT.ref, models_watched=2)
    assert later.follows == EventRef(12, Phase.FORWARD, "fc", "Linear", "Net", "aten.div.Tensor", _EVENT.tensor)
    after = "after the first event (forward step 12: fc (Linear) in Net, op aten.div.Tensor)"
    assert later.message == f"non-finite parameter fc.weight in optimizer step 13: fc (Linear) in Net (4 nan, " \
                            f"2 +inf, 1 -inf of 8), {after}"
    assert _EVENT.message.startswith("first non-finite value in forward step 12") and "after" not in _EVENT.message
    # One model watched: the first event's model goes unnamed, as its own message does.
    assert dataclasses.replace(later, models_watched=1).message.endswith("(forward step 12: fc (Linear), op "
                                                                         "aten.div.Tensor)")
    assert after in later.to_text() and after in later.to_html()
    path = tmp_path / "later.pt"
    torch.save({"report": to_plain(later)}, path)  # as a scene stores it: plain data, no class named
    back = from_plain(Report, torch.load(path, weights_only=True)["report"])
    assert back.follows == later.follows and back.message == later.message
    assert json.loads(later.to_json())["follows"]["tensor"]["role"] == "op output"


# -- a cause is its kind and the plain values it rests on; render/words/causes/readings.py writes its sentences --

_STEP = (("optimizer", "Adam"), ("subject", to_pairs(TensorRef.parameter("fc.weight"))), ("dtype", "float16"),
         ("nan", 3), ("posinf", 1), ("neginf", 0), ("lr", 1e-3), ("eps", 1e-8), ("limit", 65504.0), ("step", 7))
_INPUT = TensorStats("float32", (2, 4), 8, min=-3.0, max=2.0, absmax=3.0, zeros=2, negatives=3)
#: One event every reading of a single event can be written from: a module's argument and the op's operands.
_EVENT = Report(
    phase=Phase.FORWARD, module="fc", module_type="Linear", step=12, nan=4, posinf=2, neginf=1, numel=8,
    tensor=TensorRef.op_output("aten.div.Tensor"), model="Net", op="aten.div.Tensor", dtype="float32",
    source=SourcePointer("model.py", 42, "forward", "return a / b"), autograd_node="DivBackward0",
    output_stats=TensorStats("float32", (2, 4), 8, nan=4, posinf=2, neginf=1),
    input_stats=(
        (TensorRef.argument("input[0]"), _INPUT),
        *((TensorRef(TensorRole.OPERAND, name), dataclasses.replace(_INPUT, neginf=9))
          for name in ("self", "other", "query", "key", "attn_mask")),
    ),
    warnings=(EarlyWarning(3, "extreme-input", (("tensor", to_pairs(TensorRef.argument("input[0]"))), ("absmax", 1e9),
                                                 ("limit", 1e6))),),
    note_facts=(Note.of("deliberate", how="scalar"),),
)
_SIGNS = (("arithmetic", "div"), ("pow",), ("near", to_pairs(TensorRef(TensorRole.OPERAND, "self")), 3e36, 1e-3),
          ("output-near", 3e35), ("square", to_pairs(TensorRef.argument("input[0]")), 2e19, 1.8e19),
          ("product", 1e20, 1e19), ("scores", 3.0, 3.0, 4, 18.0), ("mask", 4))


def _of_event(label: str, reading: str, **numbers: object) -> Cause:
    return event_cause(label, reading, _EVENT, **numbers)


_DOWNSTREAM = _of_event("overflow", "wide-overflow", limit=3.4e38, signs=(), matmul=False, attention=False)
#: One cause of each reading render/words/causes/readings.py writes, with the numbers the test reads back.
CAUSES = {
    "optimizer-lr": (Cause("learning-rate-too-high", "optimizer-lr",
                           (*_STEP[:6], ("lr", 1e38), *_STEP[7:], ("margin", 1000.0))), "lr = 1e38"),
    "optimizer-lr-set": (Cause("nonfinite-number", "optimizer-lr-set",
                               (*_STEP[:6], ("lr", float("inf")), *_STEP[7:], ("name", "lr"), ("line", 17))),
                         "comes from lr, set at line 17"),
    "optimizer-lr-scheduled": (Cause("nonfinite-number", "optimizer-lr-scheduled", (
        *_STEP[:6], ("lr", float("inf")), *_STEP[7:], ("scheduler", "LambdaLR"), ("last_epoch", 3),
        ("initial_lr", 0.1))), "written by the LambdaLR scheduler's step (last_epoch 3; initial_lr 0.1)"),
    "optimizer-lr-nonfinite": (Cause("nonfinite-number", "optimizer-lr-nonfinite",
                                     (*_STEP[:6], ("lr", float("inf")), *_STEP[7:])), "lr = inf is infinite"),
    "optimizer-state-overflow": (Cause("half-precision-overflow", "optimizer-state-overflow", _STEP), "max 65504"),
    "optimizer-state-overflow-wide": (Cause("overflow", "optimizer-state-overflow-wide", _STEP),
                                      "its parameter stayed finite"),
    "optimizer-update-overflow": (Cause("half-precision-overflow", "optimizer-update-overflow", _STEP), "65504"),
    "running-stats-overflow": (Cause("overflow", "running-stats-overflow", (
        ("subject", to_pairs(TensorRef(TensorRole.BUFFER, "bn.running_var"))), ("module", "bn"),
        ("module_type", "BatchNorm1d"), ("statistic", "running_var"), ("dtype", "float32"), ("limit", 3.4e38),
        ("bound", 1.84e19), ("momentum", 0.1), ("nan", 0), ("posinf", 4), ("neginf", 0), ("numel", 4),
        ("siblings", (("running_mean", 2e18),)), ("read_before", True),
    )), "inputs spread over more than 1.84e19"),
    "buffer-overflow": (Cause("overflow", "buffer-overflow", (
        ("subject", to_pairs(TensorRef(TensorRole.BUFFER, "0.avg_sq"))), ("module", "0"),
        ("module_type", "RunningMean"), ("statistic", "avg_sq"), ("dtype", "float32"), ("limit", 3.4e38),
        ("bound", 3.4e38), ("momentum", None), ("nan", 0), ("posinf", 4), ("neginf", 0), ("numel", 4),
        ("siblings", ()), ("read_before", True),
    )), "buffer avg_sq of 0 (RunningMean) held 4 +inf"),
    "optimizer-eps-zero": (Cause("optimizer-eps-underflow", "optimizer-eps-zero",
                                 (*_STEP[:7], ("eps", 0.0), *_STEP[8:])), "eps = 0"),
    "optimizer-eps-rounds": (Cause("optimizer-eps-underflow", "optimizer-eps-rounds",
                                   (*_STEP, ("smallest", 5.96e-08))), "smallest positive 5.96e-8"),
    "optimizer-unmatched": (Cause("unclassified", "optimizer-unmatched", _STEP), "3 nan, 1 +inf"),
    "loop-write-unmatched": (Cause("unclassified", "loop-write-unmatched", _STEP), "loop's own code (no optimizer)"),
    "grad-scaler-collapse": (Cause("grad-scaler-collapse", "grad-scaler-collapse", (("skipped", 5), ("scale", 0.5))),
                             "scale fell to 0.5"),
    "extreme-batch": (Cause("bad-input-data", "extreme-batch", (
        ("batch", to_pairs(TensorRef.argument("input[0]"))), ("absmax", 3.5e9), ("bound", 1e6), event(_EVENT),
        ("then", plain_cause(_DOWNSTREAM)),
    )), "|x| = 3.5e9"),
    "diverging": (Cause("learning-rate-too-high", "diverging", (
        ("growth", ("loss", 2.5e7, 12, 250000.0, 100.0, 0, 3)), event(_EVENT),
        ("then", ("half-precision-overflow", "optimizer-update-overflow", _STEP)),
        ("absorbed", ("aten.exp.default", "model.py", 40, "fc", 0, 4, 0)),
    )), "the loss rose to 2.5e7 at step 12, 250000x its median 100"),
    "benign": (_of_event("unclassified", "benign"), "4 nan, 2 +inf, 1 -inf"),
    "bad-batch": (_of_event("bad-input-data", "bad-batch"), "entering Net already held"),
    "handled-input": (_of_event("handled-input", "handled-input", steps=3, last_step=7),
                      "so did 2 later steps' batches, the last at step 7"),
    "parameter-nonfinite": (_of_event("parameter-already-nonfinite", "parameter-nonfinite"), "when fc (Linear)"),
    "nonfinite-number": (event_cause("nonfinite-number", "nonfinite-number", dataclasses.replace(
        _EVENT, op="aten.mul.Tensor", numbers=(("other", -math.inf),))),
        "was given a Python number that is not finite (`other` of aten.mul.Tensor in fc (Linear) = -inf)"),
    "derivative-pole": (_of_event("division-by-zero", "derivative-pole", function="div"), "-a/b²"),
    "gradient-unwatched": (_of_event("unclassified", "gradient-unwatched"), "about to step"),
    "backward-unmatched": (_of_event("unclassified", "backward-unmatched"), "in the backward of DivBackward0"),
    "loss-unknown-op": (_of_event("unclassified", "loss-unknown-op"), "a log of a zero probability"),
    "module-unknown-op": (_of_event("unclassified", "module-unknown-op", overflows=True, limit=3.4e38),
                          "an overflow of float32 (max 3.4e38)"),
    "log-domain": (_of_event("log-domain", "log-domain", base="log"), "got 1 zero and 4 negatives"),
    "gamma-pole": (_of_event("log-domain", "gamma-pole", base="lgamma", zeros=1, negatives=0),
                   "lgamma got 1 zero and 0 negatives"),
    "atanh-edge": (_of_event("log-domain", "atanh-edge", base="atanh"), "got 3 values at ±1 and 4 past them"),
    "logit-edge": (_of_event("log-domain", "logit-edge", base="logit"), "got 3 values at 0 or 1 and 4 outside [0, 1]"),
    "icdf-edge": (_of_event("log-domain", "icdf-edge", base="special_ndtri"), "got 3 values at 0 or 1 and 4 outside"),
    "logdet-singular": (_of_event("log-domain", "logdet-singular", base="linalg_slogdet"), "the matrix is singular"),
    "solve-singular": (_of_event("division-by-zero", "solve-singular", base="linalg_solve_triangular"),
                       "the matrix it solves by (or inverts) is singular"),
    "sqrt-negative": (_of_event("sqrt-domain", "sqrt-negative"), "sqrt got 4 negatives"),
    "outside-unit": (_of_event("sqrt-domain", "outside-unit", base="acos", low=-0.5, high=1.0000001192092896),
                     "acos got values outside [-1, 1] in `self` of aten.div.Tensor in fc (Linear) (from -0.5 to "
                     "1.00000012)"),
    "rsqrt-zero": (_of_event("division-by-zero", "rsqrt-zero"), "rsqrt got 3 zeros"),
    "pow-negative-base": (_of_event("pow-domain", "pow-negative-base"), "fractional exponent"),
    "pow-zero-base": (_of_event("pow-domain", "pow-zero-base", zeros=2), "pow raised 2 zeros"),
    "pow-unknown-base": (_of_event("unclassified", "pow-unknown-base"), "the base is not known"),
    "exp-overflow": (_of_event("exp-overflow", "exp-overflow", threshold=88.72), "x > 88.72"),
    "matrix-exp-overflow": (_of_event("exp-overflow", "matrix-exp-overflow", threshold=88.72, bound=102.0,
                                      columns=3, largest=34.0), "norm passes about 88.72; A's largest |entry| is 34 "
                            "over 3 columns, so its largest absolute row sum (a bound on its norm and eigenvalues) "
                            "can reach 102"),
    "soft-margin-overflow": (_of_event("exp-overflow", "soft-margin-overflow", threshold=88.72), "F.softplus(-y * x)"),
    "bessel-overflow": (_of_event("exp-overflow", "bessel-overflow", base="i0"), "log(i0e(x)) + |x|"),
    "division-by-zero": (_of_event("division-by-zero", "division-by-zero", divisor="other"), "held 2 zeros of 8"),
    "division-unknown-divisor": (_of_event("unclassified", "division-unknown-divisor", limit=65504.0),
                                 "above 65504"),
    "spread-zero": (_of_event("division-by-zero", "spread-zero", spread="std"), "divided by a std of 0"),
    "empty-quotient": (_of_event("empty-reduction", "empty-quotient"), "a count of nothing"),
    "empty-mean": (_of_event("empty-reduction", "empty-mean"), "an average over zero elements"),
    "corrected-one": (_of_event("division-by-zero", "corrected-one"), "correction=1"),
    "carried": (_of_event("unclassified", "carried"), "from inputs already non-finite"),
    "ctc-infeasible": (_of_event("ctc-infeasible", "ctc-infeasible"), "zero_infinity=True"),
    "masked-softmax": (_of_event("masked-softmax", "masked-softmax", rows=1, positions=4), "1 row of 4"),
    "masked-logsumexp": (_of_event("masked-softmax", "masked-logsumexp", rows=2, positions=6, masked=15),
                         "2 rows of 6 positions"),
    "masked-attention": (_of_event("masked-softmax", "masked-attention", rows=None, positions=4, bound=18.0,
                                   limit=3.4e38), "rows of aten.div.Tensor"),
    "masked-sum": (_of_event("masked-softmax", "masked-sum", rows=5, masked=10), "all 5 of its results"),
    "masked-max": (_of_event("masked-softmax", "masked-max", rows=1, masked=5), "reduced 1 row whose"),
    "masked-resample": (_of_event("masked-softmax", "masked-resample", masked=2), "interpolated a mask holding 2"),
    "logdet-negative": (_of_event("log-domain", "logdet-negative"), "determinant is negative"),
    "masked-pick": (_of_event("masked-softmax", "masked-pick", picked=1, masked=6), "picked 1 position masked"),
    "masked-padding": (_of_event("masked-softmax", "masked-padding", rows=1, positions=5, masked=5),
                       "attended over no key for 1 sample"),
    "weight-norm-zero": (_of_event("division-by-zero", "weight-norm-zero", zeros=4), "4 values of v are 0"),
    "norm-eps-zero": (_of_event("division-by-zero", "norm-eps-zero"), "rsqrt(var + eps) with eps=0"),
    "softmax-unmatched": (_of_event("unclassified", "softmax-unmatched"), "do not fill the NaN rows"),
    "attention-unmatched": (_of_event("unclassified", "attention-unmatched", bound=(36.0, 18.0), limit=3.4e38,
                                      masked=False, keys=4), "not an overflow of the scores (|q·kᵀ| <= 36)"),
    "half-overflow": (_of_event("half-precision-overflow", "half-overflow", limit=65504.0, signs=_SIGNS,
                                matmul=True, attention=False), "max 65504"),
    "wide-overflow": (_of_event("overflow", "wide-overflow", limit=3.4e38, signs=_SIGNS, matmul=False,
                                attention=True), "the scores q·kᵀ passed it"),
    "op-unmatched": (_of_event("unclassified", "op-unmatched"), "no rule of the checklist matches"),
    "outside-growth": (Cause("overflow", "outside-growth", (
        event(_EVENT), ("growth", ("loss", 6.36e26, 2, 1e13, 6.4e13, 0, 2)),
        ("operand", (to_pairs(TensorRef(TensorRole.OPERAND, "self")), 1.97e25)), ("divisor", False),
        ("outputs", (3.65e13, 0, 0.346, 2, 5.15)), ("then", plain_cause(_DOWNSTREAM)),
    )), "the loss rose to 6.36e26 at step 2 with it while the model's outputs went from 0.346 at step 0 to 5.15"),
}


def _stdlib_only(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_stdlib_only(item) for item in value)
    return value is None or type(value) in (str, int, float, bool)


def test_every_reading_has_a_round_trip_case() -> None:
    from nan_magic.render.words.causes.readings import _READINGS

    assert set(CAUSES) == set(_READINGS)


@pytest.mark.parametrize("reading", sorted(CAUSES))
def test_a_cause_round_trips_through_a_scene_s_plain_data_with_its_numbers(reading: str, tmp_path) -> None:
    cause, shown = CAUSES[reading]
    assert cause.reading == reading and _stdlib_only(cause.facts)
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = dataclasses.replace(raised(run, model), cause=cause)
    path = tmp_path / "report.pt"
    torch.save({"report": to_plain(report)}, path)  # as scene/dump.py stores it
    back = from_plain(Report, torch.load(path, weights_only=True)["report"]).cause
    assert back == cause and back.facts == cause.facts
    assert shown in cause_hint(back) and cause_hint(back) == cause_hint(cause)
    assert cause_evidence(back) == cause_evidence(cause) and cause_evidence(back)
    assert shown in report.to_text()  # the sentence a user reads


def test_a_version_5_scene_s_extreme_batch_named_its_batch_by_words_and_reads_back_typed(tmp_path) -> None:
    cause, shown = CAUSES["extreme-batch"]
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    # Before version 6 the batch was its words: always an argument of the model call.
    data["report"]["cause"] = to_plain(Cause(cause.label, cause.reading, tuple(
        (key, "input[0]" if key == "batch" else value) for key, value in cause.facts)))
    data["version"] = 5
    torch.save(data, tmp_path / "version_5_scene.pt")
    back = nan_magic.load_scene(tmp_path / "version_5_scene.pt").report.cause
    assert back == cause and back.fact("batch") == to_pairs(TensorRef.argument("input[0]"))
    assert cause_hint(back).startswith(f"input[0] entering Net reached {shown}")


def test_a_diagnosed_cause_holds_only_plain_values() -> None:
    cause = _huge_learning_rate().cause
    assert cause is not None and cause.reading == "optimizer-lr" and _stdlib_only(cause.facts)
    assert cause.fact("lr") == 1e38 and cause.fact("dtype") == "float32"
    assert "lr = 1e38" in cause.hint and "lr 1e38 >= float32 max 3.4e38 / 1000" in cause.evidence


# -- nothing reads a stored name by its dots: a module's place in its model is data (LayerCall.path) --

#: The dotted names the package may take apart, each with why it is not a name the package stored.
_DOTS_READ = {
    ("tensor_refs.py", "op_function"): "torch's own OpOverload name (namespace.name.overload), read in one place",
    ("distributed/ranks.py", "user_path"): "torch's qualified name from named_modules, as it walks the live model",
    ("localize/ops/masks.py", "buffers"): "torch's qualified name from named_buffers, of the live module",
    ("scene/older_scenes.py", "_path"): "the scene loader's compat path: a version 2-4 scene stored no layer's path",
    ("localize/ops/sources.py", "hook_definer"): "Python's co_qualname of a hook's code (its class), not a module name",
    ("localize/ops/sources.py", "defined_below"): "Python's co_qualname of a forward line's code (its class), as above",
    ("localize/op_origins.py", "birth_order"): "torch's qualified names of the live model: a parameter's (from "
                                               "named_parameters) under its module's path (from named_modules)",
}
_BY_DOTS = {"count", "split", "rsplit", "partition", "rpartition", "find", "rfind", "index", "rindex"}


def _reads_dots(node: ast.AST) -> bool:
    """``name.split(".")`` and its kin, or ``name.startswith(parent + ".")``: a name taken apart by its dots."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or not node.args:
        return False
    first = node.args[0]
    if node.func.attr in _BY_DOTS:
        return isinstance(first, ast.Constant) and first.value == "."
    if node.func.attr in ("startswith", "endswith"):  # a name built from another one, then a dot
        ends = first.right if isinstance(first, ast.BinOp) else first.values[-1] if isinstance(first, ast.JoinedStr) \
            else None
        return isinstance(ends, ast.Constant) and isinstance(ends.value, str) and ends.value.endswith(".")
    return False


def test_no_module_reads_a_name_it_stored_by_its_dots() -> None:
    package = Path(nan_magic.__file__).parent
    found: dict[tuple[str, str], int] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if _reads_dots(node):
                        found[(path.relative_to(package).as_posix(), function.name)] = node.lineno
    assert {place: line for place, line in found.items() if place not in _DOTS_READ} == {}
    assert set(found) == set(_DOTS_READ)  # each allowed place still reads one (else its entry goes)
