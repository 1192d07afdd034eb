"""pytest plugin: assert that a training step stays finite.

Loaded through the ``pytest11`` entry point of the package (or ``-p
nan_magic.pytest_plugin``). Two ways to use it:

The ``nan_watch`` fixture, for one block::

    def test_step_stays_finite(nan_watch):
        model, opt = build()
        with nan_watch(model, opt):
            train_step(model, opt)

The ``nan_watch`` marker, for a whole test; positional arguments name
fixtures to watch (with none, every module the test calls at top level is
watched), keyword arguments are :func:`nan_magic.watch` options::

    @pytest.mark.nan_watch("model", ops=True)
    def test_epoch(model): ...

Either way, a real non-finite event fails the test with the text report
(also in ``on_detect="warn"``/``"log"`` modes, once the block ends; a test
that fails of its own after one has the report as a note under its error);
benign events do not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.lifecycle.entry import watch
from nan_magic.lifecycle.watch import Watch
from nan_magic.records import Report

__all__ = ["nan_watch", "watching"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "nan_watch(*fixture_names, **options): fail the test at a real NaN/Inf event "
        "(nan_magic.watch over the named fixtures, or every module called)",
    )


@contextlib.contextmanager
def watching(*targets: Any, **options: Any) -> Iterator[Watch]:
    """Run the block under :func:`nan_magic.watch`; fail the test at a real event."""
    __tracebackhide__ = True
    watcher = watch(*targets, **options)
    try:
        with watcher:
            yield watcher
    except NonFiniteError as error:
        _fail(error.report)
    except Exception as error:
        # warn/log: the test failed of its own after a real event (``assert torch.isfinite(loss)``): its error is
        # the failure, with the report under it (pytest shows an exception's notes), where it said nothing of it.
        if watcher.report is not None and hasattr(error, "add_note"):  # (Python 3.11+)
            error.add_note(watcher.report.to_text())
        raise
    if watcher.report is not None:
        _fail(watcher.report)


@pytest.fixture
def nan_watch() -> Callable[..., contextlib.AbstractContextManager[Watch]]:
    """``with nan_watch(*targets, **options):`` fails the test at a real NaN/Inf event.

    Takes what :func:`nan_magic.watch` takes; yields the watch.
    """
    return watching


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    marker = item.get_closest_marker("nan_watch")
    if marker is None or not isinstance(item, pytest.Function):
        return (yield)
    missing = [name for name in marker.args if name not in item.funcargs]
    if missing:
        pytest.fail(
            f"@pytest.mark.nan_watch names {', '.join(map(repr, missing))}: not fixtures this test uses",
            pytrace=False,
        )
    targets = [item.funcargs[name] for name in marker.args]
    options = {"labels": marker.args, **marker.kwargs}
    test = item.obj

    # The watch goes around the test function itself, not around this hook:
    # the report's frames then lead from the test to the producer, without
    # pytest's and pluggy's in between.
    @functools.wraps(test)
    def watched(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        with watching(*targets, **options):
            return test(*args, **kwargs)

    item.obj = watched
    try:
        return (yield)
    finally:
        item.obj = test


def _fail(report: Report) -> None:
    __tracebackhide__ = True
    # "from None": the report is the whole story, without a "during handling
    # of the above exception" chain (``pytest.fail`` cannot say so itself).
    raise pytest.fail.Exception(report.to_text(), pytrace=False) from None
