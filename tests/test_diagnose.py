"""Diagnosis: one fixture per cause of the checklist through the real watch, and the rules on hand-built Reports.

The fixtures run under ``mode="full"``, whose reports also carry each module's inputs as evidence; the
rules are the same for the tiered default (whose replay reads the producing op's operands), checked
where the two differ.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from faults import FORWARD_FAULTS, Fault, distance, fp16_adam_step, marked_line
from torch import nn
from torch.nn import functional as F
from watching import raised, sgd_regression

import nan_magic
from nan_magic.explain import diagnose as diagnose_module
from nan_magic.explain.diagnose import DIVERGENCE_RISES, LABELS, diagnose
from nan_magic.localize.outside.recorder import LOSS_BUDGET
from nan_magic.note_records import Note
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Phase, Report, SourcePointer, StepSummary, TensorRef, TensorRole, TensorStats


def assert_cause(report: Report, label: str, *named: str) -> Cause:
    """The report's cause has ``label`` and its hint names each of ``named``."""
    cause = report.cause
    assert cause is not None
    assert cause.label == label, f"{cause.label}: {cause.hint}"
    for text in named:
        assert text in cause.hint, f"{text!r} not in {cause.hint!r}"
    assert cause.evidence
    return cause


# -- the fault library ------------------------------------------------------------------

EXPECTED = {  # fault -> (label with replay, label in ops mode)
    # ops mode: addmm only carries the weight's inf on (a propagator); the module-level rule names the weight
    "inf_weight": ("parameter-already-nonfinite", "parameter-already-nonfinite"),
    "log_negative": ("log-domain", "log-domain"),
    "zero_variance": ("division-by-zero", "division-by-zero"),
    "fp16_overflow": ("half-precision-overflow", "half-precision-overflow"),
    "nan_in_batch": ("bad-input-data", "bad-input-data"),
    "tuple_output": ("sqrt-domain", "sqrt-domain"),
    "dict_output": ("division-by-zero", "division-by-zero"),
    "called_twice": ("half-precision-overflow", "half-precision-overflow"),
    "shared_submodule": ("log-domain", "log-domain"),
}


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
@pytest.mark.parametrize("fault", FORWARD_FAULTS, ids=lambda f: f.name)
def test_every_fault_gets_its_cause_and_a_hint_naming_the_producer(fault: Fault, ops: bool) -> None:
    model, run = fault.build()
    report = raised(run, model, ops=ops, mode="full")
    named = str(fault.tensor) if fault.phase == "data" else f"{fault.module} ({fault.module_type})"
    assert_cause(report, EXPECTED[fault.name][ops], named)


def _fault(name: str) -> Fault:
    return next(fault for fault in FORWARD_FAULTS if fault.name == name)


# -- one fixture per cause ----------------------------------------------------------------


def test_half_precision_matmul_overflow_names_the_inputs_and_the_limit() -> None:
    model, run = _fault("fp16_overflow").build()
    cause = assert_cause(raised(run, model, ops=True), "half-precision-overflow", "1 (HalfMatmul)", "65504")
    assert "20 (`x`), 60 (`self.weight`)" in cause.hint  # the names on the line, not the schema's self and mat2
    assert "float32" in cause.hint  # the fix


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "defer"])
def test_a_bessel_overflow_names_the_operand_as_the_user_wrote_it(defer: bool) -> None:
    """A von Mises normaliser ``log(i0(kappa))``: the hint says what reached |x| = 220 by the line's name."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(6, 4)
    x[1] = 300.0 * model.weight.detach()[1].sign()

    def run() -> None:
        out = model(x)
        kappa = F.softplus(out[:, 1])
        torch.log(torch.special.i0(kappa)).mean().backward()

    cause = raised(run, model, defer=defer).cause
    assert cause is not None and cause.label == "exp-overflow"
    assert "`kappa` reached |x| = 220" in cause.hint and "`self`" not in cause.hint


class ExpScores(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def test_exp_overflow() -> None:
    model = nn.Sequential(nn.Linear(4, 4), ExpScores())
    with torch.no_grad():
        model[0].bias.fill_(100.0)
    report = raised(lambda: model(torch.randn(3, 4)), model, mode="full")
    assert report.op == "aten.exp.default"
    assert_cause(report, "exp-overflow", "1 (ExpScores)", "88.72")


def test_zero_variance_names_the_rows_of_the_divisor() -> None:
    model, run = _fault("zero_variance").build()
    assert_cause(raised(run, model, ops=True), "division-by-zero", "1 (HandNorm)", "0 for 4 rows", "add eps")
    model, run = _fault("zero_variance").build()
    # the replay gives the default mode the division's own operands too
    report = raised(run, model, mode="full")
    assert_cause(report, "division-by-zero", "1 (HandNorm)", "0 for 4 rows", "add eps")
    assert any("input[0] of 1 (HandNorm) is constant" in line for line in report.cause.evidence)


class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_std_over_a_batch_of_one_is_a_division_by_n_minus_one() -> None:
    model = nn.Sequential(nn.Linear(4, 4), BatchStandardize())
    report = raised(lambda: model(torch.randn(1, 4)), model, mode="full")
    assert_cause(report, "division-by-zero", "1 (BatchStandardize)", "N - 1 = 0", "(1, 4)")


class LogLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_log_of_zeros_counts_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), LogLayer())
    x = torch.randn(4, 8)
    zeros = int((model[1](model[0](x)) == 0).sum())
    report = raised(lambda: model(x), model, mode="full")
    assert zeros > 0 and report.neginf == zeros
    assert_cause(report, "log-domain", f"log got {zeros} zeros and 0 negatives in input[0] of 2 (LogLayer)")


def test_log_of_negatives() -> None:
    model, run = _fault("log_negative").build()
    assert_cause(raised(run, model, mode="full"), "log-domain", "17 negatives in input[0] of 1 (LogLayer)",
                 "log_softmax")
    # The tiered default's replay names the module's own input too, as mode="full" does (since round 21: the op's
    # finding holds the producer call's arguments): the name the user knows (causes/phrases.input_named).
    model, run = _fault("log_negative").build()
    assert_cause(raised(run, model), "log-domain", "17 negatives in input[0] of 1 (LogLayer)", "log_softmax")


def test_sqrt_of_negatives() -> None:
    model, run = _fault("tuple_output").build()
    assert_cause(raised(run, model, ops=True), "sqrt-domain", "sqrt got 32 negatives in `x - 10` (`self` of",
                 "1 (TwoHeads)")


def test_sqrt_at_zero_in_backward_names_the_forward_line() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    anchor = torch.randn(3, 8)
    report = raised(lambda: distance(embed(anchor), embed(anchor.clone())).sum().backward(), embed, ops=True)
    assert report.phase == "backward" and report.autograd_node == "SqrtBackward0"
    assert_cause(report, "sqrt-domain", f"faults.py:{marked_line('distance')}", "torch.sqrt(", "add eps")


class SignedRoot(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x**0.5


def test_pow_of_a_negative_base_with_a_fractional_exponent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SignedRoot())
    report = raised(lambda: model(torch.randn(3, 4)), model, mode="full")
    assert report.op == "aten.pow.Tensor_Scalar"
    assert_cause(report, "pow-domain", "1 (SignedRoot)", "negative base")


class MaskedAttention(nn.Module):
    """Masks and normalises in one module: the replay must see through the deliberate -inf."""

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(mask, float("-inf")).softmax(-1)


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_a_fully_masked_softmax_row(ops: bool) -> None:
    model = MaskedAttention()
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1] = True  # every key of row 1 masked
    report = raised(lambda: model(torch.randn(3, 5), mask), model, ops=ops, mode="full")
    assert_cause(report, "masked-softmax", "1 row of 5 positions", "MaskedAttention (root)")


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"ops": True}], ids=["default", "defer", "ops"])
def test_a_loss_over_a_fully_masked_logsumexp_row(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[0, 3:] = True
    mask[2] = True  # every class of row 2 masked: its logsumexp is -inf, the loss +inf

    def step() -> None:
        scores = model(torch.randn(5, 4)).masked_fill(mask, float("-inf"))
        loss = -scores.logsumexp(-1).mean()  # the deferred check claims the loss it still holds
        loss.backward()
        opt.step()

    report = raised(step, model, opt, **options)
    assert report.op == "aten.logsumexp.default"
    cause = assert_cause(report, "masked-softmax", "1 row of 6 positions", "logsumexp over nothing is -inf")
    assert any("held 9 -inf" in line for line in cause.evidence)
    assert "ops=True" not in report.to_text()


def test_learning_rate_too_high_needs_the_loss_growing_before_the_event() -> None:
    w = sgd_regression(lr=1.0, on_detect="log")
    report = w.report
    assert report is not None and report.tensor.role is TensorRole.LOSS and report.step > 20
    cause = assert_cause(report, "learning-rate-too-high", "the loss rose", "became 1 +inf",
                         "lower the learning rate")
    assert any(f"rising on each of the last {DIVERGENCE_RISES} steps" in line for line in cause.evidence)
    assert sgd_regression(lr=0.1, on_detect="log").report is None  # the same problem, converging


def test_adam_epsilon_underflow_in_float16() -> None:
    model, opt, step = fp16_adam_step()
    cause = assert_cause(raised(step, model, opt), "optimizer-eps-underflow", "Adam", "0.weight", "1e-8", "float32")
    assert "dtype float16" in cause.evidence


def test_nan_in_the_batch_is_bad_input_data() -> None:
    model, run = _fault("nan_in_batch").build()
    assert_cause(raised(run, model, mode="full"), "bad-input-data", "input[0]", "1 nan", "(2, 3)")


class ToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


def test_an_overflow_in_a_step_whose_batch_is_extreme_blames_the_batch() -> None:
    model = nn.Sequential(ToHalf(), nn.Linear(4, 4).half())
    x = torch.randn(2, 4) * 1e7  # far beyond float16's 65504
    cause = assert_cause(raised(lambda: model(x), model, mode="full"), "bad-input-data", "input[0]", "0 (ToHalf)")
    assert any("half-precision-overflow" in line for line in cause.evidence)  # what it then did


def test_cross_entropy_with_every_target_ignored_is_an_empty_reduction() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    x, labels = torch.randn(4, 8), torch.full((4,), -100)
    report = raised(lambda: F.cross_entropy(model(x), labels).backward(), model, ops=True)
    assert_cause(report, "empty-reduction", "aten.nll_loss_forward.default", "ignore_index")
    # the tiered default traces the loss code: the same op, the same reading
    report = raised(lambda: F.cross_entropy(model(x), labels).backward(), model)
    assert_cause(report, "empty-reduction", "aten.nll_loss_forward.default", "ignore_index")
    # the per-module watch records the loss code as the default does: the same reading
    report = raised(lambda: F.cross_entropy(model(x), labels).backward(), model, mode="full")
    assert_cause(report, "empty-reduction", "aten.nll_loss_forward.default", "ignore_index")

    def over_budget() -> None:
        # The loss code runs more ops than a step records (LOSS_BUDGET): its op is not named.
        out = model(x)
        offset = sum(torch.zeros(()) for _ in range(LOSS_BUDGET))
        (F.cross_entropy(out, labels) + offset).backward()

    # without the op two readings fit: say so, do not guess
    cause = assert_cause(raised(over_budget, model), "unclassified", "empty selection", "ops=True")
    assert "domain error" in cause.hint


def test_a_parameter_already_nonfinite() -> None:
    model, run = _fault("inf_weight").build()
    assert_cause(raised(run, model, mode="full"), "parameter-already-nonfinite", "2.weight", "2 (Linear)", "1 +inf")


# -- the facts the diagnosis reads are report fields, not sentences in the notes ------------


class Siamese(nn.Module):
    """Embeds two inputs and returns their distance: equal inputs put sqrt at 0 inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return distance(self.embed(a), self.embed(b))


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["tiered", "ops"])
def test_a_backward_sqrt_at_zero_reports_its_autograd_node(options: dict[str, bool]) -> None:
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    anchor = torch.randn(3, 8)

    def step() -> None:
        opt.zero_grad()
        model(anchor, anchor.clone()).sum().backward()
        opt.step()

    report = raised(step, model, opt, **options)
    assert (report.phase, report.autograd_node) == ("backward", "SqrtBackward0")
    cause = assert_cause(report, "sqrt-domain", f"faults.py:{marked_line('distance')}", "add eps")
    assert "autograd node SqrtBackward0" in cause.evidence
    if not options:  # the tiered watch's replay named it, and kept the fact
        assert report.reproduced


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["tiered", "ops"])
def test_an_adam_step_reports_its_optimizer(options: dict[str, bool]) -> None:
    model, opt, step = fp16_adam_step()
    report = raised(step, model, opt, **options)
    assert (report.phase, report.optimizer) == ("optimizer", "Adam")
    assert_cause(report, "optimizer-eps-underflow", "the Adam step", "0.weight")


def test_a_float16_adam_step_that_overflows_with_an_eps_float16_holds_is_not_blamed_on_eps() -> None:
    # eps=1e-3 is a float16 number: the step's inf comes from the update of a bias near float16's max, not
    # from 0/0. lr=50 is far from that max (an lr within 1000x of it is learning-rate-too-high itself).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].bias.fill_(-65472.0)  # the forward stays finite; Adam's first update moves it by -lr: -65522
    opt = torch.optim.Adam(model.parameters(), lr=50.0, eps=1e-3)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 4).half() * 1e-3).float().sum().backward()
        opt.step()

    report = raised(step, model, opt)
    assert (report.phase, report.optimizer, report.optimizer_eps) == ("optimizer", "Adam", 1e-3)
    assert report.cause is not None and report.cause.label == "half-precision-overflow"


def test_the_eps_a_float16_step_lost_is_the_one_the_hint_names() -> None:
    model, opt, step = fp16_adam_step()
    opt.param_groups[0]["eps"] = 1e-10
    report = raised(step, model, opt)
    assert report.optimizer_eps == 1e-10
    assert_cause(report, "optimizer-eps-underflow", "eps = 1e-10 rounds to 0")


def test_the_facts_survive_json_pickle_and_the_scene(tmp_path) -> None:
    model, opt, step = fp16_adam_step()
    report = raised(step, model, opt, dump=str(tmp_path))
    facts = json.loads(report.to_json())
    assert (facts["optimizer"], facts["autograd_node"]) == ("Adam", None)
    assert pickle.loads(pickle.dumps(report)).optimizer == "Adam"
    assert report.scene is not None and nan_magic.load_scene(report.scene).report.optimizer == "Adam"
    assert report.cause is not None and nan_magic.load_scene(report.scene).report.cause == report.cause
    # The JSON holds the cause's kind, its plain facts and the sentences a reader without nan_magic needs.
    assert facts["cause"]["label"] == report.cause.label and facts["cause"]["hint"] == report.cause.hint
    assert facts["cause"]["evidence"] == list(report.cause.evidence) and facts["cause"]["facts"]
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    anchor = torch.randn(3, 8)
    report = raised(lambda: distance(embed(anchor), embed(anchor.clone())).sum().backward(), embed, ops=True)
    assert json.loads(report.to_json())["autograd_node"] == "SqrtBackward0"


def test_the_diagnosis_never_reads_a_fact_from_the_notes() -> None:
    # A note holds what it says for the user: without the field there is no node rule to apply.
    cause = diagnose(report(phase=Phase.BACKWARD, op="aten.div.Tensor", tensor=TensorRef.op_output("aten.div.Tensor"),
                            posinf=3,
                            note_facts=(Note.of("autograd-backward", op="aten.div.Tensor", node="SqrtBackward0"),)))
    assert cause.label == "unclassified"
    cause = diagnose(report(phase=Phase.OPTIMIZER, tensor=TensorRef.parameter("fc.weight"), dtype="float16", nan=5,
                            note_facts=(Note.of("optimizer-made-it", optimizer="Adam",
                                                       tensor=to_pairs(TensorRef.parameter("fc.weight"))),)))
    assert cause.label == "unclassified" and "Adam" not in cause.hint


# -- two readings -------------------------------------------------------------------------


class Ratio(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x / y


def test_a_half_precision_division_without_its_divisor_is_unclassified_and_with_it_is_not() -> None:
    model = Ratio()
    x = torch.full((2, 3), 300.0, dtype=torch.float16)
    y = torch.tensor([[1e-3, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float16)  # 3e5 overflows, and a 0
    cause = assert_cause(raised(lambda: model(x, y), model, replay=False, mode="full"), "unclassified", "Ratio (root)",
                         "an overflow of float16 (max 65504)", "a division by zero")
    assert "ops=True" in cause.hint
    # the op's operands settle it: from the replay in the default mode, or at the op in ops mode
    # (the divisor named as the line writes it, `y`, since session 33; before, by its schema name `other`)
    assert_cause(raised(lambda: model(x, y), model, mode="full"), "division-by-zero", "(`y` (2, 3) held 1 zero of 6)")
    assert_cause(raised(lambda: model(x, y), model, ops=True), "division-by-zero", "(`y` (2, 3) held 1 zero of 6)")


def test_an_unknown_op_is_read_from_its_inputs_only_when_one_reading_fits() -> None:
    model, run = _fault("fp16_overflow").build()  # inputs all 20.0: only an overflow fits
    assert_cause(raised(run, model, replay=False, mode="full"), "half-precision-overflow", "1 (HalfMatmul)")
    model, _ = _fault("fp16_overflow").build()
    x = torch.full((2, 64), 20.0, dtype=torch.float16)
    x[:, 0] = 0.0  # zeros in the input: a division by zero fits as well
    cause = assert_cause(raised(lambda: model(x), model, replay=False, mode="full"), "unclassified", "1 (HalfMatmul)",
                         "an overflow of float16", "a division by zero")
    assert "ops=True" in cause.hint


def test_a_half_precision_overflow_after_a_diverging_loss_is_the_learning_rate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 8) * 3
    y = x.sum(1, keepdim=True)

    def train() -> None:
        for _ in range(50):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(train, model, opt, mode="full")
    assert report.dtype == "float16" and report.step > DIVERGENCE_RISES
    cause = assert_cause(report, "learning-rate-too-high", "the loss rose", "2 (Linear)")
    assert any(line.startswith("then: half-precision-overflow") for line in cause.evidence)


# -- in the report views ---------------------------------------------------------------------


def test_cause_and_hint_are_in_the_text_and_html_summaries() -> None:
    model, run = _fault("log_negative").build()
    report = raised(run, model, mode="full")
    text, html = report.to_text(), report.to_html()
    assert "log-domain" in text and report.cause.hint in text
    assert "log-domain" in html and "17 negatives in input[0] of 1 (LogLayer)" in html
    assert report.to_dict()["cause"]["label"] == "log-domain"


# -- rules on hand-built Reports ---------------------------------------------------------------


def stats(dtype: str = "float32", shape: tuple[int, ...] = (4, 4), **fields) -> TensorStats:
    base = {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5, "absmax": 1.0, "zeros": 0, "negatives": 8}
    base.update(fields)
    numel = 1
    for size in shape:
        numel *= size
    return TensorStats(dtype=dtype, shape=shape, numel=numel, **base)


def operand(name: str) -> TensorRef:
    return TensorRef(TensorRole.OPERAND, name)


def report(**fields) -> Report:
    base = {
        "phase": Phase.FORWARD, "module": "encoder.log", "module_type": "LogLayer", "step": 3,
        "nan": 0, "posinf": 0, "neginf": 0, "numel": 16, "dtype": "float32", "tensor": TensorRef.output(),
    }
    base.update(fields)
    return Report(**base)


@pytest.mark.parametrize("op", ["aten.acos.default", "aten.asin.default"])
def test_acos_or_asin_past_one_is_a_domain_error_with_its_range(op: str) -> None:
    past = stats(min=0.9999998807907104, max=1.0000001192092896, zeros=0, negatives=0)
    cause = diagnose(report(op=op, nan=3, input_stats=((operand("self"), past),)))
    assert cause.label == "sqrt-domain"
    base = op.split(".")[1]
    assert cause.hint.startswith(f"{base} got values outside [-1, 1] in `self` of {op} in encoder.log (LogLayer) "
                                 "(from 0.999999881 to 1.00000012), where it is NaN")
    assert "clamp into [-1 + 1e-7, 1 - 1e-7]" in cause.hint
    inside = stats(min=-0.5, max=0.5)  # a NaN from inside the domain is not this reading
    assert diagnose(report(op=op, nan=3, input_stats=((operand("self"), inside),))).label == "sqrt-domain"


def test_an_acos_of_a_rounded_cosine_in_a_module_is_named_with_a_verified_clamp() -> None:
    class Angle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            unit = F.normalize(self.fc(x), dim=-1)
            return torch.acos((unit * unit).sum(-1) * (1 + 1e-6))  # producer: rounded-cosine

    torch.manual_seed(0)
    model = Angle()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(8, 4)).mean().backward()
    report = caught.value.report
    assert (report.module, report.op) == ("", "aten.acos.default")
    assert report.source.lineno == marked_line("rounded-cosine", where=Angle)
    assert report.cause.label == "sqrt-domain" and "outside [-1, 1]" in report.cause.hint
    assert next(trial for trial in report.fixes if trial.kind == "eps").finite is True


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_nan_target_is_bad_data_read_by_the_loss_not_a_models_input(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    targets = torch.randn(24, 1)
    targets[13] = float("nan")  # a missing label
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for step in range(3):
            y = targets[step * 8:(step + 1) * 8]
            loss = F.mse_loss(model(torch.randn(8, 3)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.tensor.path) == (Phase.DATA, None, 1, "y")
    assert report.cause.label == "bad-input-data"
    assert report.cause.hint.startswith("y, read by the code after the model call (the loss), already held 1 nan of 8 "
                                        "(first at index (5, 0))")
    assert "entering" not in report.cause.hint


def test_log_counts_zeros_and_negatives_from_the_output() -> None:
    cause = diagnose(report(op="aten.log.default", nan=3, neginf=12, input_stats=((operand("self"), stats()),)))
    assert cause.label == "log-domain"
    assert "log got 12 zeros and 3 negatives in `self` of aten.log.default in encoder.log (LogLayer)" in cause.hint


def test_log1p_speaks_of_values_below_minus_one() -> None:
    cause = diagnose(report(op="aten.log1p.default", nan=2))
    assert cause.label == "log-domain" and "0 values at -1 and 2 values below -1" in cause.hint


def test_log1p_counts_its_minus_infinities_as_values_at_minus_one_and_clamps_to_minus_one_plus_eps() -> None:
    cause = diagnose(report(op="aten.log1p.default", neginf=6))
    assert "log1p got 6 values at -1 and 0 values below -1" in cause.hint
    assert "x.clamp_min(-0.99999988)" in cause.hint and "1e-12" not in cause.hint


def test_log_hints_keep_their_zeros_and_eps() -> None:
    for base in ("log", "log2", "log10"):
        cause = diagnose(report(op=f"aten.{base}.default", nan=1, neginf=2))
        assert f"{base} got 2 zeros and 1 negative" in cause.hint and "x.clamp_min(1e-12)" in cause.hint


@pytest.mark.parametrize(
    ("counts", "label"),
    [({"posinf": 4}, "division-by-zero"), ({"nan": 4}, "sqrt-domain")],
    ids=["zeros", "negatives"],
)
def test_rsqrt_of_zeros_is_a_zero_variance_and_of_negatives_a_domain_error(counts, label) -> None:
    cause = diagnose(report(op="aten.rsqrt.default", input_stats=((operand("self"), stats()),), **counts))
    assert cause.label == label and "encoder.log (LogLayer)" in cause.hint


def test_pow_readings() -> None:
    def pow_cause(dtype: str = "float32", inputs=(), **counts) -> Cause:
        return diagnose(report(op="aten.pow.Tensor_Scalar", dtype=dtype, input_stats=inputs, **counts))

    assert pow_cause(nan=2).label == "pow-domain"
    assert pow_cause(posinf=3, inputs=((operand("self"), stats(zeros=3)),)).label == "pow-domain"
    half = pow_cause("float16", posinf=3, inputs=((operand("self"), stats("float16")),))
    assert half.label == "half-precision-overflow"
    # The module's input, not the base:
    unknown = pow_cause(posinf=3, inputs=((TensorRef.argument("input[0]"), stats()),))
    assert unknown.label == "unclassified" and "zero to a negative power or an overflow" in unknown.hint


def test_a_scalar_zero_over_zero_is_an_empty_reduction() -> None:
    inputs = ((operand("self"), stats(shape=(), absmax=0.0, min=0.0, max=0.0, zeros=1)),
              (operand("other"), stats(shape=(), absmax=0.0, min=0.0, max=0.0, zeros=1)))
    cause = diagnose(report(op="aten.div.Tensor", module=None, module_type=None, nan=1, numel=1,
                            input_stats=inputs))
    assert cause.label == "empty-reduction"


def test_a_half_quotient_without_a_zero_divisor_is_an_overflow() -> None:
    inputs = ((operand("self"), stats("float16", absmax=3e4)),
              (operand("other"), stats("float16", zeros=0, absmax=1e-3)))
    cause = diagnose(report(op="aten.div.Tensor", dtype="float16", posinf=2, input_stats=inputs))
    assert cause.label == "half-precision-overflow" and "30000 (`self`)" in cause.hint


def test_exp_that_made_no_inf_is_not_an_exp_overflow() -> None:
    assert diagnose(report(op="aten.exp.default", nan=1)).label == "unclassified"


@pytest.mark.parametrize(
    ("node", "label"),
    [("SqrtBackward0", "sqrt-domain"), ("LogBackward0", "log-domain"), ("PowBackward0", "pow-domain"),
     ("DivBackward0", "division-by-zero"), ("LinalgVectorNormBackward0", "division-by-zero"),
     ("ExpBackward0", "exp-overflow"), ("AcosBackward0", "sqrt-domain")],
)
def test_a_backward_op_is_read_through_its_forward_function(node: str, label: str) -> None:
    line = SourcePointer("/home/me/model.py", 42, "forward", "    d = torch.linalg.vector_norm(x - y, dim=-1)")
    cause = diagnose(report(
        phase=Phase.BACKWARD, op="aten.div.Tensor", tensor=TensorRef.op_output("aten.div.Tensor"), posinf=3,
        source=line,
        autograd_node=node,
    ))
    assert cause.label == label
    assert "model.py:42 `d = torch.linalg.vector_norm(x - y, dim=-1)`" in cause.hint
    assert f"autograd node {node}" in cause.evidence


def test_a_backward_without_its_op_gives_the_checklist_not_a_guess() -> None:
    gradient = TensorRef(TensorRole.OUTPUT_GRADIENT, None, "input[1]")
    cause = diagnose(report(phase=Phase.BACKWARD, module="head", module_type="AngleHead", tensor=gradient, nan=16))
    assert cause.label == "unclassified"
    assert "head (AngleHead)" in cause.hint and "ops=True" in cause.hint and "acos" in cause.hint


def test_a_gradient_about_to_be_applied() -> None:
    cause = diagnose(report(phase=Phase.BACKWARD, module="", module_type="Linear", tensor=TensorRef.gradient("weight"),
                            posinf=1))
    assert cause.label == "unclassified" and "gradient of weight" in cause.hint


@pytest.mark.parametrize(
    ("dtype", "tensor", "optimizer", "counts", "label"),
    [
        ("float16", TensorRef(TensorRole.OPTIMIZER_STATE, "fc.weight", "exp_avg_sq"), "Adam", {"posinf": 5},
         "half-precision-overflow"),
        ("float16", TensorRef.parameter("fc.weight"), "AdamW", {"nan": 5}, "optimizer-eps-underflow"),
        ("bfloat16", TensorRef.parameter("fc.weight"), "Adam", {"nan": 5}, "unclassified"),
        ("float32", TensorRef.parameter("fc.weight"), "SGD", {"nan": 5}, "unclassified"),
        ("float16", TensorRef.parameter("fc.weight"), "SGD", {"posinf": 5}, "half-precision-overflow"),
    ],
    ids=["fp16-state-overflow", "fp16-adamw", "bf16-holds-eps", "fp32-sgd", "fp16-sgd-overflow"],
)
def test_optimizer_rules_need_the_dtype_and_the_optimizer(dtype, tensor, optimizer, counts, label) -> None:
    cause = diagnose(report(phase=Phase.OPTIMIZER, module="fc", module_type="Linear", dtype=dtype, tensor=tensor,
                            optimizer=optimizer, **counts))
    assert cause.label == label
    assert "fc.weight" in cause.hint


def test_an_epsilon_division_op_without_the_optimizer_still_counts_in_float16() -> None:
    cause = diagnose(report(phase=Phase.OPTIMIZER, op="aten.addcdiv_.default", dtype="float16", nan=4,
                            tensor=TensorRef.op_output("aten.addcdiv_.default")))
    assert cause.label == "optimizer-eps-underflow"


def history(losses: list[float]) -> tuple[StepSummary, ...]:
    return tuple(StepSummary(step=step, loss=loss, absmax=1.0) for step, loss in enumerate(losses))


def test_divergence_needs_growth_and_a_steady_rise() -> None:
    overflow = {"op": "aten.mm.default", "posinf": 3}
    rising = history([1.0, 0.9, 1.1, 0.8, 2.0, 8.0, 40.0])
    assert diagnose(report(history=rising, **overflow)).label == "learning-rate-too-high"
    one_spike = history([1.0, 0.9, 1.1, 0.8, 0.7, 0.9, 40.0])  # one bad batch, not a climb
    assert diagnose(report(history=one_spike, **overflow)).label == "unclassified"
    slow = history([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])  # rising, but far from 10x
    assert diagnose(report(history=slow, **overflow)).label == "unclassified"


def test_a_run_that_explodes_within_a_few_steps_is_the_learning_rate() -> None:
    overflow = {"op": "aten.mse_loss.default", "posinf": 1}
    cause = diagnose(report(history=history([1.16, 4.5e23]), **overflow))  # SGD at lr 1e12: one step
    assert cause.label == "learning-rate-too-high"
    assert cause.hint.startswith("the loss rose to 4.5e23 at step 1, 3.88e23x its 1.16 at step 0; then")
    assert "lower the learning rate" in cause.hint
    three = history([1.16, 4.5e7, 7.3e17])  # lr 1e4: every step 1e10 times the last
    assert diagnose(report(history=three, **overflow)).label == "learning-rate-too-high"
    # Short histories need the explosion; a two-fold rise, or a rise that fell back, is no divergence.
    for losses in ([1.0, 2.0], [1.0, 1e3], [1.0, 1e7, 1e6], [1e7]):
        assert diagnose(report(history=history(losses), **overflow)).label == "unclassified", losses


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_sgd_at_a_learning_rate_far_too_high_is_named_as_such_when_its_loss_overflows(defer: bool) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e12)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(net, opt, defer=defer):
        for _ in range(10):
            loss = nn.functional.mse_loss(net(torch.randn(16, 4)), torch.randn(16, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = raised.value.report
    assert (report.phase, report.module, report.op, report.step) == (Phase.FORWARD, None, "aten.mse_loss.default", 2)
    assert report.cause.label == "learning-rate-too-high" and "the loss rose to" in report.cause.hint


def test_divergence_does_not_override_an_op_specific_cause_but_is_listed() -> None:
    rising = history([1.0, 0.9, 1.1, 0.8, 2.0, 8.0, 40.0])
    cause = diagnose(report(op="aten.log.default", nan=2, history=rising))
    assert cause.label == "log-domain"
    assert any("the loss rose to 40" in line for line in cause.evidence)


def test_softmax_nan_that_fills_no_whole_row_is_unclassified() -> None:
    cause = diagnose(report(op="aten._softmax.default", nan=3, output_stats=stats(shape=(4, 4)),
                            input_stats=((operand("self"), stats()),)))
    assert cause.label == "unclassified"


def test_an_op_fed_an_infinity_is_unclassified_and_names_that_input() -> None:
    cause = diagnose(report(op="aten.addmm.default", nan=1, module="fc", module_type="Linear",
                            input_stats=((operand("mat2"), stats(posinf=1)),)))
    assert cause.label == "unclassified" and "`mat2` of aten.addmm.default in fc (Linear) held 1 +inf" in cause.hint


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("tensor", [
    TensorRef.output(), TensorRef(TensorRole.LOSS), TensorRef.parameter("w"),
    TensorRef(TensorRole.OPTIMIZER_STATE, "w", "exp_avg"), TensorRef.gradient("w"),
], ids=str)
@pytest.mark.parametrize("op", [None, "aten.mm.default", "aten.log.default", "mylib.kernel"])
def test_bare_reports_never_break_the_diagnosis(phase: Phase, tensor: TensorRef, op: str | None) -> None:
    cause = diagnose(Report(phase=phase, module=None, module_type=None, step=0, nan=1, posinf=0, neginf=0,
                            numel=1, tensor=tensor, op=op))
    assert cause.label in LABELS and cause.hint and cause.evidence


def test_every_label_is_documented() -> None:
    for label in LABELS:
        assert f"``{label}``" in (diagnose_module.__doc__ or "")


class Mask(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(mask, float("-inf"))


def test_a_benign_deliberate_infinity_gets_no_fix() -> None:
    model = Mask()
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 2:] = True
    with nan_magic.watch(model, mode="full") as w:
        model(torch.randn(2, 4), mask)
    (event,) = w.events
    assert event.benign and event.cause is not None
    assert event.cause.label == "unclassified" and event.cause.hint.startswith("benign:")
    assert any("deliberate infinity" in line for line in event.cause.evidence)


def test_an_op_operand_named_input_is_the_op_s_not_the_module_s() -> None:
    assert not operand("input").is_argument
    assert not TensorRef(TensorRole.OPERAND, "input", before=True).is_argument
    assert TensorRef.argument("input[0]").is_argument and TensorRef.argument("kwargs['mask']").is_argument
    norm = report(op="aten.native_layer_norm.default", input_stats=(
        (TensorRef.argument("input[0]"), stats(absmax=2.0)), (operand("input"), stats(absmax=6e28)),
        (operand("weight"), stats())))
    assert [name for name, _stats in norm.op_inputs] == [operand("input"), operand("weight")]


# -- overflows in float32, attention, the op's own operands, optimizer facts --------------------


class Attention(nn.Module):
    """q, k, v from one input; ``fused`` runs scaled_dot_product_attention, else the eager q·kᵀ and softmax."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qk, self.v, self.fused = nn.Linear(16, 32), nn.Linear(16, 16), fused

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        if self.fused:
            return F.scaled_dot_product_attention(q, k, self.v(x), attn_mask=mask, is_causal=mask is None)
        scores = q @ k.transpose(-1, -2) / 4.0
        return (scores if mask is None else scores + mask).softmax(-1) @ self.v(x)


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "eager"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "additive-mask"])
def test_attention_whose_scores_overflow_is_an_overflow_not_a_masked_row(fused: bool, masked: bool) -> None:
    torch.manual_seed(0)
    model = Attention(fused)
    with torch.no_grad():
        model.qk.weight.mul_(1e21)  # q and k reach ~1e21: q·kᵀ passes float32's 3.4e38
    mask = torch.full((6, 6), float("-inf")).triu(1) if masked else None  # no row fully masked
    report = raised(lambda: model(torch.randn(2, 6, 16), mask), model, mode="full")
    cause = assert_cause(report, "overflow", "Attention (root)", "float32 (max 3.4e38)", "normalise q and k")
    assert "masked" not in cause.hint
    if not fused:  # the eager q·kᵀ is the producer: the hint also says to scale q
        assert "scale q by d**-0.5" in cause.hint


def test_sdpa_reports_are_read_from_the_mask_and_the_bound_of_the_scores() -> None:
    def attention(dtype: str = "float32", q: float = 3.0, mask: TensorStats | None = None, **counts) -> Cause:
        inputs = [(operand("query"), stats(dtype, (2, 2, 8, 16), absmax=q)),
                  (operand("key"), stats(dtype, (2, 2, 8, 16), absmax=q)),
                  (operand("value"), stats(dtype, (2, 2, 8, 16)))]
        inputs += [(operand("attn_mask"), mask)] if mask is not None else []
        return diagnose(report(op="aten._scaled_dot_product_flash_attention_for_cpu.default", dtype=dtype,
                               tensor=TensorRef.output("output[0]"), output_stats=stats(dtype, (2, 2, 8, 16)),
                               input_stats=tuple(inputs), **counts))

    full_row = stats(shape=(2, 1, 8, 8), neginf=8, absmax=0.0)  # 8 -inf: enough for one row of 8 keys
    masked = attention(mask=full_row, nan=32)
    assert masked.label == "masked-softmax" and "2 rows of 8 positions" in masked.hint
    assert any("cannot overflow" in line for line in masked.evidence)
    # the same mask with q and k at 1e20: the scores overflow; the mask is only mentioned
    overflowed = attention(q=1e20, mask=full_row, nan=32)
    assert overflowed.label == "overflow" and "normalise q and k (QK-norm" in overflowed.hint
    assert any("q·kᵀ·scale can reach" in line for line in overflowed.evidence)
    assert any(line.startswith("also: ") for line in overflowed.evidence)
    assert attention("float16", q=400.0, nan=32).label == "half-precision-overflow"
    # too few -inf to fill a row, and scores that cannot overflow: neither reading, say so
    partial = attention(mask=stats(shape=(2, 1, 8, 8), neginf=3, absmax=0.0), nan=32)
    assert partial.label == "unclassified" and "fewer than the 8 keys of one row" in partial.hint
    assert "boolean mask" in attention(nan=32).hint  # no float mask read: it may be a boolean one


def test_softmax_nan_needs_a_minus_inf_at_each_nan_position() -> None:
    def softmax(neginf: int) -> Cause:
        return diagnose(report(op="aten._softmax.default", nan=8, output_stats=stats(shape=(4, 4)),
                               input_stats=((operand("self"), stats(neginf=neginf)),)))

    assert softmax(neginf=8).label == "masked-softmax"
    assert softmax(neginf=5).label == "unclassified"  # 5 -inf cannot make two rows of 4 all -inf


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_a_layer_norm_of_huge_values_names_its_input_and_their_square(ops: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with torch.no_grad():
        model[0].weight.mul_(1e25)  # the LayerNorm's input reaches ~1e25: its variance overflows float32
    report = raised(lambda: model(torch.randn(2, 8)), model, ops=ops, mode="full")
    assert report.op == "aten.native_layer_norm.default"
    cause = assert_cause(report, "overflow", "1 (LayerNorm)", "(`input`)", "normalise or clip")
    assert "e25 (`input`)" in cause.hint  # the operand it normalised, not the LayerNorm's weight of 1
    assert any("its square overflows" in line for line in cause.evidence)


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e20 * 1e20


def test_float32_overflows_are_read_from_the_op_and_the_magnitudes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scale())
    report = raised(lambda: model(torch.randn(2, 4)), model, mode="full")
    assert report.op == "aten.mul.Tensor"
    assert_cause(report, "overflow", "1 (Scale)", "float32 (max 3.4e38)")
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with torch.no_grad():
        model[1].weight.fill_(3e38)  # normalised values of ~1.5 times 3e38
    cause = assert_cause(raised(lambda: model(torch.randn(2, 4)), model, mode="full"), "overflow", "3e38 (`weight`)")
    assert any("`weight` reached |x| = 3e38, within 1000x" in line for line in cause.evidence)


def test_a_float32_or_float64_op_overflows_only_where_the_evidence_shows_it() -> None:
    def wide(dtype: str, op: str, absmax: float, **counts) -> str:
        inputs = ((operand("self"), stats(dtype, absmax=absmax)),)
        return diagnose(report(op=op, dtype=dtype, input_stats=inputs, **counts)).label

    assert wide("float64", "aten.mul.Tensor", 1e200, posinf=2) == "overflow"
    assert wide("float64", "aten.native_layer_norm.default", 1e200, nan=16) == "overflow"  # > sqrt(1.8e308)
    assert wide("float64", "aten.native_layer_norm.default", 1e30, nan=16) == "unclassified"
    assert wide("float32", "mylib.kernel.default", 1e36, posinf=1) == "overflow"  # near the max
    assert wide("float32", "mylib.kernel.default", 10.0, posinf=1) == "unclassified"


def test_adamw_with_eps_zero_divides_zero_by_zero_in_float32() -> None:
    torch.manual_seed(0)
    model = nn.Embedding(10, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)

    def step() -> None:
        opt.zero_grad()
        model(torch.tensor([0, 1, 2])).sum().backward()  # rows 3 to 9 get zero gradients: 0/0
        opt.step()

    report = raised(step, model, opt)
    assert (report.phase, report.dtype, report.optimizer_eps) == ("optimizer", "float32", 0.0)
    cause = assert_cause(report, "optimizer-eps-underflow", "the AdamW step", "eps = 0", "weight", "0/0",
                         "eps = 1e-8")
    assert "eps = 0: sqrt(v) + eps is 0 where v is 0" in cause.evidence


@pytest.mark.parametrize(
    ("dtype", "lr", "implementation"),
    [(torch.float32, 1e39, {"fused": True}), (torch.float16, 1e5, {"foreach": True}),
     (torch.float16, 1e5, {"foreach": False})],  # lr as the hint writes it: 1e39, 100000
    ids=["float32-fused", "float16-foreach", "float16-for-loop"],
)
def test_a_learning_rate_past_the_dtype_max_is_the_cause_in_any_implementation(dtype, lr, implementation) -> None:
    # torch's foreach and for-loop steps refuse an lr float32 cannot hold (1e39): float16's max is in their reach
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-3, **implementation)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 4, dtype=dtype)).float().sum().backward()
        opt.step()

    report = raised(step, model, opt)
    assert (report.phase, report.step, report.optimizer_lr) == ("optimizer", 0, lr)
    limit = "3.4e38" if dtype == torch.float32 else "65504"
    shown = "1e39" if lr == 1e39 else "100000"
    cause = assert_cause(report, "learning-rate-too-high", f"lr = {shown}", f"max {limit}", "weight")
    assert any(line.startswith("lr ") and f">= {str(dtype).removeprefix('torch.')} max" in line
               for line in cause.evidence)


@pytest.mark.parametrize("lr", [float("inf"), float("nan")])
def test_a_non_finite_learning_rate_is_the_cause(lr: float) -> None:
    cause = diagnose(report(phase=Phase.OPTIMIZER, module="fc", module_type="Linear",
                            tensor=TensorRef.parameter("fc.weight"),
                            optimizer="SGD", optimizer_lr=lr, nan=16))
    # The number itself, no rate too high: a tenth of it is no remedy (issue hunt-c-s42).
    assert (cause.label, cause.reading) == ("nonfinite-number", "optimizer-lr-nonfinite")
    kind = "not a number" if lr != lr else "infinite"
    assert f"lr = {lr} is {kind}, not a rate too high" in cause.hint and "usual range" not in cause.hint


def test_a_learning_rate_gone_nan_in_the_optimizer_is_named_by_the_watch() -> None:
    # The real path (the parameter group's lr read at the event), not a report built by hand: NaN == NaN is
    # False, and the group's lr must not be taken for groups that disagree.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=float("nan"))

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    report = raised(step, model, opt)
    assert report.phase == "optimizer" and report.optimizer_lr is not None and math.isnan(report.optimizer_lr)
    assert report.cause is not None and (report.cause.label, report.cause.reading) == (
        "nonfinite-number", "optimizer-lr-nonfinite")


def _ctc_training(options: dict[str, bool], zero_infinity: bool = False) -> nan_magic.Report | None:
    """Three steps of a CTC model; at step 1 the inputs are 3 frames long, the targets 6 labels: no alignment fits."""
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    ctc = nn.CTCLoss(zero_infinity=zero_infinity)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as watch:
        for step in range(3):
            frames = 3 if step == 1 else 10
            log_probs = model(torch.randn(frames, 2, 8)).log_softmax(-1)
            targets = torch.randint(1, 5, (2, 6))
            loss = ctc(log_probs, targets, torch.full((2,), frames), torch.full((2,), 6))  # producer: ctc
            opt.zero_grad()
            loss.backward()
            opt.step()
    return watch.report


@pytest.mark.parametrize("options", [{}, {"defer": True}], ids=["immediate", "deferred"])
def test_a_ctc_loss_no_alignment_fits_is_named_with_zero_infinity(options: dict[str, bool]) -> None:
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _ctc_training(options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten._ctc_loss.Tensor")
    assert report.source is not None and report.source.lineno == marked_line("ctc", where=_ctc_training)
    assert report.cause is not None and report.cause.label == "ctc-infeasible"
    assert "gave +inf for 2 of 2 samples" in report.cause.hint and "zero_infinity=True" in report.cause.hint


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"ops": True}], ids=["immediate", "deferred", "ops"])
def test_a_ctc_loss_with_zero_infinity_is_silent(options: dict[str, bool]) -> None:
    assert _ctc_training(options, zero_infinity=True) is None
