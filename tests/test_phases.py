"""Producers outside the forward pass: backward, loss, optimizer, data, and GradScaler."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import faults
import pytest
import torch
from faults import GuardedExp, distance, fp16_adam_step, marked_line
from torch import nn
from torch.nn import functional as F
from watching import amp_training, raised

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot.checks import forward
from nan_magic.hot.checks.optimizer import step_checks as optim
from nan_magic.hot.checks.optimizer.step_checks import COLLAPSE_SKIPS, FULL_CHECK_EVERY
from nan_magic.hot.kept import rng
from nan_magic.records import TensorRef, TensorRole

# -- backward ------------------------------------------------------------------------


def test_sqrt_at_zero_distance_in_a_triplet_loss_is_a_backward_producer_in_the_loss() -> None:
    torch.manual_seed(0)
    embed = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    anchor = torch.randn(6, 8)
    positive = anchor.clone()  # same inputs: distance exactly 0
    negative = torch.randn(6, 8)

    def step() -> None:
        a, p, n = embed(anchor), embed(positive), embed(negative)
        loss = F.relu(distance(a, p) - distance(a, n) + 1.0).mean()
        assert torch.isfinite(loss)  # nothing non-finite in forward
        loss.backward()

    report = raised(step, embed)
    assert report.phase == "backward"
    assert report.module is None  # the loss code, outside every module
    assert report.nan > 0
    assert any("outside every watched module" in note for note in report.notes)
    # The loss code's nodes are listed; of them only the two square roots can have an infinite derivative.
    (region,) = [note for note in report.notes if "autograd nodes" in note]
    assert "can be infinite: SqrtBackward0 x2" in region and "PowBackward0" in region
    # The tiered default replays the loss code's recorded ops with their backward: the op and its line.
    assert (report.op, report.source.lineno if report.source else None) == (
        "aten.div.Tensor", marked_line("distance", where=faults))
    # Every measured forward row is finite (a module passed through is listed without numbers).
    forward_rows = [row for row in report.layers if row.phase == "forward" and row.stats is not None]
    assert forward_rows and all(row.stats.nonfinite == 0 for row in forward_rows)


class AngleHead(nn.Module):
    """Angle between two embeddings: acos at exactly 1 has an infinite derivative."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cosine = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        return torch.acos(cosine.clamp(-1.0, 1.0))


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.head = AngleHead()
        with torch.no_grad():
            self.encoder.weight.copy_(torch.eye(4))
            self.encoder.bias.zero_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x), self.encoder(y))


def test_acos_at_one_after_a_clamp_names_the_module_whose_backward_produced_it() -> None:
    model = Siamese()
    x = torch.eye(4)  # one-hot rows: cosine exactly 1 with themselves

    report = raised(lambda: model(x, x.clone()).mean().backward(), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("backward", "head", "AngleHead")
    # The replay named the op: its output is the report's tensor; the gradient the check saw is kept beside it.
    assert report.tensor == TensorRef.op_output("aten.rsqrt.default") and report.posinf > 0
    seen = report.module_output[0] if report.module_output is not None else None
    assert seen is not None and seen.role is TensorRole.OUTPUT_GRADIENT and seen.path.startswith("input[")
    # The replay of head's backward names the forward line that created the node.
    assert report.source is not None and report.source.function == "forward"
    assert report.source.line == "return torch.acos(cosine.clamp(-1.0, 1.0))"
    assert report.source.filename == __file__
    assert any("(AcosBackward0)" in note for note in report.notes)


class AcosOfInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.acos(x.clamp(-1.0, 1.0))  # infinite derivative at +-1


def _acos_chain() -> tuple[nn.Sequential, Callable[[], None]]:
    """Linear, acos, Linear: the acos's backward makes the third gradient infinite."""
    model = nn.Sequential(nn.Linear(2, 2), AcosOfInput(), nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    return model, lambda: model(torch.ones(1, 2)).sum().backward()


def test_the_finite_gradients_before_a_backward_producer_are_rows_of_its_table() -> None:
    model, step = _acos_chain()
    report = raised(step, model)
    rows = [row for row in report.layers if row.phase == "backward"]
    gradient = TensorRole.OUTPUT_GRADIENT
    assert [(row.module, row.module_type, row.tensor, row.status) for row in rows] == [
        (None, None, TensorRef(gradient, "", "output"), "ok"),  # computed by the loss code: the model's output
        ("2", "Linear", TensorRef(gradient, None, "input[0]"), "ok"),
        ("1", "AcosOfInput", TensorRef(gradient, None, "input[0]"), "producer"),
    ]
    table = report.table
    assert list(table[table["phase"] == "backward"]["tensor"]) == ["grad of model output", *["grad of input[0]"] * 2]
    assert [row.stats.shape for row in rows] == [(1, 3), (1, 2), (1, 2)]
    assert [row.stats.nonfinite for row in rows[:2]] == [0, 0] and rows[2].stats.nonfinite == 2
    # In the order autograd computed them, after every forward row.
    assert [row.index for row in rows] == sorted(row.index for row in rows)
    assert min(row.index for row in rows) > max(row.index for row in report.layers if row.phase != "backward")


def test_a_table_bounded_by_max_layers_counts_the_gradient_rows_it_drops() -> None:
    model, step = _acos_chain()
    whole = raised(step, model)
    model, step = _acos_chain()
    bounded = raised(step, model, max_layers=3)
    assert [row.tensor for row in bounded.layers] == [row.tensor for row in whole.layers[-3:]]
    assert bounded.layers[-1].status == "producer"
    assert bounded.layers_dropped == len(whole.layers) - 3


def test_where_with_an_overflowing_unselected_branch_is_found_through_the_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), GuardedExp(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(100.0)  # every input to GuardedExp is ~100: exp(100) = inf
    x = torch.randn(3, 4)

    def step() -> None:
        out = model(x)
        assert torch.isfinite(out).all()  # the forward output is finite
        out.sum().backward()

    report = raised(step, model)
    assert (report.phase, report.module, report.module_type) == ("backward", "1", "GuardedExp")
    assert report.nan > 0
    # GuardedExp's input is not saved by autograd (exp saves its result):
    # the replay recomputes it from model[0] to name the line and the node.
    assert report.source is not None and report.source.line.startswith("return torch.where(x < 20, torch.exp(x), x)")
    assert report.op == "aten.mul.Tensor"
    assert any("(ExpBackward0)" in note for note in report.notes)


def test_a_backward_replay_leaves_gradients_parameters_and_rng_as_they_were() -> None:
    def run(watched: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), GuardedExp(), nn.Linear(4, 1))
        with torch.no_grad():
            model[0].bias.fill_(100.0)
        x = torch.randn(3, 4)
        with nan_magic.watch(model, on_detect="log") if watched else contextlib.nullcontext() as w:
            model(x).sum().backward()
        if watched:
            assert w.report is not None and w.report.source is not None  # a replay ran
        grads = [p.grad.clone() for p in model.parameters()]
        return grads, torch.cat([p.detach().flatten() for p in model.parameters()]), torch.rand(3)

    plain, watched = run(False), run(True)
    for mine, theirs in zip(plain[0], watched[0]):
        assert torch.equal(mine.nan_to_num(nan=7.0), theirs.nan_to_num(nan=7.0))
    assert torch.equal(plain[1], watched[1])
    assert torch.equal(plain[2], watched[2])  # the random stream continues as it would have


def test_inputs_held_for_a_backward_replay_are_released_with_their_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    outputs: list[weakref.ref[torch.Tensor]] = []
    handles = [module.register_forward_hook(lambda _m, _a, out: outputs.append(weakref.ref(out))) for module in model]
    x = torch.randn(5, 4)
    with nan_magic.watch(model):
        loss = model(x).sum()
        # The watch holds the inputs that autograd saved (free: autograd keeps them anyway)...
        assert any(ref() is not None for ref in outputs)
        loss.backward()
        del loss
        gc.collect()
        # ...for a replay of a backward producer, and none past its backward.
        assert [ref() for ref in outputs] == [None] * 5
    for handle in handles:
        handle.remove()


def test_torch_leaf_modules_are_replayed_without_saving_the_rng_state(monkeypatch) -> None:
    saved: list[int] = []
    capture = forward.capture_rng_state
    monkeypatch.setattr(forward, "capture_rng_state", lambda: saved.append(1) or capture())
    # The root call's, for the fix trials' replay of the step, is taken as the call is kept (localize/modes.py kept,
    # hot/kept/rng.py ModelStates).
    take = rng.ModelStates.take
    monkeypatch.setattr(rng.ModelStates, "take", lambda states, module: saved.append(1) or take(states, module))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
        model[2].weight.fill_(3e38)  # finite; 4 inputs of 4.0 times it overflow

    report = raised(lambda: model(torch.ones(2, 4)).sum().backward(), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("forward", "2", "Linear")
    assert report.op == "aten.addmm.default"  # the replay ran, with no RNG state saved for it
    # Only the root Sequential's call saved one: Linear and ReLU draw no random numbers.
    assert len(saved) == 1


def test_a_module_that_draws_random_numbers_is_replayed_with_the_same_draw() -> None:
    class CoinLog(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.rand(()) < 0.5  # heads: log(x); tails: log(0) = -inf
            return torch.log(x * keep)  # marker

    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), CoinLog())
    torch.manual_seed(1)  # the first draw is tails (0.76), the next one heads (0.28)
    report = raised(lambda: model(torch.ones(2, 4)), model)
    # The replay drew the same tails: with the generator left where it was, it would draw heads and stay finite.
    assert (report.module, report.module_type, report.op) == ("2", "CoinLog", "aten.log.default")
    assert report.source is not None and report.source.line.endswith("# marker")


def test_a_graph_dropped_without_a_backward_takes_the_held_inputs_with_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 4)
    outputs: list[weakref.ref[torch.Tensor]] = []
    with nan_magic.watch(model, opt):
        model(x).sum().backward()
        opt.step()
        handle = model[1].register_forward_hook(lambda _m, _a, out: outputs.append(weakref.ref(out)))
        for _ in range(3):
            out = model(x)  # evaluation that forgot no_grad: graphs built, never used
        del out
        handle.remove()
        gc.collect()
        assert [ref() for ref in outputs] == [None] * 3


def test_in_place_ops_and_modules_called_twice_work_with_gradient_checks() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    act = nn.ReLU(inplace=True)
    x = torch.randn(2, 4)

    def step() -> torch.Tensor:
        shared.zero_grad()
        h = act(shared(x))  # ReLU(inplace=True) on a module output we hook
        h = shared(h)  # the same module called twice
        h.add_(1.0)  # in place on a hooked module output
        h.sum().backward()
        return shared.weight.grad.clone()

    plain = step()
    with nan_magic.watch(shared, act) as w:
        watched = step()
    assert w.report is None
    assert torch.equal(plain, watched)


# -- loss ----------------------------------------------------------------------------


def test_cross_entropy_with_every_label_ignored_is_the_loss_code() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    labels = torch.full((4,), -100)

    def step() -> None:
        F.cross_entropy(model(x), labels).backward()

    report = raised(step, model)
    assert (report.phase, report.module, report.tensor) == ("forward", None, TensorRef(TensorRole.LOSS))
    assert report.nan == 1 and report.inputs_finite
    assert any("every watched module output of this step was finite" in note for note in report.notes)


# -- forward and data ------------------------------------------------------------------


class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


def test_std_over_a_batch_of_one_is_a_forward_producer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), BatchStandardize(), nn.Linear(4, 2))
    report = raised(lambda: model(torch.randn(1, 4)), model)
    assert (report.phase, report.module, report.module_type) == ("forward", "1", "BatchStandardize")


def test_a_dataset_that_standardises_a_constant_column_is_data() -> None:
    torch.manual_seed(0)
    table = torch.randn(64, 5)
    table[:, 2] = 3.0  # a constant column
    standardised = (table - table.mean(0)) / table.std(0)
    loader = [standardised[i : i + 16] for i in range(0, 64, 16)]
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        for batch in loader:
            opt.zero_grad()
            model(batch).mean().backward()
            opt.step()

    report = raised(train, model, opt)
    assert (report.phase, report.module, report.tensor, report.step) == ("data", "", TensorRef.argument("input[0]"), 0)
    assert report.nan == 16  # the whole constant column of the first batch
    assert report.first_bad_index == (0, 2)


# -- optimizer -------------------------------------------------------------------------


def test_adam_in_pure_fp16_with_an_epsilon_that_rounds_to_zero() -> None:
    model, opt, step = fp16_adam_step()  # rows 0, 3..9 get zero gradients: 0 / (0 + eps) with eps == 0
    report = raised(step, model, opt)
    assert (report.phase, report.module, report.module_type) == ("optimizer", "0", "Embedding")
    assert report.tensor == TensorRef.parameter("0.weight")
    assert report.nan == 32  # 8 untouched rows x 4
    assert report.step == 0
    assert any("Adam step made 0.weight non-finite" in note for note in report.notes)


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_half_precision_state_the_step_overflowed_is_named_as_that_state_not_its_parameter(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.Adam(model.parameters())
    x = torch.ones(2, 4, dtype=torch.half)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            # A float16 gradient of 1e4 is finite; 0.001 * its square, Adam's update of exp_avg_sq, is not.
            (model(x).float().sum() * 5000).backward()
            opt.step()

    report = raised(run, model, opt, defer=defer)
    state = TensorRef(TensorRole.OPTIMIZER_STATE, "weight", "exp_avg_sq")
    assert (report.phase, report.step, report.tensor) == ("optimizer", 0, state)
    assert "the Adam step made state exp_avg_sq of weight non-finite" in report.notes
    assert report.cause is not None and report.cause.label == "half-precision-overflow"
    assert report.cause.hint.startswith("state exp_avg_sq of weight overflowed float16 (max 65504) in the Adam step")


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW", "RMSprop"])
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_float32_state_that_huge_finite_gradients_overflowed_is_named(defer: bool, optimizer: str) -> None:
    # Gradients of about 1e24 are finite, their square is not: exp_avg_sq (square_avg) = inf freezes the
    # parameter's update at 0, silently, while every boundary stays finite; float32 state was never read.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3)

    def run() -> None:
        for step in range(4):
            loss = model(torch.randn(4, 4)).mean() * (1e25 if step == 2 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, defer=defer)
    key = "square_avg" if optimizer == "RMSprop" else "exp_avg_sq"
    assert (report.phase, report.step, report.module, report.optimizer) == ("optimizer", 2, "0", optimizer)
    assert report.tensor == TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", key)
    assert all(parameter.isfinite().all() for parameter in model.parameters())
    assert report.cause is not None and (report.cause.label, report.cause.reading) == (
        "overflow", "optimizer-state-overflow-wide")
    assert f"state {key} of 0.weight overflowed float32 (max 3.4e38)" in report.cause.hint


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_gradients_below_the_bound_leave_float32_state_unread(defer: bool) -> None:
    # The extra pass over the state is paid only at a step whose gradients reach BOUNDED_GRAD_NORM.
    from nan_magic.hot.checks.optimizer import step_checks as optim

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    read: list[int] = []
    original, original_flatten = optim.norms, optim._flatten

    def counting(tensors: list[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
        read.append(len(tensors))
        return original(tensors, **kwargs)

    def flattening(tensors: list[torch.Tensor]) -> torch.Tensor:  # (the gradients', and the immediate check's one sum)
        read.append(len(tensors))
        return original_flatten(tensors)

    with nan_magic.watch(model, opt, defer=defer), pytest.MonkeyPatch.context() as patch:
        patch.setattr(optim, "norms", counting)
        patch.setattr(optim, "_flatten", flattening)
        for scale in (1.0, 1.0, 1e25, 1.0):
            read.clear()
            loss = model(torch.randn(4, 4)).mean() * scale
            opt.zero_grad()
            loss.backward()
            if scale > 1:  # (the step writes inf into exp_avg_sq: an event, reported; stop before it)
                break
            opt.step()
            assert max(read, default=0) <= 4  # the 4 parameters at most, never their 8 state tensors


def _adamw_steps(steps: int, between: Callable[[int, nn.Module, torch.optim.Optimizer], None], **options: Any):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    with nan_magic.watch(model, opt, **options) as w:
        for step in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            between(step, model, opt)
            opt.step()
    return w


def test_bounded_steps_check_parameters_every_full_check_step(monkeypatch) -> None:
    checked: list[int] = []
    real = optim.read_step_result

    def counting(result):  # (every step result read at once: the immediate mode's; one sum of the 4, here)
        checked.append(len(result.updated))
        return real(result)

    monkeypatch.setattr(optim, "read_step_result", counting)
    w = _adamw_steps(2 * FULL_CHECK_EVERY + 1, lambda *_: None)
    assert w.report is None
    assert checked == [4, 4, 4]  # steps 0, 16 and 32: four parameters each


@pytest.mark.parametrize("lr", [float("inf"), 1e38], ids=["infinite", "huge"])
def test_a_step_that_is_not_bounded_is_checked_at_once(lr: float) -> None:
    def infinite_lr(step: int, _model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 5:
            opt.param_groups[0]["lr"] = lr  # a schedule gone wrong: finite but huge is no bounded step either

    with pytest.raises(NonFiniteError) as caught:
        _adamw_steps(8, infinite_lr)
    report = caught.value.report
    assert (report.phase, report.step) == ("optimizer", 5) and report.tensor.role is TensorRole.PARAMETER
    name = report.tensor.name
    assert any(f"AdamW step made {name} non-finite" in note for note in report.notes)
    # An infinite rate is the number itself (nonfinite-number); a finite one past the max is a rate too high.
    label = "nonfinite-number" if lr == float("inf") else "learning-rate-too-high"
    assert report.cause is not None and report.cause.label == label
    assert f"lr = {'inf' if lr == float('inf') else '1e38'}" in report.cause.hint


@pytest.mark.parametrize("opt_class", [torch.optim.SGD, torch.optim.AdamW])
def test_a_schedule_that_changes_lr_every_step_keeps_the_bounded_verdict_right(opt_class) -> None:
    """The verdict on all but lr is cached; a new lr each step is judged alone, and a change elsewhere afresh."""
    from nan_magic.hot.checks.optimizer.step_layout import Layout, bounded_step

    weight = nn.Parameter(torch.ones(3))
    extra = {"momentum": 0.9} if opt_class is torch.optim.SGD else {}
    opt = opt_class([weight], lr=1e-3, weight_decay=0.01, **extra)
    layout = Layout((id(weight),), [("weight", weight)], [("weight", weight)], wide=True)
    group = opt.param_groups[0]
    verdicts = []
    for lr in [1e-3, 2e-3, float("nan"), 5e-4, float("inf"), 1e13, 1e-2]:
        group["lr"] = lr
        verdicts.append(bounded_step(opt, layout))
    assert verdicts == [True, True, False, True, False, False, True]
    group["weight_decay"] = 1e12  # lr x weight_decay = 1e10: still bounded; 1e15 is not
    assert bounded_step(opt, layout)
    group["lr"] = 1e3
    assert not bounded_step(opt, layout)
    group["lr"], group["weight_decay"] = 1e-3, float("nan")
    assert not bounded_step(opt, layout)
    group["weight_decay"] = 0.0
    assert bounded_step(opt, layout)
    group["lr"] = torch.tensor(1e-3)  # a tensor lr: read, never cached
    assert bounded_step(opt, layout) and layout.bounded_for is None
    group["lr"].fill_(float("nan"))
    assert not bounded_step(opt, layout)


def test_a_warm_up_schedule_that_turns_lr_nan_is_caught_at_that_step() -> None:
    def schedule(step: int, _model: nn.Module, opt: torch.optim.Optimizer) -> None:
        # A warm-up of 0 steps: 0/0 at step 4; every other step a new, finite lr.
        opt.param_groups[0]["lr"] = 1e-3 * (step + 1) if step != 4 else float("nan")

    with pytest.raises(NonFiniteError) as caught:
        _adamw_steps(8, schedule)
    report = caught.value.report
    assert (report.phase, report.step) == ("optimizer", 4) and report.tensor.role is TensorRole.PARAMETER
    assert report.cause is not None and report.cause.label == "nonfinite-number"


class WithSpare(nn.Module):
    """Two layers, and a third the optimizer updates but forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.spare = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("steps", [FULL_CHECK_EVERY + 1, 6], ids=["next-full-check", "watch-exit"])
def test_a_parameter_written_outside_the_optimizer_is_found_by_the_next_full_check_or_the_exit(steps: int) -> None:
    torch.manual_seed(0)
    model = WithSpare()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    loaded = torch.full((4,), float("nan"))  # (made before the watch: no op of the loop made it)

    def run() -> None:
        for step in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if step == 3:
                # Rebound after the step (``.data =``, as vector_to_parameters does) to a tensor made before: no op
                # writes the parameter or made its new memory, so no check of loop writes sees it (an in-place write
                # there is named: tests/test_hunt28.py; a rebinding to what the loop's ops made: test_gaps26.py);
                # no forward check ever reads it.
                model.spare.bias.data = loaded

    report = raised(run, model, opt)
    # Found after bounded steps, which cannot make it: a value no watched code produced (phase data).
    found_at = FULL_CHECK_EVERY if steps > FULL_CHECK_EVERY else steps - 1
    assert (report.phase, report.step, report.tensor, report.module) == (
        "data", found_at, TensorRef.parameter("spare.bias"), "spare")
    assert any("last checked finite, after step 0" in note and "outside the optimizer" in note for note in report.notes)
    assert report.cause is not None and report.cause.label == "parameter-already-nonfinite"
    assert report.message.startswith(f"first non-finite parameter spare.bias in data step {found_at}: spare (Linear)")


def test_a_nonfinite_gradient_is_reported_before_the_step_runs() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        model.weight.grad[0, 1] = float("inf")  # e.g. a hand-written gradient transform
        opt.step()

    report = raised(step, model, opt, backward=False)
    # (the loop's line that wrote the number, outside every module: session 46; the module's '' before, no op)
    assert (report.phase, report.module, report.tensor) == ("backward", None, TensorRef.gradient("weight"))
    assert report.op == "aten.lift_fresh.default" and report.source is not None and report.source.lineno == (
        step.__code__.co_firstlineno + 3)
    assert report.posinf == 1
    assert torch.equal(model.weight, before)  # the step never ran


class Attention(nn.Module):
    """A bare weight, registered on this module three levels down the model (``block.0.attn.w``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = nn.Module()
        block.attn = Attention()
        self.block = nn.ModuleList([block])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block[0].attn(x))


@pytest.mark.parametrize("fault", ["gradient", "step"])
def test_a_nested_parameter_is_reported_in_the_module_that_holds_it(fault: str) -> None:
    torch.manual_seed(0)
    model = Nested()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)

    def step() -> None:
        for index in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            if index == 1 and fault == "gradient":
                model.block[0].attn.w.grad[2] = float("nan")  # a hand-written gradient transform
            if index == 1 and fault == "step":
                opt.param_groups[0]["lr"] = float("inf")
            opt.step()

    report = raised(step, model, opt, backward=False)
    if fault == "gradient":
        # (session 46: the loop's line that wrote the number is the producer, outside every module, as for a
        # gradient its ``mul_`` wrote; before, no op was named and the parameter's owner stood in for it)
        assert (report.tensor, report.module, report.op) == (
            TensorRef.gradient("block.0.attn.w"), None, "aten.lift_fresh.default")
        assert "first non-finite gradient of block.0.attn.w in backward step 1: code outside" in report.message
        return
    assert (report.tensor, report.module, report.module_type) == (
        TensorRef.parameter("block.0.attn.w"), "block.0.attn", "Attention")
    assert "block.0.attn (Attention)" in report.message


def test_step_counts_optimizer_steps_across_phases() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)

    def train() -> None:
        for step in range(5):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if step == 2:
                with torch.no_grad():
                    model.weight.fill_(float("nan"))  # corrupted outside the optimizer

    report = raised(train, model, opt)
    # The loop's write after step 2's optimizer step: three steps completed (named by the write, phase optimizer).
    assert (report.phase, report.tensor, report.step) == ("optimizer", TensorRef.parameter("weight"), 3)
    assert report.op == "aten.fill_.Scalar"


# -- GradScaler -----------------------------------------------------------------------


def test_grad_scaler_overflow_in_the_first_steps_is_benign() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt, scaler, train = amp_training(model, 12, init_scale=2.0**24)
    with nan_magic.watch(model, opt, scaler) as w:
        train()
    assert w.report is None  # nothing raised, no real event
    skipped = len(w.events)
    assert 1 <= skipped < 12 and all(event.benign for event in w.events)
    assert all(event.phase == "backward" for event in w.events)
    assert "the GradScaler skipped this step" in w.events[0].notes[-1]
    assert w.step == 12 - skipped  # optimizer steps that ran
    assert scaler.get_scale() == 2.0**24 / 2**skipped  # one halving per skipped step


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_gradient_accumulation_under_a_grad_scaler_reads_the_gradients_only_where_the_scaler_skips(
    defer: bool, monkeypatch
) -> None:
    # Each micro-step of accumulation ends with no optimizer step, as a skipped step does, but it is no skip: an
    # overflow in its backward waits for scaler.step, and only a skip seen there reads the parameter gradients
    # (every one of them: a host sync on a GPU). Taken for skips, the micro-steps raised a false alarm.
    reads: list[int] = []
    read = optim.check_parameter_grads
    monkeypatch.setattr(optim, "check_parameter_grads", lambda named, *rest: reads.append(len(named)) or read(named,
                                                                                                          *rest))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # the first steps overflow in float16
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    with nan_magic.watch(model, opt, scaler, defer=defer) as w:
        for _ in range(8):
            for _micro in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y) / 4
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    skipped = 8 - w.step
    assert w.report is None and skipped >= 1 and len(w.events) == skipped  # each skip a benign event
    assert all(event.benign and "the GradScaler skipped this step" in event.notes[-1] for event in w.events)
    assert len(reads) <= skipped  # none for the 3 micro-steps of each of the 8 steps


def test_grad_scaler_whose_scale_keeps_collapsing_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), GuardedExp(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias.fill_(100.0)  # NaN gradients at any scale
    opt, scaler, train = amp_training(model, 40, init_scale=2.0**16)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, scaler) as w:
        train()
    report = caught.value.report
    assert not report.benign and report.cause is not None
    assert report.cause.label == "grad-scaler-collapse"
    assert report.module == "1"
    assert len(w.events) == COLLAPSE_SKIPS + 1  # the benign skips, then the raise


# -- gradients measured in backward ("hot gradients", step_checks.py) -------------------------


def _wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))  # 65536 weights: measured hot


def _cold_sizes(monkeypatch) -> list[list[int]]:
    """The sizes of the gradients each optimizer step had to measure itself (not in backward).

    One list per measuring call: a norm per gradient (``reads.norms``) or one over
    the small ones concatenated (``optim._flatten``).
    """
    cold: list[list[int]] = []
    in_step = []
    real_norms, real_flatten, real_pre = optim.norms, optim._flatten, optim.OptimizerChecks.on_step_pre

    def recording(tensors, *, finiteness_only=False):
        if in_step and not finiteness_only:
            cold.append(sorted(tensor.numel() for tensor in tensors))
        return real_norms(tensors, finiteness_only=finiteness_only)

    def flattening(tensors):
        if in_step:
            cold.append(sorted(tensor.numel() for tensor in tensors))
        return real_flatten(tensors)

    def pre(self, *args):
        in_step.append(True)
        try:
            return real_pre(self, *args)
        finally:
            in_step.pop()

    monkeypatch.setattr(optim, "norms", recording)
    monkeypatch.setattr(optim, "_flatten", flattening)
    monkeypatch.setattr(optim.OptimizerChecks, "on_step_pre", pre)
    return cold


def test_large_gradients_are_measured_in_backward_and_reused_at_the_step(monkeypatch) -> None:
    cold = _cold_sizes(monkeypatch)
    model = _wide_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 256)
    with nan_magic.watch(model, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert w.report is None and w.history[-1].grad_norm is not None
    # At each step only the small gradients (the biases and the 256-weight head) are measured.
    assert cold == [[1, 256, 256]] * 3


def test_a_gradient_changed_after_backward_is_measured_again_at_the_step() -> None:
    model = _wide_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = model[0].weight.detach().clone()

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        model[0].weight.grad[3, 7] = float("inf")  # after its hot measurement
        opt.step()

    report = raised(step, model, opt)
    assert (report.phase, report.tensor, report.posinf) == ("backward", TensorRef.gradient("0.weight"), 1)
    assert torch.equal(model[0].weight, before)  # the step never ran


def test_accumulated_gradients_fall_back_to_measuring_at_the_step(monkeypatch) -> None:
    cold = _cold_sizes(monkeypatch)
    model = _wide_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nan_magic.watch(model, opt) as w:
        for step in range(2):
            opt.zero_grad()
            for micro in range(2):
                batch = torch.randn(4, 256)
                if step == 1 and micro == 1:
                    batch[0, 0] = float("nan")  # a NaN in the second micro-batch
                with contextlib.suppress(NonFiniteError):
                    model(batch).sum().backward()
            if w.report is None:
                opt.step()
    assert w.report is not None and (w.report.phase, w.report.step) == ("data", 1)
    assert any(65536 in sizes for sizes in cold)  # measured at the step once accumulation was seen
