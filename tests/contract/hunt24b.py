"""hunt24b, layers, losses and data: reported incidents, each with its healthy twin (loop shapes: hunt24).

Layers: ``nn.GroupNorm(eps=0)`` over a globally pooled map (one element per group: ``0 * rsqrt(0)``); a Barlow Twins
projector's batch standardisation without eps over a dimension constant across the batch; ``nn.MultiheadAttention``
with a causal mask and a key padding mask over a left-padded batch (each mask alone leaves every query a key;
together they leave the padded sample's first query none). Losses: ``F.kl_div`` of an action-masked student
(log-probability -inf where the teacher's probability is 0: 0 * -inf); ``smooth_l1_loss`` (mean) over the positive
anchors of a batch that has none; cross-entropy with ``label_smoothing`` over a batch whose every tag is
``ignore_index``; an entropy bonus by ``xlogy(p, p)``, finite at p = 0 in forward, whose derivative in y, x / y, is
0 / 0 there. Loop code: gradients rescaled to a running average of their norm between ``backward()`` and the step,
over a batch whose loss is exactly 0 (``running / 0``, then ``0 * inf``). Data: a depth map computed in
``__getitem__`` from a disparity of 0 (a stereo matcher's "no match"), then upsampled bilinearly by the model. Each
with the fix its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop as _loader_loop
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- GroupNorm(eps=0) over a pooled map
class PooledGroupNorm(nn.Module):
    """Conv features pooled to 1x1, then GroupNorm with one channel a group: each group holds one element."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(1, 4, 3), nn.GroupNorm(4, 4, eps=eps), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1)
        return self.head(self.norm(pooled).flatten(1))  # producer: group norm


def _group_norm(eps: float) -> Scenario:
    """With one element a group the variance is exactly 0 and the mean the element itself: with eps=0 (set "to
    normalise exactly") the output is ``0 * rsqrt(0)``. The twin keeps GroupNorm's eps."""
    torch.manual_seed(0)
    model = PooledGroupNorm(eps)
    xs, ys = _batches(4, 1, 6, 6), _batches(4, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- depth from a disparity of 0, in __getitem__
class StereoDepth(torch.utils.data.Dataset):
    """Depth ``f B / disparity`` computed from a stereo matcher's disparity, where 0 means "no match"."""

    def __init__(self, masked: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.disparity = [torch.rand(1, 4, 4, generator=g) * 20 + 1 for _ in range(8)]
        self.disparity[5][0, 2, 1] = 0.0  # a pixel the matcher found no match for
        self.targets = [torch.rand(1, 8, 8, generator=g) for _ in range(8)]
        self.masked = masked

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        d = self.disparity[i]
        if self.masked:
            return torch.where(d > 0, 50.0 / d.clamp(min=1e-3), torch.zeros_like(d)), self.targets[i]
        return 50.0 / d, self.targets[i]  # producer: depth from disparity


class DepthRefiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, depth: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(depth / 50.0, scale_factor=2, mode="bilinear", align_corners=False)
        return self.conv(up)


def _disparity(masked: bool) -> Scenario:
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(StereoDepth(masked), batch_size=2)
    return _loader_loop(DepthRefiner(), loader, F.l1_loss)


# ---------------------------------------------------------------- Barlow Twins: batch std of a dead dimension
class Projector(nn.Module):
    """A ReLU projector whose output is standardised over the batch, ``(z - mean) / std`` as the Barlow Twins
    pseudo-code writes it; the twin uses the reference code's ``BatchNorm1d(affine=False)`` (it has eps)."""

    def __init__(self, batch_norm: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4, affine=False) if batch_norm else None
        with torch.no_grad():
            self.fc2.bias[3] = -5.0  # a unit whose ReLU is 0 for every sample of a batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.fc2(F.relu(self.fc1(x))))
        if self.bn is not None:
            return self.bn(z)
        return (z - z.mean(0)) / z.std(0)  # producer: batch standardise


def _barlow(batch_norm: bool) -> Scenario:
    torch.manual_seed(0)
    model = Projector(batch_norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(8, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x = xs[step]
            z1, z2 = model(x + 0.1 * torch.sin(x)), model(x + 0.1 * torch.cos(x))
            c = z1.T @ z2 / x.shape[0]
            off = c - torch.diag(c.diagonal())
            loss = (c.diagonal() - 1).pow(2).sum() + 5e-3 * off.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- kl_div of an action-masked student
def _masked_kl(lowest: bool) -> Scenario:
    """Policy distillation with action masking: the student's illegal actions are masked with -inf before
    ``log_softmax`` (log-probability -inf) and the teacher gives them probability 0; ``F.kl_div`` computes
    ``xlogy(p, p) - p * log_q``, and 0 * -inf is NaN. The twin masks with the dtype's lowest finite value."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    xs = _batches(8, 6)
    legal = [torch.rand(8, 5) > 0.3 for _ in range(4)]
    for m in legal:
        m[:, 0] = True
    teacher = [F.softmax(torch.randn(8, 5).masked_fill(~m, float("-inf")), -1) for m in legal]
    fill = torch.finfo(torch.float32).min if lowest else float("-inf")

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        log_q = F.log_softmax(logits.masked_fill(~legal[step], fill), -1)
        return F.kl_div(log_q, teacher[step], reduction="batchmean")  # producer: masked kl
    return _loop(student, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- smooth_l1 over the positives of a batch without any
class AnchorHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cls, self.box = nn.Linear(6, 16), nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.body(x))
        return self.cls(h).squeeze(-1), self.box(h)


def _no_positives(normalised: bool) -> Scenario:
    """Anchor classification plus box regression over the positive anchors only; the batch of step 2 is of
    background crops (no positive anchor): ``smooth_l1_loss`` of empty tensors with mean reduction is 0 / 0. The
    twin sums and divides by ``max(1, num_positives)`` as detectron2 does."""
    torch.manual_seed(0)
    model = AnchorHead()
    xs, boxes = _batches(12, 6), _batches(12, 4)
    positive = [torch.rand(12) > 0.6 for _ in range(4)]
    positive[2][:] = False

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        logits, box = out
        pos = positive[step]
        cls = F.binary_cross_entropy_with_logits(logits, pos.float())
        if normalised:
            reg = F.smooth_l1_loss(box[pos], boxes[step][pos], reduction="sum") / max(1, int(pos.sum()))
        else:
            reg = F.smooth_l1_loss(box[pos], boxes[step][pos])  # producer: positives mean
        return cls + reg
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- left padding under a causal mask
class CausalBlock(nn.Module):
    """``nn.MultiheadAttention`` with a causal ``attn_mask`` and a ``key_padding_mask``: with left padding the first
    query of a padded sequence may see only keys that are padding (each mask alone leaves it one key)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(12, 8), nn.MultiheadAttention(8, 2, batch_first=True), \
            nn.Linear(8, 12)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        n = tokens.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        out, _ = self.attn(h, h, h, attn_mask=causal, key_padding_mask=padding)  # producer: causal padded attention
        return self.head(h + out)


def _left_padding(left: bool) -> Scenario:
    """A decoder trained on a batch padded to the left (as for generation) at step 1: the padded sample's first
    query is masked from every key, softmax of a row of -inf. The twin pads on the right."""
    torch.manual_seed(0)
    model = CausalBlock()
    tokens = [torch.randint(1, 12, (3, 6)) for _ in range(4)]
    paddings = [torch.zeros(3, 6, dtype=torch.bool) for _ in range(4)]
    paddings[1][2, :2] = True
    if not left:
        paddings[1][2] = paddings[1][2].flip(0)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        keep = ~paddings[step][:, 1:]
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[step][:, 1:].flatten(), reduction="none")
        return (ce * keep.flatten()).sum() / keep.sum()
    return _loop(model, lambda step: (tokens[step], paddings[step]), loss_fn)


# ---------------------------------------------------------------- label smoothing over a batch of padding only
def _smoothed_all_ignored(skip: bool) -> Scenario:
    """A tagger's cross-entropy with ``label_smoothing=0.1`` and ``ignore_index=-100``; the bucketing sampler's batch
    of step 2 holds only padding: the smoothing term is divided by a count of 0 (without smoothing torch's
    nll_loss is NaN there too). The twin skips a batch with no label."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Tanh(), nn.Linear(8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = [torch.randint(0, 10, (3, 4)) for _ in range(4)]
    tags = [torch.randint(0, 5, (3, 4)) for _ in range(4)]
    tags[2][:] = -100

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if skip and bool((tags[step] == -100).all()):
                continue
            logits = model(tokens[step])
            loss = F.cross_entropy(logits.flatten(0, 1), tags[step].flatten(), label_smoothing=0.1)  # producer: smooth
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- entropy by xlogy: a safe forward, a NaN backward
def _xlogy_entropy(log_softmax: bool) -> Scenario:
    """A policy's entropy bonus written ``-xlogy(p, p).sum(-1)`` because xlogy is 0 at p = 0 (``p * log p`` is NaN
    there); but the derivative of ``xlogy(x, y)`` in y is ``x / y``: 0 / 0 where the softmax underflowed to exactly 0
    (a logit 110 below the others at step 1). The twin computes ``p * log_softmax``."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        policy[2].bias.copy_(torch.tensor([0.0, 0.0, 0.0, -110.0]))
    xs = _batches(8, 6)
    advantages = [torch.randn(8) for _ in range(4)]
    actions = [torch.randint(0, 3, (8,)) for _ in range(4)]

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        log_p = F.log_softmax(logits, -1)
        p = log_p.exp()
        entropy = -(p * log_p).sum(-1) if log_softmax else -torch.special.xlogy(p, p).sum(-1)  # producer: xlogy
        pg = -(advantages[step] * log_p.gather(1, actions[step][:, None]).squeeze(1))
        return (pg - 0.01 * entropy).mean()
    return _loop(policy, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- gradients rescaled to a running norm, a loss of 0
def _running_rescale(eps: float) -> Scenario:
    """Gradients rescaled to a running average of their norm, ``g * running / norm`` (normalised gradient descent
    against spikes, the average kept in a plain tensor); the batch of step 2 holds only masked tokens, the loss
    ``sum / n.clamp(min=1)`` is exactly 0 and so is every gradient: ``running / 0`` is inf and the gradients ``0
    * inf``, NaN, before the optimizer step. The twin adds eps to the norm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, labels = _batches(6, 6), [torch.randint(0, 4, (6,)) for _ in range(4)]
    masks = [torch.rand(6) > 0.3 for _ in range(4)]
    masks[2][:] = False
    running = torch.ones(())

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            ce = F.cross_entropy(model(xs[step]), labels[step], reduction="none")
            loss = (ce * masks[step]).sum() / masks[step].sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                grads = [p.grad for p in model.parameters()]
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                running.mul_(0.9).add_(0.1 * norm)
                scale = running / (norm + eps)  # producer: running rescale
                for g in grads:
                    g.mul_(scale)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("hunt24_group_norm_eps0_one_element_a_group", lambda: _group_norm(0.0),
         Expect("forward", "norm", "GroupNorm", step=0, op="aten.native_group_norm.default", marker="group norm",
                cause="division-by-zero")),
    Case("hunt24_group_norm_eps_healthy", lambda: _group_norm(1e-5), None),
    Case("hunt24_depth_from_a_disparity_of_0_in_getitem", lambda: _disparity(False),
         Expect("data", "", "DepthRefiner", step=2, op="aten.reciprocal.default", marker="depth from disparity",
                cause="division-by-zero")),
    Case("hunt24_depth_from_disparity_masked_healthy", lambda: _disparity(True), None),
    Case("hunt24_barlow_batch_std_of_a_dead_dimension", lambda: _barlow(False),
         Expect("forward", "", "Projector", step=0, op="aten.div.Tensor", marker="batch standardise",
                cause="division-by-zero")),
    Case("hunt24_barlow_batch_norm_healthy", lambda: _barlow(True), None),
    Case("hunt24_kl_div_of_an_action_masked_student", lambda: _masked_kl(False),
         Expect("forward", None, step=0, op="aten.mul.Tensor", marker="masked kl",
                says=tuple((mode, "inputs      finite, but for a deliberate infinity (a mask's, below)")
                           for mode in ("default", "defer", "full", "ops")))),
    Case("hunt24_kl_div_masked_lowest_finite_healthy", lambda: _masked_kl(True), None),
    Case("hunt24_smooth_l1_mean_over_no_positive_anchor", lambda: _no_positives(False),
         Expect("forward", None, step=2, op="aten.smooth_l1_loss.default", marker="positives mean",
                cause="empty-reduction")),
    Case("hunt24_smooth_l1_sum_over_max_1_positives_healthy", lambda: _no_positives(True), None),
    Case("hunt24_causal_mask_with_left_padding_first_query_sees_no_key", lambda: _left_padding(True),
         Expect("forward", "attn", "MultiheadAttention", step=1, op="aten._softmax.default",
                marker="causal padded attention", cause="masked-softmax")),
    Case("hunt24_causal_mask_with_right_padding_healthy", lambda: _left_padding(False), None),
    Case("hunt24_label_smoothing_over_a_batch_of_padding_only", lambda: _smoothed_all_ignored(False),
         Expect("forward", None, step=2, op="aten.nll_loss_forward.default", marker="smooth",
                cause="empty-reduction")),
    Case("hunt24_label_smoothing_batch_without_labels_skipped_healthy", lambda: _smoothed_all_ignored(True), None),
    Case("hunt24b_entropy_by_xlogy_backward_at_a_probability_of_0", lambda: _xlogy_entropy(False),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="xlogy", cause="log-domain")),
    Case("hunt24b_entropy_by_log_softmax_healthy", lambda: _xlogy_entropy(True), None),
    Case("hunt24b_gradients_rescaled_to_a_running_norm_over_a_zero_gradient", lambda: _running_rescale(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="running rescale",
                tensor=TensorRef.gradient("0.weight"), cause="division-by-zero")),
    Case("hunt24b_gradients_rescaled_to_a_running_norm_eps_healthy", lambda: _running_rescale(1e-6), None),
]
