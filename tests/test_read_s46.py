"""What a user reads in the whole report, sentence by sentence (session 46's reading, default and deferred modes).

Two things the reading found false: a parameter the loop's own code wrote (an EMA teacher's update after the step, a
renormalisation before it) was said to be made "in 0 (Linear)" with the parameter's counts as the op's ("made 48
NaN" where the op made 1 inf), and its fixes' note said the producer "ran in the SGD step, whose trials redo it"
right under the note that the loop's code wrote it; and the layer table's legend said every empty min and max
"held no finite value", also under a finite gradient checked by its sum and a '?' count a probe could not give.
"""

from __future__ import annotations

import pytest
import torch
from contract import all_cases
from torch import nn
from torch.nn import functional as F

import nan_magic

MODES = {"default": {}, "defer": {"defer": True}}


def _ema_teacher(count_at_step_1: float) -> tuple[tuple[object, ...], object]:
    """A student trained by SGD and a teacher the loop moves toward it after each step by ``lerp_`` with weight
    ``1 / count``; the count of the second step is ``count_at_step_1`` (0: a weight of inf, every teacher weight
    non-finite)."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    teacher = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False)
    teacher.load_state_dict(student.state_dict())
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs = [torch.randn(5, 6) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        for step, x in enumerate(xs):
            loss = F.mse_loss(student(x), teacher(x).tanh())
            opt.zero_grad()
            loss.backward()
            opt.step()
            count = torch.tensor(count_at_step_1 if step == 1 else 4.0)
            with torch.no_grad():
                weight = 1.0 / count  # the EMA's weight
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.lerp_(s, weight)
        return [p.detach().clone() for p in teacher.parameters()]

    return (student, teacher, opt), run


@pytest.mark.parametrize("mode", MODES)
def test_an_ema_update_the_loop_wrote_is_its_code_s_with_the_op_s_own_counts(mode: str) -> None:
    """The EMA's ``1.0 / count`` at count 0 is the producer (a reciprocal that made 1 inf; the teacher's weight then
    holds every element non-finite): the cause places it in the loop's code at its line with its own count, and the
    fixes' note says the trials do not run the loop's code after the step, not that the optimizer's trials did not
    fit."""
    targets, run = _ema_teacher(0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*targets, **MODES[mode]):
        run()
    report = caught.value.report
    # (step 2: the write follows the loop's second optimizer step, two completed before it)
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 2, "aten.reciprocal.default")
    assert report.source is not None and report.source.line.strip().startswith("weight = 1.0 / count")
    assert report.cause is not None and report.cause.label == "division-by-zero"
    hint = report.cause.hint
    assert "aten.reciprocal.default in the code at " in hint and "in 0 (Linear)" not in hint
    assert "giving 1 inf (x/0)" in hint and "NaN (0/0)" not in hint  # (the op's count, not the teacher weight's)
    assert "aten.reciprocal.default made 0 NaN (0/0) and 1 inf (x/0)" in report.cause.evidence
    assert "the loop's own code wrote 0.weight after the optimizer step, before the next model call" in report.notes
    assert ("no fix was tried: the producer (aten.reciprocal.default) ran in the loop's code after the optimizer step, "
            "which the trials do not run again") in " ".join(report.notes)
    assert not any("whose trials redo it" in note for note in report.notes)


def test_an_ema_update_of_a_finite_weight_stays_silent_and_bit_identical() -> None:
    """The healthy twin (a count of 4 at every step): no event, the teacher's weights as an unwatched run's."""
    targets, run = _ema_teacher(4.0)
    expected = run()
    targets, run = _ema_teacher(4.0)
    with nan_magic.watch(*targets) as watch:
        got = run()
    assert watch.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("mode", MODES)
def test_a_renormalisation_before_the_step_names_the_update_code_not_the_optimizer(mode: str) -> None:
    """Rows renormalised by hand between ``backward()`` and the step, one of them zeroed (0 / 0): the note under the
    "loop's own code wrote" note is the update code's (with the divisor's eps), not "ran in the SGD step"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for step in range(3):
            loss = F.mse_loss(model(torch.randn(4, 5)), torch.zeros(4, 2))
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                if step == 2:
                    model[0].weight[3] = 0.0  # a unit reset as dead
                norms = model[0].weight.norm(dim=1, keepdim=True)
                model[0].weight.div_(norms)
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("optimizer", "0", 2)
    assert report.cause is not None and "in the code at " in report.cause.hint
    assert "giving 5 NaN (0/0)" in report.cause.hint  # (the op wrote the parameter: its counts are the op's)
    assert "the loop's own code wrote 0.weight between backward() and the next step (a hand-written update)" in \
        report.notes
    assert any(note.startswith("no fix was tried: the producer (aten.div_.Tensor) ran in the loop's code between "
                               "backward() and the step") for note in report.notes)
    assert not any("whose trials redo it" in note for note in report.notes)


def _legend(report: nan_magic.Report) -> str:
    return next(line.strip() for line in report.to_text().splitlines() if "Empty cells" in line)


class GuardedLog(nn.Module):
    """``log`` where positive, else 0: the forward is finite, the backward at an exact 0 is 0 / 0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


def test_a_finite_gradient_checked_by_its_sum_is_not_said_to_hold_no_finite_value() -> None:
    """The default watch checks the gradient into the model's output by a sum: its row has counts (0) and no range.
    The legend says so, and no longer that such a tensor "held no finite value"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), GuardedLog(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[0], model[0].bias[0] = 0.0, 0.0  # a unit whose output is exactly 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for _step in range(2):
            loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("backward", "1", 0)
    rangeless = [layer.stats for layer in report.layers if layer.stats is not None and layer.stats.min is None]
    assert rangeless and all(stats.finite for stats in rangeless)  # (the model output's and the head's gradients)
    legend = _legend(report)
    assert "are empty where the tensor was counted but its range not read (a gradient checked by its sum" in legend
    assert "held no finite value" not in legend
    assert "where the tensor was counted but its range not read" in report.table.attrs["legend"]


@pytest.mark.parametrize("mode", MODES)
def test_a_question_mark_count_is_said_and_not_called_a_tensor_without_finite_values(mode: str) -> None:
    """A padded row's RMSNorm gives NaN that the head spreads to 2 of its 20 outputs, a tensor freed before the
    report, known by its probe only: its NaN count reads '?'. The legend says what '?' is, and does not say that the
    head's output (18 finite values) held no finite value."""
    case = next(case for case in all_cases() if case.name == "holdout_rmsnorm_without_eps_padding_row")
    scenario = case.build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode]):
        scenario.run()
    report = caught.value.report
    head = next(layer for layer in report.layers if layer.module == "head")
    assert head.stats is not None and head.stats.nan is None and head.stats.min is None
    text = report.to_text()
    row = next(line for line in text.splitlines() if "head (Linear)" in line)
    assert row.split()[2] == "?"
    legend = _legend(report)
    assert "a ? count is a kind the tensor held, its number unknown: it was freed before the report was built" in legend
    assert "held no finite value" not in legend


@pytest.mark.parametrize("mode", MODES)
def test_a_collapsing_scaler_s_note_does_not_deny_the_activation_gradient_the_report_names(mode: str) -> None:
    """A GradScaler collapsing on a head whose backward overflows float16 inside the model: the step's checks saw
    only parameter gradients overflow (the gradient into the model's outputs was finite), and the replay names the
    gradient into ``1.proj``'s output, an activation gradient, with 517 +inf. The note said "the activation gradients
    stayed finite" two lines from it; it says what the checks saw."""
    case = next(case for case in all_cases() if case.name == "grad_scaler_collapse_inside_the_model")
    scenario = case.build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode],
                                                                            **scenario.options):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.module, str(report.tensor)) == ("backward", "1", "grad of 1.proj output")
    assert report.posinf > 0
    assert ("the step's checks saw a parameter gradient overflow while the gradients into the model's outputs stayed "
            "finite") in report.notes
    assert not any("activation gradients stayed finite" in note for note in report.notes)


@pytest.mark.parametrize("mode", MODES)
def test_a_data_report_s_target_that_reached_the_loss_is_not_called_a_module_output(mode: str) -> None:
    """A dataset's ``log(duration)`` target of a zero-length event (phase data, the op in ``__getitem__``) reaches
    the loss: the row says where it reached, "reached  loss ...", not "module out" (no module made or output it);
    a module's output keeps its "module out" row."""
    cases = {case.name: case for case in all_cases()}
    scenario = cases["hunt25b_getitem_log_duration_target_of_a_zero_length_event"].build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode],
                                                                            **scenario.options):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.module, report.op) == ("data", None, "aten.log.default")
    lines = report.to_text().splitlines()
    assert "  reached     loss of code outside any watched module: f32[] 1 +inf" in lines
    assert not any(line.startswith("  module out") for line in lines)
    scenario = cases["holdout_rmsnorm_without_eps_padding_row"].build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode]):
        scenario.run()
    assert any(line.startswith("  module out  output of norm (RMSNorm): f32[4,5,8] 16 nan")
               for line in caught.value.report.to_text().splitlines())


class KeywordSpotter(nn.Module):
    """The log-energy of 16 frames of a clip, a small conv over them: a clip with 50 samples of 0 is a log of 0 in
    the root's own code, which the conv spreads to 24 infinities of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 3, padding=1)
        self.head = nn.Linear(8 * 16, 3)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        energy = torch.log(wave.unfold(-1, 50, 50).pow(2).mean(-1))
        return self.head(F.relu(self.conv(energy.unsqueeze(1))).flatten(1))


def _producer_row_counts(report: nan_magic.Report) -> tuple[object, ...]:
    row = next(layer for layer in report.layers if layer.status == "producer")
    assert row.stats is not None
    return str(row.tensor), row.stats.nan, row.stats.posinf, row.stats.neginf


@pytest.mark.parametrize("mode", MODES)
def test_the_producer_row_of_a_root_s_own_op_is_the_op_s_output_not_the_child_s(mode: str) -> None:
    """The producer row said "output of conv: 6 +inf, 18 -inf" under the headline "1 -inf of 128": it is the log's
    own output now, and the conv's output that it reached is a propagated row of the same call."""
    torch.manual_seed(0)
    model = KeywordSpotter()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clips, labels = torch.randn(16, 800) * 0.1, torch.randint(0, 3, (16,))
    clips[13, 400:450] = 0
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for it in range(2):
            loss = F.cross_entropy(model(clips[it * 8:(it + 1) * 8]), labels[it * 8:(it + 1) * 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.module, report.op, report.step, report.counts) == ("", "aten.log.default", 1,
                                                                      {"nan": 0, "+inf": 0, "-inf": 1})
    assert _producer_row_counts(report) == ("output of aten.log.default", 0, 0, 1)
    rows = {str(layer.tensor): layer.status for layer in report.layers if layer.module == ""}
    assert rows["output of conv"] == "propagated"
    producer_line = next(line for line in report.to_text().splitlines() if line.startswith(">"))
    assert "output of aten.log.default" in producer_line and "8x16" in producer_line


@pytest.mark.parametrize("name", ["holdout_kl_with_zero_targets", "loss_log_first_iteration_optimizer_not_passed",
                                  "user_s34_beta_log_prob_of_a_target_at_one",
                                  "holdout_scaler_custom_loss_log_one_minus_sigmoid",
                                  "holdout_rmsnorm_without_eps_padding_row", "holdout_compiled_model_log"])
@pytest.mark.parametrize("mode", MODES)
def test_every_producer_row_holds_the_headline_s_tensor_or_its_module_s_output(name: str, mode: str) -> None:
    """Loss code's op (its value reached the loss) and a module's op (its value reached the module's output): the
    producer row is the op's output with the headline's counts where the value reached the loss; a module's own
    output stays its producer row (the module made it)."""
    scenario = next(case for case in all_cases() if case.name == name).build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode],
                                                                            **scenario.options):
        scenario.run()
    report = caught.value.report
    tensor, *counts = _producer_row_counts(report)
    if report.module is None:
        assert (tensor, *counts) == (str(report.tensor), report.nan, report.posinf, report.neginf)
        assert next(layer.status for layer in report.layers if str(layer.tensor) == "loss") == "propagated"
    else:
        assert tensor == "output"


@pytest.mark.parametrize("name", ["optimizer_huge_learning_rate", "optimizer_adam_fp16_eps_foreach"])
@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_replay_s_inputs_say_they_are_the_replay_s_where_they_are_shown(name: str, mode: str) -> None:
    """An SGD step at lr 1e38: the inputs row "self (before): finite in [-1.829e+38, 2.409e+38]" read as the weights
    before the step (they were about 0.5); they are a replay's, from the step's result. The inputs' line says so."""
    scenario = next(case for case in all_cases() if case.name == name).build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode],
                                                                            **scenario.options):
        scenario.run()
    report = caught.value.report
    assert report.phase == "optimizer"
    lines = report.to_text().splitlines()
    assert ("  inputs      finite (numbers of a replay of the optimizer step, not the step's own: see its note)"
            in lines)
    assert any(line.strip().startswith("self") and "(before)" in line for line in lines)
