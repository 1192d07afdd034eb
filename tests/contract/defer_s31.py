"""Deferred stress rows, round 31: more of what a GPU loop does that defer_s29 and defer_s30 have not.

Each row runs in every mode (``defer=True`` and ``ops=True, defer=True``, what a GPU user runs, must say what the
immediate ones say; tests/test_defer_s31.py also holds the deferred report's line and ``%debug`` frame to the
immediate one's), each incident beside its healthy twin (the same loop with eps): the batch moved with
``.to(device, non_blocking=True)`` inside the loop; batches from a ``DataLoader(pin_memory=True)``; a loss summed and
divided by a batch size counted from a tensor (the labelled samples); a loss function compiled by ``torch.compile``;
gradient accumulation over 4 micro-batches of one flat loop (``(i + 1) % 4``), the NaN in micro-batch 3; a NaN born in
a custom ``autograd.Function``'s backward only; a parameter written by the loop under ``no_grad`` between steps (a
spherical embedding's projection onto the unit sphere); a learning-rate schedule stepped every batch;
``zero_grad(set_to_none=False)`` with the NaN in the backward; a model of two outputs of which only one feeds the
loss; a loss stacked from a list of per-sample losses. The NaN is defer22's (an RMS norm without eps over an all-zero
row, the distance's backward at 0) or one of the row's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import OUTPUT_GRADIENT, RmsNorm, _net, _zero_row

STEPS = 4
DEVICE = torch.device("cpu")  # what the loop moves its batch to (cuda on a GPU)


def _rms(step: int, module: str = "0") -> Expect:
    return Expect("forward", module, "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm",
                  cause="division-by-zero")


def _distance_backward(step: int) -> Expect:
    return Expect("backward", None, step=step, op="aten.div.Tensor", marker="distance", tensor=OUTPUT_GRADIENT,
                  kinds=frozenset({"nan"}), cause="sqrt-domain")


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


def _distance(out: torch.Tensor, y: torch.Tensor, bad: bool, eps: float) -> torch.Tensor:
    """defer22's mean distance; where ``bad`` one sample's target is its prediction (a missing label filled in)."""
    target = y.clone()
    if bad:
        target[1] = out[1].detach()
    return (((out - target) ** 2).sum(-1) + eps).sqrt().mean()  # producer: distance


# ---------------------------------------------------------------- the batch moved inside the loop, non_blocking
def _non_blocking(eps: float) -> Scenario:
    """``x.to(device, non_blocking=True)`` and the targets likewise, each batch inside the loop; step 2's batch
    holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            x = xs[step].to(DEVICE, non_blocking=True)
            y = ys[step].to(DEVICE, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- pinned-memory batches from a DataLoader
def _pinned(eps: float) -> Scenario:
    """A ``DataLoader(pin_memory=True)`` (no accelerator here: torch warns and does not pin), each batch moved with
    ``non_blocking=True``; the 3rd batch (step 2) holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 3} if eps == 0.0 else None)
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=5, shuffle=False, pin_memory=True)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loss summed over a batch size counted from a tensor
def _counted_batch(eps: float) -> Scenario:
    """The loss is the squared error of the labelled samples summed, over their count (``labelled.sum()``, a tensor:
    no host sync); step 2's batch has no labelled sample: 0 / 0 in the loop's loss code."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS)
    masks = [torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]) for _ in range(STEPS)]
    if eps == 0.0:
        masks[2] = torch.zeros(5)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step])
            labelled = masks[step]
            batch_size = labelled.sum() + eps
            loss = (((out - ys[step]) ** 2).mean(-1) * labelled).sum() / batch_size  # producer: counted batch
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loss function compiled by torch.compile
def _compiled_loss(eps: float) -> Scenario:
    """``loss_fn = torch.compile(...)`` (backend ``eager``: no C++ compiler needed) around the loss, the model
    eager; step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 2} if eps == 0.0 else None)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(out, y) + 0.1 * out.pow(2).mean()

    compiled = torch.compile(loss_fn, backend="eager")

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = compiled(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- accumulation over 4 micro-batches of one flat loop
def _flat_accumulation(eps: float) -> Scenario:
    """One loop over 12 micro-batches, ``loss / 4`` backpropagated each, ``opt.step()`` when ``(i + 1) % 4 == 0``;
    micro-batch 3 of the second window (index 6) holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(12, {6: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        opt.zero_grad()
        for i, (x, y) in enumerate(zip(xs, ys)):
            loss = F.mse_loss(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN born in a custom Function's backward only
class _UnitScale(torch.autograd.Function):
    """Forward: the input itself. Backward: the gradient scaled to unit mean magnitude per row (a hand gradient
    normaliser); a row whose gradient is all 0 is 0 / 0."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.eps = eps  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        eps = ctx.eps  # type: ignore[attr-defined]
        return grad / (grad.abs().mean(-1, keepdim=True) + eps), None  # producer: unit scale backward


class GradNormalised(nn.Module):
    """A linear layer whose output's gradient is normalised per row by :class:`_UnitScale`."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnitScale.apply(self.lin(x), self.eps)


def _backward_only(eps: float) -> Scenario:
    """The loss weights each sample; step 2 gives sample 1 weight 0: its rows' gradients are all 0, and the
    Function's backward divides them by their mean magnitude 0. The forward stays finite."""
    torch.manual_seed(0)
    model = nn.Sequential(GradNormalised(eps), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            weights = torch.ones(5, 1)
            if step == 2 and eps == 0.0:
                weights[1] = 0.0
            loss = (weights * (model(xs[step]) - ys[step]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a parameter written by the loop under no_grad
def _sphere_projection(eps: float) -> Scenario:
    """Spherical embeddings: after each ``opt.step()`` the loop projects the table onto the unit sphere under
    ``torch.no_grad()`` (``w.div_(w.norm(...))``). The padding row (index 0) is all 0 and never learns: its
    projection is 0 / 0 from step 1 on, when the projection starts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = [torch.randint(0, 10, (5, 3)) for _ in range(STEPS)]
    ys = [torch.randn(5, 2) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.mse_loss(model(tokens[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= 1:
                with torch.no_grad():
                    w = model[0].weight
                    w.div_(w.norm(dim=1, keepdim=True) + eps)  # producer: sphere projection
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a learning-rate schedule stepped every batch
def _per_batch_schedule(eps: float) -> Scenario:
    """A linear warm-up (``LambdaLR``) stepped after every ``opt.step()``, Adam; step 2's batch holds an all-zero
    row."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    xs, ys = _data(STEPS, {2: 4} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- zero_grad(set_to_none=False), the NaN in backward
def _zeroed_grads(eps: float) -> Scenario:
    """Gradients kept as tensors and zeroed in place (``zero_grad(set_to_none=False)``, which writes a NaN gradient
    back to 0 before the deferred check reads it at the next step); step 2's distance backward is 0 / 0."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = _distance(model(xs[step]), ys[step], step == 2 and eps == 0.0, eps)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- two outputs, only one feeds the loss
class TwoHeads(nn.Module):
    """A trunk and two heads: ``main`` feeds the loss; ``probe`` (an RMS-normed readout, logged only) does not."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.main = nn.Linear(8, 2)
        self.probe = nn.Sequential(RmsNorm(eps), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.main(h), self.probe(h)


def _unused_output(eps: float) -> Scenario:
    """The loss reads the main head only; the probe's output is kept (detached) for logging. Step 2's batch holds a
    row the ReLU zeroes: the probe's RMS norm of it is 0 / 0, in an output no loss reads."""
    torch.manual_seed(0)
    model = TwoHeads(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)
    with torch.no_grad():
        model.trunk.bias.fill_(-0.1)
    if eps == 0.0:
        xs[2] = _zero_row(xs[2], 3)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(STEPS):
            main, probe = model(xs[step])
            loss = F.mse_loss(main, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += [loss.detach(), probe.detach()]
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loss stacked from a list of per-sample losses
def _stacked_losses(eps: float) -> Scenario:
    """Each sample's distance computed in a Python loop, ``torch.stack(per_sample).mean()``; step 2's sample 1 has
    its prediction for target: its distance's backward is 0 / 0."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step])
            target = ys[step].clone()
            if step == 2 and eps == 0.0:
                target[1] = out[1].detach()
            per_sample = []
            for o, t in zip(out, target):
                per_sample.append((((o - t) ** 2).sum() + eps).sqrt())  # producer: sample distance
            loss = torch.stack(per_sample).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect | None, healthy: Callable[[], Scenario],
         source: object = None) -> list[Case]:
    return [Case(f"defer_s31_{name}", build, expect, source=source),
            Case(f"defer_s31_{name}_healthy", healthy, None)]


CASES = [
    *_row("non_blocking_to_inside_the_loop", lambda: _non_blocking(0.0), _rms(2), lambda: _non_blocking(1e-6),
          defer22),
    *_row("pinned_memory_loader_batches", lambda: _pinned(0.0), _rms(2), lambda: _pinned(1e-6), defer22),
    *_row("sum_over_a_batch_size_counted_from_a_tensor", lambda: _counted_batch(0.0),
          Expect("forward", None, step=2, op="aten.div.Tensor", marker="counted batch", cause="empty-reduction"),
          lambda: _counted_batch(1e-6)),
    *_row("loss_function_under_torch_compile", lambda: _compiled_loss(0.0), _rms(2), lambda: _compiled_loss(1e-6),
          defer22),
    *_row("flat_accumulation_of_4_nan_in_micro_batch_3", lambda: _flat_accumulation(0.0), _rms(1),
          lambda: _flat_accumulation(1e-6), defer22),
    *_row("custom_function_backward_only_divides_by_0", lambda: _backward_only(0.0),
          Expect("backward", "0", "GradNormalised", step=2, op="aten.div.Tensor", marker="unit scale backward",
                 cause="division-by-zero"),
          lambda: _backward_only(1e-6)),
    *_row("embedding_projected_to_the_sphere_under_no_grad", lambda: _sphere_projection(0.0),
          Expect("optimizer", "0", "Embedding", step=2, op="aten.div_.Tensor", marker="sphere projection",
                 cause="division-by-zero"),
          lambda: _sphere_projection(1e-6)),
    *_row("lr_schedule_stepped_every_batch", lambda: _per_batch_schedule(0.0), _rms(2),
          lambda: _per_batch_schedule(1e-6), defer22),
    *_row("zero_grad_set_to_none_false_nan_in_backward", lambda: _zeroed_grads(0.0), _distance_backward(2),
          lambda: _zeroed_grads(1e-6)),
    *_row("two_outputs_only_one_feeds_the_loss", lambda: _unused_output(0.0), _rms(2, "probe.0"),
          lambda: _unused_output(1e-6), defer22),
    *_row("loss_stacked_from_per_sample_losses", lambda: _stacked_losses(0.0),
          Expect("backward", None, step=2, op="aten.div.Tensor", marker="sample distance", tensor=OUTPUT_GRADIENT,
                 kinds=frozenset({"nan"}), cause="sqrt-domain"),
          lambda: _stacked_losses(1e-6)),
]
