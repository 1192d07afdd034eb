"""Op-level values and boundaries: what ops=True must agree on with the default mode.

An op's non-finite output is an event only where it reaches a boundary (a
module output, the loss, a gradient, a parameter); then the first op on its
path is the producer. Deliberate infinities (an infinite fill scalar, a float
mask) are benign while their consumers stay finite; a NaN scalar never is.
Our own reads (the optimizer's gradient norm) are never judged.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef

# -- absorbed intermediate infinities --------------------------------------------------


class GeluNew(nn.Module):
    """Hugging Face's ``gelu_new``: in float16, ``pow(x, 3)`` overflows for |x| > 40 and tanh absorbs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = GeluNew()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(x))


def _gelu_new_fp16() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(Mlp(), nn.Linear(4, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    # |x| in [41, 200]: x ** 3 overflows float16 (65504), x ** 2 (used by pow's backward) does not.
    signs = torch.where(torch.rand(6, 8) < 0.5, -1.0, 1.0)
    x = (signs * (41 + 159 * torch.rand(6, 8))).half()

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            loss = model(x).float().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


class GeluThenScale(nn.Module):
    """gelu_new's absorbed pow overflow first, then a real overflow of the scaled output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return h * 1000.0  # producer: scaled gelu


def _gelu_then_overflow() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(GeluThenScale(), nn.Linear(8, 2)).half()
    x = (41 + 159 * torch.rand(6, 8)).half()  # gelu(x) = x, and x * 1000 > 65504 for x > 65.5
    return Scenario((model,), lambda: model(x))


class GuardedExp(nn.Module):
    """exp for small inputs, identity otherwise: exp overflows in the branch not taken."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 20, torch.exp(x), x)  # producer: guarded exp


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = GuardedExp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def _guarded_exp_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].fc.bias.fill_(100.0)  # every element takes the identity branch; exp gives +inf
    return model, torch.randn(3, 4)


def _guarded_exp_forward() -> Scenario:
    model, x = _guarded_exp_model()
    return Scenario((model,), lambda: model(x))


def _guarded_exp_backward() -> Scenario:
    model, x = _guarded_exp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run() -> None:
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()  # exp's backward: grad (0 where the branch was not taken) * exp(x) (+inf) = NaN
        opt.step()

    return Scenario((model, opt), run)


# -- infinite and NaN fill scalars -----------------------------------------------------------


class MaskScores(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(mask, float("-inf"))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(6, 6)
        self.mask = MaskScores()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2)
        return self.softmax(self.mask(scores, mask)) @ x  # producer: softmax call


def _attention(full_row: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", Attention())
    attention = model.attn
    x = torch.randn(2, 5, 6)
    mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    mask[:, :, 3:] = True  # padding: the last two keys of every query
    if full_row:
        mask[1, 2, :] = True  # one query of the second sequence sees no key: softmax of all -inf is NaN
    return Scenario((model,), lambda: attention(x, mask=mask))


class NanPad(nn.Module):
    """Writes NaN as padding (a NaN given as a scalar, never a deliberate infinity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x < -1.0, float("nan"))  # producer: masked_fill nan


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), NanPad())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def _masked_fill_nan_nested() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(Encoder(), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4) * 3

    def run() -> None:
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class InPlaceNanFill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.masked_fill_(h > 1.0, float("nan"))  # producer: in-place nan fill
        return h * 2


def _in_place_nan_fill() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), InPlaceNanFill())
    x = torch.randn(5, 4) * 3
    return Scenario((model,), lambda: model(x))


class FullLikePad(nn.Module):
    """The root's own code pads with a NaN tensor between its children."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pad = torch.full_like(h[:, :2], float("nan"))  # producer: full_like nan
        return self.b(torch.cat([h, pad], dim=1))


def _full_like_nan() -> Scenario:
    torch.manual_seed(0)
    model = FullLikePad()
    x = torch.randn(3, 4)
    return Scenario((model,), lambda: model(x))


class WhereNanThenPad(nn.Module):
    """bfloat16: a NaN scalar through torch.where (wrapped by aten.scalar_tensor), then a -inf pad."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.where(x > 1.0, float("nan"), x)  # producer: where nan scalar
        return F.pad(h, (0, 1), value=float("-inf")).softmax(-1)


class PadNan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 1), value=float("nan"))  # producer: pad nan


def _scalar_fill(module: nn.Module) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), module).to(torch.bfloat16)
    x = (torch.randn(3, 4) * 3).to(torch.bfloat16)
    return Scenario((model,), lambda: model(x))


# -- float attention masks (deliberate infinities that enter from outside) ------------------


class CausalScores(nn.Module):
    """Additive float mask: given as an argument, or held as a buffer."""

    def __init__(self, buffer: torch.Tensor | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        if buffer is not None:
            self.register_buffer("causal", buffer)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.causal if mask is None else mask
        scores = self.proj(x) @ x.transpose(-1, -2) + mask
        return torch.softmax(scores, dim=-1) @ x  # producer: causal softmax


def _causal(as_buffer: bool, fully_masked_row: bool = False) -> Scenario:
    torch.manual_seed(0)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    if fully_masked_row:
        mask[0, 0] = float("-inf")  # the first query now sees no key at all
    model = CausalScores(mask if as_buffer else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 5, 8)

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            out = model(x) if as_buffer else model(x, mask)
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


class Decoder(nn.Module):
    """Builds its causal mask in its own code and passes it to a child as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalScores()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[-2])
        return self.norm(self.attn(x, mask))


def _causal_in_parent() -> Scenario:
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 5, 8)

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


# -- optimizer ----------------------------------------------------------------------------


def _adam_fp16() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    # eps=1e-8 rounds to 0 in float16: rows of the embedding without gradients get 0 / 0.
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    tokens = torch.tensor([3, 7])

    def run() -> None:
        opt.zero_grad()
        model(tokens).float().sum().backward()
        opt.step()  # producer: adam step

    return Scenario((model, opt), run)


# -- nan_magic's own reads -----------------------------------------------------------------


def _diverging_regression() -> Scenario:
    """Least squares by SGD above 2/λmax: the loss grows geometrically until it overflows."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def run() -> None:
        for _ in range(400):
            loss = F.mse_loss(model(x), y)  # producer: regression loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


def _huge_finite_gradients() -> Scenario:
    """Every gradient element finite near 1e25: their squares, and so the gradient norm, overflow float32."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    x = torch.randn(4, 16)

    def run() -> list[torch.Tensor]:
        for _ in range(2):
            loss = (model(x) * 1e25).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


_MASKS_ELSEWHERE = (
    "full: a -inf buffer consumed into NaN is still reported as a non-finite parameter (the module-level side of "
    "issue 15 item 9); the tiered modes replay the step under the op tracer, as ops mode does"
)

CASES = [
    Case("ops_gelu_new_fp16_large_inputs", _gelu_new_fp16, None,
         note="pow overflows float16 inside gelu_new, tanh absorbs it: no boundary sees it"),
    Case("ops_gelu_new_then_a_real_overflow", _gelu_then_overflow,
         Expect("forward", "0", "GeluThenScale", op="aten.mul.Tensor", marker="scaled gelu",
                op_modes=("default", "defer", "ops")),
         note="the producer is the op whose inf reached the output, not gelu's absorbed pow before it. The full "
              "mode's module replay stops at the first op that made an inf (to open %debug in its frame), so it "
              "names the absorbed pow: op and line asserted in the tiered and ops modes"),
    Case("ops_guarded_exp_forward", _guarded_exp_forward, None, note="torch.where discards exp's +inf"),
    Case("ops_guarded_exp_backward", _guarded_exp_backward,
         Expect("backward", "0.act", "GuardedExp", op="aten.mul.Tensor", marker="guarded exp",
                op_modes=("default", "defer", "full", "ops")),
         note="the absorbed +inf times a zero gradient"),
    Case("ops_masked_fill_neginf_partly_masked", lambda: _attention(full_row=False), None),
    Case("ops_masked_fill_neginf_fully_masked_row", lambda: _attention(full_row=True),
         Expect("forward", "attn.softmax", "Softmax", op="aten._softmax.default", marker="softmax call"),
         note="no kinds asserted: the deferred check has no counts for the softmax output freed by then "
              "(tests/test_oplevel.py pins the 4 NaN in the other modes)"),
    Case("ops_masked_fill_nan_nested", _masked_fill_nan_nested,
         Expect("forward", "0.inner.1", "NanPad", op="aten.masked_fill.Scalar", marker="masked_fill nan",
                kinds=frozenset({"nan"}))),
    Case("ops_in_place_nan_fill", _in_place_nan_fill,
         Expect("forward", "1", "InPlaceNanFill", op="aten.masked_fill_.Scalar", marker="in-place nan fill",
                kinds=frozenset({"nan"}))),
    Case("ops_where_nan_scalar_bf16", lambda: _scalar_fill(WhereNanThenPad()),
         Expect("forward", "1", "WhereNanThenPad", op="aten.scalar_tensor.default", marker="where nan scalar",
                kinds=frozenset({"nan"}))),
    Case("ops_pad_nan_value", lambda: _scalar_fill(PadNan()),
         Expect("forward", "1", "PadNan", op="aten.constant_pad_nd.default", marker="pad nan",
                kinds=frozenset({"nan"}))),
    Case("ops_full_like_nan_in_parent_code", _full_like_nan,
         Expect("forward", "", "FullLikePad", op="aten.full_like.default", marker="full_like nan",
                kinds=frozenset({"nan"}))),
    Case("ops_causal_mask_built_by_the_parent", _causal_in_parent, None),
    Case("ops_causal_mask_buffer", lambda: _causal(as_buffer=True), None),
    Case("ops_causal_mask_buffer_fully_masked_row", lambda: _causal(as_buffer=True, fully_masked_row=True),
         Expect("forward", "", "CausalScores", op="aten._softmax.default", marker="causal softmax",
                kinds=frozenset({"nan"})),
         modes=("default", "defer", "ops"), note=_MASKS_ELSEWHERE),
    Case("ops_adam_fp16_eps", _adam_fp16,
         Expect("optimizer", "0", "Embedding", op="aten.addcdiv_.default", marker="adam step",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"})),
         note="the tiered and full modes replay the optimizer step on copies to name its op "
              "(localize/replay/optimizer.py)"),
    Case("ops_diverging_regression", _diverging_regression,
         Expect("forward", None, step=64, op="aten.mse_loss.default", marker="regression loss",
                op_modes=("default", "defer", "ops")),
         note="the loss overflows at step 64; our own gradient norm must not be judged a step early. "
              "The full mode does not trace the loss code for its op"),
    Case("ops_huge_finite_gradients_are_no_event", _huge_finite_gradients, None,
         note="the gradient norm overflows while every element is finite: an early warning, not an event"),
]
