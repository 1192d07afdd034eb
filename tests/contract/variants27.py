"""Issue 27's kinds again, each in a form its first cases did not take (the audit of issue 27).

One variant per kind, written to catch what the first cases let pass: another
optimizer and dtype, a Dataset returning a dict from two loader workers, a
per-row masked mean under bf16 autocast, a custom op whose forward makes the
value, a GradScaler with ``unscale_`` and clipping before its step, an
inference method calling three submodules, a sampling temperature that
reaches zero at the third step, Adam written by hand, a scheduler's NaN
warm-up, and a hand-written cosine similarity whose norm's backward divides
by zero. Each says what every mode reports; healthy versions stay silent.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario, scaler_collapse, steps_and_data
from contract.steps_and_data import LogLayer
from nan_magic.records import TensorRef


def _rmsprop_fp16(healthy: bool) -> Scenario:
    """RMSprop on float16 parameters, eps=1e-8 (0 in float16): an embedding row never used divides 0 by 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=1e-3 if healthy else 1e-8)
    tokens = torch.tensor([0, 1, 2, 3])  # row 4 is never used: its gradient stays zero

    def run() -> list[torch.Tensor]:
        for _ in range(2):
            opt.zero_grad()
            model(tokens).float().pow(2).mean().backward()
            opt.step()  # producer: rmsprop step
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


class LogFeatures(Dataset):
    """Samples as dicts, their features log-transformed; sample 9 has a zero feature (log 0 = -inf)."""

    def __init__(self, healthy: bool) -> None:
        torch.manual_seed(0)
        self.x, self.y = torch.rand(16, 4) + 0.1, torch.randn(16, 1)
        if not healthy:
            self.x[9, 2] = 0.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": torch.log(self.x[i]), "label": self.y[i]}  # producer: log features


def _dict_dataset_in_workers(healthy: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(LogFeatures(healthy), batch_size=4, num_workers=2)

    def run() -> None:
        for batch in loader:
            loss = F.mse_loss(model(batch["features"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


def _per_row_masked_mean(healthy: bool) -> Scenario:
    """A per-sequence mean over kept tokens under bf16 autocast; sequence 1 keeps none at step 1: 0 / 0 per row."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 5, 4)
    keeps = [torch.ones(2, 5), torch.ones(2, 5)]
    keeps[1][1] = 0.0
    if healthy:
        keeps[1][1, 0] = 1.0

    def run() -> list[torch.Tensor]:
        for keep in keeps:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = model(x).float()
            pooled = (h * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True)  # producer: per-row mean
            opt.zero_grad()
            pooled.pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


@torch.library.custom_op("nan_magic_contract::log_scale", mutates_args=())
def log_scale(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x) * 2.0


@log_scale.register_fake
def _log_scale_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class LogScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_scale(x)  # producer: custom op call


def _custom_op_forward(healthy: bool) -> Scenario:
    """A custom op whose own forward takes a log: a negative input at step 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), LogScale())
    batches = [torch.rand(3, 2) + 0.5, torch.rand(3, 2) + (0.5 if healthy else -2.0)]

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(batch) for batch in batches]

    return Scenario((model,), run)


class ThreePartDecoder(nn.Module):
    """``decode`` calls three top-level submodules; the last takes a log."""

    def __init__(self) -> None:
        super().__init__()
        self.post_quant_conv = nn.Conv2d(2, 2, 1)
        self.decoder = nn.Conv2d(2, 2, 1)
        self.to_image = nn.Sequential(nn.Identity(), LogLayer())
        with torch.no_grad():
            for conv in (self.post_quant_conv, self.decoder):
                conv.weight.copy_(torch.eye(2).view(2, 2, 1, 1))
                conv.bias.zero_()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.to_image(self.decoder(self.post_quant_conv(z)))


def _three_part_decode() -> Scenario:
    torch.manual_seed(0)
    vae = ThreePartDecoder()
    latents = [torch.rand(1, 2, 3, 3) + 0.5, torch.rand(1, 2, 3, 3) + 0.5, -torch.rand(1, 2, 3, 3) - 0.5]

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [vae.decode(z) for z in latents]

    return Scenario((vae,), run)


def _temperature_schedule() -> Scenario:
    """Sampling with a temperature annealed to zero: the third step's logits / 0 make the probabilities NaN."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    x = torch.randn(3, 4)

    def run() -> list[torch.Tensor]:
        tokens = []
        with torch.no_grad():
            for temperature in (1.0, 0.5, 0.0):
                logits = model(x)
                probs = torch.softmax(logits / temperature, -1)  # producer: annealed temperature
                tokens.append(torch.multinomial(probs, 1))
        return tokens

    return Scenario((model,), run)


def _adam_by_hand(eps: float) -> Scenario:
    """Adam written by hand over ``model.parameters()``; eps=0 and a unit that never fires (zero gradients): 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias[3] = -100.0  # unit 3 never fires: its bias's gradient is zero
        model[0].weight[3] = 0.0
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()]
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        for step in range(1, 4):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p, (m, v) in zip(model.parameters(), moments):
                    m.mul_(0.9).add_(p.grad, alpha=0.1)
                    v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                    update = (m / (1 - 0.9**step)) / ((v / (1 - 0.999**step)).sqrt() + eps)  # producer: hand adam
                    p.sub_(1e-3 * update)
                    p.grad = None
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model,), run)


def _lambda_lr_warmup(warmup: int) -> Scenario:
    """LambdaLR with a warm-up of ``warmup`` steps computed with tensors: 0 / 0 = NaN when it is zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: float(torch.clamp(torch.tensor(float(step)) / warmup, max=1.0)) if warmup else float(
            torch.tensor(0.0) / torch.tensor(0.0)))
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()  # producer: scheduled step
            scheduler.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _cosine_by_hand(healthy: bool) -> Scenario:
    """A hand-written cosine similarity in the loss; one embedding row is zero: its root's backward divides by 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, target = torch.randn(3, 4), torch.randn(3, 4)
    if not healthy:
        x[1] = 0.0

    def run() -> list[torch.Tensor]:
        for _ in range(2):
            a = model(x)
            norms = (a * a).sum(-1).sqrt() * target.norm(dim=-1)  # producer: cosine
            cosine = (a * target).sum(-1) / (norms + 1e-8)
            opt.zero_grad()
            (1 - cosine).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


CASES = [
    Case("variant_rmsprop_fp16_eps", lambda: _rmsprop_fp16(False),
         Expect("optimizer", "0", "Embedding", op="aten.addcdiv_.default", marker="rmsprop step",
                tensor=TensorRef.parameter("0.weight"), cause="optimizer-eps-underflow")),
    Case("variant_rmsprop_fp16_eps_healthy", lambda: _rmsprop_fp16(True), None),
    Case("variant_dict_dataset_log_in_two_workers", lambda: _dict_dataset_in_workers(False),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log features")),
    Case("variant_dict_dataset_in_two_workers_healthy", lambda: _dict_dataset_in_workers(True), None),
    Case("variant_per_row_masked_mean_bf16", lambda: _per_row_masked_mean(False),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="per-row mean", cause="division-by-zero")),
    Case("variant_per_row_masked_mean_bf16_healthy", lambda: _per_row_masked_mean(True), None),
    Case("variant_custom_op_forward_log", lambda: _custom_op_forward(False),
         Expect("forward", "1", "LogScale", step=1, op="nan_magic_contract.log_scale.default",
                marker="custom op call"),
         note="every mode names the custom op at the line that called it, not the log inside its kernel"),
    Case("variant_custom_op_forward_healthy", lambda: _custom_op_forward(True), None),
    Case("variant_grad_scaler_collapse_with_unscale_and_clipping",
         lambda: scaler_collapse.collapsing(1.0, unscale_and_clip=True),
         Expect("backward", "1", "Head", op="aten.mm.default", marker="head output", cause="grad-scaler-collapse",
                op_modes=("default", "defer", "ops"),
                says=(("full", "the tensor whose gradient is not finite was computed inside 1, not passed to it"),)),
         source=scaler_collapse, note=scaler_collapse.FULL),
    Case("variant_decode_of_three_submodules", _three_part_decode,
         Expect("forward", "to_image.1", "LogLayer", step=2, op="aten.log.default", marker="inference log"),
         source=steps_and_data),
    Case("variant_sampling_temperature_annealed_to_zero", _temperature_schedule,
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="annealed temperature")),
    Case("variant_adam_by_hand_zero_eps", lambda: _adam_by_hand(0.0),
         Expect("optimizer", "0", "Linear", op="aten.div.Tensor", marker="hand adam",
                tensor=TensorRef.parameter("0.weight"), cause="division-by-zero")),
    Case("variant_adam_by_hand_healthy", lambda: _adam_by_hand(1e-8), None),
    Case("variant_lambda_lr_nan_warmup", lambda: _lambda_lr_warmup(0),
         Expect("optimizer", "0", "Linear", op="aten.add_.Tensor", marker="scheduled step")),
    Case("variant_lambda_lr_warmup_healthy", lambda: _lambda_lr_warmup(2), None),
    Case("variant_cosine_by_hand_zero_row", lambda: _cosine_by_hand(False),
         Expect("backward", None, op="aten.div.Tensor", marker="cosine")),
    Case("variant_cosine_by_hand_healthy", lambda: _cosine_by_hand(True), None),
]
