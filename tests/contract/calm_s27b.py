"""Healthy programs the session's two new rules meet, silent in every mode, the run left as it was unwatched.

A watched parameter replaced by a new one while the watch runs (LoopWrites.on_registered, torch's registration
hook): resized embeddings, weights tied in the loop, pruning's and parametrize's reparametrizations, a state dict
loaded with ``assign=True``, a LoRA merge, a conv fused with its batch norm, a module swapped, a parameter made
empty and filled before its first use. A learning rate the loop sets (localize/outside/lr_lines.py): from a Python
float every step, 0.0 for a frozen group, a tensor filled in place or assigned, a scheduler and the loop both writing,
a warm-up, OneCycleLR, a rate read into ``lr`` and only logged. The harness is calm26.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.fusion import fuse_conv_bn_eval

from contract import Case, Expect, Scenario
from contract.calm26 import finish


class _Lm(nn.Module):
    def __init__(self, vocab: int = 10, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _loop(model: nn.Module, step_fn, steps: int = 4, make_opt=None) -> Scenario:
    """``steps`` steps; ``step_fn(step, model, opt)`` runs first each step and may return a new optimizer."""
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
    holder = {"opt": make_opt(model)}
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(steps):
            new = step_fn(step, model, holder["opt"])
            if new is not None:
                holder["opt"] = new
            opt = holder["opt"]
            loss = model(ids).float().pow(2).mean() if not isinstance(model, _Lm) else nn.functional.cross_entropy(
                model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, holder["opt"])

    return Scenario((model, holder["opt"]), run)


# -- a watched parameter replaced ---------------------------------------------------------------------


def _resize_embeddings() -> Scenario:
    """resize_token_embeddings: a new, larger embedding Parameter (old rows copied), a new optimizer over it."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        old = m.emb.weight.detach()
        m.emb.weight = nn.Parameter(torch.cat([old, torch.randn(2, old.shape[1]) * 0.02]))
        m.emb.num_embeddings = old.shape[0] + 2
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _tie_weights() -> Scenario:
    """``head.weight = emb.weight`` inside the cell, after the watch began."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 1:
            return None
        m.head.weight = m.emb.weight
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _prune_then_remove() -> Scenario:
    """nn.utils.prune: weight becomes weight_orig * weight_mask, and prune.remove makes it a Parameter again."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step == 1:
            prune.l1_unstructured(m.mid, "weight", amount=0.5)
        elif step == 3:
            prune.remove(m.mid, "weight")
        else:
            return None
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn, steps=5)


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrize_then_remove() -> Scenario:
    """parametrize.register_parametrization in the loop, remove_parametrizations later (left parametrized)."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step == 1:
            parametrize.register_parametrization(m.mid, "weight", _Symmetric())
        elif step == 3:
            parametrize.remove_parametrizations(m.mid, "weight", leave_parametrized=True)
        else:
            return None
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn, steps=5)


def _load_assign() -> Scenario:
    """load_state_dict(assign=True) of a snapshot taken earlier: every parameter replaced by a new one."""
    torch.manual_seed(0)
    model = _Lm()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        m.load_state_dict({k: v.clone() for k, v in snapshot.items()}, assign=True)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _lora_merge() -> Scenario:
    """A LoRA merge that builds a new Parameter: W + B @ A."""
    torch.manual_seed(0)
    model = _Lm()
    a, b = torch.randn(2, 8) * 0.1, torch.randn(8, 2) * 0.1

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        with torch.no_grad():
            m.mid.weight = nn.Parameter(m.mid.weight + b @ a)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def _fuse_conv_bn() -> Scenario:
    """fuse_conv_bn_eval mid-run (an eval-mode fine-tune): the conv swapped for its fused copy, the bn for Identity."""
    torch.manual_seed(0)
    model = _ConvNet()
    x = torch.randn(2, 3, 6, 6)
    holder = {"opt": torch.optim.SGD(model.parameters(), lr=0.05)}

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                model.eval()
                model.body[0] = fuse_conv_bn_eval(model.body[0], model.body[1])
                model.body[1] = nn.Identity()
                holder["opt"] = torch.optim.SGD(model.parameters(), lr=0.05)
            loss = model(x).pow(2).mean()
            holder["opt"].zero_grad()
            loss.backward()
            holder["opt"].step()
            losses.append(loss.detach())
        return finish(losses, model, holder["opt"])

    return Scenario((model, holder["opt"]), run)


def _swap_module() -> Scenario:
    """A module swapped for a new one in the loop (a fresh head), and a new optimizer."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        m.head = nn.Linear(8, 10, bias=False)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _empty_then_filled() -> Scenario:
    """A Parameter made with torch.empty (here: its garbage made NaN, as empty may give) and filled before its first
    use: ``m.bias = nn.Parameter(torch.empty(n)); nn.init.zeros_(m.bias)``."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        m.mid.bias = nn.Parameter(torch.empty(8).fill_(float("nan")))
        nn.init.zeros_(m.mid.bias)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _empty_filled_later() -> Scenario:
    """The same, the new Parameter made in the update region (after backward) and filled before the next forward."""
    torch.manual_seed(0)
    model = _Lm()
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))
    holder = {"opt": torch.optim.SGD(model.parameters(), lr=0.05)}

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                nn.init.zeros_(model.mid.bias)
                holder["opt"] = torch.optim.SGD(model.parameters(), lr=0.05)
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            holder["opt"].zero_grad()
            loss.backward()
            holder["opt"].step()
            if step == 1:
                model.mid.bias = nn.Parameter(torch.empty(8).fill_(float("nan")))
            losses.append(loss.detach())
        return finish(losses, model, holder["opt"])

    return Scenario((model, holder["opt"]), run)


class _Sentinel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        # A "not yet set" marker kept as a frozen Parameter (saved with the model), never read by forward.
        self.best = nn.Parameter(torch.full((1,), float("inf")), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _inf_sentinel_replaced() -> Scenario:
    """A frozen Parameter holding a deliberate inf sentinel, replaced in the loop by a new inf one, never read."""
    torch.manual_seed(0)
    model = _Sentinel()
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.05)

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                model.best = nn.Parameter(torch.full((1,), float("inf")), requires_grad=False)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _weight_norm_in_loop() -> Scenario:
    """parametrizations.weight_norm applied to a watched layer mid-run (weight becomes original0 * original1)."""
    torch.manual_seed(0)
    model = _Lm()

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 1:
            return None
        nn.utils.parametrizations.weight_norm(m.mid)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return _loop(model, step_fn)


def _meta_model_loaded() -> Scenario:
    """A model built on the meta device (init_empty_weights), watched, then loaded with assign=True in the cell."""
    torch.manual_seed(0)
    weights = _Lm().state_dict()
    with torch.device("meta"):
        model = _Lm()
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))
    holder: dict[str, Any] = {}

    def run() -> tuple[Any, ...]:
        model.load_state_dict({k: v.clone() for k, v in weights.items()}, assign=True)
        holder["opt"] = opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model,), run)


REPLACED = {
    "weight-norm-parametrization-in-loop": _weight_norm_in_loop, "meta-model-loaded-with-assign": _meta_model_loaded,
    "resize-embeddings": _resize_embeddings, "tie-weights-in-cell": _tie_weights,
    "prune-then-remove": _prune_then_remove, "parametrize-then-remove": _parametrize_then_remove,
    "load-state-dict-assign": _load_assign, "lora-merge-new-parameter": _lora_merge,
    "fuse-conv-bn-eval": _fuse_conv_bn, "module-swapped": _swap_module, "empty-then-filled": _empty_then_filled,
    "empty-in-update-filled-before-forward": _empty_filled_later, "inf-sentinel-replaced": _inf_sentinel_replaced,
}

# -- learning rates the loop sets -------------------------------------------------------------------


def _lr_loop(set_lr, make_opt=None, steps: int = 5, sched=None) -> Scenario:
    torch.manual_seed(0)
    model = _Lm()
    opt = (make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)))(model)
    scheduler = sched(opt) if sched is not None else None
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(steps):
            set_lr(step, opt)
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _lr_python_float() -> Scenario:
    def set_lr(step: int, opt: Any) -> None:
        lr = 0.05 * 0.9 ** step
        for group in opt.param_groups:
            group["lr"] = lr

    return _lr_loop(set_lr)


def _lr_zero_frozen_group() -> Scenario:
    def make(m: _Lm) -> Any:
        return torch.optim.AdamW([{"params": m.emb.parameters(), "lr": 0.0},
                                  {"params": [*m.mid.parameters(), *m.head.parameters()]}], lr=1e-2)

    def set_lr(step: int, opt: Any) -> None:
        lr = 0.0
        opt.param_groups[0]["lr"] = lr

    return _lr_loop(set_lr, make)


def _lr_tensor_filled() -> Scenario:
    def make(m: _Lm) -> Any:
        return torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2))

    def set_lr(step: int, opt: Any) -> None:
        lr = torch.tensor(1e-2 * (step + 1) / 5)
        opt.param_groups[0]["lr"].fill_(lr)

    return _lr_loop(set_lr, make)


def _lr_tensor_fused_assigned() -> Scenario:
    def make(m: _Lm) -> Any:
        return torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), foreach=False)

    def set_lr(step: int, opt: Any) -> None:
        lr = torch.tensor(1e-2 / (step + 1))
        opt.param_groups[0]["lr"] = lr

    return _lr_loop(set_lr, make)


def _lr_scheduler_and_loop() -> Scenario:
    def set_lr(step: int, opt: Any) -> None:
        if step == 2:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.5

    return _lr_loop(set_lr, sched=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))


def _lr_warmup() -> Scenario:
    warmup, base = 3, 0.05

    def set_lr(step: int, opt: Any) -> None:
        scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        lr = base * scale
        for group in opt.param_groups:
            group["lr"] = lr

    return _lr_loop(set_lr)


def _lr_warmup_from_zero() -> Scenario:
    """step / warmup from step 0: the first rate is exactly 0.0."""
    warmup = 4

    def set_lr(step: int, opt: Any) -> None:
        lr = 0.05 * step / warmup
        for group in opt.param_groups:
            group["lr"] = lr

    return _lr_loop(set_lr)


def _lr_onecycle() -> Scenario:
    return _lr_loop(lambda step, opt: None, sched=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=6))


def _lr_logged() -> Scenario:
    logged: list[float] = []

    def set_lr(step: int, opt: Any) -> None:
        lr = opt.param_groups[0]["lr"]
        logged.append(lr)

    return _lr_loop(set_lr, sched=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4))


LRS = {
    "lr-python-float-every-step": _lr_python_float, "lr-zero-frozen-group": _lr_zero_frozen_group,
    "lr-tensor-filled": _lr_tensor_filled, "lr-tensor-assigned": _lr_tensor_fused_assigned,
    "lr-scheduler-and-loop": _lr_scheduler_and_loop, "lr-warmup": _lr_warmup,
    "lr-warmup-from-zero": _lr_warmup_from_zero, "lr-onecycle": _lr_onecycle, "lr-read-and-logged": _lr_logged,
}

def _nan_replacement_read() -> Scenario:
    """The incident twin: ``mid.bias`` replaced by a new NaN Parameter that the next forward reads."""

    def step_fn(step: int, m: _Lm, opt: Any) -> Any:
        if step != 2:
            return None
        m.mid.bias = nn.Parameter(torch.full((8,), float("nan")))  # producer: nan bias replaced
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    return _loop(_Lm(), step_fn)


CASES = [
    *(Case(f"calm_s27b_{name}", build, None, benign=0) for name, build in REPLACED.items()),
    *(Case(f"calm_s27b_{name}", build, None, benign=0) for name, build in LRS.items()),
    Case("calm_s27b_nan-replacement-read", _nan_replacement_read,
         Expect("optimizer", "mid", "Linear", step=2, op="aten.full.default", marker="nan bias replaced",
                cause="nonfinite-number")),
]
