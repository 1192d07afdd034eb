"""A NaN carried on by a passive op (``cat``, ``where``) beside a deliberate infinity read before it (flake18).

The op tracer passes an origin on through a passive op from the tensors it reads. It took the first entry it
found, so where the first was a mask's deliberate -inf and a later one the NaN a division had just made, the output
was called benign and ``ops=True`` named the op after it (the cross entropy's mean). Each with its healthy twin, in
every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- open-set logits: masked classes, then "unknown"
def _open_set(safe: bool) -> Scenario:
    """Open-set classification: the class logits with the classes absent from the task masked by -inf, and an
    "unknown" logit appended, the mean logit over the classes present; at step 1 none is present, and that mean
    is 0 / 0 (its twin clamps the count to 1, as ``mean`` over an empty selection is guarded in practice)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    xs = _batches(2, 4)
    present = [
        torch.tensor([True, True, False]),
        torch.tensor([False, False, False]),
        torch.tensor([True, False, True]),
        torch.tensor([False, True, True]),
    ]

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        mask = present[step]
        masked = logits.masked_fill(~mask, float("-inf"))
        count = mask.sum().clamp(min=1) if safe else mask.sum()
        unknown = (logits * mask).sum(1, keepdim=True) / count  # producer: unknown logit
        return F.cross_entropy(torch.cat([masked, unknown], 1), torch.full((2,), 3))

    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- the hardest negative's ratio, picked by where
def _hardest_ratio(safe: bool) -> Scenario:
    """A mining loss keeps, of each row's negatives (the positives masked by -inf), the hardest one's ratio of
    similarity to its norm: ``where(hardest, sim / norm, 0)``, the -inf read first by the ``where`` of the mask
    made before it. At step 2 the batch holds a padding sample of zeros: its embedding's norm is 0, and 0 / 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    xs = _batches(4, 4)
    xs[2][1] = 0.0
    same = torch.eye(4, dtype=torch.bool)

    def loss_fn(emb: torch.Tensor, step: int) -> torch.Tensor:
        sim = emb @ emb.T
        negatives = sim.masked_fill(same, float("-inf"))
        norm = emb.norm(dim=1, keepdim=True) * emb.norm(dim=1) + (1e-8 if safe else 0.0)
        ratio = torch.where(negatives.isinf(), negatives, sim / norm)  # producer: hardest ratio
        return ratio.amax(1).mean()

    return _loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


CASES = [
    Case(
        "carried18_open_set_unknown_logit_over_no_class",
        lambda: _open_set(False),
        Expect("forward", None, step=1, op="aten.div.Tensor", marker="unknown logit", cause="division-by-zero"),
    ),
    Case("carried18_open_set_unknown_logit_count_clamped_healthy", lambda: _open_set(True), None),
    Case(
        "carried18_hardest_ratio_of_a_zero_embedding",
        lambda: _hardest_ratio(False),
        Expect("forward", None, step=2, op="aten.div.Tensor", marker="hardest ratio", cause="division-by-zero"),
    ),
    Case("carried18_hardest_ratio_with_eps_healthy", lambda: _hardest_ratio(True), None),
]
