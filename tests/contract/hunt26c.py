"""hunt26c, incidents born in backward formulas, optimizer steps and the data phase, each with its healthy twin.

Backward: a hand-written ``autograd.Function`` normalising embeddings whose backward divides by the saved raw norm
of an all-zero row; ``eigh``'s backward over an identity-initialised weight (every eigenvalue tied); the ``L_0.5``
quasi-norm sparsity penalty of a pruned weight (``|w|^(p - 1)`` at an exact 0). Optimizer: RAdam with ``eps=0`` once
its rectification starts (step 6), over embedding rows no batch uses; Adadelta with ``eps=0`` over the same rows; Adam
whose beta2, warmed up towards 1 uncapped, rounds to 1.0 (a bias correction of 0).
Data: a ``collate_fn`` turning counts into frequencies with an empty document; a Dataset standardising by statistics
of a split it names wrongly (the mean of nothing); a worker's augmentation taking the log of a randomly erased patch
(``num_workers=2``); the loop standardising targets per batch, the last batch holding one sample. Each with the fix
its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- a hand-written backward dividing by a saved 0
class Normalise(torch.autograd.Function):
    """``x / max(|x|, eps)`` with its backward written by hand; the broken one divides by the raw norm it saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clamp_saved: bool) -> torch.Tensor:  # type: ignore[override]
        norm = x.norm(dim=-1, keepdim=True)
        y = x / norm.clamp(min=1e-6)
        ctx.save_for_backward(y, norm.clamp(min=1e-6) if clamp_saved else norm)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        y, norm = ctx.saved_tensors
        return (g - y * (y * g).sum(-1, keepdim=True)) / norm, None  # producer: normalise backward


class NormalisedBag(nn.Module):
    def __init__(self, clamp_saved: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 1)
        self.clamp_saved = clamp_saved
        with torch.no_grad():
            self.embed.weight[0] = 0.0  # the unknown token's row starts at 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(Normalise.apply(self.embed(tokens), self.clamp_saved)).mean(1)


def _normalise_backward(clamp_saved: bool) -> Scenario:
    """Step 1's batch holds the unknown token 0, whose row is all 0: the forward's clamp keeps it finite, the
    backward divides the incoming gradient by the raw norm, 0. The twin saves the clamped norm."""
    torch.manual_seed(0)
    model = NormalisedBag(clamp_saved)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = [torch.randint(1, 10, (4, 5)) for _ in range(3)]
    tokens[1][2, 3] = 0
    ys = _batches(4, 1, steps=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(tokens[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- eigh's backward with tied eigenvalues
class PrincipalAxis(nn.Module):
    """A recurrent-style square map whose principal axis (top eigenvector of W^T W) a regulariser aligns."""

    def __init__(self, identity: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.rec = nn.Linear(6, 6, bias=False)
        self.out = nn.Linear(6, 1)
        with torch.no_grad():
            if identity:
                self.rec.weight.copy_(torch.eye(6))  # IRNN's identity init: every eigenvalue of W^T W is 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.rec(torch.tanh(self.inp(x)))))


def _eigh_backward(identity: bool) -> Scenario:
    """The loss adds ``1 - (v_top . u)^2`` for the top eigenvector of ``W^T W``; eigh's backward divides by the gaps
    between eigenvalues, all 0 for the identity. The twin keeps the default init (distinct eigenvalues)."""
    torch.manual_seed(0)
    model = PrincipalAxis(identity)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    target = torch.ones(6) / 6 ** 0.5
    xs, ys = _batches(5, 4, steps=3), _batches(5, 1, steps=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            w = model.rec.weight
            _, vectors = torch.linalg.eigh(w.T @ w)  # producer: eigh backward
            loss = F.mse_loss(model(xs[step]), ys[step]) + 0.1 * (1 - (vectors[:, -1] @ target) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an L_0.5 penalty of a pruned weight
def _quasi_norm(eps: float, prune_at: int | None = None) -> Scenario:
    """Half the first layer's weights were pruned to exactly 0; the loss adds the ``L_0.5`` quasi-norm of the weight
    to push more to 0, written ``sum(|w|^p)^(1/p)``, before the model call. Its backward is ``|w|^(p - 1)`` (inf at
    0) times ``sign(w)`` (0): NaN. ``prune_at``: the loop prunes at that step instead, in place, just before the
    penalty (a leaf written in the same data region: its replay must not write it again). The twin adds eps to
    ``|w|``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    mask = torch.rand(8, 4) > 0.5
    if prune_at is None:
        with torch.no_grad():
            model[0].weight.mul_(mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 4, steps=3), _batches(6, 1, steps=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            if step == prune_at:
                with torch.no_grad():
                    model[0].weight.mul_(mask)
            w = model[0].weight
            penalty = ((w.abs() + eps) ** 0.5).sum() ** 2  # producer: quasi-norm backward
            loss = F.mse_loss(model(xs[step]), ys[step]) + 1e-3 * penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- RAdam / Adadelta with eps=0 over unused rows
class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def _unused_rows(optimizer: str, eps: float, steps: int) -> Scenario:
    """Tokens 8 to 11 never occur: their embedding rows' gradients are 0 at every step, and so are their moments.
    RAdam's adaptive rate ``sqrt(1 - beta2^t) / (sqrt(v) + eps)`` is inf once rectification starts (step 6), times
    a first moment of 0; Adadelta's ``sqrt(u + eps) / sqrt(v + eps)`` is 0 / 0 at once. The twin keeps eps."""
    torch.manual_seed(0)
    model = BagClassifier()
    if optimizer == "radam":
        opt: torch.optim.Optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3, eps=eps)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.Adadelta(model.parameters(), eps=eps)
    tokens = [torch.randint(0, 8, (4, 5)) for _ in range(steps)]
    labels = [torch.randint(0, 3, (4,)) for _ in range(steps)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            loss = F.cross_entropy(model(tokens[step]), labels[step])
            opt.zero_grad()
            loss.backward()
            if optimizer == "adam":
                # beta2 warmed up towards 1; uncapped (eps 0) it rounds to 1.0 at step 16, where Adam's bias
                # correction ``1 - beta2^t`` is 0 and its denominator ``sqrt(v) / 0`` is 0 / 0 over the unused rows.
                opt.param_groups[0]["betas"] = (0.9, min(1 - 0.1 ** (step + 1), 1 - eps))
            opt.step()  # producer: unused rows step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a collate_fn's frequencies of an empty document
def _collate_frequencies(floor: bool) -> Scenario:
    """Documents as token-id lists; the collate_fn counts tokens and divides by each document's length. Stop-word
    filtering left document 9 empty: 0 / 0 in batch 2. The twin divides by at least 1."""
    torch.manual_seed(0)
    docs = [torch.randint(0, 16, (int(n),)) for n in torch.randint(3, 9, (12,))]
    docs[9] = torch.zeros(0, dtype=torch.long)
    labels = torch.randint(0, 2, (12,))
    model = nn.Linear(16, 2)

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.stack([torch.bincount(doc, minlength=16).float() for doc, _ in items])
        lengths = counts.sum(1, keepdim=True)
        if floor:
            lengths = lengths.clamp(min=1)
        return counts / lengths, torch.stack([y for _, y in items])  # producer: frequencies

    loader = DataLoader(list(zip(docs, labels)), batch_size=4, collate_fn=collate)
    return loader_loop(model, loader, F.cross_entropy, lr=0.1)


# ---------------------------------------------------------------- a Dataset's statistics of an empty split
class Tabular(Dataset):
    """Standardises each row by the mean and std of the rows of ``stats_split``, computed on first use."""

    def __init__(self, stats_split: str) -> None:
        torch.manual_seed(0)
        self.x, self.y = torch.randn(16, 4) * 3 + 1, torch.randn(16, 1)
        self.split = ["train"] * 12 + ["val"] * 4
        self.stats_split = stats_split
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stats is None:
            rows = self.x[[s == self.stats_split for s in self.split]]
            self.stats = (rows.mean(0), rows.std(0))  # producer: split statistics
        mean, std = self.stats
        return (self.x[i] - mean) / std, self.y[i]


def _split_statistics(stats_split: str) -> Scenario:
    """The statistics are asked of split "training"; the rows are tagged "train": the mean of no row is NaN. The
    twin names the split right."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    loader = DataLoader(Tabular(stats_split), batch_size=4)
    return loader_loop(model, loader, F.mse_loss, lr=0.01)


# ---------------------------------------------------------------- a worker's log of a randomly erased patch
class ErasedIntensities(Dataset):
    """Positive intensity images, randomly erased (a patch set to 0, seeded by index), then log-transformed."""

    def __init__(self, floor: float) -> None:
        torch.manual_seed(0)
        self.images, self.labels = torch.rand(16, 1, 6, 6) + 0.5, torch.randint(0, 2, (16,))
        self.floor = floor

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i].clone()
        if i == 10:  # the only index whose draw erases
            image[:, 1:3, 2:5] = 0.0
        if self.floor:
            image = image.clamp(min=self.floor)
        return image.log(), self.labels[i]  # producer: log intensity


def _worker_log_erased(floor: float) -> Scenario:
    """Item 10's augmentation erased a patch to 0 and the log of it is -inf, in one of two workers; batch 2. The
    twin clamps the intensities first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    loader = DataLoader(ErasedIntensities(floor), batch_size=4, num_workers=2)
    return loader_loop(model, loader, F.cross_entropy, lr=0.01)


# ---------------------------------------------------------------- the loop standardises targets of a batch of one
def _target_standardisation(drop_last: bool) -> Scenario:
    """Nine samples in batches of 4: the last batch holds one, and the loop's per-batch ``y.std()`` of one number is
    NaN. The twin drops the last partial batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = list(zip(torch.randn(9, 4), torch.randn(9, 1) * 5 + 2))
    loader = DataLoader(data, batch_size=4, drop_last=drop_last)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            y = (y - y.mean()) / y.std()  # producer: target standardisation
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


_EIGH = Expect("backward", None, step=0, op="aten.div_.Tensor", marker="eigh backward", cause="division-by-zero")
_QUASI = Expect("backward", None, step=0, op="aten.pow.Tensor_Scalar", marker="quasi-norm backward",
                cause="pow-domain")
_TARGETS = Expect("data", None, step=2, op="aten.std.correction", marker="target standardisation",
                  cause="division-by-zero")

CASES = [
    Case("hunt26c_hand_written_backward_divides_by_a_saved_zero_norm", lambda: _normalise_backward(False),
         Expect("backward", "", "NormalisedBag", step=1, op="aten.div.Tensor", marker="normalise backward",
                cause="division-by-zero")),
    Case("hunt26c_hand_written_backward_saves_the_clamped_norm_healthy", lambda: _normalise_backward(True), None),
    # (The penalties' ops run before the model call, in the data region: recorded_ops.with_early_loss_code.)
    Case("hunt26c_eigh_backward_over_an_identity_initialised_weight", lambda: _eigh_backward(True), _EIGH),
    Case("hunt26c_eigh_backward_over_a_default_initialised_weight_healthy", lambda: _eigh_backward(False), None),
    Case("hunt26c_half_quasi_norm_penalty_of_a_pruned_weight", lambda: _quasi_norm(0.0), _QUASI),
    Case("hunt26c_half_quasi_norm_penalty_with_eps_healthy", lambda: _quasi_norm(1e-8), None),
    Case("hunt26c_half_quasi_norm_penalty_of_a_weight_the_loop_prunes_in_place", lambda: _quasi_norm(0.0, 1),
         Expect("backward", None, step=1, op="aten.pow.Tensor_Scalar", marker="quasi-norm backward",
                cause="pow-domain")),
    Case("hunt26c_half_quasi_norm_penalty_with_eps_of_a_weight_the_loop_prunes_healthy",
         lambda: _quasi_norm(1e-8, 1), None),
    Case("hunt26c_radam_eps_0_over_unused_embedding_rows", lambda: _unused_rows("radam", 0.0, 9),
         Expect("optimizer", "embed", "Embedding", step=5, op="aten.reciprocal.default", marker="unused rows step",
                tensor=TensorRef.parameter("embed.weight"), cause="optimizer-eps-underflow")),
    Case("hunt26c_radam_default_eps_over_unused_embedding_rows_healthy", lambda: _unused_rows("radam", 1e-8, 9),
         None),
    Case("hunt26c_adadelta_eps_0_over_unused_embedding_rows", lambda: _unused_rows("adadelta", 0.0, 3),
         Expect("optimizer", "embed", "Embedding", step=0, op="aten.div_.Tensor", marker="unused rows step",
                tensor=TensorRef.parameter("embed.weight"), cause="optimizer-eps-underflow")),
    Case("hunt26c_adadelta_default_eps_over_unused_embedding_rows_healthy",
         lambda: _unused_rows("adadelta", 1e-6, 3), None),
    Case("hunt26c_adam_beta2_warmed_up_to_1_over_unused_embedding_rows", lambda: _unused_rows("adam", 0.0, 18),
         Expect("optimizer", "embed", "Embedding", step=16, op="aten.div.Tensor", marker="unused rows step",
                tensor=TensorRef.parameter("embed.weight"), cause="division-by-zero")),
    Case("hunt26c_adam_beta2_warm_up_capped_over_unused_embedding_rows_healthy",
         lambda: _unused_rows("adam", 1e-3, 18), None),
    Case("hunt26c_collate_fn_frequencies_of_an_empty_document", lambda: _collate_frequencies(False),
         Expect("data", "", "Linear", step=2, op="aten.div.Tensor", marker="frequencies",
                tensor=TensorRef.argument("input[0]"), cause="division-by-zero")),
    Case("hunt26c_collate_fn_frequencies_floored_length_healthy", lambda: _collate_frequencies(True), None),
    Case("hunt26c_dataset_statistics_of_a_misnamed_empty_split", lambda: _split_statistics("training"),
         Expect("data", "", "Sequential", step=0, op="aten.mean.dim", marker="split statistics",
                tensor=TensorRef.argument("input[0]"), cause="empty-reduction")),
    Case("hunt26c_dataset_statistics_of_the_named_split_healthy", lambda: _split_statistics("train"), None),
    Case("hunt26c_worker_log_of_a_randomly_erased_patch", lambda: _worker_log_erased(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log intensity",
                tensor=TensorRef.argument("input[0]"), cause="log-domain")),
    Case("hunt26c_worker_log_of_clamped_intensities_healthy", lambda: _worker_log_erased(1e-3), None),
    Case("hunt26c_loop_standardises_targets_of_a_last_batch_of_one", lambda: _target_standardisation(False),
         # The loop built the targets from the batch alone: the recorded modes tell it by
         # RegionRecords.claimed_from_data, ops=True by the op tracer's taint (localize/ops/derived.py).
         _TARGETS),
    Case("hunt26c_loop_standardises_targets_dropping_the_last_batch_healthy",
         lambda: _target_standardisation(True), None),
]
