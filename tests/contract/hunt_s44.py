"""hunt_s44, incidents checked for op, line, phase and step in every mode, immediate and deferred.

Patch-based vision code: a decoder that blends its patches back by overlap-add (``F.fold``) and divides by each
pixel's coverage, fed at step 2 a multi-scale batch whose size leaves a border no patch covers (``0 / 0``); a
sub-pixel (``PixelShuffle``) super-resolution net trained with a masked Charbonnier loss written without its eps
(``sqrt(0)``'s backward at the letterbox's masked pixels); a normalised cross-correlation loss over ``F.unfold``
windows without eps (a flat patch: ``0 / 0``). Layers: ``LayerNorm(eps=0)`` after an embedding's ``padding_idx``
row (the all-zero row's variance is 0). Policies: ``Categorical(logits=...)`` of a state with no legal action.
Optimizers: ``RMSprop(centered=True, eps=0)`` over a row no sample uses. Structure: a graph network given a batch
object of its own class (``model(data)``, as graph libraries' ``Data``), whose features hold a NaN (the watch read no
tensor of such an object: the root's own code was named the producer, phase forward) or whose graph leaves a node no
edge reaches (a mean aggregation's ``0 / 0``); the same object holding an attention bias with ``-inf`` (benign); a
model returning an object of its own class; a layer that normalises the gradient flowing back by a tensor hook; a
task head appended to a ``ModuleList`` mid-run. Each with a healthy twin: the same code
with an eps, a guard, or healthy data; and idioms that must stay silent: ``F.cosine_embedding_loss`` of a zero
vector (its own eps), a validation metric under ``no_grad`` that divides by a count of 0 after the step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop

LOSS_CODE_OPS = ("default", "defer", "ops")


# ---------------------------------------------------------------- overlap-add by F.fold, a border no patch covers
class PatchBlend(nn.Module):
    """Transforms each 3x3 patch (stride 2) and blends them back by overlap-add, averaging where patches overlap:
    the sum of the patches over the number of patches that covered each pixel."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor
        self.patch = nn.Linear(2 * 9, 2 * 9)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        size = h.shape[-2:]
        cols = self.patch(F.unfold(h, 3, stride=2).transpose(1, 2)).transpose(1, 2)
        summed = F.fold(cols, size, 3, stride=2)
        cover = F.fold(F.unfold(torch.ones_like(h), 3, stride=2), size, 3, stride=2)
        return summed / cover.clamp_min(self.floor)  # producer: overlap-add average


class PatchNet(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.stem, self.blend, self.head = nn.Conv2d(1, 2, 1), PatchBlend(floor), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blend(self.stem(x)).mean((2, 3)))


def _fold(floor: float) -> Scenario:
    """Multi-scale training: 7x7 crops (3 patches a side cover them), then at step 2 an 8x8 crop, whose last row
    and column no patch covers: ``0 / 0``. Twin: the coverage clamped to 1 (the border is 0)."""
    torch.manual_seed(0)
    model = PatchNet(floor)
    xs = [torch.randn(2, 1, 8 if step == 2 else 7, 8 if step == 2 else 7) for step in range(4)]
    ys = _batches(2, 1)
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- PixelShuffle SR, a masked Charbonnier loss
def _charbonnier(eps: float) -> Scenario:
    """ESPCN-style x2 super-resolution; the loss is Charbonnier's ``sqrt(d ** 2 + eps)`` over the difference masked
    to the frame (letterboxed frames: a black border the mask zeroes). Without eps, the masked pixels' ``sqrt(0)``
    has an infinite derivative: ``0 * inf`` in the backward. Twin: eps 1e-6."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, padding=1),
                          nn.PixelShuffle(2))
    lows, highs = [torch.rand(2, 1, 4, 4) for _ in range(4)], [torch.rand(2, 1, 8, 8) for _ in range(4)]
    frame = torch.ones(2, 1, 8, 8)
    frame[..., :1, :] = 0.0

    def loss_fn(sr: torch.Tensor, step: int) -> torch.Tensor:
        diff = (sr - highs[step]) * frame
        return torch.sqrt(diff ** 2 + eps).mean()  # producer: charbonnier

    return sgd_loop(model, lambda step: (lows[step],), loss_fn)


# ---------------------------------------------------------------- normalised cross-correlation over unfold windows
def _ncc(eps: float) -> Scenario:
    """An image-registration loss: local normalised cross-correlation of the warped and fixed images over 3x3
    windows (``F.unfold``). At step 1 the fixed image has a flat (saturated) region: a window's variance is 0,
    ``0 / sqrt(0)``. Twin: eps 1e-5 (as VoxelMorph writes it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 1, 3, padding=1))
    moving, fixed = [torch.rand(2, 1, 6, 6) for _ in range(4)], [torch.rand(2, 1, 6, 6) for _ in range(4)]
    fixed[1][0, 0, :3, :3] = 1.0

    def loss_fn(warped: torch.Tensor, step: int) -> torch.Tensor:
        a, b = F.unfold(warped, 3), F.unfold(fixed[step], 3)
        a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
        cross = (a * b).sum(1)
        ncc = cross / torch.sqrt((a * a).sum(1) * (b * b).sum(1) + eps)  # producer: ncc
        return -ncc.mean()

    return sgd_loop(model, lambda step: (moving[step],), loss_fn)


# ---------------------------------------------------------------- LayerNorm(eps=0) over the padding row
class PaddedEncoder(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(6, 4, padding_idx=0), nn.LayerNorm(4, eps=eps), nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids))).mean(1)


def _layer_norm(eps: float) -> Scenario:
    """Token ids with no padding, until step 2's batch is padded: the padding row of the embedding is all zeros, its
    variance is 0 and ``LayerNorm(eps=0)`` normalises it by ``rsqrt(0)``: ``0 * inf``. Twin: eps 1e-5."""
    torch.manual_seed(0)
    model = PaddedEncoder(eps)
    ids = [torch.randint(1, 6, (3, 5)) for _ in range(4)]
    ids[2][1, 3:] = 0
    ys = _batches(3, 1)
    return sgd_loop(model, lambda step: (ids[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a policy over the legal actions, none legal
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.logits = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 5)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.logits(self.body(obs))


def _policy(stuck: bool, validate: bool) -> Scenario:
    """REINFORCE over ``Categorical(logits=logits.masked_fill(~legal, -inf))``; at step 2 one state (a terminal
    one the buffer kept) has no legal action: its normalised logits are ``-inf - (-inf)``. Twin: a no-op action that
    is always legal."""
    torch.manual_seed(0)
    model = Policy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    obs = _batches(4, 4)
    legal = [torch.rand(4, 5) > 0.4 for _ in range(4)]
    for mask in legal:
        mask[:, 0] = True
    if stuck:
        legal[2][3] = False
    actions = [torch.zeros(4, dtype=torch.long) for _ in range(4)]
    returns = _batches(4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = model(obs[step]).masked_fill(~legal[step], float("-inf"))
            dist = torch.distributions.Categorical(logits=logits, validate_args=validate)  # producer: policy
            loss = -(dist.log_prob(actions[step]) * returns[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- centered RMSprop, eps=0, a row no sample uses
def _centered_rmsprop(eps: float) -> Scenario:
    """``RMSprop(centered=True, eps=0)`` over an embedding whose row 5 no batch uses: its gradient is 0, its square
    average and its mean 0, and the update ``0 / sqrt(0 - 0)`` at the first step. Twin: eps 1e-8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 1))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=eps, centered=True)
    ids = [torch.randint(0, 5, (5,)) for _ in range(3)]
    ys = _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(ids[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: centered rmsprop step
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- silent: cosine_embedding_loss of a zero vector
def _cosine_embedding() -> Scenario:
    """A siamese pair loss, ``F.cosine_embedding_loss``; at step 1 an image is blank and the embedding (no bias) of
    it is exactly 0. Torch's loss adds its own eps under the norms: the loss and gradients stay finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    lefts, rights = _batches(4, 4), _batches(4, 4)
    lefts[1][2] = 0.0
    same_pair = [torch.tensor([1.0, -1.0, 1.0, -1.0]) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cosine_embedding_loss(model(lefts[step]), model(rights[step]), same_pair[step], margin=0.2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- silent: a metric of an empty class under no_grad
def _metric() -> Scenario:
    """After each step, the recall of class 2 on a validation batch, under ``no_grad`` with the model in eval mode:
    ``hits / positives``; the step 1 batch has no sample of class 2, its recall is ``0 / 0``, a NaN the loop logs.
    No model, loss or gradient sees it: the watch stays silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]
    vals, val_ys = _batches(6, 4), [torch.tensor([0, 1, 2, 0, 1, 2]) for _ in range(4)]
    val_ys[1] = torch.tensor([0, 1, 0, 1, 0, 1])

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(4):
            model.train()
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                pred = model(vals[step]).argmax(-1)
                positives = (val_ys[step] == 2)
                recall = (pred[positives] == 2).float().sum() / positives.float().sum()
            logged.append(torch.stack([loss.detach(), recall]))
        return logged

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a graph batch object of the user's class
class Graph:
    """A graph library's batch: node features, edges and each node's graph, as attributes of a plain object."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> None:
        self.x, self.edge_index, self.batch = x, edge_index, batch


@dataclasses.dataclass
class GraphFields:
    """The same batch as a dataclass."""

    x: torch.Tensor
    edge_index: torch.Tensor
    batch: torch.Tensor


class MeanConv(nn.Module):
    """Message passing with a mean over each node's incoming messages (a sum divided by the in-degree)."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor, self.lin = floor, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        summed = torch.zeros_like(x).index_add(0, dst, self.lin(x)[src])
        degree = torch.zeros(x.shape[0]).index_add(0, dst, torch.ones(dst.shape[0]))
        return summed / degree.clamp_min(self.floor)[:, None]  # producer: mean aggregation


class GraphNet(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.conv1, self.conv2, self.head = MeanConv(floor), MeanConv(floor), nn.Linear(4, 1)

    def forward(self, data: Graph | GraphFields) -> torch.Tensor:
        h = self.conv1(data.x, data.edge_index).relu()
        h = self.conv2(h, data.edge_index)
        return self.head(torch.zeros(2, 4).index_add(0, data.batch, h))


def _graph(floor: float, isolated: bool, nan_feature: bool, batch_type: type = Graph) -> Scenario:
    """Two graphs of 3 nodes a batch. At step 2: the edges leave node 3 with no incoming edge (its mean is
    ``0 / 0``), or node 3's feature 1 is NaN (a missing value in the dataset). Twin: the degree clamped to 1."""
    torch.manual_seed(0)
    model = GraphNet(floor)
    graphs = []
    for step in range(4):
        x = torch.randn(6, 4)
        edges = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 4], [1, 2, 0, 4, 5, 3, 0, 3]])
        if isolated and step == 2:
            edges = torch.tensor([[0, 1, 2, 3, 4, 1], [1, 2, 0, 4, 5, 0]])
        if nan_feature and step == 2:
            x[3, 1] = float("nan")
        graphs.append(batch_type(x, edges, torch.tensor([0, 0, 0, 1, 1, 1])))
    ys = _batches(2, 1)
    return sgd_loop(model, lambda step: (graphs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a batch object holding an attention bias
class SequenceBatch:
    def __init__(self, x: torch.Tensor, bias: torch.Tensor) -> None:
        self.x, self.bias = x, bias


class BiasedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk, self.head = nn.Linear(4, 8), nn.Linear(4, 1)

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        q, k = self.qk(batch.x).chunk(2, -1)
        weights = (q @ k.transpose(1, 2) + batch.bias[:, None, :]).softmax(-1)  # producer: biased softmax
        return self.head((weights @ batch.x).mean(1))


def _biased(fully_masked: bool) -> Scenario:
    """The batch object holds a padding bias (``-inf`` past each sequence's length), a deliberate infinity; at step
    2 one sequence is all padding: softmax of a row of ``-inf``. Twin: every sequence has a token."""
    torch.manual_seed(0)
    model = BiasedAttention()
    batches = []
    for step in range(4):
        bias = torch.zeros(2, 5)
        bias[1, 3:] = float("-inf")
        if fully_masked and step == 2:
            bias[0, :] = float("-inf")
        batches.append(SequenceBatch(torch.randn(2, 5, 4), bias))
    ys = _batches(2, 1)
    return sgd_loop(model, lambda step: (batches[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a model returning an object of its own class
class Scores:
    def __init__(self, logits: torch.Tensor, aux: torch.Tensor) -> None:
        self.logits, self.aux = logits, aux


class CosineScorer(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc, self.aux = eps, nn.Linear(4, 3), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> Scores:
        h = self.fc(x)
        return Scores(h / (h.norm(dim=-1, keepdim=True) + self.eps), self.aux(x))  # producer: scores object


def _scores(eps: float) -> Scenario:
    """The scorer's bias is 0 and step 2's batch holds a blank sample: its row's norm is 0, ``0 / 0``. Twin: eps."""
    torch.manual_seed(0)
    model = CosineScorer(eps)
    with torch.no_grad():
        model.fc.bias.zero_()
    xs = _batches(3, 4)
    xs[2][1] = 0.0
    ys = [torch.randint(0, 3, (3,)) for _ in range(4)]
    return sgd_loop(model, lambda step: (xs[step],),
                    lambda out, step: F.cross_entropy(out.logits, ys[step]) + out.aux.mean(), lr=0.0)


# ---------------------------------------------------------------- a tensor hook normalising the gradient
class GradientNormalised(nn.Module):
    """A linear layer whose output's gradient is rescaled to unit norm on its way back (a hook ``forward``
    registers on its output)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc = eps, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.requires_grad:
            h.register_hook(lambda g: g / (g.norm() + self.eps))  # producer: gradient hook
        return h


def _gradient_hook(eps: float) -> Scenario:
    """A per-sample weighted loss; at step 2 every sample of the batch has weight 0: the gradient into the hooked
    output is exactly 0 and the hook divides it by its norm, ``0 / 0``. Twin: eps."""
    torch.manual_seed(0)
    model = nn.Sequential(GradientNormalised(eps), nn.ReLU(), nn.Linear(4, 1))
    xs, ys = _batches(3, 4), _batches(3, 1)
    weights = [torch.ones(3, 1) for _ in range(4)]
    weights[2][:] = 0.0
    return sgd_loop(model, lambda step: (xs[step],),
                    lambda out, step: (weights[step] * (out - ys[step]) ** 2).mean())


# ---------------------------------------------------------------- a head appended mid-run (continual learning)
class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4, bias=False)
        self.heads = nn.ModuleList([nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.body(x))


class CosineHead(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc = eps, nn.Linear(4, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h / (h.norm(dim=-1, keepdim=True) + self.eps))  # producer: appended head


def _appended_head(eps: float) -> Scenario:
    """Task 1's head is appended to ``heads`` at step 2 (and to the optimizer by ``add_param_group``); step 3's
    batch holds a blank sample, which the body (no bias) maps to 0: the new head's ``0 / 0``. Twin: eps."""
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(3, 4, steps=5), _batches(3, 2, steps=5)
    xs[3][0] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            if step == 2:
                model.heads.append(CosineHead(eps))
                opt.add_param_group({"params": model.heads[1].parameters()})
            loss = F.mse_loss(model(xs[step], 0 if step < 2 else 1), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s44_fold_overlap_add_uncovered_border_0_over_0", lambda: _fold(0.0),
         Expect("forward", "blend", "PatchBlend", step=2, op="aten.div.Tensor", marker="overlap-add average")),
    Case("hunt_s44_fold_overlap_add_clamped_cover_healthy", lambda: _fold(1.0), None),
    Case("hunt_s44_pixel_shuffle_masked_charbonnier_without_eps", lambda: _charbonnier(0.0),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="charbonnier", op_modes=LOSS_CODE_OPS)),
    Case("hunt_s44_pixel_shuffle_masked_charbonnier_healthy", lambda: _charbonnier(1e-6), None),
    Case("hunt_s44_unfold_ncc_loss_flat_window", lambda: _ncc(0.0),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="ncc", op_modes=LOSS_CODE_OPS)),
    Case("hunt_s44_unfold_ncc_loss_with_eps_healthy", lambda: _ncc(1e-5), None),
    Case("hunt_s44_layer_norm_eps_0_over_the_padding_row", lambda: _layer_norm(0.0),
         Expect("forward", "norm", "LayerNorm", step=2, op="aten.native_layer_norm.default")),
    Case("hunt_s44_layer_norm_padding_row_healthy", lambda: _layer_norm(1e-5), None),
    Case("hunt_s44_categorical_no_legal_action", lambda: _policy(True, False),
         Expect("forward", None, step=2, op="aten.logsumexp.default", marker="policy", op_modes=LOSS_CODE_OPS,
                cause="masked-softmax")),
    Case("hunt_s44_categorical_no_legal_action_validated", lambda: _policy(True, True),
         Expect("forward", None, step=2, op="aten.logsumexp.default", marker="policy", op_modes=LOSS_CODE_OPS,
                cause="masked-softmax")),
    Case("hunt_s44_categorical_noop_always_legal_healthy", lambda: _policy(False, True), None),
    Case("hunt_s44_centered_rmsprop_eps_0_unused_row", lambda: _centered_rmsprop(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="centered rmsprop step")),
    Case("hunt_s44_centered_rmsprop_unused_row_healthy", lambda: _centered_rmsprop(1e-8), None),
    Case("hunt_s44_cosine_embedding_loss_of_a_zero_vector_healthy", _cosine_embedding, None),
    Case("hunt_s44_no_grad_recall_of_an_absent_class_healthy", _metric, None),
    Case("hunt_s44_graph_object_batch_nan_feature_is_data", lambda: _graph(1.0, False, True),
         Expect("data", "", "GraphNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data",
                says=(("default", "skip-batch cannot leave out"), ("defer", "skip-batch cannot leave out")))),
    Case("hunt_s44_graph_dataclass_batch_nan_feature_is_data", lambda: _graph(1.0, False, True, GraphFields),
         Expect("data", "", "GraphNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s44_graph_object_batch_isolated_node_mean_0_over_0", lambda: _graph(0.0, True, False),
         Expect("forward", "conv1", "MeanConv", step=2, op="aten.div.Tensor", marker="mean aggregation")),
    Case("hunt_s44_graph_object_batch_isolated_node_clamped_healthy", lambda: _graph(1.0, True, False), None),
    Case("hunt_s44_object_batch_padding_bias_healthy", lambda: _biased(False), None),
    Case("hunt_s44_object_batch_padding_bias_fully_masked_row", lambda: _biased(True),
         Expect("forward", "", "BiasedAttention", step=2, op="aten._softmax.default", marker="biased softmax",
                cause="masked-softmax")),
    Case("hunt_s44_model_returns_an_object_of_its_class", lambda: _scores(0.0),
         Expect("forward", "", "CosineScorer", step=2, op="aten.div.Tensor", marker="scores object")),
    Case("hunt_s44_model_returns_an_object_of_its_class_healthy", lambda: _scores(1e-6), None),
    Case("hunt_s44_gradient_hook_normalises_a_zero_gradient", lambda: _gradient_hook(0.0),
         Expect("backward", "0", "GradientNormalised", step=2, op="aten.div.Tensor", marker="gradient hook")),
    Case("hunt_s44_gradient_hook_with_eps_healthy", lambda: _gradient_hook(1e-6), None),
    Case("hunt_s44_head_appended_mid_run_0_over_0", lambda: _appended_head(0.0),
         Expect("forward", "heads.1", "CosineHead", step=3, op="aten.div.Tensor", marker="appended head")),
    Case("hunt_s44_head_appended_mid_run_healthy", lambda: _appended_head(1e-6), None),
]
