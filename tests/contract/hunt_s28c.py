"""hunt_s28c, the data pipeline and the gradient side, where a GPU user's loop differs from a CPU test; each incident
with its twin (the users' fix: silent and bit-identical, in every mode).

Data: an ``IterableDataset`` streaming windows whose last window is padded with NaN; a ``collate_fn`` that pads with
NaN and masks the inputs but forgets the targets; a brightness augmentation in log space over a black image
(``log(0)``, then ``-inf - -inf``); a per-batch z-score of targets, inside the loss call after the model's, in a
batch of one distinct value (``0 / 0``: the loss code's, forward); a blank tile standardised by its own std in
__getitem__ under two persistent workers with pinned memory; a memory-mapped numpy file (``np.memmap``
through ``torch.from_numpy``) holding a NaN record; a ``WeightedRandomSampler`` that oversamples a record whose log
count is ``log(0)``, first drawn at a later step; a dataset cached in memory whose loop log-transforms each batch in
place, so that the second epoch takes ``log(0)`` of a count of 1; a batch moved with ``.to(non_blocking=True)`` to
half precision from raw sensor counts. Gradients: a loss masked by ``torch.where`` whose masked entries' forward is
inf (a reciprocal distance on the diagonal: NaN in the backward); one parameter among many with a NaN gradient under
``clip_grad_norm_(foreach=True)``; a user's ``p.register_hook(lambda g: g / g.norm())`` over a parameter whose
gradient is 0 at step 0; tied embeddings whose gradient is NaN from the output projection's use only.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop as _loader_loop
from contract.loops import sgd_loop as _loop


def _regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# ---------------------------------------------------------------- an IterableDataset whose last window is NaN-padded
class Windows(IterableDataset):
    """A sensor stream cut into windows of 4 with stride 4; the last, short window is padded to full length with
    ``pad`` (NaN: "missing", as a pandas habit), its target the next reading."""

    def __init__(self, pad: float) -> None:
        super().__init__()
        self.series, self.pad = torch.sin(torch.linspace(0.0, 6.0, 27)), pad

    def __iter__(self):
        for start in range(0, 27, 4):
            window = self.series[start:start + 4]
            if len(window) < 4:
                window = torch.cat([window, torch.full((4 - len(window),), self.pad)])  # producer: nan pad
            yield window, self.series[min(start + 4, 26)].reshape(1)


def _windows(pad: float) -> Scenario:
    """Seven windows in batches of 2: the last batch (step 3) holds the padded window. The twin pads with 0."""
    torch.manual_seed(0)
    loader = DataLoader(Windows(pad), batch_size=2)  # 27 readings: the last window holds 3
    return _loader_loop(_regressor(), loader, F.mse_loss)


# ---------------------------------------------------------------- a collate_fn masks the inputs, not the targets
def _nan_collate(batch, fix_targets: bool):
    """Pads variable-length sequences (inputs and per-step targets) with NaN, then replaces the inputs' NaN by 0;
    the slip forgets the targets, which the loss averages over every position."""
    length = max(len(x) for x, _ in batch)
    xs = torch.full((len(batch), length, 2), float("nan"))
    ys = torch.full((len(batch), length), float("nan"))  # producer: nan targets
    for i, (x, y) in enumerate(batch):
        xs[i, :len(x)], ys[i, :len(y)] = x, y
    xs = torch.where(torch.isnan(xs), torch.zeros_like(xs), xs)
    if fix_targets:
        ys = torch.where(torch.isnan(ys), torch.zeros_like(ys), ys)
    return xs, ys


def _collate_targets(fix_targets: bool) -> Scenario:
    """Eight sequences in batches of 2; only the third batch's two differ in length. The twin masks both."""
    torch.manual_seed(0)
    lengths = [3, 3, 3, 3, 2, 3, 3, 3]
    data = [(torch.randn(n, 2), torch.randn(n)) for n in lengths]
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1), nn.Flatten(-2))
    loader = DataLoader(data, batch_size=2, collate_fn=lambda batch: _nan_collate(batch, fix_targets))
    return _loader_loop(model, loader, F.mse_loss)


# ---------------------------------------------------------------- brightness augmentation in log space
def _log_brightness(floor: float) -> Scenario:
    """The loop sets each image's mean log-intensity to a random one (a brightness jitter done in log space):
    ``log(x) - mean(log(x))`` of a black image is ``-inf - -inf``. Step 2 holds a black image; the twin clamps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.rand(3, 1, 6, 6) for _ in range(4)], [torch.randint(0, 2, (3,)) for _ in range(4)]
    xs[2][1] = 0.0
    shifts = [torch.rand(3, 1, 1, 1) - 0.5 for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logs = torch.log(xs[step].clamp(min=floor))  # producer: log brightness
            centred = logs - logs.mean((1, 2, 3), keepdim=True)
            x = torch.exp(centred + shifts[step])
            loss = F.cross_entropy(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- z-score of targets in a batch of one value
def _constant_targets(eps: float) -> Scenario:
    """Ratings in batches of 4, z-scored per batch in the loop; step 1's four users all rated 3: ``0 / 0``."""
    torch.manual_seed(0)
    model = _regressor()
    xs = _batches(4, 4)
    ys = [torch.randint(1, 6, (4, 1)).float() for _ in range(4)]
    ys[1][:] = 3.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        y = ys[step]
        return F.mse_loss(out, (y - y.mean()) / (y.std() + eps))  # producer: target z-score
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a GPU user's loader: 2 persistent workers, pinned
class Tiles(Dataset):
    """Image tiles standardised by their own statistics in ``__getitem__``; tile 13 is blank (a constant 0.5: the
    scanner's background), its ``std`` 0 and ``(x - mean) / std`` ``0 / 0``."""

    def __init__(self, eps: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tiles, self.labels = torch.rand(16, 1, 6, 6, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        self.tiles[13] = 0.5
        self.eps = eps

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        tile = self.tiles[i]
        return (tile - tile.mean()) / (tile.std() + self.eps), self.labels[i]  # producer: tile standardise


def _gpu_loader(eps: float) -> Scenario:
    """As a GPU user's loader is set: ``num_workers=2, pin_memory=True, persistent_workers=True``, each batch moved
    with ``.to(device, non_blocking=True)`` (the CPU here). Batches of 4 alternate between the two workers: tile 13 is
    in batch 3, worker 1's second. The twin adds an eps to the std."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Tiles(eps), batch_size=4, num_workers=2, pin_memory=True, persistent_workers=True)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            x, y = x.to("cpu", non_blocking=True), y.to("cpu", non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a memory-mapped numpy file with a NaN record
class MappedRecords(Dataset):
    """Records read from an ``np.memmap`` of float32, through ``torch.from_numpy`` (no copy until collate)."""

    def __init__(self, path: str, repair: bool) -> None:
        self.records, self.repair = np.memmap(path, dtype=np.float32, mode="r", shape=(16, 5)), repair

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        record = torch.from_numpy(np.array(self.records[i]))
        if self.repair:
            record = torch.nan_to_num(record)
        return record[:4], record[4:]


def _memmap(repair: bool) -> Scenario:
    """Record 9 was written as NaN by the exporter (a failed sensor read); batches of 4: step 2."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((16, 5)).astype(np.float32)
    values[9, 2] = np.nan
    fd, path = tempfile.mkstemp(suffix=".f32")
    os.close(fd)
    values.tofile(path)
    torch.manual_seed(0)
    loader = DataLoader(MappedRecords(path, repair), batch_size=4)
    return _loader_loop(_regressor(), loader, F.mse_loss)


# ---------------------------------------------------------------- a weighted sampler oversamples a corrupt record
class LogCounts(Dataset):
    """Features are log counts computed in ``__getitem__``; record 5 holds a count of 0 (``log(0)``)."""

    def __init__(self, floor: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.counts = torch.randint(1, 50, (12, 4), generator=gen).float()
        self.counts[5, 1] = 0.0
        self.targets, self.floor = torch.randn(12, 1, generator=gen), floor

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return torch.log(self.counts[i] + self.floor), self.targets[i]  # producer: log count


def _weighted_sampler(floor: float) -> Scenario:
    """A class-balancing ``WeightedRandomSampler`` gives record 5 (a rare class) ten times the weight of the others;
    it is first drawn in batch 2, not 0. The twin adds 1 to the counts (``log1p``)."""
    torch.manual_seed(0)
    weights = torch.ones(12)
    weights[5] = 10.0
    sampler = WeightedRandomSampler(weights, num_samples=16, generator=torch.Generator().manual_seed(19))
    loader = DataLoader(LogCounts(floor), batch_size=4, sampler=sampler)
    return _loader_loop(_regressor(), loader, F.mse_loss)


# ---------------------------------------------------------------- a cached dataset log-transformed in place twice
def _cached_in_place(in_place: bool) -> Scenario:
    """The dataset is cached in memory and given whole-batch (``batch_size=None``), so the loop's ``x.log_()`` writes
    into the cache: epoch 1 turns a count of 1 into 0, epoch 2 takes ``log(0)``. Three batches, two epochs: the
    incident is step 3 (epoch 2's first). The twin writes ``x = x.log()`` (out of place)."""
    torch.manual_seed(0)
    model = _regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache = [(torch.randint(2, 30, (4, 4)).float() + torch.rand(4, 4), torch.randn(4, 1)) for _ in range(3)]
    cache[0][0][2, 3] = 1.0
    loader = DataLoader(cache, batch_size=None)

    def run() -> list[torch.Tensor]:
        losses = []
        for _epoch in range(2):
            for x, y in loader:
                x = x.log_() if in_place else x.log()  # producer: cached log
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- raw counts moved with non_blocking to half
def _non_blocking_half(scale_first: bool) -> Scenario:
    """The loop moves each batch of raw 16-bit sensor counts with ``.to(device, torch.float16, non_blocking=True)``
    and scales afterwards; step 1 holds a saturated reading of 70000 (above float16's 65504). The twin scales in
    float32 first, then casts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randint(0, 60000, (4, 4)).float() for _ in range(4)], _batches(4, 1)
    xs[1][2, 0] = 70000.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if scale_first:
                x = (xs[step] / 65504.0).to("cpu", torch.float16, non_blocking=True)
            else:
                x = xs[step].to("cpu", torch.float16, non_blocking=True) / 65504.0  # producer: half move
            loss = F.mse_loss(model(x).float(), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- torch.where over a reciprocal distance
class Points(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


def _where_reciprocal(safe: bool) -> Scenario:
    """A repulsion loss ``mean(1 / d_ij)`` over pairs, the diagonal masked by ``torch.where``: its forward ``1 / 0``
    is discarded, but the backward of the reciprocal there is ``0 * inf``. The twin puts 1 in the masked entries
    before dividing (the double-where)."""
    torch.manual_seed(0)
    model = Points()
    xs = _batches(5, 3)
    off = ~torch.eye(5, dtype=torch.bool)

    def loss_fn(z: torch.Tensor, step: int) -> torch.Tensor:
        d = (z.unsqueeze(0) - z.unsqueeze(1)).pow(2).sum(-1)
        if safe:
            d = torch.where(off, d, torch.ones_like(d))
        return torch.where(off, 1.0 / d, torch.zeros_like(d)).mean()  # producer: repulsion
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- clip_grad_norm_(foreach=True), one NaN among many
class GatedNet(nn.Module):
    """Eight layers and one learned gate, its magnitude taken by hand as ``sqrt(g ** 2)``; the gate starts at 0."""

    def __init__(self, by_abs: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(8)])
        self.gate = Gate(by_abs)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.gate(x))


class Gate(nn.Module):
    def __init__(self, by_abs: bool) -> None:
        super().__init__()
        self.g, self.by_abs = nn.Parameter(torch.zeros(4)), by_abs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude = self.g.abs() if self.by_abs else torch.sqrt(self.g ** 2)  # producer: gate magnitude
        return x * (1.0 + magnitude)


def _clip_foreach(by_abs: bool) -> Scenario:
    """Step 0's backward of ``sqrt`` at 0 makes the gate's gradient NaN; ``clip_grad_norm_(foreach=True)`` then
    scales all 19 gradients by a NaN total norm. The report must name the gate, not the clip."""
    torch.manual_seed(0)
    model = GatedNet(by_abs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a user's gradient hook over a zero gradient
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.main, self.aux = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.main(h), self.aux(h)


def _user_hook(eps: float) -> Scenario:
    """The user normalises the auxiliary head's weight gradient with ``p.register_hook``; the auxiliary loss is
    warmed up from a weight of 0 at step 0, so that gradient is 0 and the hook's ``g / g.norm()`` is ``0 / 0``."""
    torch.manual_seed(0)
    model = TwoHeads()
    model.aux.weight.register_hook(lambda g: g / (g.norm() + eps))  # producer: user hook
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys, zs = _batches(4, 4), _batches(4, 1), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step]) + (step / 4) * F.mse_loss(aux, zs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- tied embeddings, NaN from the output use only
class CosineHead(nn.Module):
    """Cosine logits against the (tied) embedding rows, their norm clamped after the square root (the slip) or
    the squared norm clamped before it (the fix)."""

    def __init__(self, embedding: nn.Embedding, before: bool) -> None:
        super().__init__()
        self.embedding, self.before = embedding, before

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embedding.weight
        squared = w.pow(2).sum(1, keepdim=True)
        norm = squared.clamp(min=1e-12).sqrt() if self.before else squared.sqrt().clamp(min=1e-6)  # producer: row norm
        return F.linear(h, w / norm) * 10.0


class TiedLM(nn.Module):
    def __init__(self, before: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(9, 6, padding_idx=0)
        self.mix = nn.Linear(6, 6)
        self.head = CosineHead(self.embedding, before)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embedding(tokens))))


def _tied(before: bool) -> Scenario:
    """The padding row is all zeros: the input use gives it no gradient (padding_idx), the output use's square
    root at 0 gives it ``0 / 0`` in step 0's backward. The twin clamps the squared norm before the root."""
    torch.manual_seed(0)
    model = TiedLM(before)
    tokens = [torch.randint(1, 9, (3, 4)) for _ in range(4)]
    targets = [torch.randint(1, 9, (3, 4)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


CASES = [
    Case("hunt_s28c_iterable_dataset_last_window_padded_with_nan", lambda: _windows(float("nan")),
         Expect("data", "", "Sequential", step=3, op="aten.full.default", marker="nan pad")),
    Case("hunt_s28c_iterable_dataset_last_window_padded_with_zero_healthy", lambda: _windows(0.0), None),
    Case("hunt_s28c_collate_fn_nan_padding_masks_inputs_forgets_targets", lambda: _collate_targets(False),
         Expect("data", None, step=2, op="aten.full.default", marker="nan targets")),
    Case("hunt_s28c_collate_fn_nan_padding_masks_inputs_and_targets_healthy", lambda: _collate_targets(True), None),
    Case("hunt_s28c_log_space_brightness_jitter_of_a_black_image", lambda: _log_brightness(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log brightness",
                cause="log-domain")),
    Case("hunt_s28c_log_space_brightness_jitter_clamped_healthy", lambda: _log_brightness(1e-3), None),
    Case("hunt_s28c_loop_z_scores_targets_of_a_batch_of_one_rating", lambda: _constant_targets(0.0),
         # Built from the targets alone, but in the loss code after the model call: the loss code's (forward), as
         # hunt15's PPO advantage std and hunt20's pos_weight are; only the data region's code is data.
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="target z-score", cause="division-by-zero")),
    Case("hunt_s28c_loop_z_scores_targets_with_eps_healthy", lambda: _constant_targets(1e-6), None),
    Case("hunt_s28c_pinned_persistent_two_workers_standardise_a_blank_tile", lambda: _gpu_loader(0.0),
         Expect("data", "", "Sequential", step=3, op="aten.div.Tensor", marker="tile standardise",
                cause="division-by-zero")),
    Case("hunt_s28c_pinned_persistent_two_workers_std_eps_healthy", lambda: _gpu_loader(1e-6), None),
    Case("hunt_s28c_memmap_numpy_record_holding_a_nan", lambda: _memmap(False),
         Expect("data", "", "Sequential", step=2, op=None, cause="bad-input-data")),
    Case("hunt_s28c_memmap_numpy_record_repaired_healthy", lambda: _memmap(True), None),
    Case("hunt_s28c_weighted_sampler_oversamples_a_log_count_of_0", lambda: _weighted_sampler(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log count", cause="log-domain")),
    Case("hunt_s28c_weighted_sampler_log1p_counts_healthy", lambda: _weighted_sampler(1.0), None),
    Case("hunt_s28c_cached_dataset_log_transformed_in_place_second_epoch", lambda: _cached_in_place(True),
         Expect("data", "", "Sequential", step=3, op="aten.log_.default", marker="cached log",
                cause="log-domain")),
    Case("hunt_s28c_cached_dataset_log_transformed_out_of_place_healthy", lambda: _cached_in_place(False), None),
    Case("hunt_s28c_non_blocking_half_move_of_a_saturated_reading", lambda: _non_blocking_half(False),
         Expect("data", "", "Sequential", step=1, op="aten._to_copy.default", marker="half move",
                cause="half-precision-overflow")),
    Case("hunt_s28c_non_blocking_half_move_scaled_first_healthy", lambda: _non_blocking_half(True), None),
    Case("hunt_s28c_where_masked_reciprocal_distance_backward", lambda: _where_reciprocal(False),
         Expect("backward", None, step=0, op="aten.mul.Tensor", marker="repulsion",
                cause="division-by-zero")),
    Case("hunt_s28c_where_masked_reciprocal_distance_double_where_healthy", lambda: _where_reciprocal(True), None),
    Case("hunt_s28c_clip_grad_norm_foreach_over_one_nan_gradient_among_many", lambda: _clip_foreach(False),
         Expect("backward", "gate", "Gate", step=0, op="aten.div.Tensor", marker="gate magnitude",
                cause="sqrt-domain",
                # The gradient the gate's op wrote, not the first the clip then wrote NaN into (layers.0.weight: ops
                # mode's tie of one origin, op_origins.birth_order); the per-module watch names the op's output.
                says=tuple((mode, "first non-finite gradient of gate.g") for mode in ("default", "defer", "ops")))),
    Case("hunt_s28c_clip_grad_norm_foreach_gate_by_abs_healthy", lambda: _clip_foreach(True), None),
    Case("hunt_s28c_user_gradient_hook_normalises_a_zero_gradient", lambda: _user_hook(0.0),
         Expect("backward", "aux", "Linear", step=0, op="aten.div.Tensor", marker="user hook",
                cause="division-by-zero")),
    Case("hunt_s28c_user_gradient_hook_with_eps_healthy", lambda: _user_hook(1e-12), None),
    Case("hunt_s28c_tied_embedding_nan_gradient_from_the_output_use_only", lambda: _tied(False),
         Expect("backward", "head", "CosineHead", step=0, op="aten.div.Tensor", marker="row norm",
                cause="sqrt-domain")),
    Case("hunt_s28c_tied_embedding_squared_norm_clamped_healthy", lambda: _tied(True), None),
]
