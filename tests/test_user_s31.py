"""Session 31's walk (tests/notebooks/user_s31/): what a person read that was wrong, asserted in-process.

A tiny ViT under ``torch.autocast("cpu", dtype=torch.bfloat16)`` whose hand-written softmax (``scores.exp()``, then
``weights / weights.sum(-1, keepdim=True)`` on the next line) overflows: the max-subtracted exp makes the step
finite, and it is the same softmax. Before, the stable trial said "not a fix, though the step came out finite: it
changes what the line computes ... the max does not cancel here ... the model's output moved by 0.00195": its check
(the max moved by 1 to 2 more) compared the two replays element by element at 4 eps of the output's dtype, and a
bfloat16 exp's rounding (~0.4% per weight) moved the logits near 0 by more than that. The check now allows the
rounding of the coarser of the exp's and the value's dtype, relative to the tensor's largest value; a scale that
does not cancel (an exp used as a value) still moves it by e-fold and is still refused (test_fixes_hunt15.py).

The GNN notebook as a plain script (``python gnn.py`` with ``nan_magic.watch``): Python 3.11's traceback ended in

    File "gnn.py", line 24, in forward
      return agg / deg.unsqueeze(1)
  ^^^^^^^^^^^^^

carets at column 0 under nothing: the last frame is the stand-in that ``%debug`` opens (errors/line_state.py), whose
``raise`` sat at column 0 and was 17 characters wide. The stand-in's raise now spans the line, and no caret is drawn.

The GNN's mean aggregation divides by the degree, 0 at an isolated node. The cause's hint said "if it is a count,
clamp it to >= 1", and the verified trial and its suggested edit right under it clamped the degree to 1.2e-07
(``deg.unsqueeze(1).clamp_min(1.2e-07)``). A denominator of whole numbers (a degree, ``mask.sum(1)``, a bincount) is
now clamped to 1, which the edit writes.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from watching import raised

from nan_magic import NonFiniteError, watch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, scale: float) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * self.scale
        weights = scores.exp()
        weights = weights / weights.sum(-1, keepdim=True)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, N, D))


class TinyViT(nn.Module):
    def __init__(self, d: int = 64, scale: float = 1.0) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, stride=8)
        self.pos = nn.Parameter(torch.randn(1, 16, d))
        self.norm, self.attn, self.head = nn.LayerNorm(d), Attention(d, 4, scale), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        x = x + self.attn(self.norm(x))
        return self.head(x.mean(1))


def _train(vit: TinyViT, steps: int) -> None:
    torch.manual_seed(1)
    images, labels = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.AdamW(vit.parameters(), lr=3e-3)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(vit(images).float(), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _overflowing_vit() -> TinyViT:
    torch.manual_seed(0)
    vit = TinyViT(scale=8.0)  # D ** 0.5 where D ** -0.5 was meant
    with torch.no_grad():
        vit.attn.qkv.weight.mul_(3.0)
    return vit


@pytest.mark.parametrize("options", [{}, {"defer": True}], ids=["immediate", "deferred"])
def test_a_bf16_hand_softmax_s_max_subtracted_exp_is_verified(options: dict) -> None:
    vit = _overflowing_vit()
    report = raised(lambda: _train(vit, 1), vit, **options)
    assert (report.module, report.op, report.phase.value) == ("attn", "aten.exp.default", "forward")
    assert report.source is not None and report.source.line == "weights = scores.exp()"
    (stable,) = [trial for trial in report.fixes if trial.kind == "stable"]
    assert stable.finite is True and stable.untried is None, stable
    text = report.to_text()
    assert "stable: the exp max-subtracted (exp(x - x.amax(-1, keepdim=True))) -> verified" in text, text
    assert "does not cancel" not in text


def test_an_exp_used_as_a_bf16_scale_is_still_no_fix() -> None:
    """The same model whose exp is not normalised (``weights`` used as it is): the moved max moves the output."""
    vit = _overflowing_vit()
    original = Attention.forward

    def unnormalised(self: Attention, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-2, -1) * self.scale).exp()
        return self.proj((weights @ v).transpose(1, 2).reshape(B, N, D))

    Attention.forward = unnormalised  # type: ignore[method-assign]
    try:
        report = raised(lambda: _train(vit, 1), vit)
    finally:
        Attention.forward = original  # type: ignore[method-assign]
    (stable,) = [trial for trial in report.fixes if trial.kind == "stable"]
    assert stable.finite is None and stable.fact("changes_value") is True, stable


class MeanConv(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        msg = self.lin(x)[src]
        agg = torch.zeros(x.shape[0], msg.shape[1]).index_add(0, dst, msg)
        deg = torch.zeros(x.shape[0]).index_add(0, dst, torch.ones(dst.shape[0]))
        return agg / deg.unsqueeze(1)


class CountedMeanConv(MeanConv):
    """The degree as integers (``bincount``): a count by its dtype."""

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        msg = self.lin(x)[src]
        agg = torch.zeros(x.shape[0], msg.shape[1]).index_add(0, dst, msg)
        deg = torch.bincount(dst, minlength=x.shape[0])
        return agg / deg.unsqueeze(1)


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["default", "ops"])
def test_a_script_s_traceback_ends_at_the_producing_line_without_stray_carets(options: dict) -> None:
    torch.manual_seed(0)
    conv, edges = MeanConv(16, 8), torch.randint(0, 39, (2, 160))  # node 39: no edges
    opt = torch.optim.Adam(conv.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as caught, watch(conv, opt, **options):
        loss = conv(torch.randn(40, 16), edges).sum()
        loss.backward()
        opt.step()
    lines = "".join(traceback.format_exception(caught.value)).splitlines()
    at = lines.index("    return agg / deg.unsqueeze(1)")
    assert lines[at - 1].endswith(", in forward") and "test_user_s31.py" in lines[at - 1], lines
    assert lines[at + 1].startswith("nan_magic.errors.exceptions.NonFiniteError: first non-finite value in forward "
                                    "step 0: MeanConv (root)"), lines[at - 1:at + 2]
    assert not any(line.strip() and set(line.strip()) <= {"^", "~"} and not line.startswith("    ")
                   for line in lines), lines


@pytest.mark.parametrize(("conv", "form", "edit"), [
    (CountedMeanConv, "count", "return agg / deg.unsqueeze(1).clamp_min(1)"),
    (MeanConv, "clamp_min", "return agg / deg.unsqueeze(1).clamp_min(1.2e-07)")], ids=["integer", "float"])
def test_a_count_divisor_is_clamped_to_one_where_its_dtype_says_it_counts(conv: type, form: str, edit: str) -> None:
    """An integer degree (bincount) is clamped to 1, as the cause's hint says; a float one is clamped to eps (its
    zeros alone move): whole floats on this step may be a fraction on the next (``mask.float().mean(1)``), which a
    clamp to 1 would change (session 31's review)."""
    torch.manual_seed(0)
    model, edges = conv(16, 8), torch.randint(0, 39, (2, 160))  # node 39: no edges
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> None:
        loss = model(torch.randn(40, 16), edges).sum()
        loss.backward()
        opt.step()

    report = raised(step, model, opt)
    (eps,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert eps.finite is True and eps.fact("form") == form, eps
    text = report.to_text()
    counted = "eps: its denominator clamped to at least 1 (it holds counts: integers, 0 where nothing was counted)"
    assert (counted + " -> verified" in text) is (form == "count"), text
    assert edit in text, text
    assert "if it is a count, clamp it to >= 1" in text
