"""hunt_s39g, a gradient the loop assigns itself: federated averaging over a round in which no client took part.

Each round, every sampled client computes its gradient with ``torch.autograd.grad`` on its own data; the server
averages them over the clients that took part and assigns ``p.grad = average`` before ``opt.step()``. Round 2's
Bernoulli sampling selected no client: the average is ``0 / 0``. The twin skips a round without clients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


def _fedavg(skip_empty: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    params = list(model.parameters())
    clients = [(_batches(4, 5, steps=1)[0], torch.randint(0, 3, (4,))) for _ in range(3)]
    taking_part = [torch.tensor([True, False, True]), torch.tensor([False, True, True]),
                   torch.tensor([False, False, False]), torch.tensor([True, True, False])]
    opt = torch.optim.SGD(params, lr=0.1)

    def run() -> list[torch.Tensor]:
        out = []
        for rnd in range(4):
            mask = taking_part[rnd]
            if skip_empty and not mask.any():
                continue
            per_client = []
            for x, y in clients:
                per_client.append(torch.autograd.grad(F.cross_entropy(model(x), y), params))
            weight = mask.float()
            for i, p in enumerate(params):
                stacked = torch.stack([g[i] for g in per_client])
                p.grad = (stacked * weight.view(-1, *[1] * p.ndim)).sum(0) / weight.sum()  # producer: fedavg
            opt.step()
            out.append(params[0].detach().clone())
        return out

    return Scenario((model, opt), run)


_EXPECT = Expect("backward", None, step=2, op="aten.div.Tensor", marker="fedavg", cause="division-by-zero")

CASES = [
    # (Before session 40 the tiered modes named no op: the assignment ``p.grad = ...`` is no in-place write, and the
    # update region, watched after its first step, dropped the first gradients' ops from its ring. A region that
    # assigns a watched parameter's gradient is now recorded every step: loop_writes._assigned_gradient.)
    Case("hunt_s39g_federated_average_over_a_round_without_clients", lambda: _fedavg(False), _EXPECT),
    Case("hunt_s39g_federated_average_skipping_an_empty_round_healthy", lambda: _fedavg(True), None),
]
