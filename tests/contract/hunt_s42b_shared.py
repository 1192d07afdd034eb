"""hunt_s42b (continued): one block two models share, made non-finite where the second model runs it.

The block is named once, under the first model (``shared.1`` in ``Encoder``); the report names the model whose call
ran it (``Decoder``), as the tiered replay of that call did: full and ops named the encoder. The healthy twin keeps
the decoder's latents random.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario, hunt_s42b
from contract.hunt_s42b import LogScale
from contract.loops import batches as _batches


# ---------------------------------------------------------------- further: one submodule shared by two models
class Encoder(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.pre(x))


class Decoder(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.out = nn.Linear(4, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(self.shared(z))


def _shared_block(dead: bool) -> Scenario:
    """An encoder and a decoder model that share one block (``shared``: named once, under the encoder); at step 2
    the decoder's latent batch is all zero and the block's bias zeroed: ``log(0)`` where the decoder runs it (the
    encoder's input keeps it finite). full and ops named the encoder. Twin: the latents stay random."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), LogScale())
    encoder, decoder = Encoder(block), Decoder(block)
    opt = torch.optim.SGD([*encoder.parameters(), *decoder.out.parameters()], lr=1e-2)
    xs, zs = _batches(5, 4), _batches(5, 4)
    if dead:
        zs[2] = torch.zeros(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2 and dead:
                with torch.no_grad():
                    block[0].bias.zero_()
            loss = encoder(xs[step]).mean() + decoder(zs[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((encoder, decoder), run)


CASES = [
    Case("hunt_s42b_a_block_two_models_share_run_by_the_second", lambda: _shared_block(True),
         Expect("forward", "shared.1", "LogScale", step=2, op="aten.log.default", marker="log scale",
                model="Decoder"), source=hunt_s42b),
    Case("hunt_s42b_a_block_two_models_share_healthy", lambda: _shared_block(False), None),
]
