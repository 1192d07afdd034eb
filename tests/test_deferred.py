"""Deferred checks: one host transfer per step, the same producers as immediate checks.

On CUDA the watch keeps per-call results on the device and reads them once
per step. The same code runs here with the CPU as the device (``defer=True``),
and a transfer counter stands in for CUDA's sync debug mode.
"""

from __future__ import annotations

import sys
import traceback
import warnings
import weakref

import faults
import pytest
import torch
from faults import fp16_adam_step
from torch import nn
from torch.nn import functional as F
from watching import attributes_read, raised

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot import reads
from nan_magic.hot.checks.optimizer import step_checks as optim
from nan_magic.hot.checks.optimizer import step_reports as optim_reports
from nan_magic.hot.kept import step_log as calls
from nan_magic.lifecycle import watch
from nan_magic.records import TensorRef, TensorRole

# Functions that read tensor values on the host: none may run in a healthy deferred step.
PER_TENSOR_READS = ("kinds_of", "tensor_stats")


@pytest.fixture
def transfers(monkeypatch):
    """Count deferred transfers; fail on any per-tensor read."""
    count = {"reads": 0}
    real = reads.read_scalars

    def counting(scalars):
        count["reads"] += 1
        return real(scalars)

    for module in (calls, watch, optim, optim_reports):  # (optim_reports: a step result read at once, or at the end)
        if hasattr(module, "read_scalars"):
            monkeypatch.setattr(module, "read_scalars", counting)

    def forbidden(*args, **kwargs):
        raise AssertionError("a per-tensor host read in a healthy deferred step")

    from nan_magic.hot.checks.backward import gradient_checks as gradients

    for module in (watch, gradients, optim):
        for name in PER_TENSOR_READS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    return count


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 3))


def test_a_healthy_training_step_costs_one_transfer(transfers) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    # The last step is a full parameter check (optim.FULL_CHECK_EVERY), read at the end.
    steps = optim.FULL_CHECK_EVERY + 1
    with nan_magic.watch(model, opt, defer=True, mode="full") as w:
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        during = transfers["reads"]
    assert during == steps  # one per step, at the optimizer step
    assert transfers["reads"] == steps + 1  # and one at the end for the last step's result
    assert w.report is None and w.step == steps
    assert [summary.loss is not None for summary in w.history] == [True] * steps


def test_inference_costs_one_transfer_per_forward(transfers) -> None:
    model = _mlp().eval()
    with torch.no_grad(), nan_magic.watch(model, defer=True, mode="full"):
        for _ in range(4):
            model(torch.randn(2, 8))
    assert transfers["reads"] == 4


def test_deferred_finds_backward_producers() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(embed, defer=True, mode="full"):
        torch.sqrt(((embed(x) - embed(x.clone())) ** 2).sum(-1)).sum().backward()
    report = caught.value.report
    assert (report.phase, report.module) == ("backward", None)
    # The loss code's nodes, described before backward freed them.
    assert any("can be infinite: SqrtBackward0" in note for note in report.notes)


def test_deferred_finds_optimizer_producers_at_the_next_sync() -> None:
    model, opt, step = fp16_adam_step()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=True, mode="full"):
        step()
    report = caught.value.report
    seen = (report.phase, report.module, report.tensor, report.step)
    assert seen == ("optimizer", "0", TensorRef.parameter("0.weight"), 0)


def test_deferred_names_a_freed_producer_from_its_probe() -> None:
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught, torch.no_grad(), nan_magic.watch(model, defer=True, mode="full"):
        model(torch.randn(8, 4))  # no autograd: Log's output is freed before the check
    report = caught.value.report
    assert (report.module, report.module_type) == ("1", "Log")
    assert "detected at the deferred check" in report.notes


def sync_sites(run) -> list[str]:
    """Where each host synchronisation that ``run()`` makes comes from.

    CUDA's sync debug mode warns at every synchronising call; each warning
    raised while ``run`` is on the stack is kept, as its innermost nan_magic
    and test frames, so that a failure says which line synchronised.
    (Switching the mode on can itself warn: that one is not ``run``'s.)
    """
    sites: list[str] = []

    def inside_run() -> bool:
        frame = sys._getframe()
        while frame is not None and frame.f_code is not run.__code__:
            frame = frame.f_back
        return frame is not None

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message) and inside_run():
            frames = [
                f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
                for frame in traceback.extract_stack()[:-1]
                if "nan_magic" in frame.filename or "tests" in frame.filename
            ]
            sites.append(" < ".join(reversed(frames[-4:])))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_makes_at_most_one_host_sync() -> None:
    torch.manual_seed(0)
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 3, (16,), device="cuda")

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def three_steps() -> None:
        for _ in range(3):
            step()

    def watched() -> None:
        with nan_magic.watch(model, opt, mode="full") as w:
            three_steps()
            assert w.defer
            w.optimizers.carried = None  # the exit flush is not part of a step

    step()  # warm-up outside the count
    plain = sync_sites(three_steps)
    assert plain == []  # capturable AdamW: the unwatched step never waits for the device
    sites = sync_sites(watched)
    assert len(sites) <= 3, "\n".join(sites)


# -- the op and line, found by replay at the deferred check ------------------------------------


class Parent(nn.Module):
    """Its log child receives a value of the parent's own code, which no watched call returned."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.log = faults.LogLayer()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.fc(x) * 1.0))


def _train_once(model: nn.Module, **options) -> nan_magic.Report:
    """One SGD step under a deferred watch: the check runs at ``opt.step()``, after backward freed the graph."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step() -> None:
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return raised(step, model, opt, defer=True, **options, mode="full")


def test_a_producer_whose_inputs_were_freed_is_replayed_from_its_recomputed_inputs() -> None:
    torch.manual_seed(0)
    report = _train_once(nn.Sequential(nn.Linear(8, 8), faults.LogLayer(), nn.Linear(8, 2)))
    assert (report.phase, report.module, report.module_type) == ("forward", "1", "LogLayer")
    assert report.op == "aten.log.default"
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line("log"))
    # The output was freed too: counted again by running the producer on the same inputs.
    assert report.nan > 0 and report.nan + report.posinf + report.neginf <= report.numel == 32
    assert any("running 1 again on the same inputs" in note for note in report.notes)
    # Its input, recomputed from the Linear that returned it, is described and finite (then the op's, "self").
    operand = TensorRef(TensorRole.OPERAND, "self")
    assert [name for name, _stats in report.input_stats] == [TensorRef.argument("input[0]"), operand]
    assert report.input_stats[0][1].nonfinite == 0 and report.input_stats[0][1].numel == 32


def test_a_producer_fed_by_its_parents_code_is_found_by_replaying_the_parent() -> None:
    torch.manual_seed(0)
    report = _train_once(Parent())
    assert (report.module, report.module_type, report.op) == ("log", "LogLayer", "aten.log.default")
    assert report.source.lineno == faults.marked_line("log")
    assert any("a replay of the root module, which called it, found the op in log" in note for note in report.notes)


def test_gradients_checked_on_autograds_own_thread() -> None:
    """On CUDA, autograd runs the backward on a device thread, not the one that called ``backward()``."""
    import threading

    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    anchor = torch.randn(3, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(embed, defer=True, mode="full"):
        embedded = embed(anchor)
        loss = faults.distance(embedded, embedded).sum()  # sqrt'(0) = inf, then 0 * inf in backward
        worker = threading.Thread(target=torch.autograd.backward, args=(loss,))
        worker.start()
        worker.join()
    report = caught.value.report
    model_output_gradient = TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output")
    assert (report.phase, report.module, report.tensor) == ("backward", None, model_output_gradient)


def test_without_replay_the_deferred_report_still_names_the_producer() -> None:
    torch.manual_seed(0)
    report = _train_once(nn.Sequential(nn.Linear(8, 8), faults.LogLayer(), nn.Linear(8, 2)), replay=False)
    assert (report.module, report.op, report.source) == ("1", None, None)
    assert "detected at the deferred check" in report.notes


def test_an_autocast_overflow_is_replayed_under_the_same_autocast() -> None:
    model, opt, step = faults.autocast_overflow("cpu")
    report = raised(step, model, opt, defer=True, mode="full")
    assert (report.module, report.module_type, report.op) == ("1", "Gram", "aten.mm.default")
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line("gram"))
    assert report.posinf > 0 and report.dtype == "float16"


def test_an_exception_after_an_unjudged_non_finite_value_is_explained_by_it() -> None:
    # The deferred check would judge the step at the optimizer step; torch.multinomial on the
    # NaN probabilities raises first. The watch names the producer, from multinomial's error.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), faults.LogLayer(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = -10 * torch.ones(2, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=True):
        torch.multinomial(model(x).softmax(-1), 1)
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.op) == (
        "forward", "1", "LogLayer", "aten.log.default")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "probability tensor contains" in str(caught.value.__cause__)


def test_an_exception_with_nothing_non_finite_before_it_leaves_the_watch_unchanged() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(KeyError, match="batch"), nan_magic.watch(model, defer=True):
        model(torch.ones(1, 4))
        raise KeyError("batch")


class _Held:
    """Holds the labels as an attribute: no local variable of the loop names them."""


def _nan_target_step(defer: bool) -> NonFiniteError:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = _Held()
    held.x, held.y = torch.randn(8, 4), torch.randn(8, 1)
    held.y[3] = float("nan")

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out * 2, held.y)

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for _ in range(2):
            opt.zero_grad()
            loss_of(model(held.x)).backward()
            opt.step()
    return caught.value


@pytest.mark.parametrize("defer", [False, True])
def test_a_nan_label_no_variable_holds_is_data_named_by_the_recorded_op_that_read_it(defer: bool) -> None:
    # The recorded loss code's arguments say what entered it: in the deferred mode nothing of the loss
    # graph is read when backward starts (its saved tensors are gone by the check), in either mode the
    # same name.
    report = _nan_target_step(defer).report
    assert report.phase == "data" and report.module is None
    assert str(report.tensor) == "target of aten.mse_loss.default"
    assert (report.nan, report.numel) == (1, 8)


def test_an_unrecorded_loss_code_has_its_data_found_in_what_its_nodes_saved(monkeypatch) -> None:
    # A loss region over the recorder's budget is not recorded: the deferred mode then takes the data
    # leaves its autograd nodes saved as backward starts, named by the node.
    monkeypatch.setattr("nan_magic.localize.outside.recorder.LOSS_BUDGET", 1)
    report = _nan_target_step(True).report
    assert report.phase == "data"
    assert str(report.tensor) == "target of MseLossBackward0"


@pytest.mark.parametrize("defer", [False, True])
def test_the_loss_code_and_its_graph_are_let_go_once_the_step_is_judged(defer: bool) -> None:
    # The deferred watch keeps the loss code's records and the loss's autograd node until the optimizer step has
    # judged the step (the nodes are walked only at an event): with retain_graph=True they keep what autograd
    # saved, which the user's own code has let go of by then. Nothing of it outlives the step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with nan_magic.watch(model, opt, defer=defer):
        for _ in range(2):
            opt.zero_grad()
            difference = model(x) - y
            saved = weakref.ref(difference)  # the square's backward saves it
            loss = difference.square().mean()
            loss.backward(retain_graph=True)
            del loss, difference
            opt.step()
            assert saved() is None


def test_the_mode_is_chosen_once_as_an_object_and_watch_defer_reads_it() -> None:
    from nan_magic.hot.timing import Deferred, Immediate

    model = nn.Linear(3, 2)
    with nan_magic.watch(model) as cpu, nan_magic.watch(model, defer=True) as deferred:
        pass
    assert isinstance(cpu.timing, Immediate) and cpu.defer is False  # the CPU default
    assert isinstance(deferred.timing, Deferred) and deferred.defer is True
    assert cpu.log.hold_probes is False and deferred.log.hold_probes is True


def test_no_part_of_the_hot_path_asks_which_mode_it_runs_in() -> None:
    """Only hot/timing.py knows the two modes apart: a flag test elsewhere in hot/ is a mode leaking out of it."""
    assert attributes_read("hot", ("defer", "deferred", "holds_probes"), allowed="timing.py") == []


def test_ops_on_a_device_checks_immediately_but_under_a_process_group() -> None:
    # ops=True reads every op's output as it runs: the automatic choice (defer=None) does not defer it on a
    # device, where it would meet at the step's check what the step freed. A model on the meta device stands in
    # for CUDA here; an explicit defer=True is kept.
    from nan_magic.hot.timing import Deferred, Immediate, timing_for
    from nan_magic.options import WatchConfig

    on_a_device = nn.Linear(4, 4, device="meta")
    assert isinstance(timing_for(WatchConfig(), [on_a_device]), Deferred)
    assert isinstance(timing_for(WatchConfig(ops=True), [on_a_device]), Immediate)
    assert isinstance(timing_for(WatchConfig(ops=True, defer=True), [on_a_device]), Deferred)
    assert isinstance(timing_for(WatchConfig(ops=True), [nn.Linear(4, 4)]), Immediate)
