"""Op-level engine: OpTracer finds the producer op; replay_module re-runs a module call.

Lines are located by ``# at: <key>`` markers in this file, never hard-coded.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from nan_magic.hot.kept.rng import capture_rng_state
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.replay.module_run import replay_module
from nan_magic.records import Phase, TensorRef, TensorRole

INF = math.inf


def line_of(key: str) -> int:
    """Line number of the ``# at: key`` marker in this file."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    found = [number for number, text in enumerate(lines, 1) if text.rstrip().endswith(f"# at: {key}")]
    assert len(found) == 1, key
    return found[0]


def trace(run: Callable[[], Any], **options: Any) -> OpFinding | None:
    tracer = OpTracer(**options)
    with tracer:
        run()
    return tracer.finding


@contextmanager
def module_names(model: nn.Module) -> Iterator[Callable[[], str | None]]:
    """A module stack kept by global hooks, as the watch keeps it."""
    names = {id(sub): name for name, sub in model.named_modules()}
    stack: list[str] = []

    def enter(module: nn.Module, _args: Any) -> None:
        if id(module) in names:
            stack.append(names[id(module)])

    def leave(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in names:
            stack.pop()

    with register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True):
        yield lambda: stack[-1] if stack else None


# -- forward producers ------------------------------------------------------------


def test_log_of_negative() -> None:
    x = torch.tensor([1.0, -1.0, 2.0])
    finding = trace(lambda: torch.log(x))  # at: log
    assert finding is not None
    assert finding.op == "aten.log.default"
    assert finding.phase == Phase.FORWARD
    assert finding.source is not None and finding.source.lineno == line_of("log")
    assert finding.source.filename == __file__
    assert finding.inner_source is None and finding.forward_source is None
    assert (finding.nan, finding.posinf, finding.neginf, finding.numel) == (1, 0, 0, 3)
    assert finding.new_kinds == ("nan",)
    assert finding.module is None
    assert [label for label, _ in finding.input_stats] == [TensorRef(TensorRole.OPERAND, "self")]
    assert finding.input_stats[0][1].finite


class HandNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / centred.pow(2).mean(-1, keepdim=True).sqrt()  # at: norm


def test_zero_variance_in_hand_written_norm() -> None:
    model = nn.Sequential(nn.Linear(4, 4), HandNorm())
    x = torch.randn(3, 4)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(0.5)  # every feature equal: variance 0
    with module_names(model) as name:
        finding = trace(lambda: model(x), module_name=name)
    assert finding is not None
    assert finding.op == "aten.div.Tensor"
    assert finding.module == "1"
    assert finding.source is not None and finding.source.lineno == line_of("norm")
    assert finding.source.function == "forward"
    assert (finding.nan, finding.numel) == (12, 12)
    assert dict(finding.input_stats)[TensorRef(TensorRole.OPERAND, "other")].zeros == 3


def test_fp16_matmul_overflow() -> None:
    a = torch.full((4, 8), 300.0, dtype=torch.float16)
    b = torch.full((8, 4), 300.0, dtype=torch.float16)
    finding = trace(lambda: a @ b)  # at: matmul
    assert finding is not None
    assert finding.op == "aten.mm.default"
    assert finding.source is not None and finding.source.lineno == line_of("matmul")
    assert (finding.posinf, finding.numel) == (16, 16)
    assert finding.new_kinds == ("+inf",)
    assert finding.dtype == "float16"


def test_narrowing_copy_is_the_producer() -> None:
    x = torch.tensor([1.0, 1e6])
    finding = trace(lambda: x.half())  # at: narrow
    assert finding is not None
    assert finding.op == "aten._to_copy.default"
    assert finding.source is not None and finding.source.lineno == line_of("narrow")
    assert finding.posinf == 1


def test_autocast_cast_to_fp16_is_the_producer() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    x[0, 0] = 1e5  # finite in float32, above float16's 65504

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            layer(x)  # at: autocast

    finding = trace(run)
    assert finding is not None
    assert finding.op == "aten._to_copy.default"
    assert finding.source is not None and finding.source.lineno == line_of("autocast")
    assert (finding.posinf, finding.dtype) == (1, "float16")


def test_inference_mode_tensors() -> None:
    layer = nn.Linear(4, 4)

    def run() -> None:
        y = layer(torch.randn(2, 4))
        y.add_(1)  # inference tensors have no version counter: nothing may be cached wrongly
        torch.log(y.abs().neg())  # at: inference

    with torch.inference_mode():
        finding = trace(run)
    assert finding is not None and finding.op == "aten.log.default"
    assert finding.source is not None and finding.source.lineno == line_of("inference")


def test_in_place_division_by_zero() -> None:
    x = torch.tensor([1.0, -2.0, 0.5])
    finding = trace(lambda: x.div_(0))  # at: div_
    assert finding is not None
    assert finding.op in ("aten.div_.Tensor", "aten.div_.Scalar")
    assert finding.source is not None and finding.source.lineno == line_of("div_")
    assert (finding.posinf, finding.neginf) == (2, 1)
    # The value before the op is an input: it was finite.
    assert finding.input_stats[0][0] == TensorRef(TensorRole.OPERAND, "self", before=True)
    assert finding.input_stats[0][1].finite
    assert ("other", 0) in finding.scalars


def test_in_place_op_on_a_tensor_that_already_held_the_kind_is_no_producer() -> None:
    x = torch.tensor([INF, 1.0])

    def run() -> None:
        x.mul_(2)
        x.add_(1)

    assert trace(run) is None


def test_infinite_scalar_arguments_count_as_inputs() -> None:
    x = torch.randn(2, 3)

    def run() -> None:
        torch.full((2,), -INF)
        torch.add(x, -INF)
        x.masked_fill(x > 0, -INF)
        torch.clamp(x, min=-INF, max=INF)

    assert trace(run) is None


def test_partly_masked_softmax_is_benign() -> None:
    scores = torch.randn(2, 4)
    mask = torch.tensor([[True, True, False, False], [False, True, False, False]])
    assert trace(lambda: F.softmax(scores.masked_fill(mask, -INF), dim=-1)) is None


def test_fully_masked_row_makes_softmax_the_producer() -> None:
    scores = torch.randn(2, 4)
    mask = torch.tensor([[True, True, True, True], [False, True, False, False]])
    finding = trace(lambda: F.softmax(scores.masked_fill(mask, -INF), dim=-1))  # at: softmax
    assert finding is not None
    assert finding.op == "aten._softmax.default"
    assert (finding.nan, finding.numel) == (4, 8)
    assert finding.new_kinds == ("nan",)
    assert finding.source is not None and finding.source.lineno == line_of("softmax")
    # The op ran inside torch.nn.functional.softmax.
    assert finding.inner_source is not None
    assert finding.inner_source.filename.endswith("functional.py")
    (label, stats), = finding.input_stats
    assert label == TensorRef(TensorRole.OPERAND, "self") and stats.neginf == 5 and stats.nan == 0


def test_kinds_filter() -> None:
    x = torch.tensor([-1.0, 0.0])

    def run() -> None:
        torch.log(x)  # nan (ignored), -inf for 0
        torch.sqrt(x)  # nan only

    finding = trace(run, kinds=frozenset({"nan"}))
    assert finding is not None and finding.op == "aten.log.default" and finding.new_kinds == ("nan",)
    finding = trace(lambda: torch.sqrt(x), kinds=frozenset({"inf"}))
    assert finding is None
    finding = trace(run, kinds=frozenset({"inf"}))
    assert finding is not None and finding.op == "aten.log.default" and finding.new_kinds == ("-inf",)


def test_propagation_of_bad_data_is_no_finding() -> None:
    x = torch.tensor([float("nan"), 1.0])
    w = torch.randn(2, 2)
    assert trace(lambda: torch.tanh(x @ w).exp().sum()) is None


def test_on_finding_stops_at_the_op_and_reset_rearms() -> None:
    seen: list[OpFinding] = []

    def stop(finding: OpFinding) -> None:
        seen.append(finding)
        raise FloatingPointError(finding.op)

    tracer = OpTracer(on_finding=stop)
    x = torch.tensor([-1.0])
    after: list[int] = []
    with pytest.raises(FloatingPointError, match=r"aten\.log\.default"), tracer:
        torch.log(x)
        after.append(1)
    assert after == [] and len(seen) == 1
    tracer.reset()
    assert tracer.finding is None and tracer.producer_tensors == ()
    with pytest.raises(FloatingPointError, match=r"aten\.sqrt\.default"), tracer:
        torch.sqrt(x)


def test_on_finding_raises_out_of_backward() -> None:
    def stop(finding: OpFinding) -> None:
        raise FloatingPointError(finding.op)

    a = torch.zeros(2, requires_grad=True)
    with pytest.raises(FloatingPointError, match=r"aten\.div\.Tensor"), OpTracer(on_finding=stop):
        a.sqrt().sum().backward()
    assert a.grad is None


def test_producer_tensors_are_copies_of_inputs_and_output() -> None:
    tracer = OpTracer()
    x = torch.tensor([-1.0, 4.0])
    with tracer:
        torch.log(x)
    labels = [label for label, _ in tracer.producer_tensors]
    assert labels == ["output", "self"]
    assert torch.equal(tracer.producer_tensors[1][1], x)


# -- backward and optimizer ---------------------------------------------------------


def test_backward_producer_names_the_forward_line() -> None:
    a = torch.ones(2, 3, requires_grad=True)
    b = torch.ones(2, 3)

    def run() -> None:
        distance = torch.sqrt(((a - b) ** 2).sum(-1))  # at: sqrt
        distance.sum().backward()  # at: backward

    finding = trace(run)
    assert finding is not None
    assert finding.phase == Phase.BACKWARD
    assert finding.op == "aten.div.Tensor"
    assert finding.autograd_node == "SqrtBackward0"
    assert finding.forward_source is not None
    assert finding.forward_source.lineno == line_of("sqrt")
    assert finding.forward_source.line == "distance = torch.sqrt(((a - b) ** 2).sum(-1))  # at: sqrt"
    assert finding.source is not None and finding.source.lineno == line_of("backward")
    assert finding.new_kinds == ("+inf",) and finding.posinf == 2


def test_backward_of_in_place_op_on_a_view_names_its_line() -> None:
    a = torch.tensor([[4.0, 0.0], [1.0, 1.0]], requires_grad=True)

    def run() -> None:
        b = a * 1
        b[0].sqrt_()  # at: view sqrt_
        b.sum().backward()

    finding = trace(run)
    assert finding is not None and finding.phase == Phase.BACKWARD
    assert finding.forward_source is not None
    assert finding.forward_source.lineno == line_of("view sqrt_")


class _ZeroSafeSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        root = x.sqrt()  # at: custom forward
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (root,) = ctx.saved_tensors
        return grad / (2 * root)  # at: custom backward


def test_custom_function_backward() -> None:
    a = torch.zeros(3, requires_grad=True)

    def run() -> None:
        _ZeroSafeSqrt.apply(a * 1).sum().backward()

    finding = trace(run)
    assert finding is not None and finding.phase == Phase.BACKWARD
    assert finding.op == "aten.div.Tensor"
    assert finding.source is not None and finding.source.lineno == line_of("custom backward")
    assert finding.forward_source is not None
    assert finding.forward_source.lineno == line_of("custom forward")


@pytest.mark.parametrize("foreach", [True, False])
def test_adam_in_fp16_divides_by_a_zero_eps(foreach: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).half()
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3, eps=1e-8, foreach=foreach)
    x = torch.randn(8, 4).half()
    x[:, 0] = 0  # the weight's first column gets a zero gradient: 0 / (0 + eps) with eps == 0 in fp16
    phase: list[Phase | None] = [None]

    def run() -> None:
        layer(x).float().pow(2).mean().backward()
        phase[0] = Phase.OPTIMIZER
        opt.step()  # at: step
        phase[0] = None

    finding = trace(run, phase_hint=lambda: phase[0])
    assert finding is not None
    assert finding.phase == Phase.OPTIMIZER
    assert finding.op == ("aten._foreach_addcdiv_.ScalarList" if foreach else "aten.addcdiv_.default")
    assert finding.tensor == ("self[0]" if foreach else "output")
    assert finding.new_kinds == ("nan",) and finding.nan == 3
    assert finding.source is not None and finding.source.lineno == line_of("step")
    assert finding.inner_source is not None and finding.inner_source.filename.endswith("adam.py")
    labels = [label for label, _ in finding.input_stats]
    assert labels[0] == TensorRef(TensorRole.OPERAND, "self[0]" if foreach else "self", before=True)
    assert all(stats.finite for _, stats in finding.input_stats)


# -- results are unchanged ------------------------------------------------------------


class _RecordingTracer(OpTracer):
    """An OpTracer that also lists the ops it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_transformer_fast_path_is_kept_and_bit_identical() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = layer(x)
        tracer = _RecordingTracer()
        with tracer:
            got = layer(x)
    assert "aten._transformer_encoder_layer_fwd.default" in tracer.ops
    assert torch.equal(got, expected)


def _train(traced: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    tracer = OpTracer()
    losses = []
    for _ in range(3):
        with tracer if traced else torch.enable_grad():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.detach())
    assert tracer.finding is None
    return [p.detach().clone() for p in model.parameters()], torch.stack(losses)


def test_training_steps_are_bit_identical_under_the_tracer() -> None:
    params, losses = _train(traced=False)
    traced_params, traced_losses = _train(traced=True)
    assert torch.equal(losses, traced_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, traced_params))


# -- replay -----------------------------------------------------------------------------


class DropLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.drop(x))  # at: droplog


def test_replay_reproduces_the_dropout_mask() -> None:
    model = nn.Sequential(nn.Identity(), DropLog())
    x = torch.ones(4, 16)
    torch.manual_seed(1)
    rng = capture_rng_state()
    out = model[1](x)  # the call the watch recorded
    expected_first = tuple(int(i) for i in (out == -INF).reshape(-1).nonzero()[0])
    expected_first = tuple(divmod(expected_first[0], 16))
    rng_after_call = torch.get_rng_state()
    result = replay_module(model[1], (x,), {}, rng_state=rng, kinds=frozenset({"nan", "inf"}), module_name="1")
    assert result.reproduced and result.note is None
    finding = result.finding
    assert finding is not None
    assert finding.op == "aten.log.default"
    assert finding.module == "1"
    assert finding.source is not None and finding.source.lineno == line_of("droplog")
    assert finding.neginf == int((out == -INF).sum())
    assert finding.output_stats.first_bad_index == expected_first
    # The user's random stream goes on as if no replay had happened.
    assert torch.equal(torch.get_rng_state(), rng_after_call)


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()  # at: inner sqrt


def test_replay_names_the_nested_module() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Tanh(), Inner()))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.zero_()
    x = torch.ones(2, 3)
    rng = capture_rng_state()
    result = replay_module(model, (x,), {}, rng_state=rng, module_name="")
    assert result.finding is not None
    assert result.finding.module == "1.1"
    assert result.finding.op == "aten.sqrt.default"
    assert result.finding.source is not None and result.finding.source.lineno == line_of("inner sqrt")
    result = replay_module(model[1], (-x,), {}, rng_state=rng, module_name="encoder")
    assert result.finding is not None and result.finding.module == "encoder.1"


def test_replay_leaves_batchnorm_state_and_autograd_alone() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.2))
    x = torch.randn(8, 4)
    rng = capture_rng_state()
    out = block(x)
    state = {name: t.clone() for name, t in block.state_dict().items()}
    versions = {name: t._version for name, t in block.state_dict(keep_vars=True).items()}
    rng_before = torch.get_rng_state()
    result = replay_module(block, (x,), {}, rng_state=rng, module_name="block")
    assert not result.reproduced and result.finding is None
    assert result.note == "replay of block on its recorded inputs stayed finite; the op is unknown"
    for name, tensor in block.state_dict(keep_vars=True).items():
        assert torch.equal(tensor, state[name]), name
        assert tensor._version == versions[name], name
    assert torch.equal(torch.get_rng_state(), rng_before)
    out.sum().backward()  # the graph of the original call is intact
    assert block[0].weight.grad is not None


class WritesWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.mul_(2)
        x.add_(1)
        return x * self.weight


def test_replay_restores_parameters_and_inputs_written_in_place() -> None:
    module = WritesWeight()
    x = torch.zeros(3)
    rng = capture_rng_state()
    result = replay_module(module, (x,), {}, rng_state=rng)
    assert result.note == "replay of the root module on its recorded inputs stayed finite; the op is unknown"
    assert torch.equal(module.weight.detach(), torch.ones(3))
    assert torch.equal(x, torch.zeros(3))


def test_replay_of_already_bad_inputs() -> None:
    x = torch.tensor([float("nan"), 1.0])
    result = replay_module(nn.Linear(2, 2), (x,), {}, rng_state=capture_rng_state(), module_name="fc")
    assert not result.reproduced and result.note is not None
    assert "already held" in result.note
