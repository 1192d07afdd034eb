"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt20).

Optimizers as a GPU user runs them (``foreach=True``, the CUDA default): Adagrad and Adamax with ``eps=0`` over an
embedding row never used (0 / 0 in the update); an inverse-square-root schedule by ``LambdaLR`` that is inf at step
0; a run resumed from a checkpoint whose Adam, SGD-momentum or Adagrad state, or whose parameter, already holds a
NaN (the state is named, phase data: hot/checks/optimizer/step_reports.py).
Loss code: a Pearson correlation loss over a batch of constant targets; an approximate NDCG of a query without a
relevant document (ideal DCG 0); the IoU of a degenerate predicted box and a point annotation; CIoU's aspect term
``atan(w / h)`` of a zero-height box (the atan absorbs the inf in the forward; the division's backward is 0 / 0);
``pos_weight`` computed from a batch without positives; ORPO's log-odds ``log1p(-exp(logp))`` of a sequence the
policy is certain of (forward absorbed, backward 0 / 0); a physics-informed residual ``u_r / r`` at the origin,
its derivatives by ``autograd.grad(create_graph=True)``; multi-task balancing by a running magnitude debiased at
step 0; a Lorentz-model distance ``acosh(-<x, y>)`` of a node to itself, its argument rounded below 1.
Model code: ArcFace's ``acos`` of a cosine rounded past 1; Glow's invertible 1x1 convolution by ``torch.logdet`` of a
rotation whose determinant is -1 (its cause: strict xfail); a closed-form ridge head by ``linalg.inv_ex`` of a
singular Gram matrix.
Shapes of outputs and wrappers: a producer in a module returning a NamedTuple, a list of feature maps, a tensor and
None, an HF-style ``ModelOutput`` with the loss computed in a keyword-only forward; a model wrapped in
``nn.DataParallel`` (its ``module.`` prefix is not the user's); a colour jitter in the data code whose hue divides
by the chroma of a grey pixel. The loops' own shapes: tests/contract/hunt20_runs.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef, TensorRole


# ---------------------------------------------------------------- Adagrad / Adamax with eps=0 over a dead row
def _eps_zero_optimizer(kind: str, eps: float) -> Scenario:
    """Adagrad (foreach, the CUDA default) or Adamax with eps=0, as papers write them; rows 4 and 5 of the
    embedding are never looked up: their gradient is 0, their accumulated statistic 0, the update 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 1))
    if kind == "adagrad":
        opt: torch.optim.Optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, eps=eps, foreach=True)
    else:
        opt = torch.optim.Adamax(model.parameters(), lr=0.01, eps=eps)
    tokens, ys = torch.tensor([0, 1, 2, 3]), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(tokens), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: eps zero step
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an inverse-sqrt schedule at step 0
def _inverse_sqrt_schedule(shifted: bool) -> Scenario:
    """``LambdaLR(lambda s: rsqrt(s))`` (the Transformer schedule without its warm-up), computed with tensors: at
    step 0 the factor is inf, so Adam (foreach) steps with lr = inf. The twin counts from 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    offset = 1.0 if shifted else 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(torch.rsqrt(torch.tensor(s + offset))))
    xs, ys = _batches(8, 4), _batches(8, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: inverse sqrt step
            scheduler.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a run resumed from a checkpoint holding a NaN
def _resumed(where: str, optimizer: str = "adam") -> Scenario:
    """A run resumed by ``load_state_dict`` from a checkpoint saved after its last finite loss: the optimizer's
    state of ``0.weight`` (where='state': Adam's ``exp_avg_sq``, SGD's ``momentum_buffer``, Adagrad's ``sum``) or
    the parameter ``2.weight`` itself (where='param') already holds a NaN (the diverged step was saved).
    where='none' is the clean checkpoint."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt: torch.optim.Optimizer = {
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=1e-3),
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(model.parameters(), lr=1e-2),
    }[optimizer]()
    xs, ys = _batches(8, 4), _batches(8, 1)
    F.mse_loss(model(xs[0]), ys[0]).backward()
    opt.step()
    opt.zero_grad()
    model_state, opt_state = model.state_dict(), opt.state_dict()
    if where == "state":
        key = {"adam": "exp_avg_sq", "sgd": "momentum_buffer", "adagrad": "sum"}[optimizer]
        opt_state["state"][0][key][1, 2] = float("nan")
    if where == "param":
        model_state["2.weight"][0, 3] = float("nan")
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(xs[step + 1]), ys[step + 1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a Pearson correlation loss of constant targets
def _pearson(eps: float) -> Scenario:
    """A correlation loss ``1 - r`` (rank-IC in return forecasting); at step 2 every target of the batch is the
    same (a day the market was closed, returns 0): the target's norm is 0, r = 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    xs, ys = _batches(8, 4), _batches(8)
    ys[2] = torch.zeros(8)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        pred, target = out.squeeze(1) - out.mean(), ys[step] - ys[step].mean()
        r = (pred * target).sum() / (pred.norm() * target.norm() + eps)  # producer: pearson
        return 1 - r
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- approximate NDCG of a query with no relevant doc
def _approx_ndcg(clamped: bool) -> Scenario:
    """ApproxNDCG (ranks by a sigmoid of pairwise score differences) over one query of 6 documents per step; the
    query of step 2 has no relevant document: its DCG and its ideal DCG are both 0. allRank masks such queries."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    docs = _batches(6, 5)
    relevance = [torch.randint(0, 3, (6,)).float() for _ in range(4)]
    relevance[2] = torch.zeros(6)
    discount = 1 / torch.log2(torch.arange(6) + 2.0)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        scores, gains = out.squeeze(1), 2 ** relevance[step] - 1
        ranks = 1 + torch.sigmoid((scores[None, :] - scores[:, None]) / 0.1).sum(1) - 0.5
        dcg = (gains / torch.log2(1 + ranks)).sum()
        ideal = (gains.sort(descending=True).values * discount).sum()
        if clamped:
            ideal = ideal.clamp(min=1e-10)
        return 1 - dcg / ideal  # producer: ndcg
    return _loop(model, lambda step: (docs[step],), loss_fn)


# ---------------------------------------------------------------- box losses over degenerate boxes
class BoxHead(nn.Module):
    """Predicts (cx, cy, w, h) with ReLU widths, as anchor-free heads do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return torch.cat([out[:, :2], F.relu(out[:, 2:])], 1)


def _box_loss(kind: str, eps: float) -> Scenario:
    """At step 2 the head's size outputs die (its bias is knocked far negative by the step before).
    kind='iou': 1 - IoU, with a point annotation (x1 == x2, y1 == y2) in the batch: a zero-area prediction and a
    zero-area target have a union of 0, IoU = 0 / 0. kind='ciou': only the height dies; CIoU's aspect term
    ``atan(w / h)`` is atan(inf) = pi/2 in the forward, and the division's backward is 0 / 0."""
    torch.manual_seed(0)
    model = BoxHead()
    with torch.no_grad():
        model.fc.bias[2:] = 3.0
    xs = _batches(4, 4)
    targets = [torch.tensor([[0.5, 0.5, 1.0, 2.0]] * 4) for _ in range(4)]
    if kind == "iou":
        targets[2][1] = torch.tensor([0.3, 0.3, 0.0, 0.0])

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.fc.bias[3] = -100.0
                if kind == "iou":
                    model.fc.bias[2] = -100.0
        return (xs[step],)

    def corners(b: torch.Tensor) -> torch.Tensor:
        return torch.cat([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)

    def loss_fn(pred: torch.Tensor, step: int) -> torch.Tensor:
        p, t = corners(pred), corners(targets[step])
        wh = (torch.min(p[:, 2:], t[:, 2:]) - torch.max(p[:, :2], t[:, :2])).clamp(min=0)
        inter = wh[:, 0] * wh[:, 1]
        union = pred[:, 2] * pred[:, 3] + targets[step][:, 2] * targets[step][:, 3] - inter
        if kind == "iou":
            iou = inter / (union + eps)  # producer: iou
            return (1 - iou).mean()
        iou = inter / union
        w, h = pred[:, 2], pred[:, 3]
        aspect = torch.atan(targets[step][:, 2] / targets[step][:, 3]) - torch.atan(w / (h + eps))  # producer: ciou
        v = 4 / math.pi ** 2 * aspect ** 2
        return (1 - iou + v).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- pos_weight from a batch without positives
def _pos_weight(clamped: bool) -> Scenario:
    """``pos_weight = negatives / positives`` of each batch for an imbalanced BCE; the batch of step 2 has no
    positive: pos_weight is inf, and BCE's ``1 + (pos_weight - 1) * y`` is inf * 0 over its negatives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    xs = _batches(8, 4)
    ys = [torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0], [0.0], [0.0], [0.0]]) for _ in range(4)]
    ys[2] = torch.zeros(8, 1)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        positives = (ys[step] == 1).sum()
        if clamped:
            positives = positives.clamp(min=1)
        pos_weight = (ys[step] == 0).sum() / positives  # producer: pos weight
        return F.binary_cross_entropy_with_logits(out, ys[step], pos_weight=pos_weight)
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- ORPO's log-odds of a certain sequence
def _orpo(clamped: bool) -> Scenario:
    """ORPO's odds ratio (as TRL writes it): ``log1p(-exp(logp))`` of each sequence's mean token log-probability.
    At step 2 the policy is certain of every chosen token (its margin passed float32's rounding): logp = 0,
    log1p(-1) = -inf, the log-odds +inf and logsigmoid of it 0: the forward is finite, log1p's backward 0 / 0."""
    torch.manual_seed(0)
    model = nn.Linear(5, 5)
    xs = _batches(2, 3, 5)
    chosen, rejected = torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.tensor([[1, 1, 1], [2, 2, 2]])

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.weight.copy_(200.0 * torch.eye(5))
                model.bias.zero_()
            return (F.one_hot(chosen, 5).float(),)
        return (xs[step],)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        logp = logits.log_softmax(-1)
        c = logp.gather(-1, chosen[..., None]).squeeze(-1).mean(-1)
        r = logp.gather(-1, rejected[..., None]).squeeze(-1).mean(-1)
        if clamped:
            c, r = c.clamp(max=-1e-6), r.clamp(max=-1e-6)
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))  # producer: orpo
        return -c.mean() - 0.1 * F.logsigmoid(log_odds).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- a PINN's polar Laplacian at the origin
def _pinn(guarded: bool) -> Scenario:
    """A physics-informed net for a radially symmetric Poisson equation, u_rr + u_r / r = f, its derivatives by
    ``autograd.grad(create_graph=True)``; at step 2 the boundary points join the collocation set, r = 0 among
    them, and u_r / 0 is inf. The twin divides by r where r > 0 and by 1 at the origin (its term set to u_rr)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = [torch.rand(8) * 0.9 + 0.1 for _ in range(4)]
    points[2][0] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            r = points[step].clone().requires_grad_()
            u = model(r[:, None]).squeeze(1)
            u_r = torch.autograd.grad(u.sum(), r, create_graph=True)[0]
            u_rr = torch.autograd.grad(u_r.sum(), r, create_graph=True)[0]
            if guarded:
                at_origin = r == 0
                radial = torch.where(at_origin, u_rr, u_r / torch.where(at_origin, torch.ones_like(r), r))
            else:
                radial = u_r / r  # producer: pinn
            loss = (u_rr + radial - 1.0).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- debiased running magnitudes, off by one
def _debiased_balance(skip_first: bool) -> Scenario:
    """Two task losses, each divided by the running mean of its magnitude over the previous steps, debiased as Adam
    does, ``ema / (1 - beta ** t)`` with t the updates so far; at step 0 there are none: 0 / (1 - 1) = 0 / 0. The
    twin divides by the step's own magnitude until the running mean has one update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 4), _batches(8, 2)
    ema, beta = torch.zeros(2), 0.9

    def run() -> list[torch.Tensor]:
        nonlocal ema
        losses = []
        for step in range(3):
            out = model(xs[step])
            task = torch.stack([F.mse_loss(out[:, 0], ys[step][:, 0]), F.l1_loss(out[:, 1], ys[step][:, 1])])
            if skip_first and step == 0:  # noqa: SIM108 (the producer's marker goes on the division's own line)
                scale = task.detach()
            else:
                scale = ema / (1 - beta ** step)  # producer: debiased
            loss = (task / scale).sum()
            ema = beta * ema + (1 - beta) * task.detach()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a Lorentz-model distance of a node to itself
class LorentzEmbedding(nn.Module):
    """Node embeddings on the hyperboloid: x = (sqrt(1 + |v|^2), v)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Embedding(6, 3)

    def forward(self, nodes: torch.Tensor) -> torch.Tensor:
        v = self.v(nodes)
        return torch.cat([torch.sqrt(1 + (v * v).sum(-1, keepdim=True)), v], -1)


def _lorentz(clamped: bool) -> Scenario:
    """The hyperbolic distance ``acosh(-<x, y>_L)`` of each edge; at step 2 the sampled edges include a self-loop:
    -<x, x>_L is 1 in exact arithmetic and rounds just below it, and acosh of it is NaN. HGCN clamps at 1 + eps."""
    torch.manual_seed(0)
    model = LorentzEmbedding()
    with torch.no_grad():
        model.v.weight.mul_(3.0)
    edges = [torch.randint(0, 6, (2, 5)) for _ in range(4)]
    for step in range(4):
        edges[step][1] = (edges[step][0] + 1 + edges[step][1] % 5) % 6
    edges[2][:, 3] = torch.tensor([1, 1])

    def run_loss(x: torch.Tensor, step: int) -> torch.Tensor:
        a, b = x[:5], x[5:]
        inner = -a[:, 0] * b[:, 0] + (a[:, 1:] * b[:, 1:]).sum(-1)
        if clamped:
            return torch.acosh((-inner).clamp(min=1 + 1e-5)).mean()
        return torch.acosh(-inner).mean()  # producer: lorentz
    return _loop(model, lambda step: (edges[step].flatten(),), run_loss)


# ---------------------------------------------------------------- ArcFace: acos of a cosine rounded past 1
class ArcFace(nn.Module):
    """An additive angular margin head: logits s * cos(theta + m) at the target class."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.clamped = clamped

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        if self.clamped:
            cosine = cosine.clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cosine)  # producer: arcface
        target = F.one_hot(labels, 4).bool()
        return 30.0 * torch.where(target, torch.cos(theta + 0.5), cosine)


def _arcface(clamped: bool) -> Scenario:
    """At step 2 a sample's embedding is its class's centre (the head initialised from class means sees the mean
    itself): the cosine of two normalised copies of this vector rounds to 1.0000002 (float32, CPU), and acos of it
    is NaN."""
    torch.manual_seed(0)
    model = ArcFace(clamped)
    xs, labels = _batches(4, 8), [torch.randint(0, 4, (4,)) for _ in range(4)]
    centre = torch.randn(8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.weight[2] = centre
    xs[2][1], labels[2][1] = centre, 2
    return _loop(model, lambda step: (xs[step], labels[step]), lambda out, step: F.cross_entropy(out, labels[step]),
                 lr=0.0)


# ---------------------------------------------------------------- Glow's 1x1 convolution by logdet of a reflection
class InvertibleConv(nn.Module):
    """Glow's invertible 1x1 convolution, its weight a random rotation from QR; the twin takes ``slogdet``."""

    def __init__(self, signed: bool) -> None:
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(4, 4))
        if torch.det(q) > 0:
            q[:, 0] = -q[:, 0]  # QR gave a reflection: det -1, as half the random draws do
        self.weight = nn.Parameter(q)
        self.signed = signed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = x @ self.weight.t()
        if self.signed:  # noqa: SIM108 (the producer's marker goes on the logdet's own line)
            logdet = torch.linalg.slogdet(self.weight)[1]
        else:
            logdet = torch.logdet(self.weight)  # producer: glow logdet
        return z, logdet.expand(x.shape[0])


def _glow(signed: bool) -> Scenario:
    """The flow's NLL: a standard normal prior on z and the log-determinant; logdet of a det -1 weight is NaN."""
    torch.manual_seed(0)
    model = InvertibleConv(signed)
    xs = _batches(8, 4)

    def nll(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        z, logdet = out
        return (0.5 * z.pow(2).sum(1) - logdet).mean()
    return _loop(model, lambda step: (xs[step],), nll)


# ---------------------------------------------------------------- a closed-form ridge head by inv_ex
class RidgeHead(nn.Module):
    """MetaOptNet/R2D2's closed-form head: W = (X^T X + lambda I)^-1 X^T Y over the support set, by
    ``linalg.inv_ex`` (no host sync on CUDA). With lambda = 0 and a ReLU feature dead over the whole support set the
    Gram matrix has a zero row: inv_ex returns NaN and inf, and no error."""

    def __init__(self, ridge: float) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.ridge = ridge

    def forward(self, support: torch.Tensor, labels: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        xs, xq = F.relu(self.encoder(support)), F.relu(self.encoder(query))
        gram = xs.t() @ xs + self.ridge * torch.eye(3)
        inverse = torch.linalg.inv_ex(gram).inverse  # producer: ridge inverse
        return xq @ (inverse @ xs.t() @ labels)


def _ridge(ridge: float) -> Scenario:
    """Episodes of 6 support samples; at step 2 the encoder's third unit is dead (its bias knocked negative)."""
    torch.manual_seed(0)
    model = RidgeHead(ridge)
    with torch.no_grad():
        model.encoder.bias.fill_(3.0)
    supports, queries, ys = _batches(6, 4), _batches(5, 4), _batches(5, 1)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        if step == 2:
            with torch.no_grad():
                model.encoder.bias[2] = -100.0
        return supports[step], torch.ones(6, 1), queries[step]
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- outputs of other shapes
class EncoderOutput(NamedTuple):
    hidden: torch.Tensor
    log_scale: torch.Tensor


class ScaleEncoder(nn.Module):
    """Returns a NamedTuple: the hidden state and the log of its per-sample scale."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> EncoderOutput:
        h = F.relu(self.fc(x))
        return EncoderOutput(h, torch.log(h.pow(2).mean(1) + self.eps))  # producer: namedtuple


class ScaleModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.encoder = ScaleEncoder(eps)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.encoder(x)
        return self.head(out.hidden) + 0.1 * out.log_scale[:, None]


def _namedtuple(eps: float) -> Scenario:
    """At step 2 a sample's ReLU features are all dead: log of a scale 0 is -inf, in the NamedTuple's 2nd field."""
    torch.manual_seed(0)
    model = ScaleModel(eps)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.encoder.fc.bias.fill_(-100.0)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


class Pyramid(nn.Module):
    """An FPN-like neck returning a list of three levels, each normalised by its own energy."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv1d(2, 2, 1) for _ in range(3))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        levels = []
        for i, conv in enumerate(self.lateral):
            f = F.relu(conv(F.avg_pool1d(x, 2 ** i)))
            levels.append(f / (f.pow(2).mean((1, 2), keepdim=True).sqrt() + self.eps))  # producer: pyramid
        return levels


class PyramidModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.neck = Pyramid(eps)
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.head(level.mean(2)) for level in self.neck(x))


def _pyramid(eps: float) -> Scenario:
    """At step 2 the third level's lateral conv is dead (bias far negative): its energy is 0, 0 / 0."""
    torch.manual_seed(0)
    model = PyramidModel(eps)
    with torch.no_grad():
        for conv in model.neck.lateral:
            conv.bias.fill_(3.0)
    xs, ys = _batches(3, 2, 8), _batches(3, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.neck.lateral[2].bias.fill_(-100.0)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


class Attention(nn.Module):
    """HF-style attention returning (output, None) when attention weights are not asked for; its scores are
    scaled by a learned per-head temperature read through a reciprocal."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.temperature = nn.Parameter(torch.ones(1))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / (self.temperature.abs() + self.eps)  # producer: tensor and none
        return scores.softmax(-1) @ v, None


class AttentionModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.attn = Attention(eps)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x)
        return self.head(h.mean(1))


def _tensor_and_none(eps: float) -> Scenario:
    """At step 2 the temperature is 0 (a decay pulled it there): the scores are +-inf, the softmax NaN."""
    torch.manual_seed(0)
    model = AttentionModel(eps)
    xs, ys = _batches(2, 3, 4), _batches(2, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.attn.temperature.zero_()
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


@dataclass
class TaggerOutput(OrderedDict):
    """Like transformers' ModelOutput: a dataclass that is an ordered dict, the loss first."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("loss", "logits"):
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)


class Tagger(nn.Module):
    """A token tagger computing its own loss in a keyword-only forward (``model(**batch)``), averaged by hand over
    the labelled tokens (-100 marks the unlabelled ones)."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.classifier = nn.Linear(6, 3)
        self.clamped = clamped

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor) -> TaggerOutput:
        logits = self.classifier(self.embed(input_ids))
        labelled = labels != -100
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
        count = labelled.sum()
        if self.clamped:
            count = count.clamp(min=1)
        loss = (ce * labelled.flatten()).sum() / count  # producer: model output loss
        return TaggerOutput(loss=loss, logits=logits)


def _model_output(clamped: bool) -> Scenario:
    """At step 2 every token of the batch is unlabelled (a packed batch of prompts only): 0 / 0."""
    torch.manual_seed(0)
    model = Tagger(clamped)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = [torch.randint(0, 10, (2, 5)) for _ in range(4)]
    labels = [torch.randint(0, 3, (2, 5)) for _ in range(4)]
    labels[2] = torch.full((2, 5), -100)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            outputs = model(input_ids=ids[step], labels=labels[step])
            opt.zero_grad()
            outputs.loss.backward()
            opt.step()
            losses.append(outputs.loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a model wrapped in nn.DataParallel
class LogFeatures(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.eps)  # producer: data parallel


def _data_parallel(eps: float) -> Scenario:
    """``nn.DataParallel(model)`` as multi-GPU notebooks wrap it (on CPU it calls the model directly); a ReLU's
    dead feature at step 2 reaches a log: the producer is ``2``, not ``module.2``."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), LogFeatures(eps), nn.Linear(4, 1))
    with torch.no_grad():
        inner[0].bias.fill_(5.0)
    model = nn.DataParallel(inner)
    xs, ys = _batches(4, 4), _batches(4, 1)
    xs[2][0] = -100.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- colour jitter in the data code: hue of grey
def _hue_jitter(eps: float) -> Scenario:
    """A hand-written RGB -> hue in the augmentation (a colour jitter's hue shift): the hue divides by the chroma
    ``max - min``, 0 on a grey pixel (a letterboxed border at step 2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 1))
    images = [torch.rand(2, 3, 4) for _ in range(4)]
    images[2][1, :, 0] = 0.5
    ys = _batches(2, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        _r, g, b = images[step].unbind(1)
        chroma = images[step].amax(1) - images[step].amin(1)
        hue = ((g - b) / (chroma + eps)) % 6  # producer: hue
        return (torch.stack([hue / 6, images[step].amax(1), chroma], 1),)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]))


#: (gaps22: the cause was nonfinite-number, 'find where it is set', before localize/ops/called.py.)
GLOW_CAUSE = (
    "torch.logdet is a composite: where(sign == -1, nan, logabsdet); the NaN is a scalar torch itself passes to "
    "aten.scalar_tensor. The function the user's line called (its call instruction at f_lasti, read at the origin: "
    "localize/ops/called.py) is logdet, so the number is torch's: the cause is log-domain (logdet-negative)")

OPT_STEP = "eps zero step"
#: What the report says of a state a bounded step found non-finite (hot/checks/optimizer/step_reports.py).
RESUMED_SAYS = tuple((mode, "held the value before the step") for mode in ("default", "defer", "full", "ops"))
CASES = [
    Case("hunt20_adagrad_foreach_eps_0_dead_embedding_row", lambda: _eps_zero_optimizer("adagrad", 0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten._foreach_addcdiv_.Scalar", marker=OPT_STEP,
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}))),
    Case("hunt20_adagrad_foreach_default_eps_healthy", lambda: _eps_zero_optimizer("adagrad", 1e-10), None),
    Case("hunt20_adamax_eps_0_dead_embedding_row", lambda: _eps_zero_optimizer("adamax", 0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker=OPT_STEP,
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}))),
    Case("hunt20_adamax_default_eps_healthy", lambda: _eps_zero_optimizer("adamax", 1e-8), None),
    Case("hunt20_inverse_sqrt_lambda_lr_inf_at_step_0", lambda: _inverse_sqrt_schedule(False),
         Expect("optimizer", "0", "Linear", step=0, op="aten._foreach_addcdiv_.ScalarList",
                marker="inverse sqrt step", tensor=TensorRef.parameter("0.weight"))),
    Case("hunt20_inverse_sqrt_lambda_lr_from_1_healthy", lambda: _inverse_sqrt_schedule(True), None),
    Case("hunt20_resumed_adam_state_holding_a_nan", lambda: _resumed("state"),
         Expect("data", "0", "Linear", step=0, op=None, kinds=frozenset({"nan"}), cause="parameter-already-nonfinite",
                tensor=TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", "exp_avg_sq"), says=RESUMED_SAYS)),
    Case("hunt20_resumed_sgd_momentum_buffer_holding_a_nan", lambda: _resumed("state", "sgd"),
         Expect("data", "0", "Linear", step=0, op=None, kinds=frozenset({"nan"}), cause="parameter-already-nonfinite",
                tensor=TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", "momentum_buffer"), says=RESUMED_SAYS)),
    Case("hunt20_resumed_adagrad_sum_holding_a_nan", lambda: _resumed("state", "adagrad"),
         Expect("data", "0", "Linear", step=0, op=None, kinds=frozenset({"nan"}), cause="parameter-already-nonfinite",
                tensor=TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", "sum"), says=RESUMED_SAYS)),
    Case("hunt20_resumed_parameter_holding_a_nan", lambda: _resumed("param"),
         Expect("forward", "2", "Linear", step=0, op=None, tensor=TensorRef.parameter("2.weight"),
                cause="parameter-already-nonfinite")),
    Case("hunt20_resumed_clean_checkpoint_healthy", lambda: _resumed("none"), None),
    Case("hunt20_pearson_loss_of_constant_targets", lambda: _pearson(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="pearson")),
    Case("hunt20_pearson_loss_with_eps_healthy", lambda: _pearson(1e-8), None),
    Case("hunt20_approx_ndcg_of_a_query_without_relevant_documents", lambda: _approx_ndcg(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="ndcg")),
    Case("hunt20_approx_ndcg_ideal_dcg_clamped_healthy", lambda: _approx_ndcg(True), None),
    Case("hunt20_iou_loss_of_a_dead_box_and_a_point_annotation", lambda: _box_loss("iou", 0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="iou")),
    Case("hunt20_iou_loss_with_eps_healthy", lambda: _box_loss("iou", 1e-7), None),
    Case("hunt20_ciou_aspect_atan_of_a_zero_height_box", lambda: _box_loss("ciou", 0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="ciou")),
    Case("hunt20_ciou_aspect_with_eps_healthy", lambda: _box_loss("ciou", 1e-7), None),
    Case("hunt20_pos_weight_of_a_batch_without_positives", lambda: _pos_weight(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="pos weight")),
    Case("hunt20_pos_weight_positives_clamped_healthy", lambda: _pos_weight(True), None),
    Case("hunt20_orpo_log_odds_of_a_certain_sequence", lambda: _orpo(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="orpo")),
    Case("hunt20_orpo_log_odds_clamped_healthy", lambda: _orpo(True), None),
    Case("hunt20_pinn_polar_residual_at_the_origin", lambda: _pinn(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="pinn")),
    Case("hunt20_pinn_polar_residual_guarded_healthy", lambda: _pinn(True), None),
    Case("hunt20_debiased_running_magnitude_off_by_one", lambda: _debiased_balance(False),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="debiased")),
    Case("hunt20_debiased_running_magnitude_from_one_healthy", lambda: _debiased_balance(True), None),
    Case("hunt20_lorentz_distance_of_a_self_loop", lambda: _lorentz(False),
         Expect("forward", None, step=2, op="aten.acosh.default", marker="lorentz")),
    Case("hunt20_lorentz_distance_clamped_healthy", lambda: _lorentz(True), None),
    Case("hunt20_arcface_acos_of_a_cosine_past_1", lambda: _arcface(False),
         Expect("forward", "", "ArcFace", step=2, op="aten.acos.default", marker="arcface")),
    Case("hunt20_arcface_cosine_clamped_healthy", lambda: _arcface(True), None),
    Case("hunt20_glow_logdet_of_a_reflection", lambda: _glow(False),
         Expect("forward", "", "InvertibleConv", step=0, op="aten.scalar_tensor.default", marker="glow logdet")),
    Case("hunt20_glow_logdet_of_a_reflection_cause", lambda: _glow(False),
         Expect("forward", "", "InvertibleConv", step=0, op="aten.scalar_tensor.default", marker="glow logdet",
                cause="log-domain"), note=GLOW_CAUSE),
    Case("hunt20_glow_slogdet_healthy", lambda: _glow(True), None),
    Case("hunt20_ridge_head_inv_ex_of_a_singular_gram", lambda: _ridge(0.0),
         Expect("forward", "", "RidgeHead", step=2, op="aten.linalg_inv_ex.default", marker="ridge inverse")),
    Case("hunt20_ridge_head_with_lambda_healthy", lambda: _ridge(0.1), None),
    Case("hunt20_namedtuple_output_log_of_a_dead_scale", lambda: _namedtuple(0.0),
         Expect("forward", "encoder", "ScaleEncoder", step=2, op="aten.log.default", marker="namedtuple")),
    Case("hunt20_namedtuple_output_log_with_eps_healthy", lambda: _namedtuple(1e-6), None),
    Case("hunt20_list_output_pyramid_level_of_zero_energy", lambda: _pyramid(0.0),
         Expect("forward", "neck", "Pyramid", step=2, op="aten.div.Tensor", marker="pyramid")),
    Case("hunt20_list_output_pyramid_with_eps_healthy", lambda: _pyramid(1e-6), None),
    Case("hunt20_tensor_and_none_output_temperature_0", lambda: _tensor_and_none(0.0),
         Expect("forward", "attn", "Attention", step=2, op="aten.div.Tensor", marker="tensor and none")),
    Case("hunt20_tensor_and_none_output_with_eps_healthy", lambda: _tensor_and_none(1e-4), None),
    Case("hunt20_model_output_loss_over_no_labelled_token", lambda: _model_output(False),
         Expect("forward", "", "Tagger", step=2, op="aten.div.Tensor", marker="model output loss")),
    Case("hunt20_model_output_loss_count_clamped_healthy", lambda: _model_output(True), None),
    Case("hunt20_data_parallel_log_of_a_dead_feature", lambda: _data_parallel(0.0),
         Expect("forward", "2", "LogFeatures", step=2, op="aten.log.default", marker="data parallel")),
    Case("hunt20_data_parallel_log_with_eps_healthy", lambda: _data_parallel(1e-6), None),
    Case("hunt20_hue_jitter_of_a_grey_pixel", lambda: _hue_jitter(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="hue")),
    Case("hunt20_hue_jitter_with_eps_healthy", lambda: _hue_jitter(1e-8), None),
]
