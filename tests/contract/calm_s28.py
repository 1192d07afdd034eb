"""Healthy training that must stay silent in every mode (session 28): what calm26*/calm_s27* did not try.

Checkpoints and exports made inside the watch (a whole model pickled by ``torch.save``, a state_dict round trip,
``torch.jit.trace`` / ``torch.jit.script`` of the watched model), global settings the user changes inside it
(deterministic algorithms, thread count, grad mode switched by function), second-order and forward-mode
derivatives (``torch.func.hessian``, ``torch.autograd.forward_ad``), reparametrized weights (the old
``spectral_norm`` hook and its power-iteration buffers, a user's parametrization assigned through its
``right_inverse``, global random pruning redrawn every step), schedulers and optimizers no row ran
(``ReduceLROnPlateau``, ``Rprop``, ``NAdam``, ``Adam(amsgrad, maximize)``, ``SWALR`` with ``update_bn``), causal
attention with dropout inside ``scaled_dot_product_attention``, the double-``where`` idiom around a log, norms
that keep no running statistics, and ``share_memory()`` mid-training. Each row is compared with an unwatched run
as calm_s27's are (losses, state, RNG, leftovers, global settings, weak references).
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize, prune

from contract import Case, Scenario
from contract.calm26 import finish, training
from contract.calm_s27 import settled


def _mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           steps: int = 3) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


# -- checkpoints and exports made inside the watch ---------------------------------------------------


def _torch_save_whole_model() -> Scenario:
    """``torch.save(model)`` mid-training (the whole module pickled, with whatever hangs on it), loaded back with
    ``weights_only=False`` and its output compared: a watch must leave nothing on the model that cannot pickle."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y, 2)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
        losses += _steps(model, opt, x, y, 2)
        with torch.no_grad():
            losses.append(restored(x))
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _state_dict_resume() -> Scenario:
    """A checkpoint of model and optimizer state_dicts written to a buffer every other step, then training resumed
    in a fresh model and optimizer loaded from it (the watched ones dropped)."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y, 2)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        fresh = _mlp()
        fresh.load_state_dict(saved["model"])
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_opt.load_state_dict(saved["opt"])
        losses += _steps(fresh, fresh_opt, x, y, 2)
        return finish(losses, model, opt, fresh, fresh_opt)

    return Scenario((model, opt), run)


def _jit_trace_at_end() -> Scenario:
    """The trained model exported by ``torch.jit.trace`` inside the watch, its traced output read."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y)
        model.eval()
        with torch.no_grad():
            traced = torch.jit.trace(model, x)
            losses.append(traced(x))
        model.train()
        losses += _steps(model, opt, x, y, 1)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _jit_script_at_end() -> Scenario:
    """The trained model compiled by ``torch.jit.script`` inside the watch (TorchScript compiles a module's hooks
    with it), its scripted output read, then one more step of the eager model."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y)
        scripted = torch.jit.script(model)
        with torch.no_grad():
            losses.append(scripted(x))
        losses += _steps(model, opt, x, y, 1)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


# -- global settings the user changes inside the watch -------------------------------------------------


def _deterministic_switched_on() -> Scenario:
    """``torch.use_deterministic_algorithms(True)`` called by the user after the first step, left on (restored by
    the row after its result is read): the watch must not put back the value it found at entry."""

    def run() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = torch.randn(6, 8), torch.randn(6, 2)
        losses = _steps(model, opt, x, y, 1)
        torch.use_deterministic_algorithms(True)
        losses += _steps(model, opt, x, y, 2)
        return finish(losses, model, opt)

    return Scenario((), run)


def _threads_and_grad_mode_by_function() -> Scenario:
    """``torch.set_num_threads`` lowered by the user, and evaluation between steps under ``set_grad_enabled(False)``
    called as a function (no context manager), then switched back on."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        torch.set_num_threads(1)
        losses = []
        for _ in range(3):
            losses += _steps(model, opt, x, y, 1)
            torch.set_grad_enabled(False)
            losses.append(F.mse_loss(model(x), y))
            torch.set_grad_enabled(True)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _settings_restored(scenario: Scenario) -> Scenario:
    """``settled(scenario)`` whose global settings are put back after they were read: deterministic algorithms off
    and the thread count as before, so the rows after it run as they would have."""
    inner = settled(scenario)

    def run() -> tuple[Any, ...]:
        threads = torch.get_num_threads()
        try:
            return inner.run()
        finally:
            torch.use_deterministic_algorithms(False)
            torch.set_num_threads(threads)
            torch.set_grad_enabled(True)

    return Scenario(inner.targets, run, inner.options)


# -- second-order and forward-mode derivatives ----------------------------------------------------------


def _hessian_curvature_penalty() -> Scenario:
    """A flatness penalty: the trace of ``torch.func.hessian`` of the loss with respect to one sample's input,
    added to the loss (double backward through every module)."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def loss_of(step: int) -> torch.Tensor:
        def sample_loss(xi: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(xi.unsqueeze(0)), y[:1])

        h = torch.func.hessian(sample_loss)(x[0])
        return F.mse_loss(model(x), y) + 0.01 * torch.diagonal(h).sum().abs()

    return training(model, loss_of)


def _forward_ad_dual_level() -> Scenario:
    """A directional derivative by ``torch.autograd.forward_ad`` (``dual_level``, ``make_dual``, ``unpack_dual``)
    through the watched model, its square penalised."""
    torch.manual_seed(0)
    model = _mlp()
    x, y, v = torch.randn(6, 8), torch.randn(6, 2), torch.randn(6, 8)
    fwAD = torch.autograd.forward_ad

    def loss_of(step: int) -> torch.Tensor:
        with fwAD.dual_level():
            out = model(fwAD.make_dual(x, v))
            primal, tangent = fwAD.unpack_dual(out)
        return F.mse_loss(primal, y) + 0.01 * tangent.pow(2).mean()

    return training(model, loss_of)


# -- reparametrized weights ------------------------------------------------------------------------------


def _old_spectral_norm() -> Scenario:
    """``torch.nn.utils.spectral_norm`` (the hook version): ``weight_orig`` trained, ``weight_u``/``weight_v``
    buffers updated in place by a power iteration in a forward pre-hook, two iterations a call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 16), n_power_iterations=2), nn.LeakyReLU(0.2),
                          nn.utils.spectral_norm(nn.Linear(16, 1)))
    x = torch.randn(6, 8)
    return training(model, lambda s: F.softplus(-model(x)).mean(), opt=torch.optim.Adam(model.parameters(), 2e-4))


class Symmetric(nn.Module):
    """A user's parametrization: the weight is the symmetric part of a free matrix; assigning a weight goes
    through ``right_inverse`` (its upper triangle kept)."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu()


def _user_parametrization_assigned() -> Scenario:
    """A symmetric weight by ``parametrize.register_parametrization``, trained, re-assigned mid-training through
    ``right_inverse`` (``model[0].weight = ...``), read under ``parametrize.cached()`` for two forwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[0].weight = 0.5 * torch.eye(8) + 0.1 * model[0].weight
            with parametrize.cached():
                loss = F.mse_loss(model(x), y) + 0.1 * F.mse_loss(model(-x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _global_random_pruning_each_step() -> Scenario:
    """``prune.global_unstructured`` by L1 over two layers, then ``random_unstructured`` redrawn on a third every
    step (the global RNG stream drawn inside the loop, the masks and forward pre-hooks stacked each time)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        prune.global_unstructured([(model[0], "weight"), (model[2], "weight")], prune.L1Unstructured, amount=0.3)
        for _ in range(3):
            prune.random_unstructured(model[4], "weight", amount=0.2)
            losses += _steps(model, opt, x, y, 1)
        return finish(losses, model, opt)

    # The optimizer holds weight_orig, which pruning keeps as the parameter.
    return Scenario((model, opt), run)


# -- schedulers and optimizers -------------------------------------------------------------------------


def _plateau_and_rare_optimizers() -> Scenario:
    """Three heads, three optimizers no row ran (``Rprop``, ``NAdam`` with decoupled weight decay,
    ``Adam(amsgrad=True, maximize=True)`` on a negated loss), ``ReduceLROnPlateau`` stepped on the loss tensor."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": _mlp(), "b": _mlp(), "c": _mlp()})
    opts = [torch.optim.Rprop(model["a"].parameters(), lr=1e-2),
            torch.optim.NAdam(model["b"].parameters(), lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
            torch.optim.Adam(model["c"].parameters(), lr=1e-2, amsgrad=True, maximize=True)]
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opts[1], patience=0, factor=0.5)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(4):
            a, b = F.mse_loss(model["a"](x), y), F.mse_loss(model["b"](x), y)
            c = -F.mse_loss(model["c"](x), y)
            for opt in opts:
                opt.zero_grad()
            (a + b + c).backward()
            for opt in opts:
                opt.step()
            sched.step(b.detach() + 1.0)
            losses += [a.detach(), b.detach(), c.detach()]
        return finish(losses, model, *opts)

    return Scenario((model, *opts), run)


def _swa_with_update_bn() -> Scenario:
    """Stochastic weight averaging: ``AveragedModel`` made before the watch, ``SWALR`` annealing, the average
    updated each step, then ``update_bn`` (the BatchNorm statistics reset and recomputed with momentum None over a
    loader of batches) inside the watch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    swa = torch.optim.swa_utils.AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    batches = [torch.randn(6, 8) for _ in range(3)]
    y = torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        for x in batches:
            losses += _steps(model, opt, x, y, 1)
            swa.update_parameters(model)
            sched.step()
        torch.optim.swa_utils.update_bn(batches, swa)
        with torch.no_grad():
            losses.append(swa(batches[0]))
        return finish(losses, model, opt, swa)

    return Scenario((model, opt), run)


# -- values and layers ---------------------------------------------------------------------------------


class CausalBlock(nn.Module):
    """Self-attention by ``scaled_dot_product_attention(is_causal=True, dropout_p=0.1)``: the causal mask and the
    dropout drawn inside the fused op."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        return x + self.out(a.transpose(1, 2).reshape(b, t, c))


def _sdpa_causal_dropout() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(CausalBlock(), nn.LayerNorm(8), CausalBlock())
    x = torch.randn(2, 5, 8)
    return training(model, lambda s: model(x).pow(2).mean())


class SafeLog(nn.Module):
    """``log`` of a signed input where it is positive, 0 elsewhere, by the double-``where`` idiom: the log only
    ever sees a safe value, so neither branch holds a NaN forward or backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        positive = h > 0
        safe = torch.where(positive, h, torch.ones_like(h))
        return self.head(torch.where(positive, safe.log(), torch.zeros_like(h)))


def _double_where_log() -> Scenario:
    torch.manual_seed(0)
    model = SafeLog()
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


def _norms_without_running_stats() -> Scenario:
    """``BatchNorm2d(track_running_stats=False)`` (batch statistics in eval too, no buffers) and
    ``InstanceNorm2d(affine=True)``, trained, evaluated between steps in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                          nn.Conv2d(4, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.Flatten(), nn.LazyLinear(2))
    x, y = torch.randn(4, 3, 8, 8), torch.randn(4, 2)
    model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            losses += _steps(model, opt, x, y, 1)
            model.eval()
            with torch.no_grad():
                losses.append(model(x))
            model.train()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _share_memory_mid_training() -> Scenario:
    """``model.share_memory()`` after the first step (every parameter's storage moved to shared memory, as before
    handing the model to Hogwild workers), training continued."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y, 1)
        model.share_memory()
        losses += _steps(model, opt, x, y, 2)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _attention_finfo_min_mask() -> Scenario:
    """A padding mask written with ``finfo.min`` (not -inf) in a float16-free float32 model, a fully padded row
    included: its softmax is uniform, finite, and the loss ignores it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    q = torch.randn(3, 4, 8)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[0, 2:] = True
    pad[2] = True

    def loss_of(step: int) -> torch.Tensor:
        h = model(q)
        scores = (h @ h.transpose(1, 2) / math.sqrt(8)).masked_fill(pad[:, None, :], torch.finfo(h.dtype).min)
        out = scores.softmax(-1) @ h
        return out[~pad].pow(2).mean()

    return training(model, loss_of)


ROWS = {
    "torch-save-whole-model": _torch_save_whole_model,
    "state-dict-resume-fresh-model": _state_dict_resume,
    "jit-trace-at-end": _jit_trace_at_end,
    "jit-script-at-end": _jit_script_at_end,
    "hessian-curvature-penalty": _hessian_curvature_penalty,
    "forward-ad-dual-level": _forward_ad_dual_level,
    "old-spectral-norm-hook": _old_spectral_norm,
    "user-parametrization-assigned-cached": _user_parametrization_assigned,
    "global-and-random-pruning-each-step": _global_random_pruning_each_step,
    "plateau-rprop-nadam-amsgrad-maximize": _plateau_and_rare_optimizers,
    "swa-swalr-update-bn": _swa_with_update_bn,
    "sdpa-causal-dropout": _sdpa_causal_dropout,
    "double-where-log": _double_where_log,
    "norms-without-running-stats": _norms_without_running_stats,
    "share-memory-mid-training": _share_memory_mid_training,
    "attention-finfo-min-mask": _attention_finfo_min_mask,
}

SETTINGS_ROWS = {
    "deterministic-switched-on-inside": _deterministic_switched_on,
    "threads-and-grad-mode-by-function": _threads_and_grad_mode_by_function,
}

CASES = [
    *(Case(f"calm_s28_{name}", lambda build=build: settled(build()), None, benign=0) for name, build in ROWS.items()),
    *(Case(f"calm_s28_{name}", lambda build=build: _settings_restored(build()), None, benign=0)
      for name, build in SETTINGS_ROWS.items()),
]
