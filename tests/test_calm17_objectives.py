"""Objectives with their own infinities and guards, in whole loops, stay calm and bit-identical in the five modes
(issue 25; harness: test_calm16.py's ``assert_calm``): CLIP with its ``logit_scale`` clamped after each step, MoCo
with a queue buffer and a momentum encoder, SupCon whose rows without a positive are guarded; truncated BPTT (the
hidden state detached between chunks), distillation from a teacher under ``inference_mode``
(``kl_div(log_target=True)`` with temperature), a RealNVP flow (log-determinants), a mixture density network whose
unused components are masked with -inf before ``logsumexp``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(steps: int = 3, d_in: int = 6, classes: int = 3, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n, d_in), torch.randint(0, classes, (n,))) for _ in range(steps)]


# ---------------------------------------------------------------- contrastive


class TwoTowers(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 9, 16))
        self.text = nn.EmbeddingBag(50, 16, mode="mean")
        self.logit_scale = nn.Parameter(torch.tensor(math.log(scale)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor):
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1), self.logit_scale.exp()


def clip():
    """CLIP: the temperature starts above the clamp (log 100), the clamp after each step pulls it back."""

    def build() -> Loop:
        model = TwoTowers(scale=150.0)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.2)
        batches = [(torch.randn(6, 3, 8, 8), torch.randint(0, 50, (6, 4))) for _ in range(4)]

        def run() -> list[torch.Tensor]:
            out = []
            for images, texts in batches:
                img, txt, scale = model(images, texts)
                logits = scale * img @ txt.t()
                labels = torch.arange(len(images))
                loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    model.logit_scale.clamp_(0, math.log(100))
                out += [loss.detach(), model.logit_scale.detach().clone()]
            return out

        return Loop((model, opt), (model, opt), run)

    return build


class MoCo(nn.Module):
    def __init__(self, d: int = 8, queue: int = 16) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, d))
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(d, queue), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.normalize(self.encoder_q(xq), dim=1)
        with torch.no_grad():
            for pk, pq in zip(self.encoder_k.parameters(), self.encoder_q.parameters(), strict=True):
                pk.data = pk.data * 0.99 + pq.data * 0.01
            k = F.normalize(self.encoder_k(xk), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().detach()], 1) / 0.07
        ptr = int(self.queue_ptr)
        self.queue[:, ptr : ptr + k.shape[0]] = k.T  # dequeue and enqueue
        self.queue_ptr[0] = (ptr + k.shape[0]) % self.queue.shape[1]
        return logits, torch.zeros(logits.shape[0], dtype=torch.long)


def moco():
    def build() -> Loop:
        model = MoCo()
        opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
        xs = [torch.randn(4, 10) for _ in range(5)]

        def run() -> list[torch.Tensor]:
            out = []
            for x in xs:
                logits, labels = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
                loss = F.cross_entropy(logits, labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


def supcon():
    """SupCon: self-contrast removed by a mask; a row whose label has no other sample divides by a guarded count."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = [(torch.randn(6, 10), torch.tensor([0, 0, 1, 1, 2, 3])) for _ in range(3)]  # 2 and 3: alone

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in batches:
                z = F.normalize(model(x), dim=1)
                logits = z @ z.T / 0.1
                logits = logits - logits.max(dim=1, keepdim=True).values.detach()
                self_mask = 1 - torch.eye(len(y))
                positives = (y[:, None] == y[None]).float() * self_mask
                log_prob = logits - torch.log((logits.exp() * self_mask).sum(1, keepdim=True))
                count = positives.sum(1)
                count = torch.where(count < 1e-6, torch.ones_like(count), count)
                loss = -((positives * log_prob).sum(1) / count).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- sequences, distillation, densities


def truncated_bptt():
    def build() -> Loop:
        lstm, head = nn.LSTM(3, 8, batch_first=True), nn.Linear(8, 1)
        opt = torch.optim.RMSprop([*lstm.parameters(), *head.parameters()], lr=1e-2)
        series = torch.randn(2, 20, 3).cumsum(1) * 0.1

        def run() -> list[torch.Tensor]:
            out, state = [], None
            for start in range(0, 16, 4):
                chunk, target = series[:, start : start + 4], series[:, start + 1 : start + 5, :1]
                y, state = lstm(chunk, state)
                state = tuple(s.detach() for s in state)  # truncate the gradient here
                loss = F.smooth_l1_loss(head(y), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((lstm, head, opt), (lstm, head, opt), run)

    return build


def distillation():
    def build() -> Loop:
        teacher = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)).eval()
        student = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.Adam(student.parameters(), lr=1e-2)
        data, temp = _data(3), 4.0

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in data:
                with torch.inference_mode():
                    soft = F.log_softmax(teacher(x) / temp, -1)
                logits = student(x)
                kd = F.kl_div(F.log_softmax(logits / temp, -1), soft.clone(), log_target=True, reduction="batchmean")
                loss = 0.9 * kd * temp**2 + 0.1 * F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((teacher, student, opt), (teacher, student, opt), run)

    return build


class Coupling(nn.Module):
    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = (x[:, 1:], x[:, :1]) if self.flip else (x[:, :1], x[:, 1:])
        log_s, t = self.net(a).chunk(2, -1)
        log_s = torch.tanh(log_s)
        b = b * log_s.exp() + t
        return (torch.cat([b, a], 1) if self.flip else torch.cat([a, b], 1)), log_s.sum(-1)


def realnvp():
    def build() -> Loop:
        flow = nn.ModuleList(Coupling(flip=i % 2 == 1) for i in range(4))
        opt = torch.optim.Adam(flow.parameters(), lr=5e-3)
        base = torch.distributions.Normal(0.0, 1.0)
        data = [torch.randn(16, 2) * torch.tensor([1.0, 0.2]) + 1.0 for _ in range(3)]

        def run() -> list[torch.Tensor]:
            out = []
            for x in data:
                z, log_det = x, torch.zeros(x.shape[0])
                for layer in flow:
                    z, ld = layer(z)
                    log_det = log_det + ld
                loss = -(base.log_prob(z).sum(-1) + log_det).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((flow, opt), (flow, opt), run)

    return build


class MDN(nn.Module):
    """A mixture density network with 4 components of which a per-sample mask keeps 2 or more (-inf weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.out = nn.Sequential(nn.Linear(2, 16), nn.Tanh()), nn.Linear(16, 12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logit_pi, mu, log_sigma = self.out(self.body(x)).chunk(3, -1)
        log_pi = F.log_softmax(logit_pi.masked_fill(~keep, NEG_INF), -1)
        log_sigma = log_sigma.clamp(-5, 5)
        comp = -0.5 * ((y - mu) / log_sigma.exp()) ** 2 - log_sigma - 0.5 * math.log(2 * math.pi)
        return -torch.logsumexp(log_pi + comp, -1).mean()


def mdn():
    def build() -> Loop:
        model = MDN()
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
        data = [(torch.randn(8, 2), torch.rand(8, 4) < 0.6, torch.randn(8, 1)) for _ in range(3)]
        for _, keep, _ in data:
            keep[:, :2] = True

        def run() -> list[torch.Tensor]:
            out = []
            for x, keep, y in data:
                loss = model(x, keep, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


OBJECTIVES = {
    "clip-logit-scale-clamped": clip(),
    "moco-queue-momentum-encoder": moco(),
    "supcon-lonely-labels-guarded": supcon(),
    "truncated-bptt-lstm": truncated_bptt(),
    "distillation-inference-mode-teacher": distillation(),
    "realnvp-log-det": realnvp(),
    "mdn-masked-components-logsumexp": mdn(),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_objectives_with_their_own_infinities_are_calm_and_identical(name: str, options: dict) -> None:
    assert_calm(OBJECTIVES[name], options)


def test_the_clip_clamp_really_fires() -> None:
    torch.manual_seed(0)
    scales = OBJECTIVES["clip-logit-scale-clamped"]().run()[1::2]
    assert max(float(s) for s in scales) == pytest.approx(math.log(100))
