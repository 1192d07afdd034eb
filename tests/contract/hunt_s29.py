"""hunt_s29, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Sequence models: a packed GRU whose mean pool divides by an utterance's true length 0 (clamped to 1 only for the
packing); a log-energy frontend that takes and returns a ``PackedSequence``, over a dropped frame; cross-attention
whose additive mask is ``log`` of a 0/1 mask, over a sample that retrieved no passage; a rotary embedding with dynamic
NTK scaling applied to a sequence shorter than the trained context (a negative base to a fractional power).
Autograd: a ``torch.autograd.Function`` in the ``setup_context`` style whose hand-written backward of a log-sum-exp
uses the unstabilised ``exp``; gradient checkpointing (``use_reentrant`` False and True) of a block
whose hand RMSNorm has no eps, over the zeroed padding embedding. Numerics of the loop: a batch normaliser's
``E[x^2] - E[x]^2`` of a stuck sensor, rounded below 0 under a root; a multiplicative Lagrange multiplier that
overflows; GCC-PHAT's complex whitening ``X / |X|`` of a silent channel's spectrum; a hand-written EMA teacher whose
bias correction counts from 0; LambdaRank's NDCG discount ``log2(rank + 1)`` over 0-based ranks; an SSIM loss whose
constants come from the data range of each target, over a black padding frame and a bias-free denoiser.
Variants of families seen before, each in a form not covered yet: a policy's ``Categorical`` with argument validation
off, its rows selected by a boolean index before it (hunt16/17: no legal action); DP-SGD's automatic clipping by
``torch.func`` with its gamma 0 (hunt19: Opacus-style clipping); a BiLSTM-CRF's gold path through a forbidden
transition (hunt19: a plain CRF); a mixture of experts whose capacity routing masks full experts with -inf over a batch
longer than planned (hunt23: a router's top-k).
Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- packed GRU, mean pool by a true length of 0
class PackedClassifier(nn.Module):
    """Utterances padded to one length, a GRU over the packed batch, a mean over each utterance's frames. An empty
    utterance (voice activity detection trimmed it all) cannot be packed, so its length is clamped to 1 for the
    packing; the pool then divides by the true length, 0 (``guarded``: by the clamped one)."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.gru, self.head, self.guarded = nn.GRU(3, 8, batch_first=True), nn.Linear(8, 2), guarded

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=x.shape[1])
        divisor = lengths.clamp(min=1) if self.guarded else lengths
        pooled = out.sum(1) / divisor[:, None]  # producer: packed mean
        return self.head(pooled)


def _packed(guarded: bool) -> Scenario:
    torch.manual_seed(0)
    model = PackedClassifier(guarded)
    xs, ys = _batches(4, 6, 3), [torch.randint(0, 2, (4,)) for _ in range(4)]
    lengths = [torch.tensor([6, 4, 3, 5]), torch.tensor([2, 6, 6, 1]), torch.tensor([5, 0, 3, 6]),
               torch.tensor([6, 6, 2, 3])]
    return _loop(model, lambda step: (xs[step], lengths[step]), lambda out, step: F.cross_entropy(out, ys[step]))



# ---------------------------------------------------------------- a log-energy frontend over a PackedSequence
class LogEnergy(nn.Module):
    """A frontend that takes and returns a ``PackedSequence``: the log of each frame's energy (``floor`` added)."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, packed: PackedSequence) -> PackedSequence:
        energy = packed.data.pow(2)
        features = torch.log(energy + self.floor)  # producer: log energy
        return PackedSequence(features, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)


class PackedTagger(nn.Module):
    """Frame energies packed, logged by the frontend, a GRU over the packed features, a head on the last state. A
    frame of digital silence (a dropout in the recording) has energy 0: ``log(0)`` is -inf, and the GRU's input
    product with it NaN. The twin adds an energy floor of 1e-6."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.frontend, self.gru, self.head = LogEnergy(floor), nn.GRU(3, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, last = self.gru(self.frontend(packed))
        return self.head(last[-1])


def _packed_frontend(floor: float) -> Scenario:
    torch.manual_seed(0)
    model = PackedTagger(floor)
    xs, ys = _batches(3, 5, 3), [torch.randint(0, 2, (3,)) for _ in range(4)]
    lengths = [torch.tensor([5, 3, 4]), torch.tensor([2, 5, 5]), torch.tensor([4, 5, 3]), torch.tensor([5, 5, 1])]
    xs[2][1, 2] = 0.0  # a dropped frame inside the second utterance
    return _loop(model, lambda step: (xs[step], lengths[step]), lambda out, step: F.cross_entropy(out, ys[step]))

# ---------------------------------------------------------------- additive mask as log of a 0/1 mask
class Reader(nn.Module):
    """Cross-attention from the question's tokens to the retrieved passages' tokens, the additive mask written as
    ``log`` of the 0/1 passage mask (0 where kept, -inf where not). A sample for which the retriever found nothing has
    no key: its softmax is over -inf only. ``guarded`` keeps a null key that every query may attend."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.q, self.kv, self.out, self.guarded = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(8, 2), guarded

    def forward(self, question: torch.Tensor, passages: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        if self.guarded:
            passages = torch.cat([torch.zeros_like(passages[:, :1]), passages], 1)
            kept = torch.cat([torch.ones_like(kept[:, :1]), kept], 1)
        k, v = self.kv(passages).chunk(2, -1)
        bias = kept.float().log()[:, None, :]  # producer: log mask
        scores = self.q(question) @ k.transpose(1, 2) / math.sqrt(8) + bias
        weights = scores.softmax(-1)
        return self.out((weights @ v).mean(1))


def _reader(guarded: bool) -> Scenario:
    torch.manual_seed(0)
    model = Reader(guarded)
    questions, passages = _batches(3, 4, 8), _batches(3, 5, 8)
    kept = [torch.rand(3, 5) > 0.3 for _ in range(4)]
    for mask in kept:
        mask[:, 0] = True
    kept[2][1] = False
    ys = [torch.randint(0, 2, (3,)) for _ in range(4)]
    return _loop(model, lambda step: (questions[step], passages[step], kept[step]),
                 lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- rotary with dynamic NTK scaling, short sequence
class NTKRotary(nn.Module):
    """Rotary position embedding with dynamic NTK scaling: ``base * (s * L / L0 - (s - 1)) ** (d / (d - 2))``, meant
    for ``L > L0``; applied to every sequence, a short one gives a negative number to a fractional power. The twin
    scales only past the trained context, as the reference does."""

    def __init__(self, dim: int, trained: int, scale: float, guarded: bool) -> None:
        super().__init__()
        self.dim, self.trained, self.scale, self.guarded = dim, trained, scale, guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        base = torch.tensor(10000.0)
        if not self.guarded or length > self.trained:
            factor = torch.tensor(self.scale * length / self.trained - (self.scale - 1))
            base = base * factor ** (self.dim / (self.dim - 2))  # producer: ntk base
        inv_freq = 1.0 / base ** (torch.arange(0, self.dim, 2).float() / self.dim)
        angles = torch.arange(length).float()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin


class RotaryEncoder(nn.Module):
    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.embed, self.rotary, self.head = nn.Linear(4, 8), NTKRotary(8, 8, 2.0, guarded), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rotary(self.embed(x)).mean(1))


def _rotary(guarded: bool) -> Scenario:
    """Sequences of the trained length 8 and longer, then a short last chunk of 3 at step 2."""
    torch.manual_seed(0)
    model = RotaryEncoder(guarded)
    xs = [torch.randn(2, 8, 4), torch.randn(2, 12, 4), torch.randn(2, 3, 4), torch.randn(2, 8, 4)]
    ys = _batches(2, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a Function with an unstabilised backward
class LogSumExp(torch.autograd.Function):
    """A fused log-sum-exp in the ``setup_context`` style: a stable forward, and a backward written as
    ``exp(x) / sum(exp(x))``, which overflows for logits past 88 (``stable``: ``exp(x - out)``)."""

    @staticmethod
    def forward(x: torch.Tensor, stable: bool) -> torch.Tensor:  # type: ignore[override]
        return torch.logsumexp(x, -1)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0], output)
        ctx.stable = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, out = ctx.saved_tensors
        if ctx.stable:
            return grad[..., None] * torch.exp(x - out[..., None]), None
        e = torch.exp(x)  # producer: unstable backward
        return grad[..., None] * e / e.sum(-1, keepdim=True), None


def _logsumexp(stable: bool) -> Scenario:
    """A scoring model's logits grow with the inputs' scale; step 2's batch holds raw (unnormalised) features."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    xs, ys = _batches(4, 4), [torch.randint(0, 5, (4,)) for _ in range(4)]
    xs[2] = xs[2] * 3000.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return (LogSumExp.apply(out, stable) - out.gather(1, ys[step][:, None]).squeeze(1)).mean()

    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- checkpointed block, hand RMSNorm without eps
class Block(nn.Module):
    """A pre-norm MLP block with a hand-written RMSNorm and no eps: the padding token's embedding is 0."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc, self.eps = nn.Linear(8, 8), eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        normed = h / (h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()  # producer: rms norm
        return h + torch.tanh(self.fc(normed))


class CheckpointedLM(nn.Module):
    def __init__(self, eps: float, reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.blocks = nn.ModuleList([Block(eps) for _ in range(2)])
        self.head, self.reentrant = nn.Linear(8, 10), reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointed(eps: float, reentrant: bool) -> Scenario:
    """Batches of full-length sentences, then one padded at step 2."""
    torch.manual_seed(0)
    model = CheckpointedLM(eps, reentrant)
    tokens = [torch.randint(1, 10, (2, 5)) for _ in range(4)]
    tokens[2][1, 3:] = 0
    targets = [torch.randint(1, 10, (2, 5)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


# ---------------------------------------------------------------- E[x^2] - E[x]^2 of a constant feature
class RunningNormalizer(nn.Module):
    """Standardises each feature by the batch's moments, the variance written as ``E[x^2] - E[x]^2``; a sensor stuck
    at a constant reading rounds it just below 0, and the root is NaN. The twin clamps the variance at 0 first."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.guarded = guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0)
        var = (x * x).mean(0) - mean * mean
        if self.guarded:
            var = var.clamp(min=0)
        return (x - mean) / (var + 1e-5).sqrt()  # producer: moment variance


def _moments(guarded: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(RunningNormalizer(guarded), nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    xs, ys = [x * 10 for x in _batches(32, 3)], _batches(32, 1)
    xs[2][:, 1] = 1234.5  # a stuck sensor
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- Categorical, validation off, no legal action
def _no_legal_action(guarded: bool) -> Scenario:
    """A policy over 4 actions with an action mask, its ``Categorical`` built with ``validate_args=False`` (RL code
    turns validation off for speed). A state with no legal action (the episode's terminal state kept in the batch)
    has every logit at -inf, and the distribution's normalisation ``logits - logsumexp(logits)`` is ``-inf - -inf``.
    The twin drops terminal states before the policy loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    xs = _batches(5, 4)
    legal = [torch.rand(5, 4) > 0.3 for _ in range(4)]
    for mask in legal:
        mask[:, 2] = True
    legal[2][3] = False
    actions, advantages = [torch.full((5,), 2) for _ in range(4)], _batches(5)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        live = legal[step].any(-1) if guarded else torch.ones(5, dtype=torch.bool)
        masked = logits.masked_fill(~legal[step], float("-inf"))[live]
        policy = torch.distributions.Categorical(logits=masked, validate_args=False)  # producer: no legal action
        return -(policy.log_prob(actions[step][live]) * advantages[step][live]).mean() - 0.01 * policy.entropy().mean()

    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a multiplicative Lagrange multiplier
def _lagrange(cap: float) -> Scenario:
    """Constrained training: ``loss + lam * violation``, the multiplier updated multiplicatively after each step,
    ``lam *= exp(rate * violation)``. A constraint the model cannot meet makes it grow by ``e^30`` a step and it
    overflows at step 3. The twin caps the multiplier."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-12)
    xs, ys = _batches(4, 4, steps=5), _batches(4, 1, steps=5)

    def run() -> list[torch.Tensor]:
        losses, lam = [], torch.tensor(1.0)
        for step in range(5):
            out = model(xs[step])
            violation = out.abs().mean() + 29.0
            loss = F.mse_loss(out, ys[step]) + lam * violation
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                lam = (lam * torch.exp(violation)).clamp(max=cap)  # producer: multiplier
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- GCC-PHAT whitening of a zero bin
class GccPhat(nn.Module):
    """Time-delay estimation between two microphones: the cross-spectrum whitened by its magnitude,
    ``X1 conj(X2) / |X1 conj(X2)|``, back to the time domain. A channel band-limited by its anti-aliasing filter has
    spectrum bins that are exactly 0 (``0 / 0``); the twin adds an eps to the magnitude."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cross = torch.fft.rfft(a) * torch.fft.rfft(b).conj()
        whitened = cross / (cross.abs() + self.eps)  # producer: phat
        return torch.fft.irfft(whitened, n=a.shape[-1])


class DelayNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.front, self.phat, self.head = nn.Linear(16, 16), GccPhat(eps), nn.Linear(16, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(self.phat(self.front(a), b))


def _gcc_phat(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = DelayNet(eps)
    a_s, b_s, ys = _batches(3, 16), _batches(3, 16), _batches(3, 1)
    b_s[2][1] = 0.0  # a microphone unplugged for one recording
    return _loop(model, lambda step: (a_s[step], b_s[step]), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- DP-SGD per-sample clipping by torch.func
def _dp_sgd(eps: float) -> Scenario:
    """DP-SGD with automatic clipping (Auto-S), written with ``torch.func``: per-sample gradients by
    ``vmap(grad(functional_call))``, each normalised to norm 1 by ``g / (||g|| + gamma)``, averaged and noised into
    ``.grad``. With ``gamma`` set to 0, a sample the hinge loss already satisfies (at step 1) has a per-sample
    gradient of exactly 0: ``1 / 0`` is inf, times 0 is NaN. The twin keeps the paper's ``gamma = 0.01``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = _batches(4, 4), [torch.randint(0, 2, (4,)).float() * 2 - 1 for _ in range(4)]
    noise = [[torch.randn_like(p) * 0.01 for p in model.parameters()] for _ in range(4)]

    def sample_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (x[None],))
        return F.relu(1 - y * out.squeeze() * torch.where(y > 0, 100.0, 1.0))  # positives weighted: soon satisfied

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            params = {name: p.detach() for name, p in model.named_parameters()}
            grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, xs[step], ys[step])
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
            factor = 1.0 / (norms + eps)  # producer: dp clip
            opt.zero_grad()
            for (name, p), n in zip(model.named_parameters(), noise[step]):
                p.grad = (grads[name] * factor.view(-1, *[1] * (grads[name].dim() - 1))).mean(0) + n
            opt.step()
            losses.append(norms.sum())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- CRF gold path through a forbidden transition
class BioCRF(nn.Module):
    """A BiLSTM-CRF tagger (tags O, B, I) with BIO constraints: ``O -> I`` is forbidden, its transition score masked
    with -inf. A labelling error in the data (an ``I`` right after an ``O``) puts the gold path through it: the gold
    score is -inf and the negative log-likelihood +inf. The twin repairs such labels (``O I`` read as ``O B``), as the
    corpus readers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.emit = nn.LSTM(4, 8, batch_first=True, bidirectional=True), nn.Linear(16, 3)
        self.transitions = nn.Parameter(torch.zeros(3, 3))
        forbidden = torch.zeros(3, 3, dtype=torch.bool)
        forbidden[0, 2] = True
        self.register_buffer("forbidden", forbidden)

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        emissions = self.emit(self.lstm(x)[0])
        trans = self.transitions.masked_fill(self.forbidden, float("-inf"))
        gold = emissions.gather(2, tags[..., None]).squeeze(-1).sum(1)
        gold = gold + trans[tags[:, :-1], tags[:, 1:]].sum(1)  # producer: gold path
        alpha = emissions[:, 0]
        for t in range(1, x.shape[1]):
            alpha = torch.logsumexp(alpha[:, :, None] + trans[None] + emissions[:, t, None, :], 1)
        return (torch.logsumexp(alpha, 1) - gold).mean()


def _repair(tags: torch.Tensor) -> torch.Tensor:
    repaired = tags.clone()
    repaired[:, 1:][(tags[:, :-1] == 0) & (tags[:, 1:] == 2)] = 1
    return repaired


def _crf(repaired: bool) -> Scenario:
    torch.manual_seed(0)
    model = BioCRF()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs = _batches(2, 5, 4)
    tags = [torch.tensor([[1, 2, 0, 1, 2], [0, 0, 1, 2, 2]]) for _ in range(4)]
    tags[2] = torch.tensor([[1, 2, 0, 2, 2], [0, 0, 1, 2, 2]])  # an annotator's I after an O

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = model(xs[step], _repair(tags[step]) if repaired else tags[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- EMA teacher, bias correction off by one
def _ema_teacher(first: int) -> Scenario:
    """A mean teacher whose weights are the students' EMA with Adam's bias correction, ``ema / (1 - beta ** n)``,
    ``n`` counted from 0 (``first``): at the first update ``1 - beta ** 0`` is 0 and every teacher weight is inf. The
    twin counts from 1, as timm does."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    teacher.requires_grad_(False)
    shadow = [torch.zeros_like(p) for p in student.parameters()]
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = student(xs[step])
            loss = F.cross_entropy(out, ys[step])
            if step >= 2:  # the consistency term is switched on after a short burn-in
                loss = loss + F.mse_loss(out.softmax(-1), teacher(xs[step]).softmax(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                n = step + first
                for ema, s, t in zip(shadow, student.parameters(), teacher.parameters()):
                    ema.mul_(0.99).add_(s, alpha=0.01)
                    t.copy_(ema / (1 - 0.99 ** n))  # producer: bias correction
            losses.append(loss.detach())
        return losses

    return Scenario((student, teacher, opt), run)



# ---------------------------------------------------------------- MoE capacity routing, every expert full
class CapacityMoE(nn.Module):
    """Top-1 routing with an expert capacity planned from the configured tokens per batch: an expert at capacity is
    masked with -inf for the tokens after it. A batch longer than planned leaves its last tokens with every expert
    full: the gate's softmax over -inf only. The twin drops such a token (its residual passes), as Switch does."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 2), nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.capacity, self.guarded = 3, guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, load, outs = self.gate(x), torch.zeros(2), []
        for t in range(x.shape[0]):
            full = load >= self.capacity
            if self.guarded and bool(full.all()):
                outs.append(x[t])
                continue
            weights = logits[t].masked_fill(full, float("-inf")).softmax(-1)  # producer: capacity gate
            choice = int(weights.argmax())
            load[choice] += 1
            outs.append(x[t] + weights[choice] * self.experts[choice](x[t]))
        return torch.stack(outs)


def _moe(guarded: bool) -> Scenario:
    """Batches of 5 tokens (capacity 3 per expert, 6 slots), then one of 8 at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), CapacityMoE(guarded), nn.Linear(8, 1))
    xs = [torch.randn(5, 4), torch.randn(5, 4), torch.randn(8, 4), torch.randn(5, 4)]
    ys = [torch.randn(x.shape[0], 1) for x in xs]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- LambdaRank, NDCG discount off by one
def _lambdarank(offset: int) -> Scenario:
    """LambdaRank: pairwise logistic losses weighted by ``|delta NDCG|``, the discount written ``log2(rank + 1)`` over
    0-based ranks (``offset`` 1): the top document's discount is ``log2(1) = 0``, its gain over it inf, and the ideal
    DCG inf: ``inf / inf``. The twin uses ``rank + 2``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    docs, relevance = _batches(6, 5), [torch.randint(0, 3, (6,)).float() for _ in range(4)]

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        scores, rel = out.squeeze(-1), relevance[step]
        with torch.no_grad():
            ranks = scores.argsort(descending=True).argsort().float()
            gains = 2 ** rel - 1
            discount = 1.0 / torch.log2(ranks + offset)  # producer: ndcg discount
            ideal = ((2 ** rel.sort(descending=True).values - 1) / torch.log2(torch.arange(6.0) + offset)).sum()
            swap = (gains[:, None] - gains[None, :]) * (discount[:, None] - discount[None, :])
            weight = swap.abs() / ideal
        better = rel[:, None] > rel[None, :]
        return (weight * F.softplus(scores[None, :] - scores[:, None]))[better].mean()

    return _loop(model, lambda step: (docs[step],), loss_fn)



# ---------------------------------------------------------------- SSIM with a data range read off a black frame
def _ssim_loss(out: torch.Tensor, target: torch.Tensor, fixed_range: bool) -> torch.Tensor:
    """``1 - SSIM`` over 3x3 windows, its constants ``C1 = (0.01 L)^2``, ``C2 = (0.03 L)^2`` from the data range
    ``L``: read off each target (``amax - amin``), or the images' fixed range 1."""
    if fixed_range:
        data_range = torch.ones(out.shape[0], 1, 1, 1)
    else:
        data_range = (target.amax((1, 2, 3)) - target.amin((1, 2, 3))).view(-1, 1, 1, 1)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_x, mu_y = F.avg_pool2d(out, 3, 1), F.avg_pool2d(target, 3, 1)
    var_x = F.avg_pool2d(out * out, 3, 1) - mu_x**2
    var_y = F.avg_pool2d(target * target, 3, 1) - mu_y**2
    cov = F.avg_pool2d(out * target, 3, 1) - mu_x * mu_y
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    ssim = numerator / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))  # producer: ssim
    return 1 - ssim.mean()


def _ssim(fixed_range: bool) -> Scenario:
    """A bias-free frame denoiser (BF-CNN) trained with SSIM; clips are padded to a fixed length with black frames,
    and step 2's batch holds one: its data range is 0, so are both constants, and the denoiser's output of a black
    frame is 0: ``0 / 0`` in every window. The twin uses the images' fixed range, as pytorch-msssim does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.Tanh(),
                          nn.Conv2d(4, 1, 3, padding=1, bias=False))
    clean = [torch.rand(2, 1, 8, 8) for _ in range(4)]
    noisy = [c + 0.1 * torch.randn_like(c) for c in clean]
    clean[2][1], noisy[2][1] = 0.0, 0.0  # a padding frame
    return _loop(model, lambda step: (noisy[step],), lambda out, step: _ssim_loss(out, clean[step], fixed_range))

_CATEGORICAL = Expect("forward", None, step=2, op="aten.logsumexp.default", marker="no legal action",
                      cause="masked-softmax")

CASES = [
    Case("hunt_s29_packed_gru_mean_pool_by_a_true_length_of_0", lambda: _packed(False),
         Expect("forward", "", "PackedClassifier", step=2, op="aten.div.Tensor", marker="packed mean",
                cause="division-by-zero")),
    Case("hunt_s29_packed_gru_mean_pool_by_the_clamped_length_healthy", lambda: _packed(True), None),
    Case("hunt_s29_packed_sequence_log_energy_frontend_of_a_dropped_frame", lambda: _packed_frontend(0.0),
         Expect("forward", "frontend", "LogEnergy", step=2, op="aten.log.default", marker="log energy",
                cause="log-domain")),
    Case("hunt_s29_packed_sequence_log_energy_frontend_with_a_floor_healthy", lambda: _packed_frontend(1e-6), None),
    Case("hunt_s29_log_of_a_0_1_mask_over_a_sample_without_passages", lambda: _reader(False),
         Expect("forward", "", "Reader", step=2, op="aten.log.default", marker="log mask")),
    Case("hunt_s29_log_of_a_0_1_mask_with_a_null_key_healthy", lambda: _reader(True), None),
    Case("hunt_s29_dynamic_ntk_rotary_on_a_sequence_shorter_than_trained", lambda: _rotary(False),
         Expect("forward", "rotary", "NTKRotary", step=2, op="aten.pow.Tensor_Scalar", marker="ntk base",
                cause="pow-domain")),
    Case("hunt_s29_dynamic_ntk_rotary_only_past_the_trained_length_healthy", lambda: _rotary(True), None),
    Case("hunt_s29_setup_context_function_backward_exp_overflows", lambda: _logsumexp(False),
         Expect("backward", None, step=2, op="aten.exp.default", marker="unstable backward", cause="exp-overflow")),
    Case("hunt_s29_setup_context_function_backward_stabilised_healthy", lambda: _logsumexp(True), None),
    Case("hunt_s29_checkpointed_block_hand_rmsnorm_of_a_padding_embedding", lambda: _checkpointed(0.0, False),
         Expect("forward", "blocks.0", "Block", step=2, op="aten.div.Tensor", marker="rms norm",
                cause="division-by-zero")),
    Case("hunt_s29_checkpointed_block_hand_rmsnorm_with_eps_healthy", lambda: _checkpointed(1e-6, False), None),
    Case("hunt_s29_reentrant_checkpointed_block_hand_rmsnorm_of_a_padding_embedding",
         lambda: _checkpointed(0.0, True),
         Expect("forward", "blocks.0", "Block", step=2, op="aten.div.Tensor", marker="rms norm",
                cause="division-by-zero")),
    Case("hunt_s29_reentrant_checkpointed_block_hand_rmsnorm_with_eps_healthy", lambda: _checkpointed(1e-6, True),
         None),
    Case("hunt_s29_moment_variance_of_a_stuck_sensor_rounds_below_0", lambda: _moments(False),
         Expect("forward", "0", "RunningNormalizer", step=2, op="aten.sqrt.default", marker="moment variance",
                cause="sqrt-domain")),
    Case("hunt_s29_moment_variance_clamped_at_0_healthy", lambda: _moments(True), None),
    Case("hunt_s29_categorical_without_validation_over_a_state_with_no_legal_action",
         lambda: _no_legal_action(False), _CATEGORICAL),
    Case("hunt_s29_categorical_without_validation_terminal_states_dropped_healthy", lambda: _no_legal_action(True),
         None),
    Case("hunt_s29_multiplicative_lagrange_multiplier_overflows", lambda: _lagrange(math.inf),
         Expect("forward", None, step=3, op="aten.mul.Tensor", marker="multiplier", cause="overflow")),
    Case("hunt_s29_multiplicative_lagrange_multiplier_capped_healthy", lambda: _lagrange(1e6), None),
    Case("hunt_s29_gcc_phat_whitening_of_a_silent_channel", lambda: _gcc_phat(0.0),
         Expect("forward", "phat", "GccPhat", step=2, op="aten.div.Tensor", marker="phat",
                cause="division-by-zero")),
    Case("hunt_s29_gcc_phat_whitening_with_eps_healthy", lambda: _gcc_phat(1e-8), None),
    Case("hunt_s29_dp_sgd_automatic_clipping_gamma_0_of_a_satisfied_sample", lambda: _dp_sgd(0.0),
         Expect("backward", None, step=1, op="aten.reciprocal.default", marker="dp clip",
                tensor=TensorRef.gradient("0.weight"), cause="division-by-zero")),
    Case("hunt_s29_dp_sgd_automatic_clipping_gamma_0_01_healthy", lambda: _dp_sgd(0.01), None),
    Case("hunt_s29_bio_crf_gold_path_through_a_forbidden_transition", lambda: _crf(False),
         Expect("forward", "", "BioCRF", step=2, op="aten.index.Tensor", marker="gold path")),
    Case("hunt_s29_bio_crf_labels_repaired_healthy", lambda: _crf(True), None),
    Case("hunt_s29_ema_teacher_bias_correction_counted_from_0", lambda: _ema_teacher(0),
         Expect("optimizer", "0", "Linear", step=1, op="aten.div.Tensor", marker="bias correction",
                cause="division-by-zero")),
    Case("hunt_s29_ema_teacher_bias_correction_counted_from_1_healthy", lambda: _ema_teacher(1), None),
    Case("hunt_s29_ssim_constants_from_the_data_range_of_a_black_padding_frame", lambda: _ssim(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="ssim", cause="division-by-zero")),
    Case("hunt_s29_ssim_constants_from_a_fixed_data_range_healthy", lambda: _ssim(True), None),
    Case("hunt_s29_moe_capacity_routing_a_token_with_every_expert_full", lambda: _moe(False),
         Expect("forward", "1", "CapacityMoE", step=2, op="aten._softmax.default", marker="capacity gate",
                cause="masked-softmax")),
    Case("hunt_s29_moe_capacity_routing_drops_the_token_healthy", lambda: _moe(True), None),
    Case("hunt_s29_lambdarank_ndcg_discount_log2_of_rank_plus_1", lambda: _lambdarank(1),
         Expect("forward", None, step=0, op="aten.reciprocal.default", marker="ndcg discount",
                cause="division-by-zero")),
    Case("hunt_s29_lambdarank_ndcg_discount_log2_of_rank_plus_2_healthy", lambda: _lambdarank(2), None),
]
