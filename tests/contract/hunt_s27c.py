"""hunt_s27c, everyday numerics people write, each incident with its twin.

VICReg's variance term over the last, short batch of an epoch (``drop_last=False``: a batch of one, whose unbiased
variance is NaN) in the loss code, and a feature whitening module's ``std_mean`` over the same batch; a Dataset's
log-mel spectrogram of a silent clip (``log(0)``), read in the main process and in two workers; a log-target
regression taking the log of a zero target; a stick-breaking ``cumprod`` under float16 autocast on CPU overflowing
over a long sequence; a learnable kernel bandwidth, and a learnable noise scale (Kendall's uncertainty weighting
written with sigma itself), that Adam drives negative before ``sqrt`` and ``log`` take them; and the distance
builtins (``cdist``, ``pdist``, ``pairwise_distance``) between duplicate points, whose gradients torch makes 0 at a
distance of 0, which must stay calm. Each twin applies its users' fix and must stay silent and bit-identical.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop as _loader_loop
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- VICReg's variance term over a last batch of one
class Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _vicreg(drop_last: bool) -> Scenario:
    """Nine samples in batches of four: the third batch holds one sample and ``z.var(dim=0)`` (unbiased) of one row
    is ``0 / 0``. The twin drops the short batch, as VICReg's reference loader does."""
    torch.manual_seed(0)
    model = Projector()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(list(torch.randn(9, 4)), batch_size=4, drop_last=drop_last)

    def run() -> list[torch.Tensor]:
        losses = []
        for _ in range(2):
            for x in loader:
                a, b = model(x + 0.1 * torch.randn_like(x)), model(x + 0.1 * torch.randn_like(x))
                std = torch.sqrt(a.var(dim=0) + 1e-4)  # producer: vicreg variance
                loss = F.mse_loss(a, b) + F.relu(1 - std).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a whitening module's std_mean over a batch of one
class BatchWhiten(nn.Module):
    """Standardises each feature over the batch (a hand-made, statistics-free batch norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std, mean = torch.std_mean(x, dim=0, keepdim=True)  # producer: whiten std
        return (x - mean) / (std + 1e-5)


class WhitenedRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.whiten, self.head = nn.Linear(4, 8), BatchWhiten(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.whiten(self.inp(x))))


def _whiten(drop_last: bool) -> Scenario:
    """Nine samples in batches of four, ``drop_last=False``: the third step's batch of one has an unbiased std of
    NaN. The twin drops the short batch."""
    torch.manual_seed(0)
    model = WhitenedRegressor()
    data = list(zip(torch.randn(9, 4), torch.randn(9, 1)))
    return _loader_loop(model, DataLoader(data, batch_size=4, drop_last=drop_last), F.mse_loss)


# ---------------------------------------------------------------- a Dataset's log-mel of a silent clip
class Clips(Dataset):
    """Keyword-spotting clips turned into log-mel features in ``__getitem__``; clip 5 is silence (all zeros)."""

    def __init__(self, eps: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.clips = torch.randn(8, 256, generator=gen) * 0.1
        self.clips[5] = 0.0
        self.labels = torch.randint(0, 3, (8,), generator=gen)
        self.mel = torch.rand(33, 8, generator=gen)  # a filterbank over the 33 rfft bins
        self.window, self.eps = torch.hann_window(64), eps

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = torch.stft(self.clips[index], 64, hop_length=32, window=self.window, return_complex=True)
        mel = spec.abs().pow(2).transpose(0, 1) @ self.mel
        return torch.log(mel + self.eps).mean(0), self.labels[index]  # producer: log mel


def _log_mel(eps: float, workers: int) -> Scenario:
    """Batches of two in order: step 2 holds the silent clip, whose log-mel is ``log(0) = -inf``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    loader = DataLoader(Clips(eps), batch_size=2, num_workers=workers)
    return _loader_loop(model, loader, F.cross_entropy)


# ---------------------------------------------------------------- a log-target regression over a zero target
def _log_target(log1p: bool) -> Scenario:
    """House prices regressed in log space; step 1's batch holds a listing whose price was recorded as 0, and
    ``log(0)`` makes the loss inf. The twin uses ``log1p``, as RMSLE does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    xs, prices = _batches(4, 4), [torch.rand(4, 1) * 100 + 50 for _ in range(4)]
    prices[1][2] = 0.0

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        target = torch.log1p(prices[step]) if log1p else torch.log(prices[step])  # producer: log target
        return F.mse_loss(out, target)
    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- stick-breaking cumprod under float16 autocast
class StickBreaking(nn.Module):
    """Cumulative growth factors over a long sequence: ``cumprod(1 + softplus(g))``."""

    def __init__(self, in_float32: bool) -> None:
        super().__init__()
        self.gate, self.in_float32 = nn.Linear(4, 1), in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        growth = 1 + F.softplus(self.gate(x)).squeeze(-1)
        if self.in_float32:
            growth = growth.float()
        return torch.cumprod(growth, dim=1)  # producer: stick cumprod


class GrowthModel(nn.Module):
    def __init__(self, in_float32: bool) -> None:
        super().__init__()
        self.stick, self.head = StickBreaking(in_float32), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            total = self.stick(x)
        return self.head(torch.log(total[:, -1:].float()))


def _stick_cumprod(in_float32: bool) -> Scenario:
    """Sequences of 400 whose factors are about 1.003 (a product near 3); at step 1 a sequence of larger inputs
    makes each factor about 1.13, and the float16 product passes 65504 near position 90. The twin takes the
    product in float32."""
    torch.manual_seed(0)
    model = GrowthModel(in_float32)
    xs, ys = [torch.randn(2, 400, 4) * 0.01 for _ in range(4)], _batches(2, 1)
    with torch.no_grad():
        model.stick.gate.weight.fill_(2.0)
        model.stick.gate.bias.fill_(-6.0)
    xs[1][1] = 0.5
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-4)


# ---------------------------------------------------------------- a learnable bandwidth Adam drives negative
class RBFHead(nn.Module):
    """An RBF kernel layer whose bandwidth is learned directly (not through a softplus)."""

    def __init__(self, positive: bool) -> None:
        super().__init__()
        self.centres, self.bandwidth = nn.Parameter(torch.randn(6, 4) * 0.1), nn.Parameter(torch.tensor(0.15))
        self.positive = positive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = F.softplus(self.bandwidth) if self.positive else self.bandwidth
        scaled = torch.cdist(x, self.centres) / torch.sqrt(width)  # producer: bandwidth sqrt
        return torch.exp(-scaled.pow(2))


class KernelModel(nn.Module):
    def __init__(self, positive: bool) -> None:
        super().__init__()
        self.kernel, self.head = RBFHead(positive), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.kernel(x))


def _bandwidth(positive: bool) -> Scenario:
    """Adam at lr 0.1 moves the bandwidth by about 0.1 a step, from 0.15 to 0.05 and below 0 after step 1's update:
    ``sqrt`` of it is NaN in step 2's forward. The twin learns it through a softplus."""
    torch.manual_seed(0)
    model = KernelModel(positive)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    xs, ys = [x * 0.1 for x in _batches(8, 4)], _batches(8, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Kendall's uncertainty weights as sigma itself
class TwoTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.depth, self.normals = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 3)
        self.sigmas = nn.Parameter(torch.full((2,), 0.15))
        with torch.no_grad():
            for head in (self.depth, self.normals):
                head.weight.zero_()
                head.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.depth(h), self.normals(h)


def _uncertainty(as_log: bool) -> Scenario:
    """``L / (2 sigma^2) + log(sigma)`` with sigma in its own Adam group at lr 0.1 (the network's at 1e-3), depth
    and normals regressed by zero-initialised heads onto small targets: the task losses are about 1e-4, the log
    term's pull wins and each update takes about 0.1 off sigma, from 0.15 to below 0 after step 1's: step 2's
    ``log(sigma)`` is NaN. The twin learns ``log sigma^2``, as Kendall et al. do."""
    torch.manual_seed(0)
    model = TwoTask()
    network = [p for name, p in model.named_parameters() if name != "sigmas"]
    opt = torch.optim.Adam([{"params": network, "lr": 1e-3}, {"params": [model.sigmas], "lr": 0.1}])
    xs, depths, normals = _batches(8, 4), _batches(8, 1), _batches(8, 3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            depth, normal = model(xs[step])
            task = torch.stack([F.mse_loss(depth, depths[step] * 0.01), F.mse_loss(normal, normals[step] * 0.01)])
            if as_log:
                loss = (task * torch.exp(-model.sigmas) / 2 + model.sigmas / 2).sum()
            else:
                sigma = model.sigmas
                loss = (task / (2 * sigma ** 2) + torch.log(sigma)).sum()  # producer: sigma log
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- distance builtins between duplicate points
class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _duplicates(distance: str) -> Scenario:
    """A metric-learning batch holding the same image twice (a sampler with replacement): the distance between its
    two embeddings is exactly 0. torch's ``cdist``, ``pdist`` and ``pairwise_distance`` give a gradient of 0 there
    (unlike a hand-written ``sqrt``), so each loss must stay calm."""
    torch.manual_seed(0)
    model = Embedder()
    xs = _batches(6, 4)
    for x in xs:
        x[3] = x[0]

    def loss(emb: torch.Tensor, step: int) -> torch.Tensor:
        if distance == "cdist":  # batch-hard triplet, classes [0, 0, 1, 0, 1, 1]
            d = torch.cdist(emb, emb)
            same = torch.tensor([0, 0, 1, 0, 1, 1])
            same = same[:, None] == same[None, :]
            return F.relu((d * same).amax(1) - (d + 1e3 * same).amin(1) + 0.2).mean()
        if distance == "pdist":  # a uniformity loss on the hypersphere
            return torch.pdist(F.normalize(emb, dim=-1)).pow(2).mul(-2).exp().mean().log()
        return F.triplet_margin_loss(emb[[0, 1, 2]], emb[[3, 0, 3]], emb[[4, 5, 1]])
    return _loop(model, lambda step: (xs[step],), loss)



# ---------------------------------------------------------------- a discrete-time hazard model under bf16 autocast
class HazardModel(nn.Module):
    """Per-interval hazards ``sigmoid(h)``; the log-survival ``log(cumprod(1 - hazard))`` under bfloat16 autocast,
    where ``sigmoid`` of a logit above about 6 rounds to exactly 1. The twin sums ``logsigmoid(-h)`` in float32."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.trunk, self.head, self.stable = nn.Linear(4, 8), nn.Linear(8, 10), stable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.head(torch.relu(self.trunk(x)))
            if self.stable:
                return torch.cumsum(F.logsigmoid(-h.float()), dim=1)
            return torch.log(torch.cumprod(1 - torch.sigmoid(h), dim=1))  # producer: hazard log


def _hazard(stable: bool) -> Scenario:
    """At step 1 one patient's features are large: the head's logits pass 8 and the bf16 hazard is exactly 1."""
    torch.manual_seed(0)
    model = HazardModel(stable)
    xs, events = [torch.rand(4, 4) for _ in range(4)], [torch.randint(0, 10, (4,)) for _ in range(4)]
    with torch.no_grad():
        model.head.bias.fill_(-3.0)
    xs[1][0] = 40.0

    def loss(log_survival: torch.Tensor, step: int) -> torch.Tensor:
        return -log_survival.float().gather(1, events[step][:, None]).mean()
    return _loop(model, lambda step: (xs[step],), loss, lr=1e-3)


# ---------------------------------------------------------------- a capsule squash's sqrt at a zero capsule
class Squash(nn.Module):
    """Capsule squash ``s |s| / (1 + |s|^2)`` with the length written by hand (the twin adds an eps in the sqrt)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        length = torch.sqrt(s.pow(2).sum(-1, keepdim=True) + self.eps)  # producer: capsule length
        return s * length / (1 + length ** 2)


class CapsuleNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.primary, self.squash, self.classes = nn.Linear(4, 16, bias=False), Squash(eps), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        caps = self.squash(self.primary(x).view(-1, 4, 4))
        return self.classes(caps.flatten(1))


def _capsule(eps: float) -> Scenario:
    """Step 1's batch holds a blank sample (all zeros) and the primary layer has no bias: every capsule of it is
    0, its length ``sqrt(0)`` and the backward ``1 / (2 sqrt(0))`` is inf, NaN once multiplied by 0. Adam then
    writes NaN into the primary layer."""
    torch.manual_seed(0)
    model = CapsuleNet(eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = _batches(4, 4), [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[1][2] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a per-sample channel std of a mono clip
class ChannelStandardise(nn.Module):
    """Standardises each time step across channels; written for stereo input, fed mono (one channel): the unbiased
    std over a dimension of size 1 is NaN from the very first forward. The twin uses ``correction=0``."""

    def __init__(self, correction: int) -> None:
        super().__init__()
        self.correction = correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = x.std(dim=1, keepdim=True, correction=self.correction)  # producer: channel std
        return (x - x.mean(dim=1, keepdim=True)) / (std + 1e-5)


def _mono(correction: int) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(ChannelStandardise(correction), nn.Conv1d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 14, 2))
    xs, ys = _batches(3, 1, 16), [torch.randint(0, 2, (3,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


CASES = [
    Case("hunt_s27c_vicreg_variance_term_over_a_last_batch_of_one", lambda: _vicreg(False),
         Expect("forward", None, step=2, op="aten.var.correction", marker="vicreg variance",
                cause="division-by-zero")),
    Case("hunt_s27c_vicreg_variance_term_drop_last_healthy", lambda: _vicreg(True), None),
    Case("hunt_s27c_whitening_std_mean_over_a_last_batch_of_one", lambda: _whiten(False),
         Expect("forward", "whiten", "BatchWhiten", step=2, op="aten.std_mean.correction", marker="whiten std",
                cause="division-by-zero")),
    Case("hunt_s27c_whitening_std_mean_drop_last_healthy", lambda: _whiten(True), None),
    Case("hunt_s27c_dataset_log_mel_of_a_silent_clip_in_the_main_process", lambda: _log_mel(0.0, 0),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log mel", cause="log-domain")),
    Case("hunt_s27c_dataset_log_mel_of_a_silent_clip_in_two_workers", lambda: _log_mel(0.0, 2),
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log mel", cause="log-domain")),
    Case("hunt_s27c_dataset_log_mel_with_eps_in_the_main_process_healthy", lambda: _log_mel(1e-6, 0), None),
    Case("hunt_s27c_dataset_log_mel_with_eps_in_two_workers_healthy", lambda: _log_mel(1e-6, 2), None),
    Case("hunt_s27c_log_target_regression_of_a_zero_price", lambda: _log_target(False),
         Expect("forward", None, step=1, op="aten.log.default", marker="log target", cause="log-domain")),
    Case("hunt_s27c_log1p_target_regression_healthy", lambda: _log_target(True), None),
    Case("hunt_s27c_stick_breaking_cumprod_overflows_under_float16_autocast", lambda: _stick_cumprod(False),
         Expect("forward", "stick", "StickBreaking", step=1, op="aten.cumprod.default", marker="stick cumprod",
                cause="half-precision-overflow")),
    Case("hunt_s27c_stick_breaking_cumprod_in_float32_healthy", lambda: _stick_cumprod(True), None),
    Case("hunt_s27c_learned_bandwidth_adam_drives_negative_then_sqrt", lambda: _bandwidth(False),
         Expect("forward", "kernel", "RBFHead", step=2, op="aten.sqrt.default", marker="bandwidth sqrt",
                cause="sqrt-domain")),
    Case("hunt_s27c_learned_bandwidth_through_softplus_healthy", lambda: _bandwidth(True), None),
    Case("hunt_s27c_uncertainty_weights_sigma_adam_drives_negative_then_log", lambda: _uncertainty(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="sigma log", cause="log-domain")),
    Case("hunt_s27c_uncertainty_weights_as_log_variance_healthy", lambda: _uncertainty(True), None),
    Case("hunt_s27c_bf16_autocast_hazard_rounded_to_1_log_survival", lambda: _hazard(False),
         Expect("forward", "", "HazardModel", step=1, op="aten.log.default", marker="hazard log",
                cause="log-domain")),
    Case("hunt_s27c_bf16_autocast_hazard_logsigmoid_in_float32_healthy", lambda: _hazard(True), None),
    Case("hunt_s27c_capsule_squash_sqrt_backward_of_a_blank_sample_before_adam", lambda: _capsule(0.0),
         Expect("backward", "squash", "Squash", step=1, op="aten.div.Tensor", marker="capsule length",
                cause="sqrt-domain")),
    Case("hunt_s27c_capsule_squash_sqrt_with_eps_healthy", lambda: _capsule(1e-8), None),
    Case("hunt_s27c_channel_std_of_a_mono_clip_at_step_0", lambda: _mono(1),
         Expect("forward", "0", "ChannelStandardise", step=0, op="aten.std.correction", marker="channel std",
                cause="division-by-zero")),
    Case("hunt_s27c_channel_std_without_correction_healthy", lambda: _mono(0), None),
    Case("hunt_s27c_batch_hard_triplet_cdist_with_a_duplicate_healthy", lambda: _duplicates("cdist"), None),
    Case("hunt_s27c_uniformity_pdist_with_a_duplicate_healthy", lambda: _duplicates("pdist"), None),
    Case("hunt_s27c_triplet_margin_loss_with_a_duplicate_healthy", lambda: _duplicates("pairwise"), None),
]
