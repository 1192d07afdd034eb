"""Healthy training that must stay silent in every mode (session 27): what a program's structure does.

A complex-valued FFT layer, a seed drawn inside forward, clipping at inf, a user's own finiteness check and hooks,
a bf16 evaluation between fp32 steps, ``model.to()`` and ``load_state_dict`` under the swap future (parameters
swapped with ``torch.utils.swap_tensors``), packed sequences, ``load_state_dict(assign=True)`` mid-training.
The harness is calm_s27.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish, training
from contract.calm_s27 import _mlp, settled


class FFTConv(nn.Module):
    """A global convolution in frequency space with a complex-valued weight parameter (FNO-style)."""

    def __init__(self, channels: int = 4, length: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, length // 2 + 1, dtype=torch.complex64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = torch.fft.rfft(x, dim=-1)
        return torch.fft.irfft(spec * self.weight, n=x.shape[-1], dim=-1)


def _fft_conv_complex() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(FFTConv(), nn.GELU(), FFTConv())
    x = torch.randn(3, 4, 16)
    return training(model, lambda s: model(x).pow(2).mean(), torch.optim.Adam(model.parameters(), lr=1e-2))


class SeededDropout(nn.Module):
    """Seeds the global generator inside forward (a reproducible mask per call), as some research code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        torch.manual_seed(1000 + self.calls)
        return F.dropout(self.fc(x), 0.3, self.training)


def _seed_in_forward() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(SeededDropout(), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        return (model(x) + 0.01 * torch.randn(6, 2)).pow(2).mean()

    return training(model, loss_of)


def _clip_at_inf() -> Scenario:
    """Clipping that never clips: by value at +-inf, by norm with ``error_if_nonfinite=False`` (its norm
    logged), foreach on and off."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out = []
        for step in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(model.parameters(), float("inf"), foreach=bool(step % 2))
            norm = nn.utils.clip_grad_norm_(model.parameters(), 10.0, error_if_nonfinite=False,
                                            foreach=bool(step % 2))
            opt.step()
            out += [loss.detach(), norm]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


class Guarded(nn.Module):
    """The user's own NaN check in forward (a host sync and a Python branch on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if not torch.isfinite(h).all():
            raise FloatingPointError("non-finite activations")
        return self.b(h)


def _user_guard_and_hooks() -> Scenario:
    """The user's finiteness check, a forward hook saving activations for logging, a tensor hook saving the
    activation's gradient, and a full backward hook reading grad_output: all removed after the loop."""
    torch.manual_seed(0)
    model = Guarded()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        seen: list[torch.Tensor] = []

        def keep_activation(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            seen.append(output.detach().abs().mean())
            output.register_hook(lambda g: seen.append(g.norm()))

        handles = [model.a.register_forward_hook(keep_activation),
                   model.b.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].norm()))]
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        for handle in handles:
            handle.remove()
        return finish(losses + seen, model, opt)

    return Scenario((model, opt), run)


def _dtype_round_trip() -> Scenario:
    """fp32 training, ``model.to(torch.bfloat16)`` for an evaluation under no_grad, back to fp32, more training
    (the same Parameter objects, their data swapped twice)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out = []
        for step in range(4):
            if step == 2:
                model.to(torch.bfloat16).eval()
                with torch.no_grad():
                    out.append(model(x.bfloat16()))
                model.to(torch.float32).train()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return finish(out, model, opt)

    return Scenario((model, opt), run)


def _swapped_conversions() -> Scenario:
    """``torch.__future__.set_swap_module_params_on_conversion(True)``: ``model.to()`` and ``load_state_dict``
    swap each parameter's (and gradient's) contents with ``torch.utils.swap_tensors``, which refuses a tensor
    with a weak reference. An evaluation in float64, back to float32, a checkpoint loaded back, more training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.LayerNorm(6), nn.GELU(), nn.Flatten(), nn.Linear(24, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(5, 2, 8)

    def run() -> tuple[Any, ...]:
        out = []
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            for step in range(4):
                if step == 2:
                    saved = {k: v.clone() for k, v in model.state_dict().items()}
                    model.to(torch.float64)
                    with torch.no_grad():
                        out.append(model(x.double()))
                    model.to(torch.float32)
                    model.load_state_dict(saved)
                loss = model(x).pow(2).mean()
                opt.zero_grad(set_to_none=False)
                loss.backward()
                opt.step()
                out.append(loss.detach())
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        return finish(out, model, opt)

    return Scenario((model, opt), run)


class PackedGRU(nn.Module):
    """Variable-length sequences through a GRU as a PackedSequence (the GRU's input and output)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, padding_value=0.0)
        return self.head(padded.sum(1) / lengths.unsqueeze(1))


def _packed_gru() -> Scenario:
    torch.manual_seed(0)
    model = PackedGRU()
    x, lengths = torch.randn(3, 6, 4), torch.tensor([6, 2, 4])
    return training(model, lambda s: model(x, lengths).pow(2).mean())



def _assign_load() -> Scenario:
    """``load_state_dict(sd, assign=True)`` mid-training (new Parameter objects in the model's slots) and a new
    optimizer over them; the watch was given the old one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))
    first = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out, opt = [], first
        for step in range(4):
            if step == 2:
                model.load_state_dict({k: v.clone() * 0.5 for k, v in model.state_dict().items()}, assign=True)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return finish(out, model, opt)

    return Scenario((model, first), run)


class Masker(nn.Module):
    """Marks the activations below a threshold -inf (masked_fill with an infinite scalar): its output."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.masked_fill(h < -0.5, float("-inf"))


def _hook_cleans_output() -> Scenario:
    """A forward hook the user registered on ``Masker`` returns its output with the -inf zeroed (``torch.where``
    over ``isinf``): what the next layer receives is finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Masker(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        handle = model[1].register_forward_hook(
            lambda module, args, out: torch.where(torch.isinf(out), torch.zeros_like(out), out))
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        handle.remove()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class Pooling(nn.Module):
    """Attention pooling: softmax of a scorer's output over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.value, self.out = nn.Linear(8, 1), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.score(x).squeeze(-1), -1)
        return self.out((weights.unsqueeze(-1) * self.value(x)).sum(1))


def _hooks_add_masks() -> Scenario:
    """The user's hooks put the padding mask in: a forward hook fills the scorer's output with -inf at the padding,
    and a pre-hook of a softmax module fills its input; each softmax row keeps a finite entry."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"pool": Pooling(), "proj": nn.Linear(2, 5), "soft": nn.Softmax(-1), "head": nn.Linear(5, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, pad = torch.randn(3, 5, 8), torch.zeros(3, 5, 1, dtype=torch.bool)
    pad[1, 3:] = True
    classes = torch.tensor([True, True, True, False, False])

    def run() -> tuple[Any, ...]:
        handles = [model["pool"].score.register_forward_hook(lambda m, a, out: out.masked_fill(pad, float("-inf"))),
                   model["soft"].register_forward_pre_hook(lambda m, a: (a[0].masked_fill(~classes, float("-inf")),))]
        losses = []
        for _ in range(3):
            loss = model["head"](model["soft"](model["proj"](model["pool"](x)))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        for handle in handles:
            handle.remove()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _compiled_in_its_place() -> Scenario:
    """``compiled = torch.compile(model)`` (aot_eager: numerically the eager model's), the watch given ``model``,
    the loop calling ``compiled``; compiled first in the watched cell, as in a fresh kernel (dynamo's caches reset:
    the unwatched run's graph would be reused without tracing anything)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        if step == 0:
            torch.compiler.reset()
        return compiled(x).pow(2).mean()

    return training(model, loss_of)


ROWS = {
    "fft-conv-complex-weight": _fft_conv_complex,
    "manual-seed-in-forward": _seed_in_forward,
    "clip-value-inf-norm-nonfinite-ok": _clip_at_inf,
    "user-isfinite-guard-and-hooks": _user_guard_and_hooks,
    "dtype-round-trip-bf16-eval": _dtype_round_trip,
    # Raised "_apply(): Couldn't swap Conv1d.weight" in every mode: the op tracer's weak references, the loop-code
    # recorder's view of the parameter (patches/swaps.py).
    "swap-future-to-and-load-state-dict": _swapped_conversions,
    "packed-gru": _packed_gru,
    "load-state-dict-assign-new-optimizer": _assign_load,
    "user-hooks-add-neginf-masks": _hooks_add_masks,
    # Raised dynamo's TorchRuntimeError in our hooks (reads.probe: nbytes of a symbolic size) in the default and
    # full modes: the compiled wrapper was no watched model, its call not stepped aside for (targets.join).
    "compiled-wrapper-called-model-watched": _compiled_in_its_place,
}

CASES = [
    *(Case(f"calm_s27_{name}", lambda build=build: settled(build()), None, benign=0) for name, build in ROWS.items()),
    # mode="full" raised "unclassified ... replay of 1 on its recorded inputs stayed finite": its replay claimed the
    # output the user's hook made, not the forward's own the watch judged (replay/module_run.py): one benign event.
    Case("calm_s27_user-hook-zeroes-a-child-neginf-output", lambda: settled(_hook_cleans_output()), None, benign=1),
]
