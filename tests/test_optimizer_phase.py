"""Issue 27: the optimizer step's replay and the loop's update code, beyond what the contract table asserts."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRef


def _adam_fp16_run(watched: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], nan_magic.Watch | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    tokens = torch.tensor([3, 7])

    def steps() -> None:
        for _ in range(2):
            opt.zero_grad()
            model(tokens).float().sum().backward()
            opt.step()

    w = None
    if watched:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nan_magic.watch(model, opt, on_detect="log") as w:
                steps()
    else:
        steps()
    state = [value for p in model.parameters() for value in opt.state[p].values()]
    return [p.detach().clone() for p in model.parameters()], state, w


def test_the_optimizer_replay_names_the_op_and_leaves_the_real_parameters_and_state_alone() -> None:
    params, state, w = _adam_fp16_run(watched=True)
    expected_params, expected_state, _ = _adam_fp16_run(watched=False)
    assert w is not None and w.report is not None
    assert (w.report.phase, w.report.op, w.report.step) == ("optimizer", "aten.addcdiv_.default", 0)
    for got, expected in zip(params + state, expected_params + expected_state):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def _hand_sgd(bad_step: int, through_data: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> None:
        for step in range(4):
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    scale = torch.tensor(0.0 if step == bad_step else 1.0)
                    target = parameter.data if through_data else parameter
                    target.sub_(0.01 * parameter.grad * scale / scale)  # producer: scaled update
                    parameter.grad = None

    return model, run


@pytest.mark.parametrize("mode", [{}, {"defer": True}, {"ops": True}])
def test_a_hand_written_update_is_reported_at_the_step_it_made_a_parameter_non_finite(mode) -> None:
    model, run = _hand_sgd(bad_step=2)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **mode):
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.line.endswith("# producer: scaled update")


def test_a_write_through_dot_data_is_seen_as_a_write_to_the_parameter() -> None:
    model, run = _hand_sgd(bad_step=1, through_data=True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 1, "aten.div.Tensor")
    assert report.tensor == TensorRef.parameter("0.weight")


def test_a_healthy_clipping_loop_is_only_watched_after_its_first_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    seen = []
    with nan_magic.watch(model, opt) as w:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mode = _get_current_dispatch_mode()
            seen.append((getattr(mode, "watching", None), mode.recorded() if mode is not None else None))
            opt.step()
    assert w.report is None
    # The first step's update code ran clipping's ops and wrote no parameter: from then on it is watched (each
    # op passes through, none recorded) until an op writes a watched parameter (contract/loop_writes.py).
    assert seen == [(False, 8), (True, 0), (True, 0), (True, 0)]


TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _one_linear(weight: list[float], bias: float) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(len(weight), 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([weight]))
        model[0].bias.fill_(bias)
    return model


@pytest.mark.parametrize("options", TIMINGS)
def test_a_small_models_step_check_names_the_parameter_the_step_made_non_finite(options: dict[str, bool]) -> None:
    # A small CPU float32 model's parameters are checked after the step as one sum of their concatenation
    # (step_checks.py's _step_result, immediate mode): a non-finite sum is measured one parameter at a time.
    # The second parameter is the one: the sum is not read as the first's value.
    model = _one_linear([1.0, 1.0], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e34)  # bias -= 1e34 * 1e5: -inf; the weight's gradient is 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        opt.zero_grad()
        (model(torch.zeros(1, 2)) * 1e5).sum().backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("optimizer", "0", 0)
    assert report.tensor == TensorRef.parameter("0.bias")
    assert bool(torch.isfinite(model[0].weight).all()) and not bool(torch.isfinite(model[0].bias).all())


@pytest.mark.parametrize("options", TIMINGS)
def test_finite_parameters_whose_sum_overflows_are_healthy(options: dict[str, bool]) -> None:
    # 4 x 3e38 overflows float32's sum (and each square its norm): each parameter, measured alone, is finite.
    model = _one_linear([3e38, 3e38, 3e38, 3e38], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an early warning: values near float32's limit)
        with nan_magic.watch(model, opt, **options) as w:
            for _ in range(3):
                opt.zero_grad()
                model(torch.zeros(2, 4)).sum().backward()  # a zero input: the weight's gradient is 0
                opt.step()
    assert w.report is None and w.step == 3
    assert bool(torch.isfinite(model[0].weight).all())
