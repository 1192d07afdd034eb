"""Healthy loop shapes the watch is left on for (calm_s29), every mode: optimizers and schedules changed mid-run,
layers frozen, the model cast, copied and rolled back, seeds set in the loop, accumulation with a remainder,
shared and twice-called modules, NaN batches the loop skips, inference_mode, nested watches, an interrupt.

tests/calm_s29.py: the harness and what is compared. Last: the loop's own frame and locals, and the watch with the
model it holds, are freed once the loop and the watch are gone (the recorder held the loop's frame; the op tracer
held the frames of loss code that made a -inf it handled).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from calm_s29 import MODES, Row, check, steps
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))


def _data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def lbfgs_strong_wolfe() -> Row:
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss
                out.append(opt.step(closure).detach())
        return out

    return Row((model, opt), (model, opt), run)


def plateau() -> Row:
    """ReduceLROnPlateau fed the validation loss each epoch (which stops improving: the rate drops)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    x, y = _data()

    def run(watching) -> list:
        out = []
        with watching():
            for epoch in range(4):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step(1.0 if epoch else 2.0)  # a validation loss that stalls
                out += [loss.detach(), opt.param_groups[0]["lr"]]
        return out

    return Row((model, opt), (model, opt), run)


def add_param_group() -> Row:
    """A new head grown at step 2 and handed to the optimizer by add_param_group (its own lr)."""
    body, head = nn.Linear(6, 8), nn.Linear(8, 3)
    model = nn.ModuleDict({"body": body, "head": head})
    opt = torch.optim.Adam(body.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    opt.add_param_group({"params": head.parameters(), "lr": 0.05})
                h = torch.relu(body(x))
                logits = head(h) if step >= 2 else head(h).detach()
                loss = F.cross_entropy(logits, y) + h.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def freeze_unfreeze() -> Row:
    """The body frozen (requires_grad_(False)) for two steps, then unfrozen, with set_to_none grads."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(5):
                model[0].requires_grad_(step not in (1, 2))
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def cast_mid_run() -> Row:
    """model.double() after two steps (the optimizer made again, on the same parameters), data cast too."""
    model = _mlp()
    holder = {"opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)}
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model):
            for step in range(4):
                if step == 2:
                    model.double()
                    holder["opt"] = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt = holder["opt"]
                loss = F.cross_entropy(model(x.to(model[0].weight.dtype)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model,), (model,), run)


def validation_in_the_loop() -> Row:
    """Validation each step under no_grad in eval(), a metric by nanmean over classes absent from the batch."""
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    vx, vy = torch.randn(5, 6), torch.tensor([0, 0, 1, 1, 0])  # class 2 never in the validation set

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                model.train()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    pred = model(vx).argmax(-1)
                    recall = torch.stack([((pred == c) & (vy == c)).sum() / (vy == c).sum() for c in range(3)])
                    out += [loss.detach(), recall.nanmean(), recall]  # recall[2] is 0/0
        return out

    return Row((model, opt), (model, opt), run)


def deepcopy_teacher() -> Row:
    """A teacher made by copy.deepcopy(model) inside the watch at step 1, distilled from, then EMA-updated."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    holder: dict = {}

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 1:
                    holder["teacher"] = copy.deepcopy(model).requires_grad_(False)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if "teacher" in holder:
                    with torch.no_grad():
                        soft = holder["teacher"](x).softmax(-1)
                    loss = loss + F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                if "teacher" in holder:
                    with torch.no_grad():
                        for t, s in zip(holder["teacher"].parameters(), model.parameters(), strict=True):
                            t.lerp_(s, 0.1)
                out.append(loss.detach())
        return [*out, list(holder["teacher"].parameters())]

    return Row((model, opt), (model, opt), run)


def rollback() -> Row:
    """A checkpoint (state_dict copies) every 2 steps; on a loss above the last, both are loaded back."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.2)  # large: the loss jumps
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        saved, best = None, float("inf")
        with watching():
            for step in range(6):
                if step % 2 == 0:
                    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                loss = F.cross_entropy(model(x), y)
                if loss.item() > best and saved is not None:
                    model.load_state_dict(saved[0])
                    opt.load_state_dict(saved[1])
                    out.append(torch.tensor(-1.0))
                    continue
                best = min(best, loss.item())
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def seeded_in_the_loop() -> Row:
    """torch.manual_seed(step) at each step with dropout and randn noise (the RNG state after the loop compared)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        torch.manual_seed(1000 + step)
        return F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of, n=4))


def accumulation_with_remainder() -> Row:
    """Gradient accumulation over 3 micro-batches of 7 batches: the last step takes the remaining one, scaled by
    its own count."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [_data(4) for _ in range(7)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            opt.zero_grad()
            for i, (x, y) in enumerate(batches):
                group = 3 if i < 6 else 1
                loss = F.cross_entropy(model(x), y) / group
                loss.backward()
                out.append(loss.detach())
                if (i + 1) % 3 == 0 or i == len(batches) - 1:
                    opt.step()
                    opt.zero_grad()
        return out

    return Row((model, opt), (model, opt), run)


def shared_submodule() -> Row:
    """Two models sharing one encoder (a multi-task setup), both watched, one optimizer over their union."""
    encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
    a, b = nn.Sequential(encoder, nn.Linear(16, 3)), nn.Sequential(encoder, nn.Linear(16, 1))
    params = list({id(p): p for p in [*a.parameters(), *b.parameters()]}.values())
    opt = torch.optim.Adam(params, lr=0.01)
    x, y = _data()
    target = torch.randn(8, 1)

    def loss_of(step: int) -> torch.Tensor:
        return F.cross_entropy(a(x), y) + F.mse_loss(b(x), target)

    return Row((a, b, opt), (a, b, opt), steps(a, opt, loss_of))


def siamese() -> Row:
    """One tower called twice a step (a contrastive pair), with a margin loss that is zero for some pairs."""
    tower = _mlp(6, 4)
    opt = torch.optim.SGD(tower.parameters(), lr=0.05)
    x1, x2 = torch.randn(8, 6), torch.randn(8, 6)
    same_class = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0]).float()

    def loss_of(step: int) -> torch.Tensor:
        d = F.pairwise_distance(tower(x1), tower(x2))
        return (same_class * d.pow(2) + (1 - same_class) * F.relu(1.0 - d).pow(2)).mean()

    return Row((tower, opt), (tower, opt), steps(tower, opt, loss_of))


def skips_nan_batches() -> Row:
    """A generator of batches, some with NaN features: the loop skips them by `if not torch.isfinite(x).all()`."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    raw = [_data() for _ in range(6)]
    for i in (1, 4):
        raw[i][0][2, 3] = float("nan")

    def batches():
        yield from raw

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for x, y in batches():
                if not torch.isfinite(x).all():
                    out.append(torch.tensor(-1.0))
                    continue
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def inference_mode_mixed() -> Row:
    """Each step's predictions under torch.inference_mode, fed (as a constant) into the next step's loss."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            prev = torch.zeros(8, 3)
            for _ in range(4):
                logits = model(x)
                loss = F.cross_entropy(logits, y) + 0.1 * (logits - prev).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.inference_mode():
                    inferred = model(x).softmax(-1)
                prev = inferred.clone()  # (an inference tensor, copied out to be used with autograd)
                out += [loss.detach(), prev]
        return out

    return Row((model, opt), (model, opt), run)


def nested_watches() -> Row:
    """A watch of the whole loop and, inside it, a watch of the same model around the validation, and one of the
    optimizer alone around each step."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                with watching(opt):
                    opt.step()
                with watching(model), torch.no_grad():
                    out += [loss.detach(), model(x)]
        return out

    return Row((model, opt), (model, opt), run)


def interrupted_then_run_again() -> Row:
    """A KeyboardInterrupt in the middle of a step (after backward, before the optimizer step), then the loop
    run again under a new watch from where it stopped (its gradients are zeroed first)."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def train(watching, steps: int, stop_at: int | None, out: list) -> None:
        with watching():
            for step in range(steps):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                if step == stop_at:
                    raise KeyboardInterrupt
                opt.step()
                out.append(loss.detach())

    def run(watching) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        try:
            train(watching, 4, 2, out)
        except KeyboardInterrupt:
            out.append(torch.tensor(-1.0))
        train(watching, 3, None, out)
        return out

    return Row((model, opt), (model, opt), run)


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        weight = torch.nan_to_num(keep / keep.sum(1, keepdim=True), nan=0.0)  # an empty row: 0/0, no gradient
        return (self.proj(x) * weight[..., None]).sum(1)


def empty_masked_mean() -> Row:
    """A masked mean over set elements, where a row has none: its weights 0/0 = NaN, cleaned by nan_to_num in the
    module (on the mask alone: nan_to_num on the mean itself would leave the NaN in its gradient, as it does
    unwatched, and the watch names it)."""
    model = nn.Sequential()
    pool, head = MaskedMean(), nn.Linear(4, 1)
    model.add_module("pool", pool)
    model.add_module("head", head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 5, 6)
    keep = (torch.rand(4, 5) > 0.5).float()
    keep[1] = 0

    def loss_of(step: int) -> torch.Tensor:
        return head(pool(x, keep)).pow(2).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def safe_log_by_where() -> Row:
    """An entropy bonus with the double torch.where idiom (the log's argument replaced where p is 0)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    banned = torch.zeros(8, 3, dtype=torch.bool)
    banned[:, 2] = True

    def loss_of(step: int) -> torch.Tensor:
        logits = model(x)
        p = logits.masked_fill(banned, float("-inf")).softmax(-1)  # p = 0 exactly where banned
        safe = torch.where(p > 0, p, torch.ones_like(p))
        entropy = -torch.where(p > 0, p * safe.log(), torch.zeros_like(p)).sum(-1).mean()
        return F.nll_loss(p.clamp(min=1e-12).log(), y.clamp(max=1)) - 0.01 * entropy

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def vector_round_trip() -> Row:
    """clip_grad_value_, then a manual update through parameters_to_vector / vector_to_parameters."""
    model = _mlp()
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                model.zero_grad()
                loss.backward()
                nn.utils.clip_grad_value_(model.parameters(), 0.05)
                with torch.no_grad():
                    flat = nn.utils.parameters_to_vector(model.parameters())
                    grads = nn.utils.parameters_to_vector(p.grad for p in model.parameters())
                    nn.utils.vector_to_parameters(flat - 0.1 * grads, model.parameters())
                out.append(loss.detach())
        return out

    return Row((model,), (model,), run)


def reinitialised_head() -> Row:
    """The head re-initialised mid-run by model.apply(reset) (a restart of a probe), the optimizer state reset."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    model[2].reset_parameters()
                    opt.state.clear()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


ROWS = {
    "lbfgs_strong_wolfe_closure": lbfgs_strong_wolfe,
    "reduce_lr_on_plateau": plateau,
    "add_param_group_mid_training": add_param_group,
    "freeze_then_unfreeze": freeze_unfreeze,
    "model_double_mid_run": cast_mid_run,
    "no_grad_validation_with_nanmean_metric": validation_in_the_loop,
    "deepcopy_teacher_inside_the_watch": deepcopy_teacher,
    "state_dict_rollback_mid_run": rollback,
    "manual_seed_inside_the_loop": seeded_in_the_loop,
    "accumulation_with_a_remainder_batch": accumulation_with_remainder,
    "two_models_sharing_an_encoder": shared_submodule,
    "siamese_tower_called_twice": siamese,
    "nan_batches_skipped_by_isfinite": skips_nan_batches,
    "inference_mode_between_steps": inference_mode_mixed,
    "nested_watches": nested_watches,
    "keyboard_interrupt_then_run_again": interrupted_then_run_again,
    "empty_masked_mean_nan_to_num": empty_masked_mean,
    "safe_log_by_double_where": safe_log_by_where,
    "clip_value_and_vector_round_trip": vector_round_trip,
    "head_reinitialised_mid_run": reinitialised_head,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_loop_shapes_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


# -- what the watch holds once it and the loop are gone ---------------------------------------------------


class ReturnsItsLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).mean()


class _Marker:
    """A local of the loop's frame: alive while anything holds that frame."""


def _loop_returning_its_loss(options: dict) -> tuple[weakref.ref, weakref.ref, weakref.ref]:
    model = ReturnsItsLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, losses, marker = torch.randn(4, 3), [], _Marker()
    with nan_magic.watch(model, opt, **options) as w:
        for _ in range(3):
            loss = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())  # (a view: it holds the loss, and the loss our gradient hook)
    return weakref.ref(w), weakref.ref(model), weakref.ref(marker)


def _loss_code_meeting_a_handled_inf(options: dict) -> tuple[weakref.ref, weakref.ref, weakref.ref]:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s, actions, marker = torch.randn(6, 4), torch.tensor([0.0, 0.3, 1.0, 0.5, 0.2, 0.9]), _Marker()

    def loss_of() -> torch.Tensor:
        c = F.softplus(model(s)) + 1.0
        logp = torch.distributions.Beta(c[:, 0], c[:, 1], validate_args=False).log_prob(actions)  # -inf at 0, 1
        ok = torch.isfinite(logp)
        return -torch.where(ok, logp, torch.zeros_like(logp)).sum() / ok.sum()

    with nan_magic.watch(model, opt, **options) as w:
        for _ in range(3):
            loss = loss_of()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None
    return weakref.ref(w), weakref.ref(model), weakref.ref(marker)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", [_loop_returning_its_loss, _loss_code_meeting_a_handled_inf])
def test_the_loop_its_model_and_the_watch_are_freed_once_gone(loop, mode: str) -> None:
    # Before: the loss-code recorder kept the loop's frame as the last one it walked (a data region's end moved
    # its calls aside but not that frame), and the op tracer kept, past the watch's end, the origins of loss code
    # outside every module (their witnesses hold the frame that ran it). Through a tensor that holds our gradient
    # hook (``loss.detach()`` holds the loss), that made a cycle through autograd that gc cannot free: the
    # watch, the model and every local of the loop stayed for the life of the process.
    watch, model, marker = loop(MODE_OPTIONS[mode])
    for _ in range(3):
        gc.collect()
    assert marker() is None, "the loop's frame is still held"
    assert model() is None and watch() is None
