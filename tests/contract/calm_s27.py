"""Healthy training that must stay silent in every mode (session 27): the idioms calm26* did not try.

Per-sample gradients (torch.func), forward-mode AD, LoRA with a zero B, a QAT observer's inf/-inf buffers, a CRF
over forbidden transitions and its Viterbi, Dijkstra in the loss, NaN-padded sensor data, a complex FFT layer, a
seed drawn inside forward, autograd.grad and two backwards, LBFGS under strong Wolfe, an infinite horizon buffer,
gradient clipping at inf, a user's own finiteness check and hooks, a dtype round trip, packed sequences, a
scatter-amax over an empty segment. Each ``run()`` returns what calm26.finish returns, and the torch global
settings as the loop saw them at its end (the watch must not change them while it runs).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish, training


def torch_settings() -> tuple[Any, ...]:
    """The global switches a user's code may read: a watch that leaves one flipped changes the run."""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
            torch.is_autocast_enabled("cpu"), torch.get_num_threads(),
            torch.__future__.get_swap_module_params_on_conversion())


class WeakRefs:
    """The weak references on a model's parameters and gradients, counted when compared (after the watch has
    exited): ``torch.utils.swap_tensors`` (``model.to()`` under the swap future) refuses a tensor that has one."""

    def __init__(self, *objs: Any) -> None:
        self.models = [obj for obj in objs if isinstance(obj, nn.Module)]

    def counts(self) -> list[int]:
        return [weakref.getweakrefcount(t) for model in self.models for p in model.parameters()
                for t in (p, p.grad) if t is not None]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeakRefs) and self.counts() == other.counts()

    __hash__ = None  # type: ignore[assignment]


def settled(scenario: Scenario) -> Scenario:
    """``scenario`` whose result also carries the global settings at the end of its loop, and the weak references
    left on its models."""
    run = scenario.run

    def run_and_read() -> tuple[Any, ...]:
        return run(), torch_settings(), WeakRefs(*scenario.targets)

    return Scenario(scenario.targets, run_and_read, scenario.options)


def _mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2))


# -- gradients computed another way -------------------------------------------------------------------


def _dp_sgd() -> Scenario:
    """DP-SGD: per-sample gradients from ``vmap(grad(functional_call))``, each clipped to norm 1, summed, Gaussian
    noise added (the RNG stream drawn every step), written to ``.grad`` by hand."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    func = torch.func

    def sample_loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = func.functional_call(model, params, (xi.unsqueeze(0),))
        return F.mse_loss(out, yi.unsqueeze(0))

    per_sample = func.vmap(func.grad(sample_loss), in_dims=(None, 0, 0))

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            params = {k: v.detach() for k, v in model.named_parameters()}
            grads = per_sample(params, x, y)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
            factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
            opt.zero_grad()
            for name, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factor, grads[name])
                p.grad = (clipped + 0.5 * torch.randn_like(clipped)) / len(x)
            opt.step()
            losses.append(F.mse_loss(model(x), y).detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _jvp_regulariser() -> Scenario:
    """A Jacobian penalty by forward-mode AD: ``torch.func.jvp`` of the model along a random direction (dual
    tensors through every module), its squared norm added to the loss."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    v = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        out, tangent = torch.func.jvp(model, (x,), (v,))
        return F.mse_loss(out, y) + 0.01 * tangent.pow(2).mean()

    return training(model, loss_of)


def _autograd_grad_loop() -> Scenario:
    """``torch.autograd.grad`` instead of ``backward()`` (a parameter unused this step: ``allow_unused``, its
    gradient None made zeros), then a second loss backward'ed separately into the same parameters."""
    torch.manual_seed(0)
    trunk, head, spare = nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(16, 2)
    model = nn.ModuleDict({"trunk": trunk, "head": head, "spare": spare})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        params = list(model.parameters())
        for step in range(3):
            h = torch.relu(trunk(x))
            main = F.mse_loss(head(h), y)
            grads = torch.autograd.grad(main, params, retain_graph=True, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = torch.zeros_like(p) if g is None else g
            aux = (spare(h) if step % 2 else head(h)).pow(2).mean()
            aux.backward()
            opt.step()
            losses += [main.detach(), aux.detach()]
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _lbfgs_strong_wolfe() -> Scenario:
    """LBFGS with the strong-Wolfe line search: the closure evaluated several times a step, at trial points."""
    torch.manual_seed(0)
    model = _mlp(8)
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5, history_size=4, line_search_fn="strong_wolfe")
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def run() -> tuple[Any, ...]:
        losses = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(3):
            losses.append(opt.step(closure).detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


# -- adapters and quantization ------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen base plus ``B @ A`` with B zero at the start: the adapter's output is exactly zero at step 0."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.drop(x))) * 2.0


def _lora_zero_b() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(nn.Linear(8, 16)), nn.GELU(), LoRALinear(nn.Linear(16, 2)))
    x = torch.randn(6, 8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return training(model, lambda s: model(x).pow(2).mean(), opt)


def _qat_observer() -> Scenario:
    """Quantization-aware training with torch.ao's FakeQuantize: its observers' ``min_val``/``max_val`` buffers
    start at +inf/-inf (torch's own initial values) and become finite on the first observed batch."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), FakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255),
                          nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


# -- infinities a healthy program holds ---------------------------------------------------------------


class CRF(nn.Module):
    """A linear-chain CRF whose forbidden transitions are -inf (a buffer added to the learned scores): the
    forward algorithm's logsumexp runs over them; ``decode`` is Viterbi, max over -inf scores."""

    def __init__(self, tags: int = 4) -> None:
        super().__init__()
        self.trans = nn.Parameter(torch.randn(tags, tags) * 0.1)
        forbidden = torch.zeros(tags, tags)
        forbidden[0, 3] = forbidden[3, 1] = float("-inf")
        self.register_buffer("forbidden", forbidden)

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        trans = self.trans + self.forbidden
        alpha = emissions[:, 0]
        score = emissions[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, emissions.shape[1]):
            alpha = torch.logsumexp(alpha.unsqueeze(2) + trans, 1) + emissions[:, t]
            score = score + trans[tags[:, t - 1], tags[:, t]] + emissions[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
        return (torch.logsumexp(alpha, 1) - score).mean()

    @torch.no_grad()
    def decode(self, emissions: torch.Tensor) -> torch.Tensor:
        trans = self.trans + self.forbidden
        best, back = emissions[:, 0], []
        for t in range(1, emissions.shape[1]):
            best, idx = (best.unsqueeze(2) + trans).max(1)
            best = best + emissions[:, t]
            back.append(idx)
        path = [best.argmax(1)]
        for idx in reversed(back):
            path.append(idx.gather(1, path[-1].unsqueeze(1)).squeeze(1))
        return torch.stack(path[::-1], 1)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(8, 4)
        self.crf = CRF()

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.crf.nll(self.emit(x), tags)


def _crf_viterbi() -> Scenario:
    """CRF training over allowed tag paths, then a Viterbi decode in the same cell."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(3, 5, 8)
    tags = torch.tensor([[0, 1, 2, 0, 0], [1, 2, 3, 0, 1], [2, 2, 1, 0, 2]])

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = model(x, tags)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        losses.append(model.crf.decode(model.emit(x)))
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _dijkstra(weights: torch.Tensor) -> torch.Tensor:
    """Shortest distances from node 0; unreachable nodes stay inf."""
    n = weights.shape[0]
    dist = torch.full((n,), float("inf"))
    dist[0] = 0.0
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(n):
        u = int(torch.where(done, torch.full_like(dist, float("inf")), dist).argmin())
        if math.isinf(float(dist[u])):
            break
        done[u] = True
        dist = torch.minimum(dist, dist[u] + weights[u])
    return dist


def _dijkstra_loss() -> Scenario:
    """A graph model whose loss weights each node by its shortest-path distance (Dijkstra over inf edge costs,
    unreachable nodes inf, their weight exp(-inf) = 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    feats = torch.randn(5, 4)
    inf = float("inf")
    weights = torch.tensor([[inf, 1.0, 4.0, inf, inf], [inf, inf, 2.0, inf, inf], [inf, inf, inf, inf, inf],
                            [inf, inf, inf, inf, 1.0], [inf, inf, inf, 1.0, inf]])

    def loss_of(step: int) -> torch.Tensor:
        with torch.no_grad():
            importance = torch.exp(-_dijkstra(weights))
        return (model(feats).squeeze(1).pow(2) * importance).sum()

    return training(model, loss_of)


class Horizon(nn.Module):
    """A discount over an "infinite" horizon: the horizon is a buffer holding inf, time clamped to it."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(8, 1)
        self.register_buffer("horizon", torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        steps = torch.minimum(t, self.horizon)
        return self.value(x).squeeze(1) * torch.pow(0.9, steps)


def _inf_horizon() -> Scenario:
    torch.manual_seed(0)
    model = Horizon()
    x, t = torch.randn(6, 8), torch.arange(6.0)
    return training(model, lambda s: model(x, t).pow(2).mean())


def _scatter_amax_empty() -> Scenario:
    """Graph max-pooling as torch_scatter does it: a -inf start, ``scatter_reduce(amax)``, an empty graph's -inf
    replaced by 0 before the head."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"node": nn.Linear(4, 8), "head": nn.Linear(8, 1)})
    feats, graph = torch.randn(7, 4), torch.tensor([0, 0, 1, 1, 1, 3, 3])  # graph 2 has no node

    def loss_of(step: int) -> torch.Tensor:
        h = model["node"](feats)
        pooled = torch.full((4, 8), float("-inf")).scatter_reduce(0, graph.unsqueeze(1).expand_as(h), h, "amax")
        pooled = torch.where(torch.isinf(pooled), torch.zeros_like(pooled), pooled)
        return model["head"](pooled).pow(2).mean()

    return training(model, loss_of)


def _nan_padded_sensors() -> Scenario:
    """Sensor series padded with NaN: normalised with nanmean/nansum statistics, NaN made 0 before the model,
    the loss masked with ``torch.where`` over the valid targets (no NaN reaches a module or a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    x[2:, 6:] = float("nan")
    y[3:, 5:] = float("nan")
    valid = ~torch.isnan(y)

    def loss_of(step: int) -> torch.Tensor:
        mean = torch.nanmean(x, 0, keepdim=True)
        var = torch.nansum((x - mean) ** 2, 0, keepdim=True) / (~torch.isnan(x)).sum(0, keepdim=True)
        inputs = torch.nan_to_num((x - mean) / (var + 1e-5).sqrt())
        err = torch.where(valid, model(inputs) - y, 0.0)
        return err.pow(2).sum() / valid.sum()

    return training(model, loss_of)


# -- structure ----------------------------------------------------------------------------------------


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


ROWS = {
    "dp-sgd-vmap-per-sample": _dp_sgd,
    "jvp-jacobian-penalty": _jvp_regulariser,
    "autograd-grad-then-second-backward": _autograd_grad_loop,
    "lbfgs-strong-wolfe": _lbfgs_strong_wolfe,
    "lora-zero-b": _lora_zero_b,
    "qat-fake-quantize-observer": _qat_observer,
    "crf-forbidden-transitions-viterbi": _crf_viterbi,
    "dijkstra-weighted-loss": _dijkstra_loss,
    "scatter-amax-empty-graph": _scatter_amax_empty,
    "nan-padded-sensors": _nan_padded_sensors,
    "fft-conv-complex-weight": _fft_conv_complex,
    "manual-seed-in-forward": _seed_in_forward,
    "clip-value-inf-norm-nonfinite-ok": _clip_at_inf,
    "user-isfinite-guard-and-hooks": _user_guard_and_hooks,
    "dtype-round-trip-bf16-eval": _dtype_round_trip,
    "packed-gru": _packed_gru,
    # ops=True raised "_apply(): Couldn't swap Conv1d.weight": the op tracer's weak references (patches/swaps.py).
    "swap-future-to-and-load-state-dict": _swapped_conversions,
}

# Rows whose deliberate infinity the watch records as benign (PRODUCT.md "benign"): filled from what each shows.
BENIGN: dict[str, int | None] = {"inf-horizon-buffer": None}

CASES = [
    *(Case(f"calm_s27_{name}", lambda build=build: settled(build()), None, benign=0) for name, build in ROWS.items()),
    Case("calm_s27_inf-horizon-buffer", lambda: settled(_inf_horizon()), None, benign=None),
]
