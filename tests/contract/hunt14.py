"""Where real training code puts a NaN that the other rows do not: helpers between modules, hooks, sharing, freezing.

A hand-written attention whose module-level helper softmaxes a fully masked row; a child called through a
functional helper; a custom ``autograd.Function`` whose backward divides by zero on one step; a ``torch.where``
guarding a log in the loss (its backward is 0 / 0); a ``reduction="none"`` loss averaged over an empty selection;
the 2nd of three accumulated micro-batches; a dataclass output whose unused aux field goes bad; a module shared by
two watched models; a frozen encoder run under ``no_grad`` inside the forward; a frozen block whose backward makes
the NaN; a user's forward pre-hook that normalises a child's input, a forward hook that rewrites an output, full
backward hooks; a child whose ``forward`` is called directly; a parameter whose own gradient alone goes bad; a max
pooling over a fully padded sequence.
Each: module, phase, step, op and line, in every mode (hunt14).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # producer: exp


class LogWhenTold(nn.Module):
    fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10) if self.fire else torch.tanh(x)  # producer: log


class SqrtAbs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # producer: sqrt


def _steps(model: nn.Module, batch, steps: int = 4, zero_at: int | None = None, lr: float = 0.0,
           targets: tuple = ()) -> Scenario:
    """SGD on ``model(*batch(step)).pow(2).mean()``; at step ``zero_at`` the first Linear found is zeroed."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            if step == zero_at:
                with torch.no_grad():
                    for p in next(m for m in model.modules() if isinstance(m, nn.Linear)).parameters():
                        p.zero_()
            loss = model(*batch(step)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt, *targets), run)


# ---------------------------------------------------------------- a hand-written attention, a helper softmaxes
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # producer: attention softmax
    return weights @ v


class Attention(nn.Module):
    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(attention(q, k, v, mask[:, None]).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = Attention(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x), mask)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def _attention(blind_at: int | None) -> Scenario:
    """Step ``blind_at``: token 2 of sequence 1 may attend to no key (its causal row fully masked)."""
    torch.manual_seed(0)
    xs = [torch.randn(2, 4, 8) for _ in range(3)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones(2, 4, 4, dtype=torch.bool).tril()
        if step == blind_at:
            mask[1, 2] = False
        return xs[step], mask
    return _steps(TinyTransformer(), batch, steps=3, lr=0.01)


# ---------------------------------------------------------------- helpers between a parent and its child
def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


class ThroughHelper(nn.Module):
    """Calls its children through a module-level helper (``run_layer``), or, ``direct``, ``act.forward(...)``."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 4), LogWhenTold(), nn.Linear(4, 1)
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = run_layer(self.lin, x)
        return self.out(self.act.forward(h) if self.direct else run_layer(self.act, h))


def _through_helper(direct: bool = False) -> Scenario:
    torch.manual_seed(0)
    model = ThroughHelper(direct)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        model.act.fire = step == 2  # (the whole step: the deferred check's replay sees it too)
        return (xs[step],)
    return _steps(model, batch, lr=0.01)


# ---------------------------------------------------------------- a custom autograd.Function's backward
class ClampGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / x.abs().clamp(max=1)  # producer: function backward


class UsesClampGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClampGrad.apply(x)


# ---------------------------------------------------------------- the loss code
def _where_log_loss() -> Scenario:
    """``where(p > 0, log(p), 0)``: finite forward; where p is 0, log's backward is 0 / 0 (step 2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            p = torch.sigmoid(model(torch.randn(3, 4)))
            if step == 2:
                p = p * torch.tensor([[0.0], [1.0], [1.0]])
            loss = torch.where(p > 0, torch.log(p), torch.zeros_like(p)).sum()  # producer: where log
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _empty_selection() -> Scenario:
    """A per-element loss averaged over the elements kept, and at step 2 none is kept: mean of nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            per_element = F.mse_loss(model(torch.randn(5, 4)).squeeze(-1), torch.randn(5), reduction="none")
            keep = torch.full((5,), step != 2)
            loss = per_element[keep].mean()  # producer: empty mean
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _accumulated(bad: tuple[int, int]) -> Scenario:
    """Three micro-batches per optimizer step; micro-batch ``bad`` = (step, micro) is 1000 times too large."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Exp(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)

    def run() -> None:
        for step in range(3):
            opt.zero_grad()
            for micro in range(3):
                x = torch.randn(3, 4) * (1000 if (step, micro) == bad else 1)
                (model(x).pow(2).mean() / 3).backward()
            opt.step()
    return Scenario((model, opt), run)


class LogClamped(torch.autograd.Function):
    """log(p) with p clamped in forward, and a backward by hand that forgets the clamp: g / p."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return torch.log(p.clamp_min(1e-12))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return grad / p  # producer: loss function backward


def _function_in_the_loss() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(4):
            p = torch.sigmoid(model(torch.randn(3, 4)))
            if step == 2:
                p = p * torch.tensor([[0.0], [1.0], [1.0]])
            loss = -LogClamped.apply(p).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- outputs, sharing, freezing
@dataclass
class TwoHeadsOutput:
    logits: torch.Tensor
    aux: torch.Tensor


class TwoHeads(nn.Module):
    bad = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> TwoHeadsOutput:
        h = self.body(x)
        return TwoHeadsOutput(self.head(h), torch.log(self.aux(h).sigmoid() - self.bad))  # producer: aux log


def _dataclass_aux() -> Scenario:
    """The loss reads ``out.logits`` only; at step 2 ``out.aux`` is the log of a negative."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            model.bad = float(step == 2)
            loss = model(torch.randn(3, 4)).logits.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


class SharedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x))  # producer: shared exp


def _shared(scale_at: int | None) -> Scenario:
    """One encoder in two watched models; at step ``scale_at`` the second model's batch is 1000 times too large."""
    torch.manual_seed(0)
    encoder = SharedEncoder()
    a, b = nn.Sequential(encoder, nn.Linear(4, 1)), nn.Sequential(encoder, nn.Linear(4, 2))
    opt = torch.optim.SGD([*a.parameters(), *b[1].parameters()], lr=0.001)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss_a = a(torch.randn(3, 4)).pow(2).mean()
            loss_b = b(torch.randn(3, 4) * (1000 if step == scale_at else 1)).pow(2).mean()
            opt.zero_grad()
            (loss_a + loss_b).backward()
            opt.step()
            losses.append((loss_a + loss_b).detach())
        return losses
    return Scenario((a, b, opt), run)


class FrozenEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), LogWhenTold()).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.enc(x)
        return self.head(h)


def _frozen_encoder() -> Scenario:
    torch.manual_seed(0)
    model = FrozenEncoder()
    xs = [torch.randn(3, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        model.enc[1].fire = step == 2
        return (xs[step],)
    return _steps(model, batch, lr=0.01)


def _frozen_block_backward() -> Scenario:
    """A frozen block in the middle: |x| by hand, its input zeroed at step 2 (sqrt'(0) * 0 in the backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), SqrtAbs()), nn.Linear(4, 1))
    model[1].requires_grad_(False)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[1][0].weight.zero_()
                model[1][0].bias.zero_()
        return (xs[step],)
    return _steps(model, batch)


def _pre_hook() -> Scenario:
    """A user's forward pre-hook on the second Linear normalises its input; the first Linear is zeroed at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def unit_rows(module: nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (args[0] / args[0].norm(dim=-1, keepdim=True),)  # producer: pre-hook

    model[1].register_forward_pre_hook(unit_rows)
    xs = [torch.randn(3, 4) for _ in range(4)]
    return _steps(model, lambda step: (xs[step],), zero_at=2)


def _pre_hook_on_a_container() -> Scenario:
    """The same pre-hook on a Sequential: its child is given the NaN, the container's replay must run the hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))

    def unit_rows(module: nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (args[0] / args[0].norm(dim=-1, keepdim=True),)  # producer: container pre-hook

    model[1].register_forward_pre_hook(unit_rows)
    xs = [torch.randn(3, 4) for _ in range(4)]
    return _steps(model, lambda step: (xs[step],), zero_at=2)


class ScaleAbs(nn.Module):
    """Scales by |s|, written by hand: at s = 0 the output is finite and only s's own gradient is 0 / 0."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt(self.s * self.s)  # producer: scale sqrt


def _parameter_gradient_only() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ScaleAbs(), nn.Linear(4, 1))
    xs = [torch.randn(3, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[1].s.zero_()
        return (xs[step],)
    return _steps(model, batch)


def _forward_hook() -> Scenario:
    """A user's forward hook (``with_kwargs``) rescales the first Linear's output by its largest entry: 0 / 0 once
    that Linear is zeroed at step 2. torch runs the watch's global hooks first: the output it checks is finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def rescale(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out / out.abs().amax(-1, keepdim=True)  # producer: forward hook

    model[0].register_forward_hook(rescale, with_kwargs=True)
    xs = [torch.randn(3, 4) for _ in range(4)]
    return _steps(model, lambda step: (xs[step],), zero_at=2)


def _full_backward_hook() -> Scenario:
    """Full backward hooks of the user's (as Opacus and captum register) on the module whose backward makes the NaN
    and on the next one: each is given its input as a view (BackwardHookFunction), not the tensor the watch saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAbs(), nn.Linear(4, 1))
    for layer in (model[1], model[2]):
        layer.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    xs = [torch.randn(3, 4) for _ in range(4)]
    return _steps(model, lambda step: (xs[step],), zero_at=2)


class MaskedMaxPool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h.masked_fill(~mask[..., None], float("-inf")).amax(1)  # producer: max pool


class Pooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(4, 4), MaskedMaxPool(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.enc(x), mask))


def _max_pool(padded_at: int | None) -> Scenario:
    """Max pooling over the tokens a padding mask keeps; at step ``padded_at`` sequence 1 is all padding: the max
    over nothing is -inf (the head then makes NaN of it, and was named, as a consumer of a deliberate -inf)."""
    torch.manual_seed(0)
    xs = [torch.randn(2, 5, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1] = step != padded_at
        return xs[step], mask
    return _steps(Pooler(), batch, lr=0.01)


class SafeSoftmaxThenLog(nn.Module):
    """A softmax that handles fully masked rows itself (their max set to 0: weights 0), then a log of its output."""

    shift = -100.0

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = (self.q(x) @ x.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        top = s.amax(-1, keepdim=True)  # -inf on the fully masked row: handled on the next line
        e = (s - torch.where(torch.isinf(top), torch.zeros_like(top), top)).exp()
        w = e / e.sum(-1, keepdim=True).clamp_min(1e-9)
        return torch.log(w @ x - self.shift)  # producer: log after a safe softmax


def _safe_softmax_then_log() -> Scenario:
    """Every step has a fully masked row, handled; at step 1 the log's argument goes negative."""
    torch.manual_seed(0)
    model = SafeSoftmaxThenLog()
    xs = [torch.randn(2, 3, 4) for _ in range(3)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        model.shift = 100.0 if step == 1 else -100.0
        mask = torch.ones(2, 3, 3, dtype=torch.bool)
        mask[0, 1] = False
        return xs[step], mask
    return _steps(model, batch, steps=3)


def _safe_softmax_in_the_loss() -> Scenario:
    """The same safe softmax in the loss code (replayed by the loss recorder, first op found): a log after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        for step in range(3):
            mask = torch.ones(2, 3, dtype=torch.bool)
            mask[0] = False
            s = model(torch.randn(2, 4)).masked_fill(~mask, float("-inf"))
            top = s.amax(-1, keepdim=True)
            e = (s - torch.where(torch.isinf(top), torch.zeros_like(top), top)).exp()
            w = e / e.sum(-1, keepdim=True).clamp_min(1e-9)
            loss = torch.log(w.sum(-1) - (1.0 if step == 1 else -1.0)).sum()  # producer: loss log
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


#: The max over a fully padded sequence is named once the head makes NaN of its -inf (localize/ops/origins.Picked;
#: gaps22: the head's addmm was named in every mode before; gaps23: in mode="full" too, by a replay of the call
#: around the pool and the head, replay/outward.replay_around_a_pick).
MAX_POOL = ("a max is passive (ops/plans.py): a fully masked row's -inf stays benign where it is made (the healthy "
            "pooling idioms of tests/test_calm14.py stay calm), and is noted as the max's; the consumer that makes NaN "
            "of it names the max")

CASES = [
    Case("hunt14_attention_helper_fully_masked_row", lambda: _attention(1),
         Expect("forward", "blocks.0.attn", "Attention", step=1, op="aten._softmax.default",
                marker="attention softmax")),
    Case("hunt14_attention_helper_healthy", lambda: _attention(None), None),
    Case("hunt14_child_called_through_a_helper", _through_helper,
         Expect("forward", "act", "LogWhenTold", step=2, op="aten.log.default", marker="log")),
    Case("hunt14_child_forward_called_directly", lambda: _through_helper(direct=True),
         Expect("forward", "act", "LogWhenTold", step=2, op="aten.log.default", marker="log")),
    Case("hunt14_function_backward_divides_by_zero_at_step_2",
         lambda: _steps(nn.Sequential(nn.Linear(4, 4), UsesClampGrad(), nn.Linear(4, 1)),
                        (lambda xs: lambda step: (xs[step],))([torch.randn(3, 4) for _ in range(4)]), zero_at=2),
         Expect("backward", "1", "UsesClampGrad", step=2, op="aten.div.Tensor", marker="function backward")),
    Case("hunt14_where_guarded_log_in_the_loss", _where_log_loss,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="where log")),
    Case("hunt14_custom_function_backward_in_the_loss", _function_in_the_loss,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="loss function backward")),
    Case("hunt14_reduction_none_mean_of_an_empty_selection", _empty_selection,
         Expect("forward", None, step=2, op="aten.mean.default", marker="empty mean")),
    Case("hunt14_second_micro_batch_overflows", lambda: _accumulated((1, 1)),
         Expect("forward", "1", "Exp", step=1, op="aten.exp.default", marker="exp")),
    Case("hunt14_dataclass_output_aux_field", _dataclass_aux,
         Expect("forward", "", "TwoHeads", step=2, op="aten.log.default", marker="aux log")),
    Case("hunt14_encoder_shared_by_two_models", lambda: _shared(2),
         Expect("forward", "0", "SharedEncoder", step=2, op="aten.exp.default", marker="shared exp")),
    Case("hunt14_encoder_shared_by_two_models_healthy", lambda: _shared(None), None),
    Case("hunt14_frozen_encoder_under_no_grad", _frozen_encoder,
         Expect("forward", "enc.1", "LogWhenTold", step=2, op="aten.log.default", marker="log")),
    Case("hunt14_frozen_block_backward", _frozen_block_backward,
         Expect("backward", "1.1", "SqrtAbs", step=2, op="aten.div.Tensor", marker="sqrt")),
    Case("hunt14_user_pre_hook_normalises_a_zero_input", _pre_hook,
         Expect("forward", "1", "Linear", step=2, op="aten.div.Tensor", marker="pre-hook")),
    Case("hunt14_user_pre_hook_on_a_container", _pre_hook_on_a_container,
         Expect("forward", "1", "Sequential", step=2, op="aten.div.Tensor", marker="container pre-hook")),
    Case("hunt14_user_forward_hook_rewrites_an_output", _forward_hook,
         Expect("forward", "0", "Linear", step=2, op="aten.div.Tensor", marker="forward hook")),
    Case("hunt14_user_full_backward_hooks", _full_backward_hook,
         Expect("backward", "1", "SqrtAbs", step=2, op="aten.div.Tensor", marker="sqrt")),
    Case("hunt14_max_pool_over_a_fully_padded_sequence", lambda: _max_pool(2),
         Expect("forward", "pool", "MaskedMaxPool", step=2, op="aten.amax.default", marker="max pool",
                cause="masked-softmax"), note=MAX_POOL),
    Case("hunt14_max_pool_over_padded_sequences_healthy", lambda: _max_pool(None), None),
    Case("hunt14_a_safe_softmax_is_not_blamed_for_a_later_log", _safe_softmax_then_log,
         Expect("forward", "", "SafeSoftmaxThenLog", step=1, op="aten.log.default", marker="log after a safe softmax")),
    Case("hunt14_a_safe_softmax_in_the_loss_is_not_blamed_for_a_later_log", _safe_softmax_in_the_loss,
         Expect("forward", None, step=1, op="aten.log.default", marker="loss log")),
    Case("hunt14_only_a_parameter_gradient_goes_bad", _parameter_gradient_only,
         Expect("backward", "1", "ScaleAbs", step=2, op="aten.div.Tensor", marker="scale sqrt")),
]
