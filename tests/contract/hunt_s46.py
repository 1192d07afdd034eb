"""hunt_s46, the shapes of training code rather than of ops, in every mode, immediate and deferred.

A Lightning-style module trained by a hand-written ``fit()``: ``training_step`` (a method, not ``forward``) computes
the loss, ``configure_optimizers`` returns an optimizer and a per-step scheduler, manual optimization calls
``self.optimizers()`` and ``self.manual_backward(loss)``, and ``on_before_optimizer_step`` logs each parameter's
gradient-to-weight ratio (a zero-initialised bias's ``0 / 0``, a logged NaN that reaches no boundary: silent). A
Hugging Face-style loop: ``outputs = model(**batch)`` returning an ``OrderedDict`` subclass whose ``loss`` the model
computed from ``labels``, an accelerator-like ``backward`` that scales by the accumulation, ``zero_grad(
set_to_none=False)`` and a scheduler stepped per batch. Data loops over a real ``DataLoader`` whose ``Dataset`` yields
a NaN at one index, consumed by ``while True: next(it)`` and by ``itertools.islice``, and over a generator that
standardises each batch by its own std. A loss summed over tasks in a loop (the recorded modes say that ``%debug``'s
locals are the last pass's); a lazy model materialised by a dummy call under the watch and validated every step.
Each with its healthy twin.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


# ---------------------------------------------------------------- a Lightning-style module and its fit() loop
class LitRegressor(nn.Module):
    """A LightningModule's shape: the loss in ``training_step``, the optimizer from ``configure_optimizers``, and
    with ``manual`` the step taken by the module itself through ``self.optimizers()``."""

    def __init__(self, eps: float, manual: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        for layer in (self.net[0], self.net[2]):
            nn.init.zeros_(layer.bias)
        self.eps, self.manual = eps, manual
        self.logged: dict[str, torch.Tensor] = {}
        self._optimizer: torch.optim.Optimizer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def optimizers(self) -> torch.optim.Optimizer:
        assert self._optimizer is not None
        return self._optimizer

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Logs each parameter's update scale, as people do to spot dead layers: a zero-initialised bias's ratio is
        ``0 / 0`` at the first step, a NaN in a logged number that no step reads."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.logged[f"grad_ratio/{name}"] = p.grad.norm() / p.norm()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        x, y = batch["x"], batch["y"]
        pred = self(x)
        # A normalised MSE (the error relative to the targets' spread), as regression code reports it.
        loss = F.mse_loss(pred, y) / (y.var() + self.eps)  # producer: normalised mse
        if not self.manual:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.on_before_optimizer_step(opt)
        opt.step()
        return None


def fit(module: LitRegressor, loader) -> list:
    """A hand-written ``Trainer.fit``: the optimizer and scheduler from ``configure_optimizers``."""
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    module._optimizer = opt
    losses = []
    for batch_idx, batch in enumerate(loader):
        loss = module.training_step(batch, batch_idx)
        if loss is not None:
            opt.zero_grad()
            loss.backward()
            module.on_before_optimizer_step(opt)
            opt.step()
            losses.append(loss.detach())
        sched.step()
    return [losses, [p.detach().clone() for p in module.parameters()]]


def _lit(eps: float, manual: bool, constant_at: int | None = 2) -> Scenario:
    """At step 2 the batch's targets are all equal (a sensor stuck at one reading): their variance is 0 and the
    normalised MSE divides by it. Twin: eps 1e-6 (or no stuck batch)."""
    torch.manual_seed(0)
    module = LitRegressor(eps, manual)
    batches = [{"x": torch.randn(4, 4), "y": torch.randn(4, 1)} for _ in range(4)]
    if constant_at is not None:
        batches[constant_at]["y"] = torch.full((4, 1), 0.5)
    return Scenario((module,), lambda: fit(module, batches))


# ---------------------------------------------------------------- a Hugging Face-style loop
class ClassifierOutput(OrderedDict):
    """A ``ModelOutput``'s shape: an ordered mapping whose fields are also attributes."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError as missing:
            raise AttributeError(name) from missing


class MeanPooler(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # Mean pooling over the real tokens (sentence-transformers clamps the count at 1e-9).
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=self.floor)  # producer: mean pooler


class SequenceClassifier(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.pooler, self.classifier = MeanPooler(floor), nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> ClassifierOutput:
        logits = self.classifier(self.pooler(self.encoder(self.embed(input_ids)), attention_mask))
        out = ClassifierOutput(logits=logits)
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class Accelerator:
    """``accelerate``'s shape: ``backward`` divides by the accumulation, ``sync_gradients`` says when to step."""

    def __init__(self, gradient_accumulation_steps: int) -> None:
        self.gradient_accumulation_steps, self.micro = gradient_accumulation_steps, 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps).backward()
        self.micro += 1

    @property
    def sync_gradients(self) -> bool:
        return self.micro % self.gradient_accumulation_steps == 0


def _hf(floor: float) -> Scenario:
    """Two micro-batches per step; micro-batch 5 (step 2) holds a row that is all padding (a collator that padded
    an empty text): the mean pooler's ``0 / 0``. Twin: the count clamped at 1e-9."""
    torch.manual_seed(0)
    model = SequenceClassifier(floor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    accelerator = Accelerator(2)
    data = []
    for micro in range(8):
        ids = torch.randint(1, 12, (3, 5))
        ids[:, 4] = 0
        if micro == 5:
            ids[1] = 0
        data.append({"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.randint(0, 3, (3,))})

    def run() -> list[torch.Tensor]:
        losses = []
        model.train()
        for batch in data:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=False)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a real DataLoader over a Dataset with a NaN row
class Readings(Dataset):
    """A map-style dataset of sensor rows; one row was stored with a missing value (NaN)."""

    def __init__(self, bad_index: int | None) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(24, 4, generator=gen), torch.randn(24, 1, generator=gen)
        if bad_index is not None:
            self.x[bad_index, 2] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"features": self.x[index], "target": self.y[index]}


def _collate(rows: list[dict]) -> dict:
    return {"features": torch.stack([r["features"] for r in rows]), "target": torch.stack([r["target"] for r in rows])}


def _dataloader_loop(bad_index: int | None, style: str) -> Scenario:
    """Batches of 4, in order; row 13 (batch 3) holds a NaN. ``style``: ``"next"`` (``while True`` over
    ``next(it)``, stopping at ``StopIteration``), ``"islice"`` (the first 5 batches), ``"enumerate"``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(Readings(bad_index), batch_size=4, shuffle=False, num_workers=0, collate_fn=_collate)

    def train(batch: dict) -> torch.Tensor:
        loss = F.smooth_l1_loss(model(batch["features"]), batch["target"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    def run() -> list[torch.Tensor]:
        losses = []
        if style == "next":
            it = iter(loader)
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                losses.append(train(batch))
        elif style == "islice":
            for batch in itertools.islice(loader, 5):
                losses.append(train(batch))
        else:
            for _step, batch in enumerate(loader):
                losses.append(train(batch))
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loss summed over tasks in a loop
def _multi_task(bad_task: int | None) -> Scenario:
    """Three regression targets, each loss normalised by its targets' variance in a loop over the tasks; at step 1
    task ``bad_task``'s targets are constant (a sensor stuck): ``x / 0``. The frame ran the line again for the later
    tasks, so the recorded modes say that ``%debug``'s locals are the last pass's (``task == 2``). Twin: no stuck
    sensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = _batches(5, 4), _batches(5, 3)
    if bad_task is not None:
        ys[1][:, bad_task] = 2.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = model(xs[step])
            loss = torch.zeros(())
            for task in range(3):
                target = ys[step][:, task]
                loss = loss + F.mse_loss(out[:, task], target) / target.var()  # producer: per task
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a lazy model materialised by a dummy call, validated
class LazyNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.LazyLinear(8, bias=False), nn.ReLU()), nn.LazyLinear(1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h / (h.sum(-1, keepdim=True) + self.eps))  # producer: lazy net share


def _lazy_validated(eps: float, where: str | None) -> Scenario:
    """A model of ``LazyLinear`` layers, materialised under the watch by a dummy forward before its optimizer is made
    (as lazy modules require; the optimizer is not passed to the watch), trained, and validated after every step under
    ``no_grad`` in eval mode. ``where``: ``"train"``: step 2's batch holds a blank row, which the body (no bias)
    maps to zeros (``0 / 0``); ``"val"``: the validation batch after step 1 does. Twin: eps."""
    torch.manual_seed(0)
    model = LazyNet(eps)
    xs, ys, val = _batches(3, 4), _batches(3, 1), _batches(3, 4)
    if where is not None:
        (xs[2] if where == "train" else val[1])[0] = 0.0

    def run() -> list[torch.Tensor]:
        model(torch.ones(1, 4))  # materialise the lazy parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for step in range(4):
            model.train()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                losses.append(F.mse_loss(model(val[step]), ys[step]))
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- a generator that standardises each batch
def _standardised(rows: torch.Tensor, targets: torch.Tensor, size: int, eps: float):
    """Yields batches standardised by their own statistics, as a streaming loader does without a dataset-wide
    mean."""
    for start in range(0, len(rows), size):
        x = rows[start:start + size]
        yield (x - x.mean(0)) / (x.std(0) + eps), targets[start:start + size]  # producer: batch standardise


def _generator_loop(eps: float) -> Scenario:
    """``while True`` over ``next()`` of a generator; batch 2's third feature is constant (a sensor stuck for those
    rows): its std is 0, ``0 / 0``. Twin: eps 1e-6."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.SiLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows, targets = torch.randn(16, 3), torch.randn(16, 1)
    rows[8:12, 2] = 0.25

    def run() -> list[torch.Tensor]:
        losses = []
        it = _standardised(rows, targets, 4, eps)
        while True:
            try:
                x, y = next(it)
            except StopIteration:
                break
            loss = F.l1_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


LAST_PASS = tuple((mode, "with the locals of its last pass") for mode in ("default", "defer", "full"))

CASES = [
    Case("hunt_s46_lightning_training_step_normalised_mse_constant_targets", lambda: _lit(0.0, False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="normalised mse")),
    Case("hunt_s46_lightning_manual_optimization_normalised_mse_constant_targets", lambda: _lit(0.0, True),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="normalised mse")),
    Case("hunt_s46_lightning_training_step_grad_ratio_logged_healthy", lambda: _lit(1e-6, False), None),
    Case("hunt_s46_lightning_manual_optimization_grad_ratio_logged_healthy", lambda: _lit(1e-6, True), None),
    Case("hunt_s46_hf_accelerator_accumulation_mean_pooler_all_padding_row", lambda: _hf(0.0),
         Expect("forward", "pooler", "MeanPooler", step=2, op="aten.div.Tensor", marker="mean pooler")),
    Case("hunt_s46_hf_accelerator_accumulation_mean_pooler_clamped_healthy", lambda: _hf(1e-9), None),
    Case("hunt_s46_dataloader_while_true_next_nan_row_is_data", lambda: _dataloader_loop(13, "next"),
         Expect("data", "", "Sequential", step=3, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s46_dataloader_islice_nan_row_is_data", lambda: _dataloader_loop(13, "islice"),
         Expect("data", "", "Sequential", step=3, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s46_dataloader_enumerate_nan_row_is_data", lambda: _dataloader_loop(13, "enumerate"),
         Expect("data", "", "Sequential", step=3, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s46_dataloader_while_true_next_healthy", lambda: _dataloader_loop(None, "next"), None),
    Case("hunt_s46_dataloader_islice_healthy", lambda: _dataloader_loop(None, "islice"), None),
    Case("hunt_s46_multi_task_loss_loop_constant_first_target", lambda: _multi_task(0),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="per task",
                kinds=frozenset({"+inf"}), cause="division-by-zero", says=LAST_PASS)),
    Case("hunt_s46_multi_task_loss_loop_constant_last_target", lambda: _multi_task(2),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="per task",
                kinds=frozenset({"+inf"}), cause="division-by-zero")),
    Case("hunt_s46_multi_task_loss_loop_healthy", lambda: _multi_task(None), None),
    Case("hunt_s46_lazy_model_dummy_call_then_training_blank_row", lambda: _lazy_validated(0.0, "train"),
         Expect("forward", "", "LazyNet", step=2, op="aten.div.Tensor", marker="lazy net share")),
    Case("hunt_s46_lazy_model_dummy_call_then_validation_blank_row", lambda: _lazy_validated(0.0, "val"),
         Expect("forward", "", "LazyNet", step=2, op="aten.div.Tensor", marker="lazy net share")),
    Case("hunt_s46_lazy_model_dummy_call_validated_healthy", lambda: _lazy_validated(0.0, None), None),
    Case("hunt_s46_generator_standardises_a_batch_with_a_constant_feature", lambda: _generator_loop(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="batch standardise",
                kinds=frozenset({"nan"}))),
    Case("hunt_s46_generator_standardises_with_eps_healthy", lambda: _generator_loop(1e-6), None),
]
