"""hunt_s41b, the machinery around a training step: schedulers, validation, EMA, model surgery, hooks, 2 models.

A warmup + cosine ``LambdaLR`` (numpy lengths, the run cut to the warmup): ``cos(pi * 0 / 0)``, a NaN lr at step 2.
Validation under ``no_grad``/``inference_mode`` between steps: ``0 / 0`` on an all-zero sample. An EMA teacher by
``_foreach_lerp_`` with a bias-corrected weight ``x / (1 - decay ** 0)`` = inf (watched, or not: a strict xfail).
``model.half()`` mid-run: ``exp`` overflows float16. A post-accumulate-grad hook and a full backward hook normalising
a zero gradient. A ``custom_op``'s registered backward dividing by 0 inside ``checkpoint`` (reentrant or not). Two
models of one class (``Sequential#1``/``#2``): the second's gradient, Adam step, resumed state, forward and root code
are named in it (``Expect.model``).
Each with a healthy twin: the same code with the guard or healthy data.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from nan_magic.records import TensorRef, TensorRole


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# ---------------------------------------------------------------- a warmup + cosine LambdaLR dividing 0 by 0
def _warmup_cosine(total: np.int64, adamw: bool) -> Scenario:
    """Linear warmup then cosine decay by ``LambdaLR``, the lengths numpy integers from a config; with
    ``total == warmup`` (2: a run shortened without touching the warmup) the decay's first factor is
    ``cos(pi * 0 / 0)``, NaN at step 2, and that update writes NaN into every parameter. Twin: total 4."""
    model = _mlp()
    if adamw:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    warmup = np.int64(2)

    def factor(s: int) -> float:
        if s < warmup:
            return float(s / warmup)
        return float(0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        with np.errstate(invalid="ignore", divide="ignore"):
            for step in range(4):
                loss = F.mse_loss(model(xs[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                opt.step()  # producer: warmup step
                sched.step()
                losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a validation pass between training steps
class UnitNorm(nn.Module):
    """Scales each sample to unit length (no eps: "the features are never all zero")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)  # producer: unit norm


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = UnitNorm()
        self.head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def _validation(zero: bool, inference: bool) -> Scenario:
    """Train 4 steps; after step 1 (2 optimizer steps done) a validation pass in ``model.eval()`` under
    ``no_grad`` (or ``inference_mode``) over a held-out batch with an all-zero sample: ``0 / 0`` in ``norm``,
    step 2. The training batches are healthy. Twin: the held-out batch has no zero sample."""
    torch.manual_seed(0)
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]
    val_x, val_y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    if zero:
        val_x[3] = 0.0
    context = torch.inference_mode if inference else torch.no_grad

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            model.train()
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if step == 1:
                model.eval()
                with context():
                    losses.append(F.cross_entropy(model(val_x), val_y).clone())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- an EMA by _foreach_lerp_ with a bias-corrected weight
def _ema(decay: np.float64, first: int, teacher_watched: bool = True) -> Scenario:
    """An EMA teacher updated after each step by ``torch._foreach_lerp_(ema, params, w)``, with the bias-corrected
    weight ``w = (1 - decay) / (1 - decay ** n)``; ``n`` counts from ``first``: with ``first`` 0 the weight is
    ``x / 0`` = inf at step 0 (numpy float), and the EMA's parameters become inf/NaN. Both models are watched, or
    (``teacher_watched`` False) only the student: the teacher's inf output reaches the loss at step 1.
    Twin: ``n`` counts from 1."""
    model = _mlp()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        with np.errstate(invalid="ignore", divide="ignore"):
            for step in range(3):
                loss = F.mse_loss(model(xs[step]), ys[step]) + 0.1 * F.mse_loss(model(xs[step]), ema(xs[step]))
                opt.zero_grad()
                loss.backward()
                opt.step()
                weight = float((1 - decay) / (1 - decay ** (step + first)))
                with torch.no_grad():
                    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), weight)  # producer: ema
                losses.append(loss.detach())
        return losses

    return Scenario((model, ema) if teacher_watched else (model,), run)


# ---------------------------------------------------------------- model.half() mid-run
class ExpFeatures(nn.Module):
    """Positive features ``exp(x)``: 12 overflows float16 (65504), never float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()  # producer: exp features


def _half_mid_run(peak: float) -> Scenario:
    """Two steps in float32, then ``model.half()`` and half batches (to save memory): at step 2 a feature of
    ``peak`` 12 makes ``exp`` overflow float16 (inf in ``0``). Twin: peak 5."""
    torch.manual_seed(0)
    model = nn.Sequential(ExpFeatures(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ys = [torch.rand(5, 4) for _ in range(4)], _batches(5, 1)
    xs[2][1, 2] = peak

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                model.half()
            dtype = torch.float16 if step >= 2 else torch.float32
            loss = (model(xs[step].to(dtype)).float() - ys[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a post-accumulate-grad hook normalising a gradient
class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.main = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.main(h), self.aux(h)


def _post_accumulate(eps: float) -> Scenario:
    """Every weight's gradient is normalised in place as soon as it is accumulated
    (``register_post_accumulate_grad_hook``); the auxiliary loss warms up from a weight of 0 at step 0, so ``aux``'s
    gradient is exactly 0 and the hook's ``g / ||g||`` is ``0 / 0``. Twin: the hook adds eps."""
    torch.manual_seed(0)
    model = AuxNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def normalise(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.div_(p.grad.norm() + eps)  # producer: post accumulate

    for p in model.parameters():
        if p.ndim == 2:
            p.register_post_accumulate_grad_hook(normalise)
    xs, ys, zs = _batches(5, 4), _batches(5, 1), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step]) + min(1.0, step / 2) * F.mse_loss(aux, zs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- a custom op's backward inside a checkpoint
@torch.library.custom_op("nan_magic_contract::s41_soft_root", mutates_args=())
def soft_root(x: torch.Tensor) -> torch.Tensor:
    return x.abs().sqrt()


@soft_root.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _soft_root_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0], output)


def _soft_root_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, root = ctx.saved_tensors
    return grad * x.sign() / (2 * root)  # producer: soft root backward


soft_root.register_autograd(_soft_root_backward, setup_context=_soft_root_setup)


class RootBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_root(self.fc(x))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(4, 4)
        self.block = RootBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.stem(x), use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointed_custom_op(reentrant: bool, dead: bool) -> Scenario:
    """A custom op (``torch.library.custom_op`` with ``register_autograd``): ``sqrt(|x|)``, whose backward is
    ``grad * sign(x) / (2 * root)``: ``0 / 0`` where a unit is exactly 0. The block runs under ``checkpoint``
    (reentrant or not); at step 2 the batch is all zero and the biases zeroed: every unit is exactly 0.
    Twin: the batch at step 2 is healthy."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(5, 4) for _ in range(4)], _batches(5, 1)
    if dead:
        xs[2] = torch.zeros(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2 and dead:
                with torch.no_grad():
                    model.stem.bias.zero_()
                    model.block.fc.bias.zero_()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- a full backward hook rescaling grad_input
def _full_backward_rescale(eps: float) -> Scenario:
    """A module full backward hook returns ``grad_input`` scaled to unit norm (a gradient-normalising trick); at
    step 0 the auxiliary loss has weight 0, so the gradient into ``aux``'s input is exactly 0: ``0 / 0`` in the
    hook. Twin: the hook adds eps."""
    torch.manual_seed(0)
    model = AuxNet()

    def rescale(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        g = grad_input[0]
        return (g / (g.norm() + eps),)  # producer: backward hook

    model.aux.register_full_backward_hook(rescale)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys, zs = _batches(5, 4), _batches(5, 1), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step]) + min(1.0, step / 2) * F.mse_loss(aux, zs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- two models of one class: the second one's parameter
class RootScale(nn.Module):
    """Scales its input by ``sqrt(|s|)``: where ``s`` is exactly 0 only its own gradient is ``0 / 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s.abs().sqrt()  # producer: root scale


def _side_by_side(models: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer], inputs: Sequence[Sequence[Any]],
                  ys: Sequence[torch.Tensor], steps: int, at: int = -1, prune: Callable[[], object] = lambda: None
                  ) -> Callable[[], list[torch.Tensor]]:
    """The loop the two-model rows share: both models trained on one summed loss, each by its own optimizer;
    ``prune()`` runs under no_grad before step ``at`` (a pruning mask, a zeroed bias). ``inputs[i]``: model i's
    batches."""

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            if step == at:
                with torch.no_grad():
                    prune()
            first, second = (F.mse_loss(model(xs[step]), ys[step]) for model, xs in zip(models, inputs))
            loss = first + second
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()  # producer: gan step
            losses.append(loss.detach())
        return losses

    return run


def _twins_gradient(dead: bool) -> Scenario:
    """A student and a teacher of one class (``Sequential``: the report tells them apart as ``Sequential#1`` and
    ``#2``), trained side by side with one optimizer each; at step 1 the teacher's scale ``1.s`` is zeroed (a pruning
    mask): only that parameter's own gradient is ``0 / 0``. Twin: the scale is halved."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 4), RootScale(), nn.Linear(4, 1))
    teacher = nn.Sequential(nn.Linear(4, 4), RootScale(), nn.Linear(4, 1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (student, teacher)]
    xs, ys = _batches(5, 4), _batches(5, 1)

    def prune() -> None:
        teacher[1].s.mul_(0.0 if dead else 0.5)

    run = _side_by_side((student, teacher), opts, (xs, xs), ys, 3, at=1, prune=prune)
    return Scenario((student, teacher), run)


def _twins_optimizer(eps: float) -> Scenario:
    """A generator and a discriminator of one class (``Sequential``), each with its own Adam; the second's Adam has
    ``eps`` 0 ("as in the paper") and its embedding's row 9 is never looked up: ``0 / sqrt(0)`` at its first step.
    Twin: eps 1e-8."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    second = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opts = [torch.optim.Adam(first.parameters(), lr=1e-3), torch.optim.Adam(second.parameters(), lr=1e-3, eps=eps)]
    ids, ys = [torch.randint(0, 9, (6,)) for _ in range(3)], _batches(6, 1)

    run = _side_by_side((first, second), opts, (ids, ids), ys, 3)
    return Scenario((first, second), run)


_POST_ACCUMULATE_GAP = (
    "default, defer and full name the gradient, its module and step but no op: the tiered replay of the step "
    "computes scratch gradients with torch.autograd.grad, where no post-accumulate-grad hook runs (the replay "
    "stays finite and the report says so, pointing to mode=\"full\"); ops=True names the hook's div_ and its line.")
_UNWATCHED_EMA = (
    "watch(student) only: default, defer and full say phase data, 'self of aten.t.default' at the loss line, cause "
    "bad-input-data (the teacher's inf weight read by its Linear, no watched code made it), where ops=True names the "
    "loop's _foreach_lerp_ that made the teacher's weights inf (forward, no module, its line): the tiered watch "
    "follows writes of watched parameters only, and the teacher is not watched.")
class LogScale(nn.Module):
    """Log-magnitude features (no floor: "a feature is never exactly 0")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().log()  # producer: log scale


def _twins_forward(dead: bool) -> Scenario:
    """Two models of one class (``Sequential``: an online and a target network, each trained on its own loss), the
    same layers; at step 2 the batch of the second (the target's view) has an all-zero sample and its first layer's
    bias is zeroed: ``log(0)`` in its ``1``. Twin: the bias is halved instead."""
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))
    target = nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (online, target)]
    xs, views, ys = _batches(5, 4), _batches(5, 4), _batches(5, 1)
    views[2][1] = 0.0

    def prune() -> None:
        target[0].bias.mul_(0.0 if dead else 0.5)

    run = _side_by_side((online, target), opts, (xs, views), ys, 4, at=2, prune=prune)
    return Scenario((online, target), run)


def _twins_resumed(where: str) -> Scenario:
    """A GAN resumed from a checkpoint: generator and discriminator of one class (``Sequential``), each with its own
    Adam; the second's saved Adam state of ``0.weight`` (``exp_avg_sq``) already holds a NaN (where='state'; the
    diverged step was saved). where='none' is the clean checkpoint."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    xs, ys = _batches(8, 4), _batches(8, 1)
    for model, opt in zip(models, opts):
        F.mse_loss(model(xs[0]), ys[0]).backward()
        opt.step()
        opt.zero_grad()
    state = opts[1].state_dict()
    if where == "state":
        state["state"][0]["exp_avg_sq"][1, 2] = float("nan")
    opts[1].load_state_dict(state)

    run = _side_by_side(models, opts, (xs[1:], xs[1:]), ys[1:], 3)
    return Scenario((*models, *opts), run)


class Gate(nn.Module):
    """Holds a gate its parent reads (``self.gate.s``); its own forward passes its input on."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(self.fc(x))
        return self.out(h * self.gate.s.abs().sqrt())  # producer: parent gate


def _twins_parent_code(dead: bool) -> Scenario:
    """Two models of one class (``GatedNet#1``, ``#2``); the root's own code scales by ``sqrt(|gate.s|)``; at step 1
    the second model's gate is pruned to exactly 0: only ``gate.s``'s own gradient is ``0 / 0``, in the root's code
    (module ``""``). Twin: the gate is halved."""
    torch.manual_seed(0)
    models = [GatedNet(), GatedNet()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    xs, ys = _batches(5, 4), _batches(5, 1)

    def prune() -> None:
        models[1].gate.s.mul_(0.0 if dead else 0.5)

    run = _side_by_side(models, opts, (xs, xs), ys, 3, at=1, prune=prune)
    return Scenario(tuple(models), run)


CASES = [
    Case("hunt_s41b_warmup_cosine_nan_lr_sgd", lambda: _warmup_cosine(np.int64(2), adamw=False),
         Expect("optimizer", "0", "Linear", step=2, op="aten.add_.Tensor", marker="warmup step",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}))),
    Case("hunt_s41b_warmup_cosine_sgd_healthy", lambda: _warmup_cosine(np.int64(4), adamw=False), None),
    Case("hunt_s41b_warmup_cosine_nan_lr_adamw_foreach", lambda: _warmup_cosine(np.int64(2), adamw=True),
         Expect("optimizer", "0", "Linear", step=2, op="aten._foreach_mul_.Scalar", marker="warmup step",
                kinds=frozenset({"nan"}))),
    Case("hunt_s41b_warmup_cosine_adamw_foreach_healthy", lambda: _warmup_cosine(np.int64(4), adamw=True), None),
    Case("hunt_s41b_validation_under_no_grad_zero_sample", lambda: _validation(True, False),
         Expect("forward", "norm", "UnitNorm", step=2, op="aten.div.Tensor", marker="unit norm")),
    Case("hunt_s41b_validation_under_no_grad_healthy", lambda: _validation(False, False), None),
    Case("hunt_s41b_validation_under_inference_mode_zero_sample", lambda: _validation(True, True),
         Expect("forward", "norm", "UnitNorm", step=2, op="aten.div.Tensor", marker="unit norm")),
    Case("hunt_s41b_validation_under_inference_mode_healthy", lambda: _validation(False, True), None),
    Case("hunt_s41b_ema_foreach_lerp_inf_weight", lambda: _ema(np.float64(0.99), 0),
         Expect("optimizer", "0", "Linear", step=1, op="aten._foreach_lerp_.Scalar", marker="ema",
                model="Sequential#2", cause="nonfinite-number")),
    Case("hunt_s41b_ema_foreach_lerp_healthy", lambda: _ema(np.float64(0.99), 1), None),
    Case("hunt_s41b_unwatched_ema_teacher_foreach_lerp_inf_weight", lambda: _ema(np.float64(0.99), 0, False),
         Expect("forward", None, step=1, op="aten._foreach_lerp_.Scalar", marker="ema"), modes=("ops",)),
    Case("hunt_s41b_unwatched_ema_teacher_foreach_lerp_inf_weight_tiered",
         lambda: _ema(np.float64(0.99), 0, False),
         Expect("forward", None, step=1, op="aten._foreach_lerp_.Scalar", marker="ema"),
         modes=("default", "defer", "full"), marks=(pytest.mark.xfail(strict=True, reason=_UNWATCHED_EMA),)),
    Case("hunt_s41b_unwatched_ema_teacher_healthy", lambda: _ema(np.float64(0.99), 1, False), None),
    Case("hunt_s41b_half_mid_run_exp_overflows", lambda: _half_mid_run(12.0),
         Expect("forward", "0", "ExpFeatures", step=2, op="aten.exp.default", marker="exp features",
                cause="exp-overflow")),
    Case("hunt_s41b_half_mid_run_healthy", lambda: _half_mid_run(5.0), None),
    Case("hunt_s41b_post_accumulate_hook_normalises_a_zero_gradient", lambda: _post_accumulate(0.0),
         Expect("backward", "aux", "Linear", step=0, op="aten.div_.Tensor", marker="post accumulate",
                op_modes=("ops",)), note=_POST_ACCUMULATE_GAP),
    Case("hunt_s41b_post_accumulate_hook_healthy", lambda: _post_accumulate(1e-12), None),
    Case("hunt_s41b_custom_op_backward_in_a_reentrant_checkpoint", lambda: _checkpointed_custom_op(True, True),
         Expect("backward", "block", "RootBlock", step=2, op="aten.div.Tensor", marker="soft root backward")),
    Case("hunt_s41b_custom_op_in_a_reentrant_checkpoint_healthy", lambda: _checkpointed_custom_op(True, False), None),
    Case("hunt_s41b_custom_op_backward_in_a_checkpoint", lambda: _checkpointed_custom_op(False, True),
         Expect("backward", "block", "RootBlock", step=2, op="aten.div.Tensor", marker="soft root backward")),
    Case("hunt_s41b_custom_op_in_a_checkpoint_healthy", lambda: _checkpointed_custom_op(False, False), None),
    Case("hunt_s41b_full_backward_hook_rescales_a_zero_gradient", lambda: _full_backward_rescale(0.0),
         Expect("backward", "aux", "Linear", step=0, op="aten.div.Tensor", marker="backward hook")),
    Case("hunt_s41b_full_backward_hook_with_eps_healthy", lambda: _full_backward_rescale(1e-12), None),
    Case("hunt_s41b_second_model_of_a_class_parameter_gradient", lambda: _twins_gradient(True),
         Expect("backward", "1", "RootScale", step=1, op="aten.div.Tensor", marker="root scale",
                model="Sequential#2")),
    Case("hunt_s41b_second_model_of_a_class_gradient_healthy", lambda: _twins_gradient(False), None),
    Case("hunt_s41b_second_model_of_a_class_adam_eps_0", lambda: _twins_optimizer(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="gan step",
                model="Sequential#2")),
    Case("hunt_s41b_second_model_of_a_class_adam_healthy", lambda: _twins_optimizer(1e-8), None),
    Case("hunt_s41b_second_model_of_a_class_forward", lambda: _twins_forward(True),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale", model="Sequential#2")),
    Case("hunt_s41b_second_model_of_a_class_forward_healthy", lambda: _twins_forward(False), None),
    Case("hunt_s41b_second_model_of_a_class_resumed_adam_state_holding_a_nan", lambda: _twins_resumed("state"),
         Expect("data", "0", "Linear", step=0, op=None, kinds=frozenset({"nan"}), cause="parameter-already-nonfinite",
                tensor=TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", "exp_avg_sq"), model="Sequential#2")),
    Case("hunt_s41b_second_model_of_a_class_resumed_healthy", lambda: _twins_resumed("none"), None),
    Case("hunt_s41b_second_model_of_a_class_parent_code_gradient", lambda: _twins_parent_code(True),
         Expect("backward", "", "GatedNet", step=1, op="aten.div.Tensor", marker="parent gate",
                tensor=TensorRef.gradient("gate.s"), model="GatedNet#2")),
    Case("hunt_s41b_second_model_of_a_class_parent_code_healthy", lambda: _twins_parent_code(False), None),
]
