"""The counts and the cause describe the producing op's own output, in every mode.

Where a replay names the op, the report's tensor is the op's output (a
float16 ``bmm`` made +inf), not the module output the check saw (NaN after
the softmax that followed); the cause is read from that op and its operands.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario


class HalfAttention(nn.Module):
    """Scaled-less dot-product attention in float16: the scores overflow, softmax makes NaN of them."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(16, 16).half()
        self.key = nn.Linear(16, 16).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.query(x), self.key(x)
        scores = torch.bmm(q, k.transpose(1, 2))  # producer: fp16 bmm
        return torch.softmax(scores, dim=-1)


class ExpGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.exp(self.gate(x))  # producer: exp gate
        return weights / weights.sum(-1, keepdim=True)


def _half_attention() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(HalfAttention())
    with torch.no_grad():
        model[0].query.weight.fill_(1.0)
        model[0].key.weight.fill_(1.0)
    x = torch.full((2, 4, 16), 8.0, dtype=torch.float16)  # q = k ~ 128: q . k ~ 16 * 16384 > 65504
    return Scenario((model,), lambda: model(x))


def _exp_gate() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ExpGate())
    x = torch.randn(4, 8) * 600
    return Scenario((model,), lambda: model(x))


CASES = [
    Case("fp16_bmm_then_softmax", _half_attention,
         Expect("forward", "0", "HalfAttention", op="aten.bmm.default", marker="fp16 bmm",
                kinds=frozenset({"+inf"}), cause="half-precision-overflow")),
    Case("exp_then_normalise", _exp_gate,
         Expect("forward", "1", "ExpGate", op="aten.exp.default", marker="exp gate",
                kinds=frozenset({"+inf"}), cause="exp-overflow")),
]
