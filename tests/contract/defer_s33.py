"""Deferred stress rows, round 33: more of what a GPU loop does that defer_s29..defer_s32 have not.

Each row runs in every mode (``defer=True`` and ``ops=True, defer=True``, what a GPU user runs, must say what the
immediate ones say; tests/test_defer_s33.py also holds the deferred report's module, op, line, phase, step and cause
and its ``%debug`` line to the immediate one's), each incident beside its healthy twin (the same loop with the fix):
a NaN born in a ``no_grad`` validation forward between training steps; a model called twice a step (siamese), the
NaN in the second call; a NaN batch copied with ``.to(dtype, non_blocking=True)``; a NaN in step 0's very first
forward; a NaN in the loss code of the 3rd of 4 accumulated micro-batches; a NaN gradient that ``clip_grad_norm_``
spreads to every gradient; an in-place ``log_`` on a view of the model's output; a NaN inside a
``torch.utils.checkpoint`` segment; a forward returning a dict; a NaN gradient of a multi-task head whose Adam state
and weights stay NaN until the head's task comes back; a loss computed by a helper in another file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from contract import Case, Expect, Scenario, defer22, defer_s33_losses
from contract.defer22 import _net, _zero_row

STEPS = 4


def _rms(step: int, module: str = "0", phase: str = "forward") -> Expect:
    return Expect(phase, module, "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm",
                  cause="division-by-zero")


def _data(count: int, bad: dict[int, int] | None = None, rows: int = 5, width: int = 4
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(rows, width) for _ in range(count)], [torch.randn(rows, 2) for _ in range(count)]
    for index, row in (bad or {}).items():
        xs[index] = _zero_row(xs[index], row)
    return xs, ys


def _setup(eps: float) -> tuple[nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    model = _net(eps)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


# ---------------------------------------------------------------- no_grad validation between training steps
def _validation(eps: float) -> Scenario:
    """Each training step is followed by a validation batch under ``torch.no_grad()`` in eval mode; the validation
    batch after step 1 holds an all-zero row (the training batches are clean)."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS)
    vals, _ = _data(STEPS, {1: 3} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(STEPS):
            model.train()
            seen.append(_train(model, opt, xs[step], ys[step]))
            model.eval()
            with torch.no_grad():
                seen.append(model(vals[step]).abs().mean())
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- siamese: one model called twice a step
def _siamese(eps: float) -> Scenario:
    """A contrastive pair: the same encoder on two views a step; step 2's second view holds an all-zero row."""
    model, opt = _setup(eps)
    lefts, _ = _data(STEPS)
    rights, _ = _data(STEPS, {2: 0} if eps == 0.0 else None)
    rights = [r + 0.0 for r in rights]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            a = model(lefts[step])
            b = model(rights[step])
            loss = (a - b).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN batch copied with non_blocking=True
def _non_blocking(eps: float) -> Scenario:
    """The loader yields float64 batches, the loop copies each with ``.to(torch.float32, non_blocking=True)`` (what a
    pinned-memory loop does to the GPU); step 1's batch holds an all-zero row the model's RMS norm meets."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {1: 2} if eps == 0.0 else None)
    batches = [x.double() for x in xs]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            x = batches[step].to(torch.float32, non_blocking=True)
            y = ys[step].to(torch.float32, non_blocking=True)
            losses.append(_train(model, opt, x, y))
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- step 0's very first forward
def _first_forward(eps: float) -> Scenario:
    """The very first batch holds an all-zero row: nothing ran before it."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {0: 0} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        return [_train(model, opt, xs[step], ys[step]) for step in range(STEPS)]
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the loss of the 3rd of 4 micro-batches
def _cosine_accumulation(eps: float) -> Scenario:
    """Each step accumulates 4 micro-batches, one backward each; the loss is a cosine distance to the target,
    whose 3rd micro-batch of step 1 has an all-zero target row (``0 / 0`` in the loss code, not the model)."""
    model, opt = _setup(1e-6)
    torch.manual_seed(0)
    xs = [[torch.randn(5, 4) for _ in range(4)] for _ in range(3)]
    ys = [[torch.randn(5, 2) for _ in range(4)] for _ in range(3)]
    if eps == 0.0:
        ys[1][2] = _zero_row(ys[1][2], 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                out, y = model(xs[step][micro]), ys[step][micro]
                cos = (out * y).sum(-1) / (out.norm(dim=-1) * y.norm(dim=-1) + eps)  # producer: cosine
                loss = (1 - cos).mean() / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN gradient clip_grad_norm_ spreads
class _Distance(nn.Module):
    """A regressor plus a distance term ``sqrt(|a|^2 + eps)`` of a projection: its backward at a zero row is NaN."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.main, self.proj, self.eps = nn.Linear(4, 2), nn.Linear(4, 3, bias=False), eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.proj(x)
        return self.main(x), (a.pow(2).sum(-1) + self.eps).sqrt()  # producer: distance


def _clipped(eps: float) -> Scenario:
    """Step 2's batch holds an all-zero row: ``proj``'s weight gradient is NaN, and ``clip_grad_norm_`` (a NaN total
    norm) multiplies every gradient by NaN. The report must name the first gradient, not the clipped ones."""
    torch.manual_seed(0)
    model = _Distance(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2: 1})

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            prediction, distance = model(xs[step])
            loss = F.mse_loss(prediction, ys[step]) + 0.01 * distance.mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an in-place op on a view of the output
def _view_in_place(shift: float) -> Scenario:
    """The loop takes the log of the first output column in place (``out[:, 0].log_()``), a rate the model predicts
    raw; step 2's batch drives it below 0 (the twin takes the log of a softplus of it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)
    with torch.no_grad():  # the rate column rises with every hidden unit: positive for the usual batches
        model[0].weight.abs_()
        model[2].weight[0].fill_(0.5)
        model[2].bias[0].fill_(3.0)
    xs[2] = torch.full_like(xs[2], -40.0)  # every hidden unit at -1: a raw rate of 3 - 4 < 0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step]).clone()
            if shift:
                out = torch.cat([F.softplus(out[:, :1]) + shift, out[:, 1:]], 1)
            out[:, 0].log_()  # producer: view log
            loss = F.mse_loss(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN inside a checkpoint segment
class _Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (non-reentrant): the RMS norm and a linear layer inside it."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.block = nn.Sequential(defer22.RmsNorm(eps), nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def _checkpoint_segment(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = _Checkpointed(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2: 4} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        return [_train(model, opt, xs[step], ys[step]) for step in range(STEPS)]
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a forward returning a dict
class _DictOut(nn.Module):
    """``{"logits": ..., "features": ...}`` as a Hugging Face model's output: the features are the hidden state
    over its norm (``0 / 0`` at an all-zero row)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.head, self.eps = nn.Linear(4, 8, bias=False), nn.Linear(8, 2), eps

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        features = h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: dict features
        return {"logits": self.head(torch.tanh(h)), "features": features}


def _dict_output(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = _DictOut(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {1: 2})
    anchors = [torch.randn(5, 8) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step])
            loss = F.mse_loss(out["logits"], ys[step]) + 0.1 * (out["features"] * anchors[step]).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Adam's state poisoned steps before it shows
class _MultiTask(nn.Module):
    """A shared body, a main head every step and an auxiliary distance head on even steps only."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.main, self.aux, self.eps = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 3, bias=False), eps

    def forward(self, x: torch.Tensor, with_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.body(x)
        if not with_aux:
            return self.main(h), None
        a = self.aux(h - h)
        return self.main(h), (a.pow(2).sum(-1) + self.eps).sqrt()  # producer: aux task


def _adam_state(eps: float) -> Scenario:
    """Step 0's auxiliary task meets a zero projection (``aux(h - h)``): the distance's backward is NaN in
    ``aux``'s weight gradient. The user's ``clip_grad_value_`` clips finite values and leaves NaN as it is; Adam's
    ``exp_avg_sq`` and ``aux``'s weights go NaN, unused at step 1, and the loss shows it at step 2."""
    torch.manual_seed(0)
    model = _MultiTask(eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            prediction, aux = model(xs[step], step % 2 == 0)
            loss = F.mse_loss(prediction, ys[step]) + (0.01 * aux.mean() if aux is not None else 0.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the loss in a helper of another file
def _helper_loss(eps: float) -> Scenario:
    """The loss comes from ``masked_mean_error`` in tests/contract/defer_s33_losses.py; step 2's mask keeps no
    sample (every label missing)."""
    model, opt = _setup(1e-6)
    xs, ys = _data(STEPS)
    masks = [torch.ones(5) for _ in range(STEPS)]
    masks[2] = torch.zeros(5)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = defer_s33_losses.masked_mean_error(model(xs[step]), ys[step], masks[step], eps)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect | None, healthy: Callable[[], Scenario],
         source: object = None, gaps: tuple[tuple[str, str], ...] = ()) -> list[Case]:
    return [Case(f"defer_s33_{name}", build, expect, source=source, gaps=gaps),
            Case(f"defer_s33_{name}_healthy", healthy, None)]


CASES = [
    *_row("no_grad_validation_between_steps_nan_in_validation", lambda: _validation(0.0), _rms(2),
          lambda: _validation(1e-6), defer22),
    *_row("siamese_model_called_twice_nan_in_the_second_call", lambda: _siamese(0.0), _rms(2),
          lambda: _siamese(1e-6), defer22),
    *_row("nan_batch_copied_non_blocking", lambda: _non_blocking(0.0), _rms(1), lambda: _non_blocking(1e-6), defer22),
    *_row("nan_in_step_0s_first_forward", lambda: _first_forward(0.0), _rms(0), lambda: _first_forward(1e-6),
          defer22),
    *_row("loss_of_the_3rd_of_4_micro_batches", lambda: _cosine_accumulation(0.0),
          Expect("forward", None, step=1, op="aten.div.Tensor", marker="cosine", cause="division-by-zero"),
          lambda: _cosine_accumulation(1e-6)),
    *_row("nan_gradient_spread_by_clip_grad_norm", lambda: _clipped(0.0),
          Expect("backward", "", "_Distance", step=2, op="aten.div.Tensor", marker="distance", cause="sqrt-domain"),
          lambda: _clipped(1e-6)),
    *_row("in_place_log_on_a_view_of_the_output", lambda: _view_in_place(0.0),
          Expect("forward", None, step=2, op="aten.log_.default", marker="view log", cause="log-domain"),
          lambda: _view_in_place(1e-3)),
    *_row("nan_inside_a_checkpoint_segment", lambda: _checkpoint_segment(0.0), _rms(2, "block.0"),
          lambda: _checkpoint_segment(1e-6), defer22),
    *_row("forward_returns_a_dict_nan_in_one_value", lambda: _dict_output(0.0),
          Expect("forward", "", "_DictOut", step=1, op="aten.div.Tensor", marker="dict features",
                 cause="division-by-zero"),
          lambda: _dict_output(1e-6)),
    *_row("adam_state_poisoned_by_a_nan_gradient_steps_before", lambda: _adam_state(0.0),
          Expect("backward", "", "_MultiTask", step=0, op="aten.div.Tensor", marker="aux task", cause="sqrt-domain"),
          lambda: _adam_state(1e-6)),
    *_row("loss_in_a_helper_of_another_file", lambda: _helper_loss(0.0),
          Expect("forward", None, step=2, op="aten.div.Tensor", marker="helper loss", cause="empty-reduction"),
          lambda: _helper_loss(1e-6), defer_s33_losses),
]
