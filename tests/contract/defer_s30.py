"""Deferred stress rows, round 30: what a GPU loop does that a CPU loop rarely does and defer_s29 has not.

Each row runs in every mode (``defer=True`` and ``ops=True, defer=True``, what a GPU user runs, must say what the
immediate ones say), each incident beside its healthy twin (the same loop with eps): a CUDA-graph-style step
function replayed over static input/target buffers (``copy_`` into them, gradients kept as zeroed tensors, Adam's
learning rate and step as static tensors: ``capturable=True`` itself asserts a CUDA device, so the CPU stand-in is
a tensor lr); an EMA teacher updated under ``torch.no_grad()`` between steps; features of a first model detached, a
second model trained on them; ``zero_grad(set_to_none=True)`` with gradients summed into the loop's own buffers and
handed back every 2nd micro-batch; CPU bfloat16 autocast around the forward only, the loss outside it; the NaN born
in Adam's own update (``eps=0`` over an auxiliary head switched on at step 2 with weight 0: ``0 / sqrt(0)``); an
accuracy read with ``.item()`` right after the forward (a host sync before the deferred check); two losses of one
output backpropagated one by one (``retain_graph=True``), the NaN in the second's backward; a MAML-like inner loop
of 3 optimizer steps per batch; a validation forward under ``torch.inference_mode()`` between ``backward()`` and
``opt.step()``. The NaN is defer22's: the RMS norm without eps over an all-zero row (``0 / 0``), or the distance's
backward at 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import OUTPUT_GRADIENT, _loss, _net, _zero_row

STEPS = 4


def _rms(step: int, module: str = "0") -> Expect:
    return Expect("forward", module, "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm",
                  cause="division-by-zero")


def _distance_backward(step: int) -> Expect:
    return Expect("backward", None, step=step, op="aten.div.Tensor", marker="distance", tensor=OUTPUT_GRADIENT,
                  kinds=frozenset({"nan"}), cause="sqrt-domain")


def _loss_code(step: int) -> Expect:
    return Expect("forward", None, step=step, op="aten.div.Tensor", marker="loss weights", cause="empty-reduction")


def _data(count: int, bad: dict[int, int] | None = None, rows: int = 5
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(rows, 4) for _ in range(count)], [torch.randn(rows, 2) for _ in range(count)]
    for index, row in (bad or {}).items():
        xs[index] = _zero_row(xs[index], row)
    return xs, ys


def _setup(eps: float) -> tuple[nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    model = _net(eps)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


# ---------------------------------------------------------------- a captured step replayed over static tensors
def _captured_step(eps: float, where: str = "model") -> Scenario:
    """One step function (what ``torch.cuda.graph`` captures) replayed each iteration: the batch ``copy_``-ed into
    static input and target buffers, ``zero_grad(set_to_none=False)``, Adam with a static tensor lr (single-tensor,
    as a captured Adam), the loss copied into a static buffer; step 2's batch holds an all-zero row
    (``where="model"``) or is a batch of ignored samples (``where="loss"``: its loss weights are 0 / 0)."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), foreach=False)
    xs, ys = _data(STEPS, {2: 1} if eps == 0.0 and where == "model" else None)
    static_x, static_y, static_loss = torch.zeros(5, 4), torch.zeros(5, 2), torch.zeros(())
    ignored = torch.zeros((), dtype=torch.bool)

    def replay() -> None:
        opt.zero_grad(set_to_none=False)
        loss = _loss(model(static_x), static_y, where, bool(ignored), eps)
        loss.backward()
        opt.step()
        static_loss.copy_(loss.detach())

    def run() -> list[torch.Tensor]:
        history = []
        for step in range(STEPS):
            static_x.copy_(xs[step], non_blocking=True)
            static_y.copy_(ys[step], non_blocking=True)
            ignored.fill_(eps == 0.0 and where == "loss" and step == 2)
            replay()
            history.append(static_loss.clone())
        return history
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an EMA teacher updated under no_grad
def _ema_teacher(eps: float) -> Scenario:
    """A student trained toward an EMA teacher's outputs; after each ``opt.step()`` the teacher's parameters are
    moved toward the student's under ``torch.no_grad()`` (``lerp_``); step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    torch.manual_seed(1)
    teacher = _net(1e-6)
    teacher.requires_grad_(False)
    xs, ys = _data(STEPS, {2: 2} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.no_grad():
                target = 0.5 * teacher(xs[step] + 0.1) + 0.5 * ys[step]
            loss = F.mse_loss(model(xs[step]), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), model.parameters()):
                    t.lerp_(s, 0.01)
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- features detached, a second model trained on them
def _detached_features(eps: float) -> Scenario:
    """A first model (a frozen encoder, watched) makes features; the loop detaches a copy and trains a second model
    (its own optimizer) on it: ``loss.backward()`` runs through the second model only. Step 2's batch holds an
    all-zero row: the NaN is born in the first model's RMS norm."""
    torch.manual_seed(0)
    encoder = _net(eps, out=4)
    head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2: 3} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            feats = encoder(xs[step]).detach().clone()
            loss = F.mse_loss(head(feats), ys[step])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((encoder, head, opt), run)


# ---------------------------------------------------------------- set_to_none=True, gradients in the loop's buffers
def _own_grad_buffers(eps: float) -> Scenario:
    """``zero_grad(set_to_none=True)`` after every micro-batch; each gradient summed into the loop's own buffer,
    handed back as ``p.grad`` every 2nd micro-batch for ``opt.step()``; step 1's 2nd micro-batch is bad."""
    model, opt = _setup(eps)
    xs, ys = _data(2 * 3, {3: 1} if eps == 0.0 else None)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]

    def run() -> list[torch.Tensor]:
        losses = []
        for index in range(2 * 3):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(xs[index]), ys[index]) / 2
            loss.backward()
            for p, buf in zip(params, buffers):
                buf.add_(p.grad)
            if index % 2 == 1:
                for p, buf in zip(params, buffers):
                    p.grad = buf.clone()
                opt.step()
                for buf in buffers:
                    buf.zero_()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- autocast around the forward only
def _autocast_forward_only(eps: float) -> Scenario:
    """``torch.autocast("cpu", torch.bfloat16)`` around ``model(x)`` only; the loss (in float32), backward and
    step outside it; step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 4} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xs[step])
            loss = F.mse_loss(out.float(), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the NaN born in Adam's own update
class _WithAux(nn.Module):
    """A trunk and an auxiliary head whose loss is switched on at step 2 with weight 0 (a warm-up from 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk[1](self.trunk[0](x))
        return self.trunk[2](h), self.aux(h)


def _adam_update(eps: float) -> Scenario:
    """Adam with ``eps`` (0: the incident); the auxiliary head's loss joins at step 2 with weight 0, so its first
    gradient is exactly 0 and Adam's first update of it is ``0 / (sqrt(0) + eps)``: the NaN is born in the step."""
    torch.manual_seed(0)
    model = _WithAux()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps, foreach=False)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out, aux = model(xs[step])
            loss = F.mse_loss(out, ys[step])
            if step >= 2:
                loss = loss + 0.0 * (step - 2) * aux.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adam eps step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an accuracy read with .item() right after forward
def _accuracy_item(eps: float) -> Scenario:
    """``(out.argmax(-1) == label).float().mean().item()`` after each forward, before backward: a host sync that
    comes before the deferred check; step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 1} if eps == 0.0 else None)

    def run() -> list[object]:
        seen: list[object] = []
        for step in range(STEPS):
            out = model(xs[step])
            seen.append((out.argmax(-1) == ys[step].argmax(-1)).float().mean().item())
            loss = F.mse_loss(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.detach())
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- two backward passes, the NaN in the second
def _second_backward(eps: float) -> Scenario:
    """Two losses of one output backpropagated one by one: ``first.backward(retain_graph=True)`` then
    ``second.backward()``; at step 2 the second (a distance) has a zero distance: its backward is 0 / 0."""
    model, opt = _setup(1e-6)
    xs, ys = _data(STEPS, rows=6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step])
            first, second = out.pow(2).mean(), _loss(out, ys[step], "grad", eps == 0.0 and step == 2, eps)
            opt.zero_grad()
            first.backward(retain_graph=True)
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a MAML-like inner loop: k steps per batch
def _inner_steps(eps: float) -> Scenario:
    """Three optimizer steps on each batch before the next (an inner adaptation loop); batch 1 holds an all-zero
    row, so the NaN is born in its first inner step's forward."""
    model, opt = _setup(eps)
    xs, ys = _data(3, {1: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for batch in range(3):
            for _inner in range(3):
                loss = F.mse_loss(model(xs[batch]), ys[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- validation under inference_mode before the step
def _inference_between(eps: float) -> Scenario:
    """Between ``loss.backward()`` and ``opt.step()`` the loop runs a validation forward under
    ``torch.inference_mode()`` (``eval()`` then back to ``train()``); step 2's training batch is bad."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 2} if eps == 0.0 else None)
    vx, vy = _data(1, rows=3)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            model.eval()
            with torch.inference_mode():
                val = F.mse_loss(model(vx[0]), vy[0])
            model.train()
            opt.step()
            seen += [loss.detach(), val.clone()]
        return seen
    return Scenario((model, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect, healthy: Callable[[], Scenario],
         gaps: tuple[tuple[str, str], ...] = ()) -> list[Case]:
    return [Case(f"defer_s30_{name}", build, expect, source=defer22, gaps=gaps),
            Case(f"defer_s30_{name}_healthy", healthy, None)]


CASES = [
    # The update is born inside torch's Adam: the report names the step's line in the loop and the eps underflow.
    Case("defer_s30_adam_update_of_a_head_switched_on_with_weight_0", lambda: _adam_update(0.0),
         Expect("optimizer", "aux", "Linear", step=2, op="aten.addcdiv_.default", marker="adam eps step",
                cause="optimizer-eps-underflow")),
    Case("defer_s30_adam_update_of_a_head_switched_on_with_weight_0_healthy", lambda: _adam_update(1e-8), None),
    *_row("captured_step_loss_code_of_ignored_samples", lambda: _captured_step(0.0, "loss"), _loss_code(2),
          lambda: _captured_step(1e-6, "loss")),
    *_row("captured_step_replayed_over_static_tensors", lambda: _captured_step(0.0), _rms(2),
          lambda: _captured_step(1e-6)),
    *_row("ema_teacher_updated_under_no_grad", lambda: _ema_teacher(0.0), _rms(2), lambda: _ema_teacher(1e-6)),
    *_row("features_detached_second_model_trained", lambda: _detached_features(0.0), _rms(2),
          lambda: _detached_features(1e-6)),
    *_row("set_to_none_grads_summed_in_own_buffers", lambda: _own_grad_buffers(0.0), _rms(1),
          lambda: _own_grad_buffers(1e-6)),
    *_row("bf16_autocast_forward_only_loss_outside", lambda: _autocast_forward_only(0.0), _rms(2),
          lambda: _autocast_forward_only(1e-6)),
    *_row("accuracy_item_before_backward", lambda: _accuracy_item(0.0), _rms(2), lambda: _accuracy_item(1e-6)),
    *_row("retain_graph_nan_in_the_second_backward", lambda: _second_backward(0.0), _distance_backward(2),
          lambda: _second_backward(1e-6)),
    *_row("inner_loop_of_3_steps_per_batch", lambda: _inner_steps(0.0), _rms(3), lambda: _inner_steps(1e-6)),
    *_row("inference_mode_validation_before_the_step", lambda: _inference_between(0.0), _rms(2),
          lambda: _inference_between(1e-6)),
]
