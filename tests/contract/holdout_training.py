"""Held-out incidents of training set-ups: recurrent nets, teachers, compiled models, AMP, parametrizations.

An LSTM trained without clipping until its loss overflows, an EMA teacher
whose momentum schedule divides by zero total steps, a model compiled with
``torch.compile`` taking the log of a negative, a GradScaler run whose custom
loss takes ``log(1 - sigmoid)`` in float16, spectral norm over a zero-initialised
layer, rotary attention in float16 whose scores overflow, a single
``torch.where`` guarding a log (its backward is 0 / 0), label smoothing over a
vocabulary masked with ``-inf``, and ``nan_to_num`` that hides a log's -inf
from the forward but not from its backward.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.holdout_healthy import sgd_steps

LOSS_CODE_OPS = ("default", "defer", "ops")
LOSS_CODE_NOTE = "full: the loss code is not recorded; its op is not named"
#: A known miss: loop code that writes parameters after ``opt.step()`` (an EMA teacher's update) lies outside
#: the update region (localize/loop_writes.py, from backward() to the step), so only ops=True names it; the
#: other modes report the teacher's parameter at its next forward, phase forward, with no op or line.
class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _lstm_without_clipping() -> Scenario:
    """Targets of 1e4 and lr 5, no clip_grad_norm_: the head's weights grow until the loss overflows."""
    torch.manual_seed(0)
    model = Forecaster()
    x, y = torch.randn(8, 12, 3), torch.randn(8, 1) * 1e4
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=20, lr=5.0)  # producer: lstm loss


def _ema_momentum_of_zero_total_steps() -> Scenario:
    """BYOL/DINO-style teacher: momentum from a cosine schedule over ``total`` steps, and ``total`` is 0."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    teacher = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False)
    teacher.load_state_dict(student.state_dict())
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    x = torch.randn(5, 6)
    total = torch.tensor(0.0)  # the epochs * batches product of an empty loader

    def run() -> list[torch.Tensor]:
        for step in range(3):
            loss = F.mse_loss(student(x), teacher(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                m = 1 - 0.004 * (torch.cos(math.pi * step / total) + 1) / 2  # producer: ema schedule
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.mul_(m).add_((1 - m) * s)
        return [p.detach().clone() for p in teacher.parameters()]

    return Scenario((student, teacher, opt), run)


class LogScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x) + 1.0)  # producer: compiled log


def _compiled_model_log() -> Scenario:
    """A compiled model (aot_eager: no C++ toolchain needed) whose second batch makes a pre-log value negative."""
    torch.manual_seed(0)
    model = LogScale()
    with torch.no_grad():
        model.lin.weight.abs_()
        model.lin.bias.fill_(0.5)
    compiled = torch.compile(model, backend="aot_eager")
    batches = [torch.rand(6, 4), -torch.rand(6, 4) * 5]
    opt = torch.optim.SGD(model.parameters(), lr=0.001)

    def run() -> None:
        for x in batches:
            loss = compiled(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((compiled, opt), run)


def _scaler_custom_loss_log_one_minus_sigmoid() -> Scenario:
    """fp16 autocast with a GradScaler; the loss takes log(1 - sigmoid) of a logit of 12: 1 - sigmoid rounds to 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x = torch.randn(8, 4)
    x[3] = 12.0 * model.weight.detach()[0].sign() / model.weight.detach().abs().sum()

    def run() -> None:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = -torch.log(1 - torch.sigmoid(logits)).mean()  # producer: log one minus
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return Scenario((model, opt), run)


def _spectral_norm_of_a_zero_init_layer() -> Scenario:
    """A GAN discriminator's last layer zero-initialised, then spectral-normed: W / sigma(W) is 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    nn.init.zeros_(model[2].weight)
    nn.utils.parametrizations.spectral_norm(model[2])
    x = torch.randn(6, 4)
    return sgd_steps(model, lambda m: F.softplus(-m(x)).mean(), steps=1)  # producer: spectral call


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class RotaryAttention(nn.Module):
    """Rotary position embedding, then scores by einsum, in float16."""

    def __init__(self, dim: int = 16, length: int = 6) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        angles = torch.arange(length)[:, None] * 10000 ** (-torch.arange(0, dim, 2) / dim)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1))
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        scores = torch.einsum("bqd,bkd->bqk", q, k)  # producer: rope scores
        return torch.softmax(scores / math.sqrt(q.shape[-1]), -1) @ v


def _rope_attention_fp16() -> Scenario:
    """Activations of a few hundred (an un-normalised residual stream): q . k passes 65504 in float16."""
    torch.manual_seed(0)
    model = RotaryAttention().half()
    x = (torch.randn(2, 6, 16) * 300).half()

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return Scenario((model,), run)


class GuardedLog(nn.Module):
    """log where positive, else 0, with one where: log's backward at x <= 0 is 0 / x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))  # producer: single where


def _single_where_log_backward() -> Scenario:
    """A padded (all-zero) row through a Linear without bias is exactly 0 where the log is guarded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), GuardedLog(), nn.Linear(4, 1))
    x, y = torch.randn(8, 4).abs(), torch.randn(8, 1)
    x[5] = 0.0
    with torch.no_grad():
        model[0].weight.abs_()
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=1)


def _label_smoothing_over_a_masked_vocabulary() -> Scenario:
    """Constrained decoding training: forbidden tokens' logits are -inf, and label smoothing spreads mass on them."""
    torch.manual_seed(0)
    model = nn.Linear(8, 6)
    x, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 1, 0])
    forbidden = torch.zeros(6, dtype=torch.bool)
    forbidden[4:] = True

    def loss_of(m: nn.Module) -> torch.Tensor:
        logits = m(x).masked_fill(forbidden, float("-inf"))
        return F.cross_entropy(logits, y, label_smoothing=0.1)  # producer: smoothed masked

    return sgd_steps(model, loss_of, steps=1)


class LogFeature(nn.Module):
    """log of a square, its -inf replaced by nan_to_num: the forward is finite, log's backward is 0 / 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x) ** 2).nan_to_num(neginf=-10.0)  # producer: log behind nan_to_num


def _nan_to_num_backward() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(LogFeature(), nn.Linear(4, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    x[2] = 0.0  # a padded row: its features are exactly 0
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=1)


CASES: list[Case] = [
    Case("holdout_lstm_without_clipping", _lstm_without_clipping,
         Expect("forward", None, step=15, op="aten.mse_loss.default", marker="lstm loss",
                cause="learning-rate-too-high", op_modes=LOSS_CODE_OPS), note=LOSS_CODE_NOTE),
    Case("holdout_ema_teacher_momentum_zero_total", _ema_momentum_of_zero_total_steps,
         Expect("optimizer", "0", "Linear", step=1, op="aten.reciprocal.default", marker="ema schedule",
                cause="division-by-zero")),
    Case("holdout_compiled_model_log", _compiled_model_log,
         Expect("forward", "", "LogScale", step=1, op="aten.log.default", marker="compiled log")),
    Case("holdout_scaler_custom_loss_log_one_minus_sigmoid", _scaler_custom_loss_log_one_minus_sigmoid,
         Expect("forward", None, op="aten.log.default", marker="log one minus", op_modes=LOSS_CODE_OPS),
         note=LOSS_CODE_NOTE),
    Case("holdout_spectral_norm_of_a_zero_init_layer", _spectral_norm_of_a_zero_init_layer,
         Expect("forward", "2.parametrizations.weight.0", "_SpectralNorm", op="aten.div.Tensor", marker="spectral call",
                cause="division-by-zero")),
    Case("holdout_rope_attention_fp16", _rope_attention_fp16,
         Expect("forward", "", "RotaryAttention", op="aten.bmm.default", marker="rope scores")),
    Case("holdout_single_where_log_backward", _single_where_log_backward,
         Expect("backward", "1", "GuardedLog", op="aten.div.Tensor", marker="single where", cause="log-domain")),
    Case("holdout_label_smoothing_over_a_masked_vocabulary", _label_smoothing_over_a_masked_vocabulary,
         Expect("forward", None, op="aten.sum.dim_IntList", marker="smoothed masked", op_modes=LOSS_CODE_OPS,
                cause="masked-softmax"),
         modes=LOSS_CODE_OPS, note=LOSS_CODE_NOTE),
    Case("holdout_nan_to_num_hides_a_log_from_forward_only", _nan_to_num_backward,
         Expect("backward", "0", "LogFeature", op="aten.div.Tensor", marker="log behind nan_to_num",
                cause="log-domain")),
]
