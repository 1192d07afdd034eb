"""A user's CI test suite using the pytest plugin (run by tests/test_user24.py, not collected by the repository's)."""
import pytest
import torch
import trainlib


@pytest.fixture
def model():
    torch.manual_seed(0)
    return trainlib.Net()


@pytest.fixture
def bad_model():
    torch.manual_seed(0)
    return trainlib.Net(bad_forward=True)


def test_clean_with_fixture(nan_watch, model):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nan_watch(model, opt):
        trainlib.train(model, opt, 3, "clean")


@pytest.mark.parametrize("kind", ["loss", "backward", "optimizer"])
def test_bad_with_fixture(nan_watch, model, kind):
    opt = torch.optim.SGD(model.parameters(), lr=float("inf") if kind == "optimizer" else 1e-2)
    with nan_watch(model, opt):
        trainlib.train(model, opt, 3, kind)


@pytest.mark.nan_watch("bad_model")
def test_bad_forward_marker(bad_model):
    opt = torch.optim.SGD(bad_model.parameters(), lr=1e-2)
    trainlib.train(bad_model, opt, 3, "clean")


@pytest.mark.nan_watch(on_detect="warn")
def test_bad_data_marker_warn(model):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainlib.train(model, opt, 4, "clean", bad_data_step=2)


@pytest.mark.nan_watch(defer=True, on_detect="log")
def test_clean_marker_defer(model):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainlib.train(model, opt, 3, "clean")
