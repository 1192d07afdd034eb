"""The default, tiered watch: boundary checks every step, the failing step replayed to name the producer.

What a user sees: the same module, op and line as ``ops=True``; whether the
replay reproduced the event; nothing of the replay left on the model, its
gradients or the random stream; compiled models watched; an exception that
a NaN caused explained; the loss code's op named from its recorded ops.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import traceback
import weakref

import faults
import pytest
import torch
from torch import nn
from watching import attributes_read, train_steps

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.localize.outside.held import KEEP_BYTES
from nan_magic.localize.outside.recorded_ops import WeakRecord
from nan_magic.records import TensorRef


def _marked(key: str) -> int:
    return faults.marked_line(key, where=sys.modules[__name__])


class ExpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + torch.exp(x)  # producer: block exp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.BatchNorm1d(8)
        self.block = ExpBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.drop(torch.relu(self.inp(x))))))


def _net(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.001)  # healthy until a batch 400 times larger


def _batches(n: int, big_at: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    batches = [torch.randn(16, 8) for _ in range(n)]
    if big_at is not None:
        batches[big_at] = batches[big_at] * 400.0
    return batches


def test_a_forward_producer_deep_inside_is_named_with_its_op_line_and_step() -> None:
    model, opt = _net()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        train_steps(model, opt, _batches(6, big_at=3))
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "block", "ExpBlock", 3)
    assert report.op == "aten.exp.default"
    assert report.source is not None and report.source.lineno == _marked("block exp")
    assert report.reproduced is True
    assert report.posinf > 0 and report.tensor == TensorRef.op_output("aten.exp.default")
    # The per-layer table is the replayed step's: the producer row, and the rows before it finite.
    producers = [row.module for row in report.layers if row.status == "producer"]
    assert producers == ["block"]
    # %debug opens in the frame that ran the op, with its locals.
    last = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert last.lineno == _marked("block exp")
    assert report.debug_frame is not None and report.debug_frame.function == "forward"
    assert {name for name, _stats in report.debug_locals} >= {"x", "h"}


def test_a_healthy_run_is_bit_identical_and_leaves_buffers_and_the_random_stream_alone() -> None:
    watched, opt_w = _net()
    plain, opt_p = _net()
    batches = _batches(60)
    torch.manual_seed(7)
    expected = train_steps(plain, opt_p, batches)
    after_plain = torch.rand(3)
    torch.manual_seed(7)
    with nan_magic.watch(watched, opt_w) as w:
        got = train_steps(watched, opt_w, batches)
    after_watched = torch.rand(3)
    assert w.report is None and w.events == []
    assert got == expected
    assert torch.equal(after_plain, after_watched)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    # History: a row per step; the per-module steps (the second, then every 50th) measured the layers.
    assert [row.step for row in w.history][:3] == [0, 1, 2] and len(w.history) == 60


def test_the_replay_changes_no_gradient_buffer_parameter_or_random_draw() -> None:
    """on_detect="log": training goes on after the event exactly as it would unwatched."""
    batches = _batches(6, big_at=3)
    plain, opt_p = _net()
    torch.manual_seed(3)
    expected = train_steps(plain, opt_p, batches)
    watched, opt_w = _net()
    torch.manual_seed(3)
    with nan_magic.watch(watched, opt_w, on_detect="log") as w:
        got = train_steps(watched, opt_w, batches)
    assert w.report is not None and w.report.module == "block" and w.report.reproduced
    assert str(got) == str(expected)  # NaN-aware comparison of the losses
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    for a, b in zip(watched.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)


class SqrtAtZero(nn.Module):
    """Finite forward (sqrt of 0); sqrt's derivative at 0 is +inf, times the gradient: the backward makes inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + torch.sqrt(h - h.detach())  # producer: sqrt at zero


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_backward_producer_inside_the_model_is_named_by_replaying_forward_and_backward(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    grads_before = None
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        grads_before = [p.grad.clone() for p in model.parameters()]
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type) == ("backward", "1", "SqrtAtZero")
    assert report.op is not None and report.op.startswith("aten.")
    assert report.source is not None and report.source.lineno == _marked("sqrt at zero")
    assert report.reproduced is True
    # The replay's backward went into scratch gradients: .grad is what the user's backward left.
    for p, before in zip(model.parameters(), grads_before):
        torch.testing.assert_close(p.grad, before, rtol=0, atol=0, equal_nan=True)


class FirstCallOnly(nn.Module):
    """Makes a NaN on its first call only: a side effect the replay cannot reproduce."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.calls == 1 else x


def test_an_event_the_replay_does_not_reproduce_is_reported_as_the_boundary_saw_it() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FirstCallOnly())
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(2, 3))
    report = caught.value.report
    assert report.reproduced is False
    assert (report.phase, report.module, report.nan) == ("forward", "", 6)  # the model's output, as seen
    assert report.op is None
    assert any("did not reproduce" in note and 'mode="full"' in note for note in report.notes)
    assert "reproduce" in report.to_text()
    assert "\n  seen in     Sequential (root)" in report.to_text() and "\n  producer " not in report.to_text()


class FirstCallOnlyBackward(nn.Module):
    """A sqrt at 0 on its first call only (an infinite derivative in the backward); the replay's call is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.sqrt(x * 0) if self.calls == 1 else x


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_backward_event_the_replay_does_not_reproduce_names_where_it_was_seen_not_a_producer(defer) -> None:
    # The NaN is born in FirstCallOnlyBackward's backward and flows into 0's weight gradient, which the
    # optimizer's check sees: 0 is where it was seen, not the producer, and the report must not say otherwise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), FirstCallOnlyBackward(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    report = caught.value.report
    assert report.reproduced is False and report.phase == "backward" and report.op is None
    text = report.to_text()
    assert "\n  seen in     0 (Linear)" in text and "\n  producer " not in text


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.logits(x) * float("inf"), -1)  # producer: inf logits
        return torch.multinomial(probs, 1)


def test_an_exception_a_nan_caused_is_explained_and_stays_chained() -> None:
    torch.manual_seed(0)
    model = Sampler()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(3, 4))
    report = caught.value.report
    assert report.phase == "forward" and report.module == ""
    assert report.op is not None and report.source is not None and report.source.lineno == _marked("inf logits")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert any("then the forward raised RuntimeError" in note for note in report.notes)


def test_an_exception_without_a_nan_before_it_is_left_alone() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("not ours")

    with pytest.raises(KeyError), nan_magic.watch(Fails()) as w:
        w.targets.roots[0][1](torch.ones(2))
    assert w.report is None


def test_loss_code_is_traced_for_its_op_and_line() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        p = model(x)
        loss = torch.log(p - 2.0).mean()  # producer: log of negatives
        opt.zero_grad()
        loss.backward()
    report = caught.value.report
    assert (report.phase, report.module, report.op) == ("forward", None, "aten.log.default")
    assert report.source is not None and report.source.lineno == _marked("log of negatives")


def test_loss_code_running_more_ops_than_the_budget_is_said_to_be_untraced() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt) as w:
        for step in range(2):
            out = model(x)
            for _ in range(600):  # metrics computed in the loss region
                out.detach().abs().mean()
            loss = out.mean() / (0.0 if step == 1 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, None)
    assert any("ran more ops a step than the watch records" in note for note in report.notes)
    assert "loss" in w.outside.untraced


@pytest.mark.parametrize("every", [1, 3])
def test_per_module_steps_come_every_full_every_steps(every: int) -> None:
    model, opt = _net()
    seen = []
    with nan_magic.watch(model, opt, full_every=every) as w:
        for x in _batches(7):
            train_steps(model, opt, [x])
            seen.append(w.cycle.full_step)  # decided when the step's forward began
    expected = [True] * 7 if every == 1 else [i % 3 == 1 for i in range(7)]
    assert seen == expected


def test_the_full_mode_checks_every_module_and_bad_modes_are_refused() -> None:
    model, opt = _net()
    with nan_magic.watch(model, opt, mode="full") as w:
        train_steps(model, opt, _batches(2))
    assert w.cycle.full_step
    with pytest.raises(ValueError, match="mode must be 'tiered' or 'full', not 'fast'"):
        nan_magic.watch(model, mode="fast")
    with pytest.raises(ValueError, match="full_every must be at least 1"):
        nan_magic.watch(model, full_every=0)


def test_the_coverage_is_the_modes_object_and_no_other_part_of_the_hot_path_asks_the_mode() -> None:
    """Only hot/watched/coverage.py knows the tiered and full modes apart (hot/timing.py the immediate and deferred)."""
    from nan_magic.hot.watched.coverage import Boundaries, EveryCall

    model, opt = _net()
    with nan_magic.watch(model, opt) as tiered, nan_magic.watch(model, opt, mode="full") as full:
        pass
    assert isinstance(tiered.cycle.coverage, Boundaries) and isinstance(full.cycle.coverage, EveryCall)
    assert attributes_read("hot", ("tiered", "mode", "full_every"), allowed="coverage.py") == []


def test_a_top_level_call_of_a_submodule_keeps_its_qualified_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(3, 3), ExpBlockSmall()))
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model.body(torch.full((2, 3), 50.0))
    assert caught.value.report.module == "body.1"


class ExpBlockSmall(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x * 100.0)


def test_a_watch_entered_for_one_step_is_as_cheap_as_its_boundaries() -> None:
    """The decorator form: one step per entry, and the replay still names the producer."""
    model, opt = _net()
    batches = _batches(4, big_at=2)

    @nan_magic.watch(model, opt)
    def step(x: torch.Tensor) -> None:
        train_steps(model, opt, [x])

    step(batches[0])
    step(batches[1])
    with pytest.raises(NonFiniteError) as caught:
        step(batches[2])
    assert (caught.value.report.module, caught.value.report.op) == ("block", "aten.exp.default")
    assert copy.deepcopy(caught.value.report).reproduced is True


@pytest.mark.parametrize("ops", [False, True], ids=["default", "ops"])
@pytest.mark.parametrize("bad", [0, 2], ids=["first batch", "third batch"])
def test_a_batch_the_loop_computes_is_data_named_at_its_op_and_line(bad: int, ops: bool) -> None:
    # The first batch too: its data code runs between the watch's entry and the first model call, and
    # in ops mode the batch's origin outlives the reset of the step its model call opens.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raw = [torch.randn(8, 4) for _ in range(3)]
    raw[bad] = torch.ones(8, 4)  # no spread
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        for batch in raw:
            x = (batch - batch.mean(0)) / batch.std(0)  # producer: normalise the batch
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    seen = (report.phase, report.module, report.step, report.tensor)
    assert seen == ("data", "", bad, TensorRef.argument("input[0]"))
    assert report.op == "aten.div.Tensor"
    assert report.source is not None and report.source.lineno == _marked("normalise the batch")


def test_setup_code_over_the_budget_before_the_first_call_leaves_later_batches_recorded() -> None:
    # A cell often builds its model and data inside the watch: that region's ops over the budget do not
    # turn off the recording of the data code of the steps after.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt) as w:
        raw = [torch.randn(8, 4) for _ in range(100)]  # more ops than the data budget
        raw[1] = torch.ones(8, 4)
        for batch in raw:
            x = batch / batch.std(0)  # producer: scale by a zero spread
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("data", "", 1, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _marked("scale by a zero spread")
    assert not w.outside.untraced


def test_replaying_the_loss_code_leaves_the_users_tensors_alone() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    y = torch.tensor([[1.0, -1.0]] * 3)
    kept = y.clone()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        out = model(torch.randn(3, 4))
        target = y.clamp_(min=0.0)  # in place on the user's tensor, once
        loss = (out - target).abs().log().sum() + torch.log(out.sum() * 0)  # producer: log of zero
        loss.backward()
    assert (caught.value.report.op, caught.value.report.source.lineno) == ("aten.log.default", _marked("log of zero"))
    assert torch.equal(y, kept.clamp(min=0.0))  # clamped once, by the user's line; the replay used a copy


def test_a_dispatch_mode_the_user_enters_around_the_model_stays_balanced() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    model = nn.Linear(4, 1)
    with nan_magic.watch(model) as w:
        with Counting() as counting:
            model(torch.randn(2, 4)).sum()
        assert _get_current_dispatch_mode() is None or _get_current_dispatch_mode() is w.outside
    assert _get_current_dispatch_mode() is None and counting.ops > 0


def test_nothing_of_a_step_is_held_once_its_optimizer_stepped() -> None:
    import weakref

    model, opt = _net()
    x = _batches(1)[0]
    with nan_magic.watch(model, opt) as w:
        out = model(x)
        output = weakref.ref(out)
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        assert w.replays is not None and w.replays.calls[-1].output_grads  # held for a replay until the step
        opt.step()
        assert not w.replays.calls  # the step is over: its arguments and gradients are released
        del out, loss
        assert output() is None


class TwoLines(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.exp(x * 100.0)  # producer: exp before the end
        total = weights.sum(-1, keepdim=True)
        return weights / total


def test_debug_opens_on_the_producers_line_though_the_replay_ran_on() -> None:
    model = nn.Sequential(nn.Identity(), TwoLines())
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.full((2, 3), 5.0))
    last = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert last.lineno == _marked("exp before the end")
    report = caught.value.report
    assert report.debug_frame is not None and report.debug_frame.lineno == _marked("exp before the end")


def test_during_backward_the_loss_codes_large_tensors_are_held_weakly_and_a_freed_one_gives_up_quietly() -> None:
    torch.manual_seed(0)
    # Its output, two rows of KEEP_BYTES / 4 floats, is over the size the recorder keeps through backward.
    model = nn.Linear(4, KEEP_BYTES // 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model) as w:
        # The model's output is not kept by the user nor saved by autograd here (sqrt saves its result):
        loss = torch.sqrt(model(torch.randn(2, 4)) * 0.0).sum()
        assert w.outside is not None and w.outside._ops  # recorded, strongly, until backward starts
        loss.backward()
    report = caught.value.report
    assert (report.phase, report.module) == ("backward", None)
    assert report.op is None  # the replay needed the freed output: no guess, the autograd node instead
    assert any("SqrtBackward0" in note for note in report.notes)


def test_a_loss_code_of_small_tensors_keeps_its_records_as_they_are_and_a_large_one_in_a_list_is_weakened() -> None:
    # weaken()'s shortcut: while every recorded storage is small, backward() leaves the records alone
    # (each tensor would stay anyway); a large one, even one reached only through a list argument, is not.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    seen: list[list[type]] = []
    with nan_magic.watch(model) as w:
        recorder = w.outside
        assert recorder is not None

        def record_kinds(_grad: torch.Tensor) -> None:  # during backward: after weaken(), before forget()
            seen.append([type(item) for op in recorder._ops for value in op.args
                         for item in (value if isinstance(value, list) else [value])])

        out = model(torch.randn(2, 4))
        out.register_hook(record_kinds)
        out.pow(2).mean().backward()
        out = model(torch.randn(2, 4))
        out.register_hook(record_kinds)
        norms = torch._foreach_norm([torch.zeros(KEEP_BYTES // 4 + 1)])  # small output, the large one in a list
        (out.sum() + norms[0]).backward()
    small, large = seen
    assert torch.Tensor in small and all(kind is not WeakRecord for kind in small)  # not rebuilt as weak records
    assert WeakRecord in large


def test_a_kept_small_value_does_not_keep_the_large_tensors_its_autograd_node_saved() -> None:
    # A metric in the loop: logsumexp's 256-byte output is small enough to keep through backward, but its
    # autograd node saved a 16 MiB tensor, which must be freed by backward as it would be unwatched.
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alive_in_backward = []
    with nan_magic.watch(model, opt):
        h = model(torch.randn(64, 16))
        big = h.exp().repeat(1, 4000)
        freed = weakref.ref(big)
        big.logsumexp(-1).mean().item()
        del big
        h.register_hook(lambda grad: alive_in_backward.append(freed() is not None))
        h.pow(2).mean().backward()
        opt.step()
    assert alive_in_backward == [False]


def test_a_one_line_loss_whose_intermediates_autograd_frees_is_still_named_at_its_op_and_line() -> None:
    # A contrastive distance written in one line: backward frees each intermediate as its node runs.
    # Small tensors stay held through backward, so the replay of the loss's backward names the op.
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    opt = torch.optim.SGD(embed.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(embed, opt):
        torch.sqrt(((embed(x) - embed(x.clone())) ** 2).sum(-1)).sum().backward()  # producer: one-line distance
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.autograd_node) == (
        "backward", None, "aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("one-line distance")
    assert report.cause is not None and report.cause.label == "sqrt-domain"


def test_a_compiled_loss_function_still_compiles_under_the_watch() -> None:
    import torch._dynamo as dynamo

    graphs: list[object] = []

    def counting(graph, inputs):  # type: ignore[no-untyped-def]
        graphs.append(graph)
        return dynamo.lookup_backend("aot_eager")(graph, inputs)

    @torch.compile(backend=counting)
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out.tanh() * 2).pow(2).mean()

    dynamo.reset()
    model, opt = _net()
    with nan_magic.watch(model, opt):
        for x in _batches(3):
            loss = loss_fn(model(x))  # recorded by the watch, yet compiled: the recorder yields to dynamo
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert len(graphs) == 1
    dynamo.reset()


def test_replaying_the_loss_code_draws_the_same_noise_and_leaves_the_random_stream_alone() -> None:
    def run(watched: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with nan_magic.watch(model, opt, on_detect="log") if watched else contextlib.nullcontext() as w:
            for step in range(3):
                out = model(torch.randn(8, 4))
                noisy = out + 0.1 * torch.randn_like(out)
                loss = torch.log(noisy.abs().mean() * (0.0 if step == 1 else 1.0))  # producer: noisy log
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        if watched:
            assert w.report is not None and w.report.op == "aten.log.default"
            assert w.report.source is not None and w.report.source.lineno == _marked("noisy log")
        return losses, torch.rand(3)

    assert str(run(True)) == str(run(False))  # the same draws after the replay as unwatched


def test_an_inference_loop_does_not_keep_the_previous_iterations_values() -> None:
    import gc
    import weakref

    model = nn.Linear(4, 6)
    seen: list[weakref.ref[torch.Tensor]] = []
    with torch.no_grad(), nan_magic.watch(model):
        for _ in range(3):
            logits = model(torch.randn(2, 4))
            scores = logits.log_softmax(-1)
            seen.append(weakref.ref(scores))
            del logits, scores
            gc.collect()
        # every iteration's values are free once the next model call has judged its batch
        assert [ref() for ref in seen[:-1]] == [None, None]


def test_a_gan_generators_backward_producer_is_named_after_the_discriminators_step() -> None:
    torch.manual_seed(0)
    g, d = SqrtAtZero(), nn.Linear(4, 1)  # the generator's backward makes inf
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(g, d, opt_g, opt_d):
        fake = g(torch.randn(5, 4))
        loss_d = d(fake.detach()).mean() - d(torch.randn(5, 4)).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = -d(fake).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.reproduced) == (
        "backward", "", "SqrtAtZero", True), report.message
    assert report.source is not None and report.source.lineno == _marked("sqrt at zero")


def test_a_nested_watch_leaves_the_outer_watchs_warning_filter_in_place() -> None:
    import warnings

    outer_model, inner_model = nn.Linear(2, 2), nn.Linear(2, 2)
    with nan_magic.watch(outer_model):
        before = list(warnings.filters)
        with nan_magic.watch(inner_model, mode="full"):
            pass
        assert warnings.filters == before


#: What each call of Stateful left on its module, appended as its forward returns (a replay's call too).
_STATES: list[tuple[object, ...]] = []


class Stateful(nn.Module):
    """A forward with side effects on its module: a counter, a cache list and dict, in-place writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Parameter(torch.zeros(8), requires_grad=False)  # an EMA kept in a frozen parameter
        self.calls = 0
        self.seen: list[torch.Tensor] = []
        self.by_call: dict[int, float] = {}
        self.running = torch.zeros(8)  # a plain tensor attribute, written in place
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.detach())
        self.by_call[self.calls] = float(x.abs().sum())
        with torch.no_grad():
            self.frozen.mul_(0.5).add_(x.mean(0))
            self.running.add_(1.0)
        h = self.lin(x)
        self.last = h.detach()
        _STATES.append((self.calls, list(self.seen), dict(self.by_call), self.frozen.detach().clone(),
                        self.running.clone(), self.last))
        return torch.exp(h)  # producer: stateful exp


@pytest.mark.parametrize("mode", ["tiered", "full"])
def test_the_replay_leaves_the_modules_python_state_and_in_place_writes_as_the_step_left_them(mode: str) -> None:
    torch.manual_seed(0)
    model = Stateful()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [torch.randn(4, 8) for _ in range(3)] + [torch.full((4, 8), 200.0)]
    weight = model.lin.weight.detach().clone()
    _STATES.clear()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, mode=mode):
        for x in batches:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    report = caught.value.report
    assert (report.module, report.op, report.step) == ("", "aten.exp.default", 3)
    assert report.source is not None and report.source.lineno == _marked("stateful exp")
    if mode == "tiered":
        assert report.reproduced is True
    # The user's fourth call left this; the replay ran the forward again after it (a fifth state)...
    assert len(_STATES) >= 5
    calls, seen, by_call, frozen, running, last = _STATES[3]
    # ...and the module is as the user's call left it: nothing of the replay remains.
    assert model.calls == calls == 4
    assert len(model.seen) == 4 and all(a is b for a, b in zip(model.seen, seen))
    assert model.by_call == by_call and sorted(by_call) == [1, 2, 3, 4]
    assert torch.equal(model.frozen, frozen)
    assert torch.equal(model.running, running) and torch.equal(running, torch.full((8,), 4.0))
    assert model.last is last  # the attribute the user's call bound, not the replay's
    assert torch.equal(model.lin.weight, weight)


class _LogHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # producer: log head


class _Critic(nn.Module):
    """A DCGAN-style model: its layers are main.0, main.1, as the generator's are."""

    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 4), _LogHead() if bad else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


@pytest.mark.parametrize("mode", ["tiered", "full"])
def test_with_several_models_the_report_says_which_model_the_module_is_in(mode: str) -> None:
    torch.manual_seed(0)
    generator, critic, twin = _Critic(bad=False), _Critic(bad=True), _Critic(bad=True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(generator, critic, mode=mode):
        critic(generator(torch.randn(3, 4)) - 10.0)
    report = caught.value.report
    assert (report.module, report.model, report.models_watched) == ("main.1", "_Critic#2", 2)
    assert "main.1 (_LogHead) in _Critic#2, op aten.log.default" in report.message
    # Labelled (the magics pass variable names): the label names it; one model needs no naming.
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(
        generator, critic, labels=["netG", "netD"], mode=mode
    ):
        critic(generator(torch.randn(3, 4)) - 10.0)
    assert "main.1 (_LogHead) in netD, op" in caught.value.report.message
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(twin, mode=mode):
        twin(torch.randn(3, 4) - 10.0)
    assert caught.value.report.message.startswith("first non-finite value in forward step 0: main.1 (_LogHead), op")


class SqrtSwitch(nn.Module):
    """Passes its input on until ``bad`` is set; then ``sqrt`` at zero, whose backward divides by zero."""

    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0) if self.bad else x  # producer: switched sqrt


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint``: recomputed inside backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), SqrtSwitch())
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant))


def _train_checkpointed(reentrant: bool, watched: dict[str, object] | None, steps: int = 4) -> Checkpointed:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    context = nan_magic.watch(model, opt, **watched) if watched is not None else contextlib.nullcontext()
    with context:
        for _ in range(steps):
            # The reentrant form needs an input that requires gradients to build its graph.
            loss = model(torch.randn(8, 16, requires_grad=reentrant)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("options", [{}, {"full_every": 1}, {"mode": "full"}, {"ops": True}],
                         ids=["tiered", "full_every=1", "full", "ops"])
def test_checkpointed_training_is_silent_and_bit_identical_to_unwatched(
        reentrant: bool, options: dict[str, object]) -> None:
    # The recompute inside backward was taken for a new top-level call: a replay "explained" the
    # non-reentrant form's early stop and saved tensors it counts (CheckpointError in backward).
    plain = _train_checkpointed(reentrant, None)
    watched = _train_checkpointed(reentrant, options)
    for before, after in zip(plain.parameters(), watched.parameters()):
        torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("bad_step", [0, 1], ids=["boundary-step", "per-module-step"])
def test_a_backward_producer_inside_a_checkpointed_block_is_named(reentrant: bool, bad_step: int) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        for step in range(3):
            model.block[2].bad = step == bad_step
            loss = model(torch.randn(8, 16, requires_grad=reentrant)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.step) == (
        "backward", "block.2", "SqrtSwitch", bad_step), report.message
    assert (report.op, report.autograd_node, report.reproduced) == ("aten.div.Tensor", "SqrtBackward0", True)
    assert report.source is not None and report.source.lineno == _marked("switched sqrt")
    # The replay inlined reentrant checkpoints by patching torch's class: the patch is gone.
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__


class WhereRoot(nn.Module):
    """The root of the positive part by torch.where: the NaN of the other side is absorbed, its backward is 0 * NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))  # producer: where root


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("options", [{}, {"defer": True}, {"ops": True}], ids=["immediate", "deferred", "ops"])
def test_a_nan_a_checkpointed_forward_absorbs_is_named_at_the_backward_op_that_reads_it(
        reentrant: bool, options: dict[str, object]) -> None:
    # The recompute inside backward ran the forward's sqrt again: taken for a backward op, it was named the
    # producer ("aten.sqrt.default" in backward, unclassified) instead of SqrtBackward0's mul.
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    model.block = nn.Sequential(nn.Linear(16, 16), WhereRoot())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        loss = model(torch.randn(8, 16, requires_grad=reentrant)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.autograd_node) == (
        "backward", "block.1", "aten.mul.Scalar", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("where root")
    assert report.cause is not None and report.cause.label == "sqrt-domain"


@pytest.mark.parametrize("checkpointed", [False, True], ids=["called", "checkpointed"])
@pytest.mark.parametrize("options", [{}, {"defer": True}], ids=["immediate", "deferred"])
def test_a_backward_nan_in_the_first_of_two_chained_models_is_named_there(options: dict[str, object],
                                                                         checkpointed: bool) -> None:
    # head(body(x)), both watched: the gradient into body's output was kept for the call of head that the
    # tensor entered (its record of that argument), so body's backward was never replayed and the report named
    # 0.weight's gradient, unclassified.
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 4), WhereRoot())
    head = nn.Linear(4, 1)
    opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(body, head, opt, **options):
        x = torch.randn(8, 4)
        hidden = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False) if checkpointed else body(x)
        loss = head(hidden).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.model, report.module, report.op, report.autograd_node) == (
        "backward", "Sequential", "1", "aten.mul.Scalar", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("where root")
    assert report.reproduced is True


def test_reentrant_checkpoints_are_inlined_only_inside_the_replay_even_when_it_raises() -> None:
    from nan_magic.localize.replay.tiered.step_backward import reentrant_checkpoints_inline

    function = torch.utils.checkpoint.CheckpointFunction
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ZeroDivisionError), reentrant_checkpoints_inline():
        out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        assert out.grad_fn is not None and type(out.grad_fn).__name__ == "MulBackward0"  # inline: its graph kept
        raise ZeroDivisionError
    assert "apply" not in function.__dict__
    out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"


def test_reentrant_checkpoints_of_other_threads_run_as_usual_while_a_replay_inlines_its_own() -> None:
    import threading

    from nan_magic.localize.replay.tiered.step_backward import reentrant_checkpoints_inline

    x = torch.ones(2, requires_grad=True)
    seen: list[str] = []

    def other_thread() -> None:
        out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        seen.append(type(out.grad_fn).__name__)

    with reentrant_checkpoints_inline(), reentrant_checkpoints_inline():  # nested: still one patch
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        inline = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        assert type(inline.grad_fn).__name__ == "MulBackward0"
    assert seen == ["CheckpointFunctionBackward"]  # that thread's checkpoint saved its memory, as asked
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__


class SqrtAt(nn.Module):
    """Healthy until ``bad``: then ``sqrt`` at zero, whose backward divides by zero."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.l1(x) * (0 if bad else 1)
        return self.l2(torch.sqrt(h if bad else h.abs()))  # producer: sqrt when bad


@pytest.mark.parametrize(("bad_step", "options"), [(1, {}), (3, {"full_every": 2}), (2, {"full_every": 1})],
                         ids=["second-step", "every-2nd", "full_every=1"])
def test_a_backward_producer_on_a_per_module_step_is_named_like_on_any_other(
        bad_step: int, options: dict[str, object]) -> None:
    # On a per-module step the model's output is its last layer's, whose hook holds the gradient:
    # it was not kept for the replay ("no gradient flowing into the model's outputs was held").
    torch.manual_seed(0)
    model = SqrtAt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            loss = model(torch.randn(8, 4), bad=step == bad_step).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.reproduced) == ("backward", "", bad_step, True)
    assert (report.op, report.autograd_node) == ("aten.div.Tensor", "SqrtBackward0"), report.message
    assert report.source is not None and report.source.lineno == _marked("sqrt when bad")


class ReturnsItsFeatures(nn.Module):
    """Returns ``(logits, features)`` and feeds the features to its own head (HF output_hidden_states)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.head = SqrtAt()

    def forward(self, x: torch.Tensor, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.enc(x)
        return self.head(features, bad), features


@pytest.mark.parametrize("features_in_loss", [True, False], ids=["features-in-loss", "logits-only"])
def test_an_output_the_model_also_consumes_does_not_blame_the_loss_code(features_in_loss: bool) -> None:
    # The hook on `features` sees its whole gradient, which `head`'s backward made NaN: the code
    # outside the model (the loss) was blamed, with its autograd nodes as the cause.
    torch.manual_seed(0)
    model = ReturnsItsFeatures()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        for step in range(3):
            logits, features = model(torch.randn(8, 4), bad=step == 2)
            loss = logits.mean() + (1e-3 * features.pow(2).mean() if features_in_loss else 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.reproduced) == ("backward", "head", 2, True)
    assert (report.op, report.autograd_node) == ("aten.div.Tensor", "SqrtBackward0"), report.message
    assert report.source is not None and report.source.lineno == _marked("sqrt when bad")


def test_a_loss_whose_own_backward_makes_the_nan_is_still_blamed_with_a_model_output_also_consumed() -> None:
    torch.manual_seed(0)
    model = ReturnsItsFeatures()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        logits, features = model(torch.randn(8, 4))
        loss = logits.mean() + torch.sqrt(features * 0).sum()  # producer: loss sqrt
        loss.backward()
    report = caught.value.report
    assert (report.phase, report.module, report.op) == ("backward", None, "aten.div.Tensor"), report.message
    assert report.source is not None and report.source.lineno == _marked("loss sqrt")


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.lin(x)
        return self.out(torch.sqrt(h * 0) if bad else torch.tanh(h))  # producer: critic sqrt


def test_a_discriminators_backward_producer_during_the_generators_update_is_named() -> None:
    # The gradient reaching the generator's output is the discriminator's backward's: it was blamed
    # on the code outside the models (module None).
    torch.manual_seed(0)
    g, d = nn.Linear(2, 4), Critic()
    opt_g, opt_d = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(g, d, opt_g, opt_d):
        for it in range(3):
            fake = g(torch.randn(8, 2))
            loss_d = nn.functional.softplus(-d(torch.randn(8, 4))).mean() + nn.functional.softplus(
                d(fake.detach())).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = nn.functional.softplus(-d(fake, bad=it == 1)).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.reproduced) == (
        "backward", "", "Critic", True), report.message
    assert (report.op, report.autograd_node) == ("aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("critic sqrt")


class FrozenSqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x).clamp(min=0) * 0
        return self.l2(torch.sqrt(h))  # producer: frozen sqrt


@pytest.mark.parametrize("use_optimizer", [False, True], ids=["manual-update", "sgd-on-the-input"])
def test_a_frozen_models_backward_producer_seen_only_in_the_input_gradient_is_named(use_optimizer: bool) -> None:
    # PGD / saliency: no parameter gradient shows it; the manual update went on silently (then the
    # next batch was blamed as data), and the replay, without a parameter to differentiate, found nothing.
    torch.manual_seed(0)
    model = FrozenSqrt().eval().requires_grad_(False)
    delta = torch.zeros(8, 4, requires_grad=True)
    x = torch.randn(8, 4)
    opt = torch.optim.SGD([delta], lr=0.1) if use_optimizer else None
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, *([opt] if opt else [])):
        for _ in range(3):
            loss = -model(x + delta).mean()
            delta.grad = None
            loss.backward()
            if opt is not None:
                opt.step()
            else:
                with torch.no_grad():
                    delta += 0.1 * delta.grad
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.reproduced) == ("backward", "", 0, True), report.message
    assert (report.op, report.autograd_node) == ("aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("frozen sqrt")
    assert bool(delta.isfinite().all())  # stopped before the update


class _ReturnsItsLoss(nn.Module):
    """A model whose forward returns the loss itself: ``model(x).backward()``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.sqrt(self.w)).sum()  # producer: sqrt of a zero weight


@pytest.mark.parametrize("step", [True, False], ids=["then-step", "no-step"])
def test_a_model_that_returns_its_loss_has_its_backward_producer_named(step: bool) -> None:
    # The gradient into that output is backward()'s own; without a step, the watch's exit reads the gradients.
    model = _ReturnsItsLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        model(torch.ones(4)).backward()
        if step:
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.tensor, report.step) == ("backward", "", TensorRef.gradient("w"), 0)
    assert (report.op, report.autograd_node, report.reproduced) == ("aten.div.Tensor", "SqrtBackward0", True)
    assert report.source is not None and report.source.lineno == _marked("sqrt of a zero weight")
    assert torch.equal(model.w.detach(), torch.zeros(4))  # no step was taken with the gradient


@pytest.mark.parametrize("mode", ["tiered", "full"])
def test_a_watch_left_after_backward_but_before_the_step_reads_the_gradients(mode: str) -> None:
    # A cell that runs backward() and leaves opt.step() to the next cell: its gradients are read at the exit.
    model = _ReturnsItsLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, mode=mode):
        (model(torch.ones(4)) * 1.0).backward()
    report = caught.value.report
    assert report.phase == "backward"
    if mode == "tiered":  # the replay names the op
        assert report.tensor == TensorRef.gradient("w")
        assert (report.op, report.autograd_node, report.reproduced) == ("aten.div.Tensor", "SqrtBackward0", True)
    else:
        # The per-call replay of the root call names it too: the call's input is held, kept for the fix trials'
        # replay (localize/modes.py kept); the report is that replay's, of the op's output.
        assert (report.op, report.autograd_node, report.tensor.name) == ("aten.div.Tensor", "SqrtBackward0",
                                                                          "aten.div.Tensor")
        assert "the watch ended after this backward, before an optimizer step: its parameter gradients were read " \
            "then" in report.notes
        # ``sqrt(self.w)`` with w all 0: the clamp passes w no gradient, and by hand w stays 0 for good (fixes-s32:
        # a clamp of a trained parameter at its boundary is not a fix; was ("eps", True)).
        assert [(trial.kind, trial.finite, trial.fact("frozen")) for trial in report.fixes] == [("eps", None, ("w",))]
    healthy = nn.Linear(4, 1)
    with nan_magic.watch(healthy, torch.optim.SGD(healthy.parameters(), lr=0.1), mode=mode) as w:
        healthy(torch.ones(2, 4)).sum().backward()
    assert w.report is None and w.events == []


class _SqrtEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + torch.sqrt(h - h.detach() + x.abs().amax())  # producer: encoder sqrt


def test_a_siamese_models_first_call_is_replayed_though_no_optimizer_stepped_yet() -> None:
    # Two calls before the backward, the optimizer not passed and not stepped yet: the first call is kept while
    # its output lives, so a backward producer in it is named.
    torch.manual_seed(0)
    model = _SqrtEncoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    anchor, other = torch.zeros(2, 4), torch.rand(2, 4) + 1.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        loss = (model(anchor) - model(other)).pow(2).sum()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.autograd_node) == (
        "backward", "", "aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _marked("encoder sqrt")
    assert report.reproduced is True


class _LossInside(nn.Module):
    """Returns the logits and a loss made from them inside (Hugging Face with labels): fp16 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).half()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.lin(x)  # producer: fp16 logits, whose weight gradient overflows
        loss = logits.float().sum() * 40000.0  # a gradient of 40000 per logit: fits in fp16, twice that does not
        return {"loss": loss, "logits": logits}


def test_a_backward_replay_counts_an_output_used_inside_the_model_once() -> None:
    # The gradient captured on the logits already holds the inner loss's part: starting the replay from both
    # outputs made it 80000 = inf in fp16, an 'aten.add.Tensor' that only the replay ran.
    torch.manual_seed(0)
    model = _LossInside()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        model(torch.ones(2, 4, dtype=torch.half))["loss"].backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.autograd_node, report.reproduced) == (
        "backward", "lin", "AddmmBackward0", True)
    assert report.op in ("aten.mm.default", "aten.sum.dim_IntList")  # the weight's or the bias's: both overflow
    assert report.source is not None and report.source.lineno == _marked("fp16 logits, whose weight gradient overflows")


class _Inverts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[1.0, 2.0], [2.0, 4.0]]))  # singular

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.inv(self.w)


@pytest.mark.parametrize("ops", [False, True], ids=["default", "ops"])
def test_a_linalg_error_stays_the_users_to_catch(ops: bool) -> None:
    # inv's kernel makes a NaN inside, then raises: that NaN never reached the user's code, so the
    # LinAlgError is left alone (an `except torch.linalg.LinAlgError` fallback must still work).
    model = _Inverts()
    with pytest.raises(torch.linalg.LinAlgError), nan_magic.watch(model, ops=ops) as w:
        model(torch.ones(1, 2)).sum().backward()
    assert w.report is None
    with nan_magic.watch(model, ops=ops) as w:
        try:
            model(torch.ones(1, 2))
        except torch.linalg.LinAlgError:
            fallback = torch.ones(1, 2) @ torch.linalg.pinv(model.w)
    assert w.report is None and torch.isfinite(fallback).all()


class _ZeroLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        nn.init.zeros_(self.fc.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)  # producer: importance-weighted gradient overflows here


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip_grad_norm_"])
def test_gradients_that_clipping_turned_from_inf_to_nan_are_the_same_event_in_the_replay(clip: bool) -> None:
    # clip_grad_norm_ multiplies inf gradients by max_norm / inf = 0: NaN where the replay makes inf.
    torch.manual_seed(0)
    model = _ZeroLinear()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        x, y = torch.randn(2, 4) * 1e3, torch.tensor([0, 1])
        weights = 1.0 / torch.tensor([0.5, 1e-37])
        loss = (weights * nn.functional.cross_entropy(model(x), y, reduction="none")).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.autograd_node) == (
        "backward", "fc", "aten.mm.default", "AddmmBackward0")
    assert report.source is not None and report.source.lineno == _marked("importance-weighted gradient overflows here")
    assert report.reproduced is True


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi, self.v = nn.Linear(4, 3), nn.Linear(4, 1)

    def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(s), self.v(s).squeeze(-1)


@pytest.mark.parametrize("ops", [False, True])
def test_a_value_the_loss_code_made_from_a_detached_model_output_is_its_producer_not_data(ops: bool) -> None:
    # adv needs no gradient (built from v.detach()) yet the loss code made its NaN, from finite values.
    torch.manual_seed(0)
    model = _ActorCritic()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        logits, v = model(torch.randn(8, 4))
        adv = torch.ones(8) - v.detach() * 0  # every return equal: std 0
        adv = (adv - adv.mean()) / adv.std()  # producer: advantage normalisation
        loss = -(torch.log_softmax(logits, -1)[:, 0] * adv).mean()
        opt.zero_grad()
        loss.backward()
    report = caught.value.report
    assert (report.phase.value, report.module, report.op) == ("forward", None, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _marked("advantage normalisation")
    assert report.cause.label == "division-by-zero"
    assert "giving 8 NaN" in report.cause.hint and "entering" not in report.cause.hint


def _log_of_softmax(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.nll_loss(torch.log(torch.softmax(logits, -1)), y)  # producer: log of a softmax


@pytest.mark.parametrize("ops", [False, True])
def test_a_loss_code_producer_is_diagnosed_from_its_own_op_output_and_operands(ops: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with torch.no_grad():
        zeros = int((torch.softmax(model(x) * 200.0, -1) == 0).sum())
    assert zeros > 1
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        loss = _log_of_softmax(model(x) * 200.0, y)
        opt.zero_grad()
        loss.backward()
    report = caught.value.report
    assert (report.phase.value, report.module, report.op) == ("forward", None, "aten.log.default")
    assert report.source is not None and report.source.lineno == _marked("log of a softmax")
    # The counts are the op's own output's (one -inf per zero), not the loss's single +inf.
    assert (report.nan, report.posinf, report.neginf, report.numel) == (0, 0, zeros, 80)
    assert report.cause.label == "log-domain"
    assert f"log got {zeros} zeros and 0 negatives" in report.cause.hint


def _kl_of(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    return -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())  # producer: kl exp


@pytest.mark.parametrize("ops", [False, True])
def test_debug_opens_in_the_loss_helper_that_ran_the_producing_op(ops: bool) -> None:
    torch.manual_seed(0)
    enc = nn.Linear(8, 8)
    opt = torch.optim.SGD(enc.parameters(), 1e-3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(enc, opt, ops=ops):
        h = enc(torch.randn(4, 8))
        loss = _kl_of(h[:, :4], h[:, 4:] * 1000.0)
        opt.zero_grad()
        loss.backward()
    report = caught.value.report
    line = _marked("kl exp")
    assert report.op == "aten.exp.default" and report.source is not None and report.source.lineno == line
    assert report.debug_frame is not None
    assert (report.debug_frame.function, report.debug_frame.lineno) == ("_kl_of", line)
    assert report.frames and (report.frames[-1].function, report.frames[-1].lineno) == ("_kl_of", line)
    assert caught.value.__traceback__ is not None
