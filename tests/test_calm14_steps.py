"""No false alarm after hot14a (168621e, 469ccbb): the parameter check after a step reads one sum of the small CPU
parameters, measuring them one by one where that sum is not finite. Healthy parameters that stress the sum: huge
finite values, mixed dtypes, a group added mid-run, a parameter resized or moved to another dtype in place, frozen
ones. Each in the five modes, unwatched and watched bit-identical (tests/test_calm14.py's assert_calm)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_calm14 import assert_calm
from torch import nn
from watching import FIVE_MODES

#: Optimizers: RMSprop's step is checked after every step, SGD's and AdamW's every 16th and at the watch's end.
OPTIMIZERS = {
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


class Net(nn.Module):
    """Linear -> LayerNorm -> Linear; ``big`` a parameter no forward reads, ``scale`` one it does."""

    def __init__(self, big: float = 0.0) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.ones(8))
        self.big = nn.Parameter(torch.full((6,), big))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        h = self.norm(h.to(self.norm.weight.dtype)).to(self.out.weight.dtype)
        return self.out(h * self.scale[: h.shape[-1]].to(h.dtype)).float()


def scenario(optimizer: str, setup: Callable[[Net], None] = lambda m: None,
             mid_run: Callable[[Net, torch.optim.Optimizer], None] | None = None, steps: int = 4,
             big: float = 0.0, params: Callable[[Net], list] = lambda m: list(m.parameters())):
    def build():
        torch.manual_seed(0)
        model = Net(big)
        setup(model)
        opt = OPTIMIZERS[optimizer](params(model))

        def run() -> list[torch.Tensor]:
            torch.manual_seed(1)
            outputs = []
            for step in range(steps):
                if step == steps // 2 and mid_run is not None:
                    mid_run(model, opt)
                out = model(torch.randn(3, 4))
                loss = out.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                outputs += [loss.detach(), out.detach()]
            return outputs
        return (model, opt), model, run
    return build


def _bf16_norm(model: Net) -> None:
    model.norm.to(torch.bfloat16)


def _huge_float64(model: Net) -> None:
    model.double()
    model.big.data.fill_(1e308)  # 6 x 1e308: float64's sum overflows


def _freeze_inp(model: Net) -> None:
    model.inp.requires_grad_(False)


def _resize_scale(model: Net, opt: torch.optim.Optimizer) -> None:
    model.scale.data = model.scale.data[:8].clone()  # (the same length: a new storage behind the same parameter)
    model.big.data = model.big.data[:3]  # a parameter shrunk in place


def _double_all(model: Net, opt: torch.optim.Optimizer) -> None:
    model.double()


def _double_the_last(model: Net, opt: torch.optim.Optimizer) -> None:
    model.out.double()  # not the first parameter: the layout's dtype is unchanged


def _bf16_the_norm(model: Net, opt: torch.optim.Optimizer) -> None:
    model.norm.to(torch.bfloat16)  # a LayerNorm moved to bf16 mid-run


def _add_group(model: Net, opt: torch.optim.Optimizer) -> None:
    head = nn.Linear(1, 1)
    model.extra = head  # (a new module: registered, the forward does not call it)
    opt.add_param_group({"params": list(head.parameters()), "lr": 1e-3})


def _unfreeze(model: Net, opt: torch.optim.Optimizer) -> None:
    model.inp.requires_grad_(True)


CASES = {
    "huge_finite_parameters_whose_sum_overflows": {"big": 3e38},
    "huge_finite_float64_parameters": {"setup": _huge_float64},
    "float32_and_float64_parameters": {"setup": lambda m: m.out.double()},
    "a_bf16_layernorm": {"setup": _bf16_norm},
    "frozen_parameters_in_the_optimizer": {"setup": _freeze_inp},
    "frozen_parameters_left_out_then_unfrozen": {"setup": _freeze_inp, "mid_run": _unfreeze,
                                                 "params": lambda m: [p for p in m.parameters() if p.requires_grad]},
    "add_param_group_mid_run": {"mid_run": _add_group},
    "a_parameter_resized_in_place": {"mid_run": _resize_scale, "big": 1.0},
    "model_double_mid_run": {"mid_run": _double_all},
    "last_module_double_mid_run": {"mid_run": _double_the_last},
    "layernorm_to_bf16_mid_run": {"mid_run": _bf16_the_norm},
    "huge_and_the_last_module_double_mid_run": {"mid_run": _double_the_last, "big": 3e38},
}


#: A parameter's dtype changed mid-run under AdamW fails unwatched too (its state keeps the old dtype).
_DTYPE_MID_RUN = ("model_double_mid_run", "last_module_double_mid_run", "layernorm_to_bf16_mid_run",
                  "huge_and_the_last_module_double_mid_run")


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize(("name", "optimizer"), [(name, optimizer) for name in CASES for optimizer in OPTIMIZERS
                                                 if not (optimizer == "adamw" and name in _DTYPE_MID_RUN)])
def test_healthy_parameters_that_stress_the_step_checks_one_sum_are_calm(name: str, optimizer: str,
                                                                         options: dict) -> None:
    assert_calm(scenario(optimizer, **CASES[name]), options)


@pytest.mark.parametrize("name", ["huge_finite_parameters_whose_sum_overflows", "last_module_double_mid_run",
                                  "a_parameter_resized_in_place", "layernorm_to_bf16_mid_run"])
def test_those_steps_take_the_one_sum_and_its_fallback(name: str, monkeypatch) -> None:
    # The cases above reach the code they stress: immediate RMSprop's checks read one sum (optim.read_step_result),
    # non-finite for the huge parameters (then measured one by one), finite with dtypes mixed since the layout.
    from nan_magic.hot.checks.optimizer import step_checks as optim

    seen: list[tuple[bool, bool]] = []
    read = optim.read_step_result

    def spy(result):  # type: ignore[no-untyped-def]
        values = read(result)
        seen.append((result.summed, len(values) == len(result.updated)))
        return values

    monkeypatch.setattr(optim, "read_step_result", spy)
    assert_calm(scenario("rmsprop", **CASES[name]), {})
    # (summed, measured one by one): the huge parameters' sum overflows at every check, the others' does not (a
    # parameter's dtype changed since the layout was built: the concatenation promotes).
    assert seen == [(True, name.startswith("huge"))] * 4


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("change", ["layernorm_to_bf16", "last_module_double", "none"])
def test_a_parameter_the_step_makes_non_finite_after_a_dtype_change_is_named(change: str, options: dict) -> None:
    # The broken twin: the LayerNorm's own group gets a learning rate of 1e38 at step 3 (RMSprop: an update of
    # about lr / sqrt(1 - alpha) = 1e39, inf in float32 and bf16), after a dtype changed under a layout built before.
    from watching import raised

    torch.manual_seed(0)
    model = Net()
    norm = list(model.norm.parameters())
    opt = torch.optim.RMSprop([{"params": [p for p in model.parameters() if all(p is not q for q in norm)]},
                               {"params": norm}], lr=1e-3)

    def run() -> None:
        for step in range(5):
            if step == 2:
                {"layernorm_to_bf16": _bf16_the_norm, "last_module_double": _double_the_last,
                 "none": lambda m, o: None}[change](model, opt)
            if step == 3:
                opt.param_groups[1]["lr"] = 1e38
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, **options)
    assert (report.phase.value, report.module, report.step) == ("optimizer", "norm", 3)
    assert report.tensor.name in ("norm.weight", "norm.bias")
