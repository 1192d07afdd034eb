"""What leaves the watch healthy (calm_s34), every mode: copies, files, compiled forms and exceptions.

tests/calm_s30.py: the harness and what is compared. The rows: a whole model pickled inside the watch and loaded
back after it, and a deepcopy made inside the watch torch.jit.script-ed after it before its first call (each carried
the watch's hook: fixed, see below); AveragedModel (a deepcopy torch makes) built inside the watch and scripted
after; torch.jit.trace and torch.jit.script of the watched model inside the watch; copy.copy of the watched model
(the hook dicts shared) called inside the watch; the user clearing every module's hook dicts mid-watch; an instance
forward monkeypatched mid-run; a global module forward hook of the user's; register_multi_grad_hook each step;
stack_module_state + vmap over an ensemble of watched models; a KeyboardInterrupt raised by a gradient hook of the
user's inside backward (still a KeyboardInterrupt, caught around the watch); a StopIteration of the user's iterator
inside the watched function.

The finding: a model saved whole (``torch.save(model)``, ``pickle``) or deep-copied inside the watch carried the
watch's forward hook (as an inert stand-in): in a fresh process without nan_magic, ``torch.jit.script`` of the
loaded model raised AttributeError ('functools.partial' object has no attribute '__name__'), and so did scripting a
deep copy made inside the watch, after it, before the copy's first call. Now ``nn.Module.__reduce_ex__`` leaves the
watch's hooks out while a watch is active (nan_magic/patches/copies.py): copies carry no hook, also those of a class
with its own ``__getstate__`` or ``__reduce__``; ``copy.copy`` still shares the hook dicts, as torch's does.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import types

import pytest
import torch
from calm_s30 import MODES, Row, check, data, mlp, sgd, steps
from contract import MODE_OPTIONS
from test_calm_s33_loops import _train_step as _step
from torch import nn
from torch.nn import functional as F

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
               + len(m._forward_hooks_always_called) for m in model.modules())


#: What torch's shallow copy of a module shares with it (its __dict__'s containers).
_SHARED = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
           "_modules", "_parameters")


def pickled_whole_and_loaded() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        out = []
        with watching():
            out += [_step(model, opt, x, y) for _ in range(2)]
            blob, saved = pickle.dumps(model), io.BytesIO()
            torch.save(model, saved)
            out.append(_step(model, opt, x, y))
        saved.seek(0)
        for copied in (pickle.loads(blob), torch.load(saved, weights_only=False)):
            out += [_hooks(copied), torch.jit.script(copied)(x), copied(x).detach()]
        return out

    return Row((model, opt), (model, opt), run)


def deepcopy_scripted_before_its_first_call() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        with watching():
            out = [_step(model, opt, x, y)]
            best = copy.deepcopy(model)
            out.append(_step(model, opt, x, y))
        return [*out, _hooks(best), torch.jit.script(best)(x)]

    return Row((model, opt), (model, opt), run)


def averaged_model_built_in_the_watch() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        with watching():
            swa = torch.optim.swa_utils.AveragedModel(model)
            out = []
            for _ in range(3):
                out.append(_step(model, opt, x, y))
                swa.update_parameters(model)
        return [*out, _hooks(swa), torch.jit.script(swa.module)(x), swa(x).detach()]

    return Row((model, opt), (model, opt), run)


def trace_and_script_inside() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        with watching():
            out = [_step(model, opt, x, y)]
            traced, scripted = torch.jit.trace(model, x), torch.jit.script(model)
            out += [traced(x), scripted(x), _step(model, opt, x, y)]
        return out

    return Row((model, opt), (model, opt), run)


def shallow_copy_called_inside() -> Row:
    """copy.copy shares the hook dicts with the original, watched as unwatched: a hook of the user's removed from the
    original leaves the copy, one put on the copy fires on the original's call; the copy and a copied child are called
    and backed. (Inside a watch, copy.copy went through the state filter for deep copies and got dicts of its own.)"""
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        calls: list[str] = []
        with watching():
            out = [_step(model, opt, x, y)]
            handle = model.register_forward_hook(lambda *_: calls.append("original's"))
            twin, child = copy.copy(model), copy.copy(model[0])
            assert all(getattr(twin, name) is getattr(model, name) for name in _SHARED)
            assert all(getattr(child, name) is getattr(model[0], name) for name in _SHARED)
            handle.remove()
            twins = twin.register_forward_hook(lambda *_: calls.append("copy's"))
            (twin(x).sum() + child(x).sum()).backward()
            out.append(_step(model, opt, x, y))
            twins.remove()
        assert calls == ["copy's", "copy's"]  # (the copy's call, then the original's)
        return out

    return Row((model, opt), (model, opt), run)


def user_clears_every_hook_dict() -> Row:
    """A library resetting hooks the blunt way: every module's forward and backward hook dicts cleared mid-watch."""
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        with watching():
            out = [_step(model, opt, x, y)]
            for m in model.modules():
                for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
                             "_forward_hooks_always_called"):
                    getattr(m, name).clear()
            out += [_step(model, opt, x, y), _step(model, opt, x, y)]
        return out

    return Row((model, opt), (model, opt), run)


def forward_monkeypatched_mid_run() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)
    original = model.forward

    def run(watching) -> list:
        with watching():
            out = [_step(model, opt, x, y)]
            model.forward = types.MethodType(lambda self, inp: original(inp) * 2.0, model)
            out.append(_step(model, opt, x, y))
            del model.forward
            out.append(_step(model, opt, x, y))
        return out

    return Row((model, opt), (model, opt), run)


def users_global_forward_hook() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def run(watching) -> list:
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 0.5 if isinstance(m, nn.Linear) else None)
        try:
            with watching():
                return [_step(model, opt, x, y) for _ in range(3)]
        finally:
            handle.remove()

    return Row((model, opt), (model, opt), run)


def multi_grad_hook_each_step() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)
    seen: list[int] = []

    def loss_of(step: int) -> torch.Tensor:
        out = model(x)
        torch.autograd.graph.register_multi_grad_hook(
            [out, *model.parameters()], lambda grads: seen.append(sum(g is not None for g in grads)), mode="any")
        return F.cross_entropy(out, y)

    run = steps(model, opt, loss_of)
    return Row((model, opt), (model, opt), lambda watching: [run(watching), seen])


def ensemble_vmap_over_stacked_state() -> Row:
    models = [mlp() for _ in range(3)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05)
    x, y = data()
    base = copy.deepcopy(models[0]).to("meta")

    def run(watching) -> list:
        out = []
        with watching(*models, opt):
            for _ in range(2):
                params, buffers = torch.func.stack_module_state(models)
                logits = torch.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,)))(params, buffers)
                loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(3))
                opt.zero_grad()
                loss.backward()  # (the stacked copies are leaves: the models get no gradient, as unwatched)
                out += [loss.detach(), *(params[k].grad for k in sorted(params))]
                sum(F.cross_entropy(m(x), y) for m in models).backward()
                opt.step()
        return out

    return Row((*models, opt), (*models, opt), run)


def keyboard_interrupt_from_a_grad_hook() -> Row:
    model, x, y = mlp(), *data()
    opt = sgd(model)

    def stop(grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    def run(watching) -> list:
        out = []
        try:
            with watching():
                out.append(_step(model, opt, x, y))
                model[0].weight.register_hook(stop)
                out.append(_step(model, opt, x, y))
        except KeyboardInterrupt:
            out.append(1)
        model[0].weight._backward_hooks.clear()
        return out

    return Row((model, opt), (model, opt), run)


def stop_iteration_of_the_users_iterator() -> Row:
    model, opt = mlp(), None
    opt = sgd(model)
    batches = [data() for _ in range(3)]

    def run(watching) -> list:
        out = []
        with watching():
            it = iter(batches)
            try:
                while True:
                    out.append(_step(model, opt, *next(it)))
            except StopIteration:
                out.append(-1)
        return out

    return Row((model, opt), (model, opt), run)


ROWS = {f.__name__: f for f in (
    pickled_whole_and_loaded, deepcopy_scripted_before_its_first_call, averaged_model_built_in_the_watch,
    trace_and_script_inside, shallow_copy_called_inside, user_clears_every_hook_dict, forward_monkeypatched_mid_run,
    users_global_forward_hook, multi_grad_hook_each_step, ensemble_vmap_over_stacked_state,
    keyboard_interrupt_from_a_grad_hook, stop_iteration_of_the_users_iterator,
)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_loops_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


_FRESH = """
import sys, torch
sys.modules["nan_magic"] = None  # (a process that has no nan_magic)
model = torch.load(sys.argv[1], weights_only=False)
hooks = sum(len(m._forward_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules())
x = torch.ones(2, 6)
print(hooks, bool(torch.equal(torch.jit.script(model)(x), model(x))))
"""


def users_hook(module: nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    """A forward hook of the user's that pickles (by name) and scripts."""


class OwnState(nn.Sequential):
    """A model with a ``__getstate__`` of its own that does not call torch's (returns its own ``__dict__``)."""

    def __getstate__(self) -> dict:
        return self.__dict__


class LightningLike(nn.Sequential):
    """LightningModule's ``__getstate__``: a copy of the ``__dict__``, one entry changed, torch's never called."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_trainer"] = None
        return state


class OwnReduce(nn.Sequential):
    """A ``__reduce__`` of the class's own that returns the state dict."""

    def __reduce__(self) -> tuple:
        return (self.__class__.__new__, (self.__class__,), dict(self.__dict__))


@pytest.mark.parametrize("mode", MODES)
def test_a_model_saved_inside_the_watch_scripts_in_a_fresh_process(mode: str, tmp_path) -> None:
    """torch.save(model) inside the watch: the file loads where there is no nan_magic, with no hook of ours, and
    torch.jit.script compiles it (it raised AttributeError on the watch's stand-in hook)."""
    torch.manual_seed(0)
    model, x, y = mlp(), *data()
    opt = sgd(model)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        _step(model, opt, x, y)
        torch.save(model, tmp_path / "m.pt")
        _step(model, opt, x, y)
    assert w.report is None
    done = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "m.pt")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "True"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", [OwnState, LightningLike, OwnReduce])
def test_a_getstate_or_reduce_of_the_users_own_leaves_our_hook_out_too(kind: type, mode: str) -> None:
    """A model whose own __getstate__ or __reduce__ bypasses torch's, pickled and deep-copied inside the watch: the
    copies carry the user's hook and none of ours (they carried the stand-in: torch.jit.script of them raised), the
    live model's hooks untouched."""
    torch.manual_seed(0)
    model, x, y = kind(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), *data()
    opt = sgd(model)
    model.register_forward_hook(users_hook)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        _step(model, opt, x, y)
        live = dict(model._forward_hooks)
        blob, deep = pickle.dumps(model), copy.deepcopy(model)
        assert dict(model._forward_hooks) == live
    assert w.report is None and len(model._forward_hooks) == 1
    assert not {"__copy__", "__reduce_ex__"} & set(vars(nn.Module))  # (the patches went with the watch)
    assert len(live) == (1 if MODE_OPTIONS[mode].get("mode") == "full" or MODE_OPTIONS[mode].get("ops") else 2)
    for copied in (pickle.loads(blob), deep):
        assert list(copied._forward_hooks.values()) == [users_hook]
        assert torch.equal(torch.jit.script(copied)(x), model(x))
        assert torch.equal(copied(x), model(x))
