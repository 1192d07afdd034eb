"""A non-finite output gradient is judged by what the node consuming it returns (hot/checks/consumed.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import nan_magic
from nan_magic import NonFiniteError

IMMEDIATE = [{}, {"mode": "full"}, {"ops": True}]
#: The default (tiered) watch takes a NaN gradient beside the model's -inf fill for that deliberate infinity and
#: reports its spread at the optimizer step (contract: hunt_s38_kl_between_masked_categorical_policies); without an
#: optimizer, these runs say nothing there.
NAMING = [{"mode": "full"}, {"ops": True}]


class Masked(nn.Module):
    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
        self.reentrant = reentrant

    def _forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~legal, float("-inf"))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self._forward(x, legal)
        return checkpoint(self._forward, x, legal, use_reentrant=self.reentrant)


def _setup(reentrant: bool | None = None) -> tuple[Masked, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    legal = torch.ones(4, 5, dtype=torch.bool)
    legal[0, 3:] = False
    x = torch.randn(4, 6, requires_grad=reentrant is True)  # (reentrant checkpointing needs an input needing grad)
    return Masked(reentrant), x, legal


def _loss(o: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
    return torch.where(legal, o ** 2, 0.0).mean()  # NaN gradient at the masked entries only


@pytest.mark.parametrize("options", NAMING)
def test_the_output_gradient_asked_for_by_autograd_grad_is_judged_as_the_pass_ends(options: dict) -> None:
    # The output's node never runs (autograd.grad asks for the output's own gradient): the NaN gradient the user gets
    # is judged when the backward pass ends, not lost.
    model, x, legal = _setup()
    with pytest.raises(NonFiniteError), nan_magic.watch(model, **options) as w:
        o = model(x, legal)
        torch.autograd.grad(_loss(o, legal), [o])
    assert w.report is not None and w.report.phase.value == "backward" and w.report.step == 0


@pytest.mark.parametrize("options", NAMING)
def test_a_user_hook_after_ours_that_spreads_the_nan_is_an_event(options: dict) -> None:
    # Our hook sees the NaN only at masked entries; the user's hook, registered after ours, spreads it over the
    # whole gradient, so the model's masked_fill returns NaN at legal entries: an event, named in backward.
    model, x, legal = _setup()
    with pytest.raises(NonFiniteError), nan_magic.watch(model, **options) as w:
        o = model(x, legal)
        o.register_hook(lambda g: g + g.sum())
        _loss(o, legal).backward()
    assert w.report is not None and w.report.phase.value == "backward" and w.report.step == 0
    assert model.net[0].weight.grad is None or not model.net[0].weight.grad.isfinite().all()


@pytest.mark.parametrize("options", IMMEDIATE)
def test_a_user_hook_after_ours_that_zeroes_the_nan_stays_silent(options: dict) -> None:
    model, x, legal = _setup()
    with nan_magic.watch(model, **options) as w:
        o = model(x, legal)
        o.register_hook(lambda g: g.nan_to_num(0.0))
        _loss(o, legal).backward()
    assert w.report is None
    assert all(p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("options", IMMEDIATE)
def test_non_reentrant_checkpointing_runs_on_unharmed(options: dict) -> None:
    # No saved tensor is read: the user's checkpointed backward does not raise CheckpointError, and nothing is said.
    model, x, legal = _setup(reentrant=False)
    with nan_magic.watch(model, **options) as w:
        _loss(model(x, legal), legal).backward()
    assert w.report is None
    assert all(p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("options", NAMING)
@pytest.mark.xfail(strict=True, raises=NonFiniteError, reason=(
    "under reentrant activation checkpointing the masked output's consumer is the checkpoint's custom Function, "
    "whose backward computes the parameters' gradients in an inner backward it does not return: the NaN gradient "
    "at the masked entries is judged at once and the healthy loop stops (backward, step 0)"))
def test_reentrant_checkpointing_of_a_healthy_masked_model(options: dict) -> None:
    model, x, legal = _setup(reentrant=True)
    with nan_magic.watch(model, **options) as w:
        _loss(model(x, legal), legal).backward()
    assert w.report is None


@pytest.mark.parametrize("options", NAMING)
def test_reentrant_checkpointing_still_names_a_real_incident(options: dict) -> None:
    model, x, legal = _setup(reentrant=True)
    with pytest.raises(NonFiniteError), nan_magic.watch(model, **options) as w:
        q = model(x, legal).log_softmax(-1)
        torch.where(legal, q ** 2, 0.0).sum().backward()  # the log-softmax backward spreads the NaN over the row
    assert w.report is not None and w.report.phase.value == "backward" and w.report.step == 0


class FilledByAParameter(nn.Module):
    """Illegal logits filled by a learned value: the output's node has two inputs that need a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.fill = nn.Parameter(torch.full((5,), -1e4))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return torch.where(legal, self.lin(x), self.fill)


@pytest.mark.parametrize("options", NAMING)
def test_a_node_with_several_inputs_that_passes_the_nan_to_one_is_an_event(options: dict) -> None:
    # The loss's sqrt(o + 1e4) is sqrt(0) at the filled entries: its backward is inf there, which the where's
    # backward drops from the logits' gradient but hands to the fill parameter's.
    _model, x, legal = _setup()
    model = FilledByAParameter()
    with pytest.raises(NonFiniteError), nan_magic.watch(model, **options) as w:
        o = model(x, legal)
        torch.where(legal, o ** 2, (o + 1e4).sqrt()).mean().backward()
    assert w.report is not None and w.report.phase.value == "backward" and w.report.step == 0
    assert model.lin.weight.grad is None or model.lin.weight.grad.isfinite().all()
