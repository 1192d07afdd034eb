"""A training step made wholly of torch.func transforms (no backward(), no optimizer, the parameters in the loop's
dict): the watch reports its NaN in every mode, never crashes the run, and changes none of its values.

The contract rows (hunt_s39c.py, funcs_s40.py) say where the report should be; those that do not hold yet are strict
xfails there. This file holds what every mode gives today: an event at the first forward that runs on the loop's
non-finite tensor (read through the transform's wrapper, hot/reads.py ``unwrapped``), named as the tensor
functional_call swapped in for the parameter, outside every module. Before, every mode was silent while the weights
went NaN, and ``ops=True`` crashed the run ("Cannot access storage of TensorWrapper").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS, funcs_s40, hunt_s39c
from test_contract import same

import nan_magic
from nan_magic import NonFiniteError

_INCIDENTS = {
    "func_grad_hand_bce": lambda: hunt_s39c._func_logistic(False),
    "dp_sgd_auto_clip": lambda: hunt_s39c._dp_sgd(0.0),
    "grad_and_value_target_scale": lambda: funcs_s40._grad_and_value(0.0),
    "vjp_unit_residual": lambda: funcs_s40._vjp(0.0),
    "params_dict_sub": lambda: funcs_s40._in_place(0.0),
}


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize("incident", list(_INCIDENTS))
def test_a_func_step_nan_is_reported_as_the_loops_tensor(incident: str, mode: str) -> None:
    scenario = _INCIDENTS[incident]()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode]):
        scenario.run()
    report = caught.value.report
    assert report.module is None, report.message  # the loop's code, not the model's own forward
    swapped = [note.fact("name") for note in report.note_facts if note.kind == "swapped-in"]
    assert swapped and swapped[0].endswith("weight"), report.to_text()
    assert sum(report.counts.values()) > 0, report.counts


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize("incident", list(_INCIDENTS))
def test_a_func_step_watched_with_warn_computes_what_it_computes_unwatched(incident: str, mode: str) -> None:
    """on_detect="warn": the run goes on past the event, through every later transform, to the same values."""
    expected: Any = _INCIDENTS[incident]().run()
    scenario = _INCIDENTS[incident]()
    with pytest.warns(Warning), nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], on_detect="warn") as w:
        got = scenario.run()
    assert w.report is not None
    assert same(got, expected)
    assert any(torch.isnan(t).any() for t in got if isinstance(t, torch.Tensor))  # (the NaN did reach the weights)


def _own_parameters(eps: float) -> tuple[torch.nn.Module, Any]:
    """funcs_s40's in-place hinge step over ``dict(model.named_parameters())``: the model's own weights, which grad
    wraps (no ``nn.Parameter`` in the slot then, though no tensor of the loop's either)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    params = dict(model.named_parameters())
    xs = [torch.randn(6, 5) for _ in range(4)]
    ys = [torch.randint(0, 2, (6,)).float() * 2 - 1 for _ in range(4)]
    with torch.no_grad():
        xs[2] = 1000.0 * ys[2][:, None] * torch.nn.functional.normalize(params["weight"][0], dim=0)

    def hinge(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(1 - y * torch.func.functional_call(model, p, (x,)).squeeze(-1)).mean()

    def run() -> list[torch.Tensor]:
        out = []
        for step in range(4):
            g = torch.func.grad(hinge)(params, xs[step], ys[step])
            norm = torch.stack([t.norm() for t in g.values()]).norm()
            with torch.no_grad():
                for k, p in params.items():
                    p.sub_(0.1 * g[k] / (norm + eps))
            out.append(model.weight.detach().clone())
        return out

    return model, run


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_the_models_own_weight_under_grad_is_named_a_parameter_never_the_loops_tensor(mode: str) -> None:
    """The common idiom ``params = dict(model.named_parameters())``: the NaN weight is the model's own parameter.
    Before, the report said 'torch.func.functional_call ran the model with a tensor of the loop's own code in
    weight's place: it is no parameter of the model' (review of funcs-s40). ops=True names the loop's division."""
    model, run = _own_parameters(0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    assert not any(note.kind == "swapped-in" for note in report.note_facts), report.to_text()
    if report.op is None:  # (the tiered and full modes: the parameter the root read, already non-finite)
        assert (report.module, str(report.tensor)) == ("", "parameter weight"), report.to_text()
        assert report.cause is not None and report.cause.label == "parameter-already-nonfinite"
    else:
        assert report.op == "aten.div.Tensor" and report.module is None, report.to_text()


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_the_models_own_weights_under_grad_with_eps_stay_silent_and_unchanged(mode: str) -> None:
    expected = _own_parameters(1e-6)[1]()
    model, run = _own_parameters(1e-6)
    with nan_magic.watch(model, **MODE_OPTIONS[mode]) as w:
        got = run()
    assert w.report is None and same(got, expected)


class _WithAnEmptyBlock(torch.nn.Module):
    """A zero-width feature block beside a Linear, the model called inside vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.lin(x), self.extra(x[..., :0])], -1)


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_an_empty_output_inside_vmap_is_read_as_empty_not_counted_unreadable(mode: str) -> None:
    """An empty value has nothing to read, inside vmap as outside; it counted as 'functorch: 1' unread, whose words
    speak of functionalize (review of funcs-s40)."""
    torch.manual_seed(0)
    model = _WithAnEmptyBlock()
    with nan_magic.watch(model, **MODE_OPTIONS[mode]) as w:
        for _ in range(3):
            torch.func.vmap(model)(torch.rand(3, 4))
    assert w.report is None
    assert dict(w.skipped) == {}
