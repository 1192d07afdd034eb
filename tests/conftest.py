"""Shared fixtures: every test starts from a clean hook state and seeded RNG."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

sys.path.insert(0, str(Path(__file__).parent))


def global_hook_counts() -> tuple[int, ...]:
    """Sizes of torch's global hook registries: a leaked watch shows up here."""
    return (
        len(module_hooks._global_forward_pre_hooks),
        len(module_hooks._global_forward_hooks),
        len(module_hooks._global_forward_hooks_with_kwargs),  # torch's handles forget this one
        len(module_hooks._global_forward_hooks_always_called),
        len(module_hooks._global_backward_hooks),
        len(module_hooks._global_backward_pre_hooks),
        len(module_hooks._global_parameter_registration_hooks),  # (LoopWrites.on_registered's, while watched)
        len(optimizer_hooks._global_optimizer_pre_hooks),
        len(optimizer_hooks._global_optimizer_post_hooks),
    )


@pytest.fixture(autouse=True)
def no_leaked_hooks():
    """Fail any test after which a global hook or a process-wide patch (patches.py) remains."""
    from nan_magic.patches import registry as patches

    before = global_hook_counts()
    backward = torch.Tensor.backward
    scaler_methods = (torch.amp.GradScaler.scale, torch.amp.GradScaler.step)
    # (The IPython extension, loaded for a module by the ``ip`` fixture, holds one while loaded: magics.py.)
    held = patches.installed()
    torch.manual_seed(0)
    yield
    assert global_hook_counts() == before, "a watch left global hooks behind"
    assert torch.Tensor.backward is backward, "a watch left Tensor.backward wrapped"
    assert (torch.amp.GradScaler.scale, torch.amp.GradScaler.step) == scaler_methods, "a watch left GradScaler wrapped"
    assert patches.installed() == held, "a process-wide patch was left installed"


@pytest.fixture(autouse=True)
def unhurried_fix_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fix trials' time budget (fixes/runner.py) is wall time: a loaded CI machine once spent its 2 s on the
    first trial and left a verified remedy untried. Tests assert what the trials find, so they get time enough;
    test_fixes.py's budget test sets its own (a test's monkeypatch runs after this one)."""
    from nan_magic.fixes import runner

    monkeypatch.setattr(runner, "MIN_BUDGET", 600.0)


@pytest.fixture(scope="module")
def ip():
    """A real in-process IPython shell with the extension loaded (unloaded after the module)."""
    from IPython.testing import globalipapp

    # Attribute lookups: start_ipython rebinds globalipapp.get_ipython once it has run.
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nan_magic")
    yield shell
    shell.run_line_magic("unload_ext", "nan_magic")


@pytest.fixture(scope="module")
def frozen_heap():
    """The suite's heap set aside for a module whose every row collects garbage (several full ``gc.collect()``s a
    row, to see what a watch leaves alive): in a whole-suite process a full collection walks every earlier test's
    objects, a second or more each. ``gc.freeze()`` moves what exists now out of the collector's reach, so each
    collection walks only what the module's own rows made, which is collected as usual. Put back after."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of small models (``pytestmark = pytest.mark.usefixtures(...)``): every op
    there is smaller than the work of waking torch's thread pool, and on a busy machine the pool's threads wait for
    cores (a healthy GPT-2 test took 3 s on the default two threads, 0.25 s on one). Put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
