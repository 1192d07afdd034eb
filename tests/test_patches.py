"""Process-wide patches (patches/registry.py): installed once, taken back only while still ours."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.localize.replay.tiered.step_backward import reentrant_checkpoints_inline
from nan_magic.patches import registry as patches
from nan_magic.patches.registry import ProcessPatch


def user_patch(owner, name, calls: list[str]):
    """A user's own wrapper of ``owner.name``, as a profiler or logging library would install it."""
    wrapped = getattr(owner, name)

    def theirs(*args, **kwargs):
        calls.append("user")
        return wrapped(*args, **kwargs)

    setattr(owner, name, theirs)
    return theirs


def nan_step(model: nn.Module) -> None:
    model(torch.full((2, 4), float("nan"))).sum().backward()


@pytest.mark.parametrize("defer", [False, True])
def test_autograd_grad_by_inputs_of_every_form_computes_as_unwatched(defer: bool) -> None:
    """``autograd.grad`` by no parameter (patches/backward.py reads its ``inputs``): a tensor, a list, a generator, a
    GradientEdge, by keyword: each returns what it returns unwatched, and the parameters' by a generator too."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)

    def grads() -> list[torch.Tensor]:
        delta = torch.zeros_like(x, requires_grad=True)
        got = []
        for by in (lambda: delta, lambda: [delta], lambda: (t for t in [delta]),
                   lambda: torch.autograd.graph.get_gradient_edge(delta)):
            got += torch.autograd.grad(model(x + delta).sum(), by())
        got += torch.autograd.grad(outputs=model(x + delta).sum(), inputs=(t for t in [delta]))
        got += torch.autograd.grad(model(x + delta).sum(), model.parameters())
        return got

    expected = grads()
    with nan_magic.watch(model, defer=defer):
        got = grads()
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_users_backward_patch_after_ours_stays_and_ours_goes_inert() -> None:
    original = torch.Tensor.backward
    model = nn.Linear(4, 1)
    calls: list[str] = []
    try:
        with nan_magic.watch(model, mode="full") as w:
            theirs = user_patch(torch.Tensor, "backward", calls)
            model(torch.ones(2, 4)).sum().backward()
        assert w.report is None and calls == ["user"]
        assert torch.Tensor.backward is theirs  # not dropped when the watch left
        assert patches.installed() == []
        # Ours under theirs only passes through now: a watch ended, so nothing of it may act.
        model(torch.ones(2, 4)).sum().backward()
        assert calls == ["user", "user"]
        # A later watch installs afresh on top of theirs, and sees backward() again.
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, mode="full"):
            loss = model(torch.ones(2, 4)).sum() * float("inf")
            loss.backward()
        assert caught.value.report is not None
        assert torch.Tensor.backward is theirs and calls[-1] == "user"
    finally:
        torch.Tensor.backward = original


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_users_autograd_backward_patch_made_inside_the_watch_runs_at_every_backward(defer: bool) -> None:
    """``loss.backward()`` calls the ``torch.autograd.backward`` ours wrapped directly (patches/backward.py) only
    while ours is the one installed: a user's patch of it made since runs at each ``backward()``, and the loss is
    still judged."""
    original = torch.autograd.backward
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    try:
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            assert calls == []
            theirs = user_patch(torch.autograd, "backward", calls)
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            assert calls == ["user"]
            (model(torch.ones(2, 4)).sum() * float("inf")).backward()
            opt.step()
        # (The immediate check judges the loss before backward runs: theirs ran once more only deferred.)
        assert calls == ["user", "user"] if defer else calls == ["user"]
        report = caught.value.report
        assert report is not None and report.step == 2 and report.posinf + report.neginf == 1  # the loss, judged
        assert torch.autograd.backward is theirs and patches.installed() == []
    finally:
        torch.autograd.backward = original


def test_a_users_torch_save_patch_after_the_guard_stays(tmp_path) -> None:
    original = torch.save
    calls: list[str] = []
    try:
        guard = nan_magic.guard_checkpoints()
        theirs = user_patch(torch, "save", calls)
        guard.disable()
        assert torch.save is theirs
        bad = nn.Linear(2, 2)
        with torch.no_grad():
            bad.bias[0] = float("nan")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the inert guard no longer warns
            torch.save(bad.state_dict(), tmp_path / "ckpt.pt")
        assert calls == ["user"] and (tmp_path / "ckpt.pt").exists()
    finally:
        torch.save = original


def test_a_users_scaler_patch_after_ours_stays() -> None:
    scale = torch.amp.GradScaler.scale
    calls: list[str] = []
    try:
        with nan_magic.watch(nn.Linear(2, 2)):
            theirs = user_patch(torch.amp.GradScaler, "scale", calls)
        assert torch.amp.GradScaler.scale is theirs
        assert torch.amp.GradScaler.step is not theirs and "step" in vars(torch.amp.GradScaler)
        assert patches.installed() == []
    finally:
        torch.amp.GradScaler.scale = scale


@pytest.mark.parametrize("ending", ["finish", "nonfinite", "unrelated", "interrupt"])
def test_nothing_is_left_after_a_watch_however_it_ends(ending: str) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backward, save, scale = torch.Tensor.backward, torch.save, torch.amp.GradScaler.scale
    expected = {"finish": None, "nonfinite": NonFiniteError, "unrelated": ValueError,
                "interrupt": KeyboardInterrupt}[ending]
    raises = pytest.raises(expected) if expected else contextlib.nullcontext()
    with raises, nan_magic.guard_checkpoints(), nan_magic.watch(model, opt):
        names = {name for _owner, name in patches.installed()}
        assert {"backward", "scale", "step", "save"} <= names
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        if ending == "nonfinite":
            nan_step(model)
        elif ending == "unrelated":
            raise ValueError("the user's own bug")
        elif ending == "interrupt":
            raise KeyboardInterrupt
    assert patches.installed() == []
    assert (torch.Tensor.backward, torch.save, torch.amp.GradScaler.scale) == (backward, save, scale)


def test_an_inherited_classmethod_is_patched_on_the_class_and_deleted_after() -> None:
    function = torch.utils.checkpoint.CheckpointFunction
    assert "apply" not in vars(function)  # inherited from autograd.Function
    x = torch.ones(2, requires_grad=True)
    with reentrant_checkpoints_inline():
        assert [name for _owner, name in patches.installed()] == ["apply"]
        out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        assert type(out.grad_fn).__name__ == "MulBackward0"  # inline, through the bound original's stand-in
    assert "apply" not in vars(function)
    out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"


def test_holders_share_one_installation_across_threads() -> None:
    class Owner:
        def value(self) -> int:
            return 1

    installs: list[int] = []

    def wrap(original):
        installs.append(1)
        return lambda self: original(self) + 10

    patch = ProcessPatch.of(Owner, "value", wrap)
    barrier = threading.Barrier(4)
    seen: list[int] = []

    def hold() -> None:
        with patch.held():
            barrier.wait()
            seen.append(Owner().value())
            barrier.wait()

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert installs == [1] and seen == [11] * 4
    assert Owner().value() == 1 and "value" in vars(Owner) and patches.installed() == []
    with pytest.raises(RuntimeError, match="not held"):
        patch.release()


def test_a_failing_plan_installs_nothing() -> None:
    class Owner:
        def a(self) -> int:
            return 1

        def b(self) -> int:
            return 2

    def broken(original):
        raise RuntimeError("cannot wrap")

    a = Owner.a
    patch = ProcessPatch(lambda: [(Owner, "a", lambda original: original), (Owner, "b", broken)])
    with pytest.raises(RuntimeError, match="cannot wrap"):
        patch.acquire()
    assert vars(Owner)["a"] is a and patches.installed() == []
    with pytest.raises(RuntimeError, match="not held"):
        patch.release()


def _adopting_optimizers():
    from nan_magic.cli import _adopting

    model = nn.Linear(2, 2)
    watch = nan_magic.watch(model)
    return _adopting(watch), lambda: torch.optim.SGD(model.parameters(), lr=0.1), watch.targets.optimizers


def _counting_batches():
    from nan_magic.patches.loaders import watch_batches

    seen: list[int] = []
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    return watch_batches(lambda _dataset, _indices, _map, _collate: seen.append(1)), lambda: list(data), seen


def _inline_checkpoints():
    x = torch.ones(2, requires_grad=True)
    inlined: list[int] = []

    def run():
        out = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        if type(out.grad_fn).__name__ == "MulBackward0":
            inlined.append(1)

    return reentrant_checkpoints_inline(), run, inlined


@pytest.mark.parametrize(("owner", "name", "setup"), [
    (torch.optim.Optimizer, "__init__", _adopting_optimizers),
    (torch.utils.data.dataloader._BaseDataLoaderIter, "__next__", _counting_batches),
    (torch.utils.checkpoint.CheckpointFunction, "apply", _inline_checkpoints),
], ids=["Optimizer.__init__", "DataLoader iterator", "CheckpointFunction.apply"])
def test_a_users_patch_after_ours_stays_and_ours_goes_inert(owner, name, setup) -> None:
    """The command line's optimizer adoption, the samples' DataLoader patch and the replay's inline
    checkpoints, each wrapped by a user's patch while ours is installed: ours acts while held, theirs
    stays after, and ours then only passes through."""
    previous = vars(owner).get(name)
    # ``effects`` grows each time ours acts: an adopted optimizer, a batch seen, a checkpoint run inline.
    holding, use, effects = setup()
    calls: list[str] = []
    try:
        with holding:
            theirs = user_patch(owner, name, calls)
            use()
        acted = len(effects)
        assert acted > 0 and calls  # ours acted under theirs while held
        assert vars(owner)[name] is theirs and patches.installed() == []
        calls.clear()
        use()
        assert calls and len(effects) == acted  # theirs runs; ours is inert
    finally:
        if previous is None:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)

