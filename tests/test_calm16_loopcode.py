"""Non-finite values the loop's own code makes or receives, and handles, stay calm in the five modes (issue 25;
harness: test_calm16.py): a batch with missing values (NaN) imputed in the loop before the model; a metric that is
0/0 on a step with no positive prediction, only logged; a loss the loop itself checks with ``isfinite`` and
skips (no backward starts from it); per-token losses masked with ``where`` in the loss code (an inf where a
padding target has probability 0); the where-guarded log and the masked softmax cleaned by ``nan_to_num`` in the
loss code rather than in a module; a Hugging Face model under float16 autocast with the default GradScaler.
"""

from __future__ import annotations

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES, raised

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _loop(model: nn.Module, step_fn, steps: int = 3) -> Loop:
    """``step_fn(step)`` runs one iteration of the loop's code (forward, loss, backward, step) and gives outputs."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def run() -> list[torch.Tensor]:
        return [t for step in range(steps) for t in step_fn(model, opt, step)]
    return Loop((model, opt), (model, opt), run)


def imputed_batch() -> Loop:
    """Tabular rows with missing values (NaN): the loop fills them with the column mean before the model."""
    xs = [torch.randn(8, 6) for _ in range(3)]
    for x in xs:
        x[torch.rand(8, 6) < 0.2] = float("nan")
    ys = [torch.randint(0, 3, (8,)) for _ in range(3)]

    def step_fn(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
        x = xs[step]
        x = torch.where(torch.isnan(x), x.nanmean(0, keepdim=True), x)
        loss = F.cross_entropy(model(x), ys[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.detach()]
    return _loop(_classifier(), step_fn)


def nan_metric() -> Loop:
    """Precision of class 1 computed every step: 0/0 = NaN when nothing is predicted as 1; only logged."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    logged: list[float] = []

    def step_fn(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            pred = out.argmax(-1)
            precision = ((pred == 1) & (y == 1)).sum() / (pred == 1).sum()
            never = (pred == 7).float().sum() / (pred == 7).sum()  # a class never predicted: NaN every step
            logged.append(precision.item())
        return [loss.detach(), precision, never]
    model = _classifier()
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([5.0, -5.0, 0.0]))  # class 1 is never predicted at first
    return _loop(model, step_fn)


def loss_guard() -> Loop:
    """The loop skips a batch whose loss is not finite (a target of probability 0 under a hard mask), as Trainer
    loops do: no backward starts from it."""
    x = torch.randn(8, 6)
    ys = [torch.randint(0, 2, (8,)), torch.full((8,), 2), torch.randint(0, 2, (8,))]

    def step_fn(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
        logits = model(x).masked_fill(torch.tensor([False, False, True]), NEG_INF)  # class 2 is disabled
        loss = F.cross_entropy(logits, ys[step])
        if not torch.isfinite(loss):
            return [loss.detach()]
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.detach()]
    return _loop(_classifier(), step_fn)


def masked_token_losses(broken: bool = False) -> Loop:
    """Per-token NLL (``reduction='none'``) where padding targets have probability 0 (-inf log-prob: inf loss),
    averaged over the kept tokens with ``where``; a where-guarded log and a masked softmax cleaned by
    ``nan_to_num`` in the loss code too."""
    model = nn.Sequential(nn.Embedding(12, 8), nn.Linear(8, 12))
    ids = torch.randint(1, 12, (3, 6))
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, 4:] = False
    keep[2] = False  # an empty sequence

    def step_fn(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
        logits = m(ids).masked_fill(torch.arange(12) == 0, NEG_INF)  # token 0 (padding) is never predicted
        targets = ids.roll(-1, 1).masked_fill(~keep, 0)
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(3, 6)
        token_loss = torch.where(keep, nll, torch.zeros_like(nll)).sum() / keep.sum()
        score = logits.mean(-1) if broken else logits[..., 1:].mean(-1)
        attn = score.masked_fill(~keep, NEG_INF).softmax(-1).nan_to_num(0.0)  # the empty row: NaN, 0
        conf = logits.softmax(-1).amax(-1)
        guarded = torch.where(conf > 0.5, torch.log(conf - 0.5), torch.zeros_like(conf))  # NaN where not chosen
        loss = token_loss + 0.1 * (attn * nll.detach().clamp(max=10)).sum() - 0.01 * guarded.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [loss.detach(), attn.detach()]
    return _loop(model, step_fn)


def hf_fp16_scaler(kind: str) -> Loop:
    hf_models = pytest.importorskip("hf_models")
    model = hf_models.gpt2() if kind == "gpt2" else hf_models.llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # the default init_scale 2**16
    batches = [hf_models.padded_batch() for _ in range(2)]

    def run() -> list[torch.Tensor]:
        out = []
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            out += [loss.detach(), torch.tensor(scaler.get_scale())]
        return out
    return Loop((model, opt, scaler), (model, opt, scaler), run)


LOOP_CODE = {
    "missing-values-imputed-in-the-loop": imputed_batch,
    "nan-metric-only-logged": nan_metric,
    "loss-guard-skips-a-nonfinite-loss": loss_guard,
    "masked-token-losses-in-the-loss-code": masked_token_losses,
    "gpt2-fp16-default-scaler": lambda: hf_fp16_scaler("gpt2"),
    "llama-fp16-default-scaler": lambda: hf_fp16_scaler("llama"),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", LOOP_CODE)
def test_nonfinite_values_the_loop_code_handles_are_calm(name: str, options: dict) -> None:
    assert_calm(LOOP_CODE[name], options)


def test_the_loop_code_idioms_really_meet_nonfinite_values() -> None:
    torch.manual_seed(0)
    loop = nan_metric()
    outputs = loop.run()
    assert torch.isnan(outputs[1]) and torch.isnan(outputs[2])
    torch.manual_seed(0)
    loop = loss_guard()
    assert torch.isinf(loop.run()[1])
    torch.manual_seed(0)
    loop = masked_token_losses()
    assert (loop.run()[1][2] == 0).all()  # the empty row's NaN attention, cleaned
    assert all(torch.isfinite(p.grad).all() for p in loop.targets[0].parameters())


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_masked_softmax_whose_every_row_is_masked_is_named_in_the_loss_codes_backward(options: dict) -> None:
    torch.manual_seed(0)
    loop = masked_token_losses(broken=True)
    report = raised(loop.run, *loop.targets, **options)
    assert (report.phase, report.module, report.step) == ("backward", None, 0)
    assert report.op == "aten._softmax_backward_data.default"
    assert report.source is not None and "softmax(-1).nan_to_num(0.0)" in report.source.line
