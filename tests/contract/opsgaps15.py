"""Op and line in the phases around the models (opsgaps15): a custom autograd.Function, hooks, update code.

A custom ``autograd.Function`` whose backward divides by zero: the loss itself, called from a loss helper that
returned, given a large input; one in a model's forward, its backward the producer. An op under ``torch.no_grad()``
in the loss code; an in-place op on a model's output in the loss code; ``backward(retain_graph=True)`` twice, and a
second loss through a retained graph; a user's gradient hook on a model output and on a parameter; update code
that divides the gradients by their norms. Each: module, phase, step, op and line, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


class RatioLoss(torch.autograd.Function):
    """``-mean(log(p))`` as one Function, with a backward by hand: ``-g / (n p)``, 0 / 0 where p is 0 and g is."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return -torch.log(p.clamp_min(1e-12)).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return -grad / (p * p.numel())  # producer: ratio loss backward


class ClampedLog(torch.autograd.Function):
    """log with its input clamped; the backward forgets the clamp and the batch's scale (two arguments)."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ctx.save_for_backward(p)
        ctx.scale = scale
        return torch.log(p.clamp_min(1e-12)) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (p,) = ctx.saved_tensors
        return grad * ctx.scale / p, None  # producer: clamped log backward


def _probabilities(rows: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def probabilities(step: int) -> torch.Tensor:
        p = torch.sigmoid(model(torch.randn(rows, 4)))
        if step == 2:
            p = p * (torch.arange(rows) > 0).float().unsqueeze(-1)
        return p
    return model, opt, probabilities


def _function_is_the_loss() -> Scenario:
    """``loss = RatioLoss.apply(p)``: the Function returns the loss itself."""
    model, opt, probabilities = _probabilities()

    def run() -> None:
        for step in range(4):
            loss = RatioLoss.apply(probabilities(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def nll_of(p: torch.Tensor, scale: float) -> torch.Tensor:
    """A loss helper the loop calls: its frame has returned when backward runs."""
    return -ClampedLog.apply(p, scale).mean()


def _function_in_a_loss_helper(rows: int = 3) -> Scenario:
    model, opt, probabilities = _probabilities(rows)

    def run() -> None:
        for step in range(4):
            loss = nll_of(probabilities(step), scale=0.5)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


class ClampGradInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.abs().clamp_min(1e-6).sqrt()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (2 * x.abs().sqrt())  # producer: model function backward


class RootOfAbs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClampGradInForward.apply(x)


def _function_in_the_model() -> Scenario:
    """A Function in a model's forward; at step 2 its input holds a 0: its backward divides by 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RootOfAbs(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[0].weight[0].zero_()
                    model[0].bias[0].zero_()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _no_grad_weights_in_the_loss() -> Scenario:
    """Per-row weights computed under ``no_grad`` in the loss code: 1 / a count that is 0 at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            out = model(torch.randn(5, 4))
            keep = torch.full((5, 3), step != 2)
            with torch.no_grad():
                weights = 1.0 / keep.sum(-1, keepdim=True).float()  # producer: no_grad weights
            loss = (out.pow(2) * weights).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def in_place_on_a_model_output() -> Scenario:
    """The loss code scales the model's output in place by its rows' sizes, a row of which is 0 at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            out = model(torch.randn(5, 4))
            size = out.detach().abs().sum(-1, keepdim=True) * ((torch.arange(5) > 0) | (step != 2)).unsqueeze(-1)
            out.div_(size)  # producer: in-place scale
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _rows_zeroed_at_2(model: nn.Module, step: int) -> torch.Tensor:
    out = model(torch.randn(3, 4))
    return out * torch.tensor([[0.0], [1.0], [1.0]]) if step == 2 else out


def _retained_backward_twice() -> Scenario:
    """``loss.backward(retain_graph=True)`` then ``loss.backward()``: the loss's sqrt backward is 1 / 0 at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            loss = _rows_zeroed_at_2(model, step).pow(2).sum(-1).sqrt().sum()  # producer: retained sqrt
            opt.zero_grad()
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _second_loss_through_a_retained_graph() -> Scenario:
    """A first loss's backward keeps the graph; a second loss on the same output, computed after it, is the one
    whose backward (its sqrt's, 1 / 0 at step 2) goes bad."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            out = _rows_zeroed_at_2(model, step)
            opt.zero_grad()
            out.pow(2).mean().backward(retain_graph=True)
            aux = out.pow(2).sum(-1).sqrt().sum()  # producer: second loss sqrt
            aux.backward()
            opt.step()
    return Scenario((model, opt), run)


#: Why the large input's case names no op but in ops mode.
LARGE_INPUT = (
    "the loss code's tensors over 1 MiB (outside/held.py's KEEP_BYTES) are held only weakly through backward, and "
    "backward has freed them (the Function's saved input is released as its node runs) before the gradient into "
    "the model's output is judged: the replay of the recorded ops has nothing to start from (recorded_ops.Gone), as "
    "for any large loss code; ops=True traces the real backward")
CASES = [
    Case("opsgaps15_custom_function_returns_the_loss", _function_is_the_loss,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="ratio loss backward")),
    Case("opsgaps15_custom_function_in_a_returned_loss_helper", _function_in_a_loss_helper,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="clamped log backward")),
    Case("opsgaps15_custom_function_in_a_loss_helper_large_input", lambda: _function_in_a_loss_helper(300_000),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="clamped log backward"),
         gaps=tuple((mode, LARGE_INPUT) for mode in ("default", "defer", "full"))),
    Case("opsgaps15_custom_function_in_the_model_backward", _function_in_the_model,
         Expect("backward", "1", "RootOfAbs", step=2, op="aten.div.Tensor", marker="model function backward")),
    Case("opsgaps15_no_grad_block_in_the_loss_code", _no_grad_weights_in_the_loss,
         Expect("forward", None, step=2, op="aten.reciprocal.default", marker="no_grad weights")),
    Case("opsgaps15_in_place_op_on_a_model_output_in_the_loss", in_place_on_a_model_output,
         # (the recorder copies the output before the loss code's div_ writes it: region_records.keep_before_write)
         Expect("forward", None, step=2, op="aten.div_.Tensor", marker="in-place scale")),
    Case("opsgaps15_backward_retain_graph_twice", _retained_backward_twice,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="retained sqrt")),
    Case("opsgaps15_second_loss_through_a_retained_graph", _second_loss_through_a_retained_graph,
         # (the update region's records go on as loss code when the second backward starts: loop_writes.loss_starts)
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="second loss sqrt")),
]


def _hook_on_a_model_output() -> Scenario:
    """A user's gradient hook on the model's output normalises each row of the gradient: a zero row at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            out = model(torch.randn(5, 4))
            out.register_hook(lambda g: g / g.norm(dim=-1, keepdim=True))  # producer: output hook
            weight = torch.ones(5, 1)
            if step == 2:
                weight[0] = 0.0
            loss = (out * weight).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _hook_on_a_parameter() -> Scenario:
    """A user's gradient hook on a weight scales its gradient by its largest value: all zero at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[1].weight.register_hook(lambda g: g / g.abs().max())  # producer: parameter hook
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean() * (0 if step == 2 else 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _update_code_normalises_gradients() -> Scenario:
    """The loop divides each gradient by its norm between backward and step: a zero gradient at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean() * (0 if step == 2 else 1)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad.div_(p.grad.norm())  # producer: update normalise
            opt.step()
    return Scenario((model, opt), run)


#: A user's gradient hook on a model output or a parameter: mode="full" replays the owner's call from a gradient of
#: ones (the real one is not kept per module), where the hook sees no zero row; gaps23: a gradient no module replay
#: named is named by the step replay of the kept top-level calls, from the real gradients into the model's outputs and
#: with the user's hooks (replay/per_call.replayed_from_the_step), as the default watch does.
CASES += [
    Case("opsgaps15_gradient_hook_on_a_model_output", _hook_on_a_model_output,
         Expect("backward", "", step=2, op="aten.div.Tensor", marker="output hook")),
    Case("opsgaps15_gradient_hook_on_a_parameter", _hook_on_a_parameter,
         Expect("backward", "1", step=2, op="aten.div.Tensor", marker="parameter hook")),
    Case("opsgaps15_update_code_normalises_gradients", _update_code_normalises_gradients,
         # (the user's in-place write of a gradient is copied first, and the update region's records are held for
         # the step's gradient check, which claims the gradient in them: update_recorder.py, loop_writes.py)
         Expect("backward", None, step=2, op="aten.div_.Tensor", marker="update normalise",
                tensor=TensorRef.gradient("0.weight"))),
]


class LogNoClamp(torch.autograd.Function):
    """log with a backward by hand; its forward is the producer (log of 0)."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return torch.log(p)  # producer: function forward log

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return grad / p


def _function_forward_in_the_loss() -> Scenario:
    model, opt, probabilities = _probabilities()

    def run() -> None:
        for step in range(4):
            loss = -LogNoClamp.apply(probabilities(step)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


CASES += [
    Case("opsgaps15_custom_function_forward_in_the_loss", _function_forward_in_the_loss,
         Expect("forward", None, step=2, op="aten.log.default", marker="function forward log")),
]


class LogAndDouble(torch.autograd.Function):
    """Two outputs, the second made first; the loss reads only the first (the log): its backward is g / p."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(p)
        double = p * 2
        return torch.log(p.clamp_min(1e-12)), double

    @staticmethod
    def backward(ctx, grad: torch.Tensor, grad_double: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return grad / p + 2 * grad_double  # producer: two outputs backward


def _function_with_an_unused_output() -> Scenario:
    model, opt, probabilities = _probabilities()

    def run() -> None:
        for step in range(4):
            log_p, _double = LogAndDouble.apply(probabilities(step))
            loss = -log_p.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


CASES += [
    Case("opsgaps15_custom_function_with_an_unused_output", _function_with_an_unused_output,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="two outputs backward")),
]


def _data_code_standardises_in_place() -> Scenario:
    """The loop standardises each batch in place; batch 2 has a constant column: 0 / 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [torch.randn(5, 4) for _ in range(4)]
    batches[2][:, 1] = 3.0

    def run() -> None:
        for step in range(4):
            x = batches[step]
            x.sub_(x.mean(0)).div_(x.std(0))  # producer: standardise in place
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


CASES += [
    Case("opsgaps15_data_code_standardises_a_batch_in_place", _data_code_standardises_in_place,
         Expect("data", "", step=2, op="aten.div_.Tensor", marker="standardise in place")),
]
