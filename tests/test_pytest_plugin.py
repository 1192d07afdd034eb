"""The pytest plugin: a test suite asserts that a training step stays finite.

The plugin is loaded with ``-p nan_magic.pytest_plugin`` in a pytest run in
a subprocess (installed, the ``pytest11`` entry point loads it).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]

# Installed with its pytest11 entry point the plugin loads by itself; naming
# it again with -p would register the module twice.
PLUGIN = [] if any(ep.value == "nan_magic.pytest_plugin" for ep in entry_points(group="pytest11")) else [
    "-p", "nan_magic.pytest_plugin"
]

SUITE = '''
import pytest
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


def make(eps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Norm(eps))
    with torch.no_grad():
        model[0].weight.zero_()  # every row entering Norm is constant
        model[0].bias.zero_()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, opt):
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture
def model():
    return make(eps=0.0)[0]


def test_fixture_passes_a_finite_step(nan_watch):
    model, opt = make(eps=1e-5)
    with nan_watch(model, opt) as watch:
        train_step(model, opt)
    assert watch.report is None


def test_fixture_fails_a_non_finite_step(nan_watch):
    model, opt = make(eps=0.0)
    with nan_watch(model, opt):
        train_step(model, opt)


def test_fixture_fails_in_warn_mode_too(nan_watch):
    model, opt = make(eps=0.0)
    with pytest.warns(RuntimeWarning), nan_watch(model, opt, on_detect="warn"):
        train_step(model, opt)


@pytest.mark.nan_watch(ops=True)
def test_marker_fails_the_whole_test():
    model, opt = make(eps=0.0)
    train_step(model, opt)


@pytest.mark.nan_watch("model")
def test_marker_watches_a_named_fixture(model):
    model(torch.randn(8, 4))


@pytest.mark.nan_watch
def test_marker_passes_a_healthy_test():
    model, opt = make(eps=1e-5)
    train_step(model, opt)


@pytest.mark.nan_watch("nothing")
def test_marker_naming_an_unknown_fixture():
    pass
'''


def test_fixture_and_marker_fail_exactly_the_non_finite_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_training=SUITE)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=5)
    # each failure is the text report (its headline first), not a traceback into nan_magic
    result.stdout.fnmatch_lines([
        "*_ test_fixture_fails_a_non_finite_step _*",
        "nan_magic: first non-finite value in forward step 0: 1 (Norm), op aten.div.Tensor*",
        "*cause*division-by-zero*",
        "*_ test_fixture_fails_in_warn_mode_too _*",
        "nan_magic: first non-finite value in forward step 0: 1 (Norm), op aten.div.Tensor*",
        "*_ test_marker_fails_the_whole_test _*",
        "nan_magic: first non-finite value in forward step 0: 1 (Norm), op aten.div.Tensor*",
        "*_ test_marker_watches_a_named_fixture _*",
        "nan_magic: first non-finite value in forward step 0: 1 (Norm), op aten.div.Tensor*",
        "*_ test_marker_naming_an_unknown_fixture _*",
        "@pytest.mark.nan_watch names 'nothing': not fixtures this test uses",
    ])
    assert "nan_magic/pytest_plugin.py" not in result.stdout.str()
    assert "pluggy/" not in result.stdout.str()  # the report's frames lead from the test to the producer


def test_the_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.nan_watch(*fixture_names, **options):*"])
