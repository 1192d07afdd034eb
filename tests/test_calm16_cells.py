"""What a notebook does, in the five modes (issue 25; harness: test_calm16.py): the same healthy cell run again
(the watch entered twice on the same model), and ``%%nantrace`` around a cell that raises an error of its own
(KeyboardInterrupt mid-step, a shape error in the forward, one in the loss): the user's exception shows unchanged
(type and message as unwatched, one traceback through the user's frames, not a second run of the failed op chained
to it: fixed in localize/ops/plans.run_rewrapped), the model's state is what the unwatched cell left, and nothing
stays behind.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import global_hook_counts
from IPython.utils.capture import capture_output
from test_calm16 import Loop, _tensors, _traces, same, sgd_loop
from torch import nn
from watching import FIVE_MODES

import nan_magic
from nan_magic.hot.watched.module_hooks import is_watch_hook
from nan_magic.patches import registry as patches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 1))


@pytest.mark.parametrize("options", FIVE_MODES)
def test_the_watch_entered_again_around_the_same_loop_is_calm_and_identical(options: dict) -> None:
    """Two executions of one cell: each under its own watch, on the same model and optimizer (Adam: its state and
    step counts carry over from the first)."""
    x = torch.randn(8, 4)

    def build() -> Loop:
        torch.manual_seed(0)
        return sgd_loop(_net(), lambda m, step: m(x).pow(2).mean())
    loop = build()
    expected = loop.run() + loop.run() + [t for obj in loop.held for t in _tensors(obj)]
    expected_traces = [_traces(obj) for obj in loop.held]
    loop = build()
    got = []
    for _ in range(2):
        with nan_magic.watch(*loop.targets, **options) as w:
            got += loop.run()
        assert w.report is None and not w.events, (w.report, w.events)
        assert [_traces(obj) for obj in loop.held] == expected_traces
    got += [t for obj in loop.held for t in _tensors(obj)]
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected, strict=True))


SETUP = """
import torch
from torch import nn
from torch.nn import functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(6, 4), torch.randn(6, 1)
"""

TRAIN = """
for step in range(3):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""

#: Cells that raise an error of their own, with the exception type the user must see.
RAISING = {
    "keyboard-interrupt": ("""
for step in range(3):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward()
    if step == 1:
        raise KeyboardInterrupt
    opt.step()
""", KeyboardInterrupt),
    "shape-error-in-forward": ("""
for step in range(3):
    loss = F.mse_loss(model(x if step < 2 else x[:, :3]), y)
    opt.zero_grad(); loss.backward(); opt.step()
""", RuntimeError),
    "error-in-a-custom-backward": ("""
class Checked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()
    @staticmethod
    def backward(ctx, g):
        raise ValueError("gradient check failed")
for step in range(3):
    out = model(x)
    loss = F.mse_loss(Checked.apply(out) if step == 1 else out, y)
    opt.zero_grad(); loss.backward(); opt.step()
""", ValueError),
    "error-in-the-optimizer-step": ("""
for step in range(3):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward()
    opt.step(closure=None) if step < 2 else torch.optim.LBFGS(model.parameters()).step()
""", TypeError),
    "shape-error-in-the-loss": ("""
for step in range(3):
    loss = F.mse_loss(model(x), y) + (0 if step < 1 else torch.cat([y, x]).sum())
    opt.zero_grad(); loss.backward(); opt.step()
""", RuntimeError),
}

MAGIC_FLAGS = [pytest.param("", id="immediate"), pytest.param("--defer", id="deferred"),
               pytest.param("--ops", id="ops"), pytest.param("--ops --defer", id="ops-deferred"),
               pytest.param("--full", id="full")]


def _run(ip, cell: str):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


def _model_state(ip) -> list[torch.Tensor]:
    ns = ip.user_ns
    return [t.detach().clone() for t in ns["model"].parameters()] + [
        torch.empty(0) if p.grad is None else p.grad.clone() for p in ns["model"].parameters()] + [
        v.clone() for s in ns["opt"].state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("flags", MAGIC_FLAGS)
@pytest.mark.parametrize("name", RAISING)
def test_a_cell_that_raises_its_own_error_shows_it_unchanged_and_leaves_nothing(ip, name: str, flags: str) -> None:
    cell, kind = RAISING[name]
    ip.run_cell(SETUP)
    plain, _ = _run(ip, cell)
    assert isinstance(plain.error_in_exec, kind)
    expected = _model_state(ip), str(plain.error_in_exec)
    ip.run_cell(SETUP)
    before = global_hook_counts(), _traces(ip.user_ns["model"]), _traces(ip.user_ns["opt"])
    watched, captured = _run(ip, f"%%nantrace model opt {flags}\n{cell}")
    assert type(watched.error_in_exec) is type(plain.error_in_exec)
    assert str(watched.error_in_exec) == expected[1]
    # The traceback as IPython shows it: one error, not chained to a second run of the op; the user's frames, and of
    # ours at most the dispatch frame the op failed in (IPython always shows the innermost frame, even a hidden one).
    assert watched.error_in_exec.__context__ is None and "During handling" not in captured.stdout
    files = re.findall(r"^File (\S+):\d+, in ", captured.stdout, re.M)
    assert "nan_magic" not in "".join(files[:-1]), captured.stdout
    assert "NonFiniteError" not in captured.stdout and "_nan_report" not in ip.user_ns
    assert (global_hook_counts(), _traces(ip.user_ns["model"]), _traces(ip.user_ns["opt"])) == before
    assert patches.installed() == [(warnings, "formatwarning")]  # (the loaded extension's printer only)
    got = _model_state(ip)
    assert len(got) == len(expected[0]) and all(same(a, b) for a, b in zip(got, expected[0], strict=True))
    after, _ = _run(ip, "z = model(torch.full((1, 4), float('nan')))")  # nothing watches the next cell
    assert after.error_in_exec is None


@pytest.mark.parametrize("flags", MAGIC_FLAGS)
def test_a_healthy_cell_run_twice_under_nantrace_is_what_it_is_unwatched(ip, flags: str) -> None:
    ip.run_cell(SETUP)
    for _ in range(2):
        assert _run(ip, TRAIN)[0].error_in_exec is None
    expected = _model_state(ip)
    ip.run_cell(SETUP)
    before = global_hook_counts(), _traces(ip.user_ns["model"]), _traces(ip.user_ns["opt"])
    ip.user_ns.pop("_nan_report", None)
    for _ in range(2):
        result, captured = _run(ip, f"%%nantrace {flags}\n{TRAIN}")
        assert result.error_in_exec is None and captured.stdout == ""
    assert ip.user_ns.get("_nan_report") is None
    assert (global_hook_counts(), _traces(ip.user_ns["model"]), _traces(ip.user_ns["opt"])) == before
    got = _model_state(ip)
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))


def test_an_op_that_fails_runs_once_and_raises_its_own_error_and_a_wrapped_number_is_still_retried() -> None:
    from nan_magic.localize.ops.plans import run_op

    calls = []

    def failing(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught:
        run_op(failing, (torch.ones(2, 3), torch.ones(2, 3)), {})
    assert len(calls) == 1 and caught.value.__context__ is None
    assert torch.equal(run_op(torch.ops.aten.detach.default, (0.5,), {}), torch.tensor(0.5, dtype=torch.float64))


def copies_in_the_loop() -> tuple[Loop, dict]:
    """A cell that copies the model while it trains: a deep-copied teacher (updated as an EMA), the best model
    so far (deepcopy), an AveragedModel made in the loop (it deep-copies), a checkpoint of the whole model
    (``torch.save(model)``) loaded back."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    kept: dict = {}

    def run() -> list[torch.Tensor]:
        out = []
        for step in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 0:
                kept["teacher"] = copy.deepcopy(model)
                kept["swa"] = torch.optim.swa_utils.AveragedModel(model)
                buffer = io.BytesIO()
                torch.save(model, buffer)
                kept["file"] = buffer.getvalue()
            kept["best"] = copy.deepcopy(model)
            kept["swa"].update_parameters(model)
            with torch.no_grad():
                for t, s in zip(kept["teacher"].parameters(), model.parameters(), strict=True):
                    t.mul_(0.9).add_(s, alpha=0.1)
                out += [kept["teacher"](x), kept["swa"](x), loss.detach()]
        return out
    return Loop((model, opt), (model, opt), run), kept


@pytest.mark.parametrize("options", FIVE_MODES)
def test_copying_and_saving_the_model_inside_the_watch_works_and_the_copies_carry_nothing_that_runs(
        options: dict) -> None:
    # The tiered watch's hook on the model was copied with it: deepcopy raised "cannot pickle 'generator' object",
    # torch.save "cannot pickle 'weakref.ReferenceType' object" (module_hooks._ModelReturned).
    torch.manual_seed(0)
    loop, kept = copies_in_the_loop()
    expected = loop.run()
    saved = torch.load(io.BytesIO(kept["file"]), weights_only=False).state_dict()
    torch.manual_seed(0)
    loop, kept = copies_in_the_loop()
    with nan_magic.watch(*loop.targets, **options) as w:
        got = loop.run()
    assert w.report is None and not w.events
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))
    assert not loop.targets[0]._forward_hooks
    # Copied or saved while the watch is active, the model carries none of its hooks (patches/scripting.py:
    # unhooked_copies), called or not: the file's model was left an inert stand-in that torch.jit.script could not
    # compile.
    assert not kept["teacher"]._forward_hooks
    best = kept["best"]  # never called
    assert not best._forward_hooks
    assert b"nan_magic" not in pickle.dumps(best)
    loaded = torch.load(io.BytesIO(kept["file"]), weights_only=False)  # (it loads without nan_magic's code)
    assert all(same(a, b) for a, b in zip(loaded.state_dict().values(), saved.values(), strict=True))
    assert not any(m._forward_hooks or m._forward_hooks_with_kwargs for m in loaded.modules())


class _OwnDeepcopy(nn.Sequential):
    """A model whose own ``__deepcopy__`` copies its ``__dict__``, never asking torch's reduction."""

    def __deepcopy__(self, memo: dict) -> nn.Module:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_deep_copy_by_the_users_own_deepcopy_drops_the_stand_in_at_its_first_call(options: dict) -> None:
    """The case that keeps the stand-in (docs/how-it-watches.md): a model deep-copied inside the watch by its own
    ``__deepcopy__`` carries, besides the user's hook, a stand-in for the watch's hook (tiered modes); the copy's first
    call removes it, runs the user's hook and computes what the model does."""
    torch.manual_seed(0)
    model = _OwnDeepcopy(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    seen: list[str] = []
    model.register_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    ours = 0 if options.get("mode") == "full" or options.get("ops") else 1  # (the tiered watch's hook on the model)
    with nan_magic.watch(model, opt, **options) as w:
        model(x).pow(2).mean().backward()
        opt.step()
        teacher = copy.deepcopy(model)
        assert len(teacher._forward_hooks) == 1 + ours
        assert sum(is_watch_hook(hook) for hook in teacher._forward_hooks.values()) == ours
        seen.clear()
        with torch.no_grad():
            got, expected = teacher(x), model(x)
    assert w.report is None and not w.events
    assert torch.equal(got, expected)
    assert seen == ["_OwnDeepcopy", "_OwnDeepcopy"]  # (the copy's user hook, then the model's)
    assert len(teacher._forward_hooks) == 1 and not any(map(is_watch_hook, teacher._forward_hooks.values()))


@pytest.mark.parametrize("options", FIVE_MODES)
def test_exporting_the_model_at_the_end_of_the_watched_cell_works(options: dict) -> None:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with nan_magic.watch(model, opt, **options):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected = model(x).detach()
        traced = torch.jit.trace(model, x)
        exported = torch.export.export(model, (x,))
        scripted = torch.jit.script(model)
    for converted in (traced, exported.module(), scripted):
        assert torch.allclose(converted(x), expected)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()  # producer: scripted log


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_model_scripted_inside_the_watch_runs_unwatched_and_the_eager_one_stays_watched(options: dict) -> None:
    """``torch.jit.script(model)`` inside the watch (the tiered watch's hook on the model comes off while it compiles:
    patches/scripting.py): the scripted model's call of a negative batch goes unjudged by that hook and computes as
    unwatched; the eager model's call of it is still named, with its module, op and line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Log())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    good, bad = torch.rand(8, 4) + 0.5, -torch.rand(8, 4) - 0.5
    watch = nan_magic.watch(model, **options)
    with pytest.raises(nan_magic.NonFiniteError), watch:
        model(good)
        hooks = dict(model._forward_hooks)
        scripted = torch.jit.script(model)
        assert dict(model._forward_hooks) == hooks  # the eager model's hooks, as they were, in order
        assert same(scripted(good), model(good))
        model(bad)
    report = watch.report
    assert report is not None
    assert (report.phase.value, report.module, report.op) == ("forward", "1", "aten.log.default")
    assert report.source is not None and "producer: scripted log" in report.source.line
    assert torch.isnan(scripted(bad)).all()  # (scripted: still the model's computation)


NESTED_TRAIN = ("for step in range(3):\n    loss = F.mse_loss(model(x), y)\n    opt.zero_grad(); loss.backward(); "
                "opt.step()\n")


@pytest.mark.parametrize("flags", [flags for flags, *_ in (p.values for p in MAGIC_FLAGS)])
@pytest.mark.parametrize("nesting", ["nantrace-under-nanwatch-on", "watch-inside-nantrace"])
def test_watches_nested_in_a_notebook_are_calm_and_identical(ip, nesting: str, flags: str) -> None:
    ip.run_cell(SETUP)
    ip.run_cell(NESTED_TRAIN)
    expected = _model_state(ip)
    ip.run_cell(SETUP + "import nan_magic\n")
    ip.user_ns.pop("_nan_report", None)
    if nesting == "nantrace-under-nanwatch-on":
        with capture_output():
            ip.run_line_magic("nanwatch", f"on {flags}")
            result, captured = _run(ip, "%%nantrace --ops\n" + NESTED_TRAIN)
            ip.run_line_magic("nanwatch", "off")
    else:
        inner = "with nan_magic.watch(model, opt, ops=True):\n" + "".join(
            f"    {line}\n" for line in NESTED_TRAIN.splitlines())
        result, captured = _run(ip, f"%%nantrace {flags}\n{inner}")
    assert result.error_in_exec is None and ip.user_ns.get("_nan_report") is None, captured.stdout
    assert all(same(a, b) for a, b in zip(_model_state(ip), expected, strict=True))
    assert not ip.user_ns["model"]._forward_hooks


def _exp_loss_run() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], list[torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs = [torch.randn(4, 6) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        out = []
        for step in range(3):
            scale = 1.0 if step == 0 else 100.0
            loss = torch.exp(model(xs[step]) * scale).mean()  # exp overflows at step 1
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out
    return model, opt, run


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_cell_run_again_after_it_overflowed_names_the_op_not_the_last_runs_results(options: dict) -> None:
    # A notebook: the cell ran once unwatched and overflowed; its results (inf, nan) are still in a variable when
    # the user runs it again under the watch. ops=True named that variable (earlier[1], never read this run) as
    # the step's data: gradients._given_to_the_loss took the user's locals as data where no outside recorder said
    # what the loss code read; the loss's non-finite values made by a traced op from finite ones now settle it.
    earlier = _exp_loss_run()[2]()
    assert torch.isinf(earlier[1])
    model, opt, run = _exp_loss_run()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten.exp.default")
    assert report.source is not None and "exp overflows at step 1" in report.source.line


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_label_is_named_beside_the_last_runs_results(options: dict) -> None:
    # ops=True named earlier[0]: the label, read by ``(out - y) ** 2`` whose nodes save nothing of it, was found
    # only among the user's variables, where the stale tensor came first; what the op tracer read now goes first.
    earlier = [torch.tensor(float("inf")), torch.tensor(float("nan"))]  # a previous run's losses, still in a variable
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    xs = [torch.randn(8, 6) for _ in range(3)]
    ys = [torch.randn(8, 3) for _ in range(3)]
    ys[1][2, 1] = float("nan")
    loop = sgd_loop(model, lambda m, step: ((m(xs[step]) - ys[step]) ** 2).mean())
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*loop.targets, **options):
        loop.run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 1, "ys[1]")
    assert len(earlier) == 2
