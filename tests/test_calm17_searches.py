"""Whole programs whose infinities are sentinels, masks or starting values stay calm and bit-identical in the five
modes (issue 25; harness: test_calm16.py's ``assert_calm``). Each case is one cell of a known kind of repo:

PPO with invalid-action masks (``Categorical`` over -inf logits, GAE, clipped ratio over minibatch epochs, an early
stop on approximate KL), a SAC-style squashed Gaussian (the ``log(1 - tanh^2 + eps)`` correction), graph networks
whose isolated nodes have no edge (GCN's ``deg.pow(-0.5)`` with its inf set to 0 as PyG does, GAT's softmax over
incoming edges with a -inf ``scatter_reduce`` maximum, a mean aggregation over ``clamp(min=1)``, a graph readout by
``index_add``), a seq2seq GRU with random teacher forcing, then greedy and beam search (beams started at -inf,
finished beams set to -inf), kNN with a leave-one-out diagonal of inf and a running top-k that starts at inf, a
prototypical network whose missing classes are at distance inf, early stopping (``best = float("inf")``,
``torch.tensor(inf)``, ReduceLROnPlateau, the best state restored), and metrics over NaN-padded targets.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.distributions import Categorical, Normal
from torch.nn import functional as F
from watching import FIVE_MODES

INF, NEG_INF, NAN = float("inf"), float("-inf"), float("nan")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---------------------------------------------------------------- reinforcement learning


class ActorCritic(nn.Module):
    def __init__(self, obs: int = 6, actions: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, 32), nn.Tanh())
        self.actor, self.critic = nn.Linear(32, actions), nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[Categorical, torch.Tensor]:
        h = self.body(obs)
        return Categorical(logits=self.actor(h).masked_fill(~legal, NEG_INF)), self.critic(h).squeeze(-1)


def ppo():
    """A rollout of a toy environment written in torch, GAE, then PPO epochs over shuffled minibatches."""

    def build() -> Loop:
        agent = ActorCritic()
        opt = torch.optim.Adam(agent.parameters(), lr=3e-3, eps=1e-5)
        horizon, gamma, lam, clip, target_kl = 16, 0.99, 0.95, 0.2, 0.05

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(2):  # updates
                obs_l, legal_l, act_l, logp_l, val_l, rew_l, done_l = [], [], [], [], [], [], []
                obs = torch.randn(6)
                with torch.no_grad():
                    for t in range(horizon):
                        legal = torch.rand(5) < 0.6
                        legal[t % 5] = True  # at least one legal action
                        dist, value = agent(obs, legal)
                        action = dist.sample()
                        obs_l.append(obs)
                        legal_l.append(legal)
                        act_l.append(action)
                        logp_l.append(dist.log_prob(action))
                        val_l.append(value)
                        rew_l.append((action == t % 5).float())
                        done_l.append(torch.tensor(float(t % 7 == 6)))
                        obs = torch.randn(6)
                    _, next_value = agent(obs, torch.ones(5, dtype=torch.bool))
                    values, rewards, dones = torch.stack(val_l), torch.stack(rew_l), torch.stack(done_l)
                    advantages, last = torch.zeros(horizon), torch.tensor(0.0)
                    for t in reversed(range(horizon)):
                        nxt = next_value if t == horizon - 1 else values[t + 1]
                        delta = rewards[t] + gamma * nxt * (1 - dones[t]) - values[t]
                        last = delta + gamma * lam * (1 - dones[t]) * last
                        advantages[t] = last
                    returns = advantages + values
                b_obs, b_legal, b_act, b_logp = (torch.stack(x) for x in (obs_l, legal_l, act_l, logp_l))
                for _ in range(3):  # epochs
                    for idx in torch.randperm(horizon).split(8):
                        dist, value = agent(b_obs[idx], b_legal[idx])
                        logratio = dist.log_prob(b_act[idx]) - b_logp[idx]
                        ratio = logratio.exp()
                        with torch.no_grad():
                            approx_kl = ((ratio - 1) - logratio).mean()
                        adv = advantages[idx]
                        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                        pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
                        loss = pg + 0.5 * F.mse_loss(value, returns[idx]) - 0.01 * dist.entropy().mean()
                        opt.zero_grad()
                        loss.backward()
                        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                        opt.step()
                        out += [loss.detach(), approx_kl]
                    if approx_kl > target_kl:
                        break
            return out

        return Loop((agent, opt), (agent, opt), run)

    return build


class SquashedActor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.mu, self.log_std = nn.Sequential(nn.Linear(4, 32), nn.ReLU()), nn.Linear(32, 2), nn.Linear(32, 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.net(obs)
        dist = Normal(self.mu(h), self.log_std(h).clamp(-20, 2).exp())
        u = dist.rsample()
        action = torch.tanh(u)
        logp = dist.log_prob(u).sum(-1) - torch.log(1 - action.pow(2) + 1e-6).sum(-1)
        return action, logp


def sac_actor():
    """SAC's actor and entropy temperature: a squashed Gaussian, pre-tanh values large enough to saturate."""

    def build() -> Loop:
        actor, critic = SquashedActor(), nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
        log_alpha = torch.zeros(1, requires_grad=True)
        opt = torch.optim.Adam(actor.parameters(), lr=3e-3)
        opt_alpha = torch.optim.Adam([log_alpha], lr=3e-3)
        with torch.no_grad():
            actor.mu.bias.fill_(4.0)  # tanh(4 + noise): the correction's 1 - tanh^2 is near 0

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(4):
                obs = torch.randn(16, 4)
                action, logp = actor(obs)
                q = critic(torch.cat([obs, action], -1)).squeeze(-1)
                loss = (log_alpha.exp().detach() * logp - q).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                alpha_loss = -(log_alpha * (logp.detach() - 2.0)).mean()
                opt_alpha.zero_grad()
                alpha_loss.backward()
                opt_alpha.step()
                out += [loss.detach(), log_alpha.detach().clone()]
            return out

        return Loop((actor, opt, opt_alpha), (actor, critic, opt, opt_alpha), run)

    return build


# ---------------------------------------------------------------- graph networks

NODES = 7  # nodes 5 and 6 have no edge at all
EDGES = torch.tensor([[0, 1, 1, 2, 3, 4, 0], [1, 0, 2, 1, 4, 3, 3]])


class GCN(nn.Module):
    def __init__(self, d_in: int = 4, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d_in, d), nn.Linear(d, classes)

    @staticmethod
    def propagate(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        deg_inv_sqrt = deg.pow(-0.5)
        deg_inv_sqrt[deg_inv_sqrt == float("inf")] = 0  # PyG's gcn_norm: isolated nodes
        norm = deg_inv_sqrt[src] * deg_inv_sqrt[dst]
        return torch.zeros_like(x).index_add_(0, dst, norm[:, None] * x[src]) + x

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.propagate(F.relu(self.propagate(self.lin1(x), edges)), edges))


class GAT(nn.Module):
    def __init__(self, d_in: int = 4, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.lin, self.att, self.head = (
            nn.Linear(d_in, d, bias=False),
            nn.Parameter(torch.randn(2 * d) * 0.1),
            nn.Linear(d, classes),
        )

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        h = self.lin(x)
        e = F.leaky_relu(torch.cat([h[dst], h[src]], -1) @ self.att, 0.2)
        e_max = torch.full((x.shape[0],), NEG_INF).scatter_reduce(0, dst, e, "amax", include_self=True)
        w = (e - e_max[dst]).exp()  # isolated nodes keep -inf: no edge reads them
        denom = torch.zeros(x.shape[0]).index_add_(0, dst, w)
        alpha = w / (denom[dst] + 1e-16)
        return self.head(F.elu(torch.zeros_like(h).index_add_(0, dst, alpha[:, None] * h[src]) + h))


class SageGraphs(nn.Module):
    """Mean aggregation over ``deg.clamp(min=1)``, then a graph-level mean readout by ``index_add`` (two graphs)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_lin, self.neigh_lin, self.head = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        summed = torch.zeros_like(x).index_add_(0, dst, x[src])
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0])).clamp(min=1)
        h = F.relu(self.self_lin(x) + self.neigh_lin(summed / deg[:, None]))
        pooled = torch.zeros(2, h.shape[1]).index_add_(0, batch, h)
        return self.head(pooled / torch.bincount(batch, minlength=2).clamp(min=1)[:, None])


def gnn(kind: str):
    def build() -> Loop:
        x = torch.randn(NODES, 4)
        model = {"gcn": GCN, "gat": GAT, "sage": SageGraphs}[kind]()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
        batch = torch.tensor([0, 0, 0, 1, 1, 1, 1])

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(4):
                if kind == "sage":
                    loss = F.cross_entropy(model(x, EDGES, batch), torch.tensor([0, 1]))
                else:
                    logits = model(F.dropout(x, 0.2), EDGES)
                    train_mask = torch.tensor([1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
                    loss = F.cross_entropy(logits[train_mask], torch.tensor([0, 1, 2, 1, 0]))
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            model.eval()
            with torch.no_grad():
                out.append(model(x, EDGES, batch) if kind == "sage" else model(x, EDGES).argmax(-1))
            model.train()
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- seq2seq with beam search

PAD, BOS, EOS, VOCAB = 0, 1, 2, 12


class Seq2Seq(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(VOCAB, d, padding_idx=PAD), nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.encoder, self.decoder = nn.GRU(d, d, batch_first=True), nn.GRUCell(2 * d, d)
        self.out = nn.Linear(2 * d, VOCAB)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory, h = self.encoder(self.src_emb(src))
        return memory, h[0]

    def step(self, token: torch.Tensor, h: torch.Tensor, memory: torch.Tensor, src: torch.Tensor):
        scores = (memory @ h[:, :, None]).squeeze(-1).masked_fill(src == PAD, NEG_INF)  # padding never attended
        context = (scores.softmax(-1)[:, :, None] * memory).sum(1)
        h = self.decoder(torch.cat([self.tgt_emb(token), context], -1), h)
        return F.log_softmax(self.out(torch.cat([h, context], -1)), -1), h

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, teacher_forcing: float) -> torch.Tensor:
        memory, h = self.encode(src)
        token, logps = tgt[:, 0], []
        for t in range(1, tgt.shape[1]):
            logp, h = self.step(token, h, memory, src)
            logps.append(logp)
            use_truth = torch.rand(()) < teacher_forcing
            token = tgt[:, t] if use_truth else logp.argmax(-1)
        return torch.stack(logps, 1)

    @torch.no_grad()
    def beam_search(self, src: torch.Tensor, beams: int = 3, max_len: int = 6) -> torch.Tensor:
        memory, h = self.encode(src[None])
        memory, h, src_b = memory.expand(beams, -1, -1), h.expand(beams, -1), src[None].expand(beams, -1)
        scores = torch.zeros(beams)
        scores[1:] = NEG_INF  # the first step expands one beam only
        seqs, tokens, finished = torch.full((beams, 1), BOS), torch.full((beams,), BOS), []
        for _ in range(max_len):
            logp, h = self.step(tokens, h, memory, src_b)
            total = (scores[:, None] + logp).view(-1)
            scores, flat = total.topk(beams)
            origin, tokens = flat // VOCAB, flat % VOCAB
            seqs, h = torch.cat([seqs[origin], tokens[:, None]], 1), h[origin]
            for b in (tokens == EOS).nonzero().flatten().tolist():
                finished.append((scores[b] / seqs.shape[1], seqs[b]))
            scores = scores.masked_fill(tokens == EOS, NEG_INF)  # a finished beam is not extended
        finished += [(scores[b] / seqs.shape[1], seqs[b]) for b in range(beams) if scores[b] > NEG_INF]
        return max(finished, key=lambda pair: float(pair[0]))[1]


def seq2seq():
    def build() -> Loop:
        model = Seq2Seq()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        src = torch.randint(3, VOCAB, (4, 6))
        src[2:, 4:] = PAD
        tgt = torch.cat([torch.full((4, 1), BOS), src.flip(1)], 1)

        def run() -> list[torch.Tensor]:
            out = []
            for epoch in range(4):
                logps = model(src, tgt, teacher_forcing=1.0 - epoch / 4)
                loss = F.nll_loss(logps.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1), ignore_index=PAD)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                out.append(loss.detach())
            model.eval()
            out += [model.beam_search(src[2]), model(src, tgt, teacher_forcing=0.0).argmax(-1)]
            model.train()
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- nearest neighbours


def knn_probe():
    """An embedding trained by a batch-hard triplet loss (the other classes masked with -inf and inf); kNN
    accuracy computed in chunks, merged into a running top-k that starts at inf, and a 1-NN whose diagonal is
    filled with inf (leave one out)."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(12, 6), torch.arange(12) % 3

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                z = model(x)
                d = torch.cdist(z, z)
                same = y[:, None] == y[None]
                hardest_pos = d.masked_fill(~same | torch.eye(12, dtype=torch.bool), NEG_INF).amax(1)
                hardest_neg = d.masked_fill(same, INF).amin(1)
                loss = F.relu(hardest_pos - hardest_neg + 0.5).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            with torch.no_grad():
                z = model(x)
                best_d, best_i = torch.full((12, 3), INF), torch.full((12, 3), -1)
                for start in range(0, 12, 5):
                    d = torch.cdist(z, z[start : start + 5])
                    rows = torch.arange(12)
                    own = (rows >= start) & (rows < start + 5)
                    d[own, rows[own] - start] = INF  # leave one out
                    merged_d = torch.cat([best_d, d], 1)
                    merged_i = torch.cat([best_i, torch.arange(start, start + d.shape[1]).expand(12, -1)], 1)
                    best_d, pick = merged_d.topk(3, largest=False)
                    best_i = merged_i.gather(1, pick)
                votes = F.one_hot(y[best_i], 3).sum(1)
                nearest = torch.cdist(z, z).fill_diagonal_(INF).argmin(1)  # 1-NN, leave one out
                out += [best_d, (votes.argmax(1) == y).float().mean(), (y[nearest] == y).float().mean()]
            return out

        return Loop((model, opt), (model, opt), run)

    return build


def prototypical():
    """Few-shot episodes where some of the five classes have no support example: their prototype is at inf."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def run() -> list[torch.Tensor]:
            out = []
            for episode in range(3):
                present = torch.tensor([0, 1, 2]) + episode % 2
                support_y = present.repeat(2)
                query_y = present.repeat(2)
                support, query = model(torch.randn(6, 6)), model(torch.randn(6, 6))
                counts = torch.zeros(5).index_add_(0, support_y, torch.ones(6))
                protos = torch.zeros(5, 8).index_add_(0, support_y, support) / counts.clamp(min=1)[:, None]
                d = torch.cdist(query, protos).pow(2).masked_fill(counts[None] == 0, INF)
                loss = F.cross_entropy(-d, query_y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out += [loss.detach(), (-d).argmax(1)]
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- early stopping and metrics


def early_stopping(best_as_tensor: bool):
    """Patience on a validation loss whose best starts at inf (a float, or a tensor), ReduceLROnPlateau, the best
    weights kept by ``deepcopy(state_dict())`` and loaded back at the end."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        xt, yt, xv, yv = torch.randn(32, 5), torch.randn(32, 1), torch.randn(16, 5), torch.randn(16, 1)

        def run() -> list[torch.Tensor]:
            best = torch.tensor(INF) if best_as_tensor else float("inf")
            best_state, bad, out = None, 0, []
            for _ in range(12):
                model.train()
                loss = F.mse_loss(model(xt), yt)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    val = F.mse_loss(model(xv), yv)
                sched.step(val)
                out += [loss.detach(), val]
                if val < best - 1e-4:
                    best, bad = (val.clone() if best_as_tensor else val.item()), 0
                    best_state = copy.deepcopy(model.state_dict())
                else:
                    bad += 1
                    if bad >= 3:
                        break
            model.load_state_dict(best_state)
            return [*out, torch.as_tensor(best)]

        return Loop((model, opt), (model, opt), run)

    return build


def nan_padded_targets():
    """Variable-length regression targets padded with NaN (a collator's choice): the loss masks them, the metrics
    use ``nanmean`` and a per-series R² whose empty series is 0/0 (NaN) and skipped by ``nanmean``."""

    def build() -> Loop:
        model = nn.GRU(3, 8, batch_first=True)
        head = nn.Linear(8, 1)
        opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=1e-2)
        x = torch.randn(4, 6, 3)
        y = torch.randn(4, 6)
        y[1, 4:], y[2, 2:], y[3, :] = NAN, NAN, NAN  # the last series has no target at all

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                pred = head(model(x)[0]).squeeze(-1)
                keep = ~torch.isnan(y)
                loss = F.mse_loss(pred[keep], y[keep])
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    err = torch.where(keep, (pred - y) ** 2, NAN)
                    mean_y = y.nanmean(1, keepdim=True)
                    ss_tot = torch.where(keep, (y - mean_y) ** 2, NAN).nansum(1)
                    r2 = 1 - err.nansum(1) / ss_tot  # the empty series: 1 - 0/0
                    out += [loss.detach(), err.nanmean(), r2.nanmean(), torch.nanmedian(err)]
            return out

        return Loop((model, head, opt), (model, head, opt), run)

    return build


SEARCHES = {
    "ppo-invalid-action-masks-gae-kl-stop": ppo(),
    "sac-squashed-gaussian-saturated": sac_actor(),
    "gcn-isolated-nodes-deg-pow-inf-zeroed": gnn("gcn"),
    "gat-edge-softmax-scatter-amax-from-neg-inf": gnn("gat"),
    "sage-mean-clamped-degree-graph-readout": gnn("sage"),
    "seq2seq-teacher-forcing-beam-search": seq2seq(),
    "knn-leave-one-out-inf-running-topk": knn_probe(),
    "protonet-missing-classes-at-inf": prototypical(),
    "early-stopping-float-inf": early_stopping(best_as_tensor=False),
    "early-stopping-tensor-inf": early_stopping(best_as_tensor=True),
    "nan-padded-targets-nanmean-r2": nan_padded_targets(),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", SEARCHES)
def test_programs_with_sentinels_masks_and_starting_infinities_are_calm_and_identical(name: str, options: dict):
    assert_calm(SEARCHES[name], options)


def test_the_sentinels_are_really_there() -> None:
    """Guards against moot cases: GCN's degree has an inf it zeroes, GAT's maximum keeps a -inf, the empty series'
    R² is skipped (the metrics come out finite), the SAC correction's 1 - tanh^2 comes near 0."""
    torch.manual_seed(0)
    deg = torch.zeros(NODES).index_add_(0, EDGES[1], torch.ones(EDGES.shape[1]))
    assert torch.isinf(deg.pow(-0.5)).any()
    e_max = torch.full((NODES,), NEG_INF).scatter_reduce(0, EDGES[1], torch.zeros(7), "amax", include_self=True)
    assert torch.isinf(e_max).any()
    loop = SEARCHES["nan-padded-targets-nanmean-r2"]()
    assert all(torch.isfinite(t).all() for t in loop.run())
    actor = SquashedActor()
    with torch.no_grad():
        actor.mu.bias.fill_(4.0)
        action, _ = actor(torch.randn(16, 4))
    assert (1 - action.pow(2)).min() < 1e-3
