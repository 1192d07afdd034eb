"""assign_s40, loop code that *assigns* a parameter or a gradient (no in-place op on it), each with its healthy twin.

A renormalisation in a helper, ``p.data = p.data / p.data.norm(...)``, after a dead-unit reset zeroes a row; a token
count normaliser applied by ``p.grad = p.grad / count`` after backward, over a batch with no counted token; a model
soup built by ``load_state_dict`` of weights the loop averaged with weights that sum to 0; and, to compare, the same
renormalisation written in place, ``p.copy_(p / p.norm(...))``. Each incident is exact by construction (a 0 / 0).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _renorm_by_data(weight: torch.Tensor, floor: float) -> None:
    """Rows to unit norm, by assignment (no in-place op)."""
    norm = weight.data.norm(dim=1, keepdim=True)
    weight.data = weight.data / (norm.clamp_min(floor) if floor else norm)  # producer: helper renorm


def _renorm_in_place(weight: torch.Tensor, floor: float) -> None:
    with torch.no_grad():
        norm = weight.norm(dim=1, keepdim=True)
        weight.copy_(weight / (norm.clamp_min(floor) if floor else norm))  # producer: copy renorm


def _dead_unit_reset(in_place: bool, floor: float) -> Scenario:
    """After each step, the loop keeps the first layer's rows at unit norm in a helper; at step 2 it resets a unit it
    takes for dead by zeroing its row first: the row's norm is 0 and the renormalisation is ``0 / 0``. The twin
    clamps the norm (a zeroed row stays 0)."""
    torch.manual_seed(0)
    model = _mlp()
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    renorm = _renorm_in_place if in_place else _renorm_by_data

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                with torch.no_grad():
                    model[0].weight[3] = 0.0  # a unit reset
            renorm(model[0].weight, floor)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _token_normalised(floor: float) -> Scenario:
    """Summed token losses, each gradient divided by the batch's count of counted tokens by ``p.grad = p.grad /
    count`` after backward; step 2's batch counts none: its gradients are all 0 and the division is ``0 / 0``. The
    twin divides by the count clamped to at least 1."""
    torch.manual_seed(0)
    model = _mlp()
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(4)]
    masks = [torch.rand(6) > 0.3 for _ in range(4)]
    masks[2] = torch.zeros(6, dtype=torch.bool)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            mask = masks[step].float()
            loss = (F.cross_entropy(model(xs[step]), ys[step], reduction="none") * mask).sum()
            opt.zero_grad()
            loss.backward()
            count = mask.sum().clamp_min(floor) if floor else mask.sum()
            for p in model.parameters():
                p.grad = p.grad / count  # producer: token count
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _soup(weights: tuple[float, float]) -> Scenario:
    """Every second step the loop builds a model soup: the current weights and a kept snapshot averaged with the
    weights ``(a, b)`` of each, ``(a * w + b * s) / (a + b)``, loaded by ``load_state_dict``. At step 2 the soup's
    weights are both 0 (a schedule that has not started): ``0 / 0`` in every weight. The twin weights them 1 and 1."""
    torch.manual_seed(0)
    model = _mlp()
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(4)]
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                a, b = weights
                current = model.state_dict()
                soup = {k: (a * current[k] + b * snapshot[k]) / torch.tensor(a + b) for k in current}  # producer: soup
                model.load_state_dict(soup)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("assign_s40_helper_renormalises_a_reset_row_by_data_assignment", lambda: _dead_unit_reset(False, 0.0),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div.Tensor", marker="helper renorm",
                cause="division-by-zero")),
    Case("assign_s40_helper_renormalises_by_data_assignment_with_a_floor_healthy",
         lambda: _dead_unit_reset(False, 1e-12), None),
    Case("assign_s40_helper_renormalises_a_reset_row_by_copy", lambda: _dead_unit_reset(True, 0.0),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div.Tensor", marker="copy renorm",
                cause="division-by-zero")),
    Case("assign_s40_helper_renormalises_by_copy_with_a_floor_healthy", lambda: _dead_unit_reset(True, 1e-12), None),
    Case("assign_s40_gradient_assigned_over_a_count_of_no_token", lambda: _token_normalised(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="token count", cause="division-by-zero")),
    Case("assign_s40_gradient_assigned_over_a_clamped_count_healthy", lambda: _token_normalised(1.0), None),
    Case("assign_s40_soup_of_weights_zero_loaded_by_load_state_dict", lambda: _soup((0.0, 0.0)),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div.Tensor", marker="soup", cause="division-by-zero")),
    Case("assign_s40_soup_of_weights_one_loaded_by_load_state_dict_healthy", lambda: _soup((1.0, 1.0)), None),
]
