"""The watch leaves no trace: hooks gone however it ends, user hooks kept, results unchanged."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import global_hook_counts
from faults import FORWARD_FAULTS
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nan_magic
from nan_magic import NonFiniteError


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.LayerNorm(16), nn.Linear(16, 3))


def instance_hook_counts(model: nn.Module) -> list[tuple[int, ...]]:
    return [
        (
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            len(m._backward_pre_hooks),
            len(m._state_dict_hooks),
        )
        for m in model.modules()
    ] + [(len(p._backward_hooks or {}),) if hasattr(p, "_backward_hooks") else (0,) for p in model.parameters()]


def user_hooks(model: nn.Module) -> list[str]:
    calls: list[str] = []
    model[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model[0].register_forward_pre_hook(lambda m, i: calls.append("pre"))
    model[0].weight.register_hook(lambda g: calls.append("grad"))
    return calls


def train(model: nn.Module, steps: int, watched: bool) -> list[float]:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    losses = []
    for _ in range(steps):
        if watched:
            with nan_magic.watch(model, opt):
                losses.append(_step(model, opt, x, y))
        else:
            losses.append(_step(model, opt, x, y))
    return losses


def _step(model, opt, x, y) -> float:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


class Tapped(nn.Module):
    """Registers a gradient hook of its own on its output, before the watch registers one."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out.register_hook(lambda g: self.seen.append("inside forward"))
        return out


class SqrtOfZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - x.detach())  # 0 forward; its derivative there is +inf


def test_user_gradient_hooks_on_module_outputs_run_and_detach_as_before() -> None:
    seen: list[str] = []
    model = nn.Sequential(nn.Linear(3, 3), Tapped(seen), nn.Linear(3, 1))
    handles = []
    # Module forward hooks run after the watch's global ones: these register after it.
    model[0].register_forward_hook(lambda m, i, o: handles.append(o.register_hook(lambda g: seen.append("after"))))
    model[2].register_forward_hook(lambda m, i, o: handles.append(o.register_hook(lambda g: seen.append("removed"))))
    with nan_magic.watch(model):
        out = model(torch.ones(2, 3))
        handles[1].remove()
        out.sum().backward()
    assert seen == ["inside forward", "after"]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_gradient_whose_tensor_already_had_a_user_hook_is_still_checked() -> None:
    seen: list[str] = []
    model = nn.Sequential(nn.Linear(3, 3), Tapped(seen), SqrtOfZero())
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, mode="full"):
        model(torch.ones(2, 3)).sum().backward()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type) == ("backward", "2", "SqrtOfZero")
    assert seen == ["inside forward"]  # the user's hook ran first, as registered
    # The tiered watch replays the step, forward code included: a hook that forward registers runs
    # again for the replay's gradient (docs/guide.md, Limitations)...
    seen.clear()
    seen_outside: list[str] = []
    tap = model[1].register_forward_hook(
        lambda m, i, o: (o.register_hook(lambda g: seen_outside.append("replayed")), None)[1]
    )
    # (The fix trials replay it again, each: fixes=False leaves the replay alone.)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, fixes=False):
        model(torch.ones(2, 3)).sum().backward()
    assert (caught.value.report.module, caught.value.report.reproduced) == ("2", True)
    tap.remove()
    assert seen_outside == ["replayed"] * 2
    # ...but what it appended to a list the module holds is put back: the module is as the user's call left it.
    assert seen == ["inside forward"]


def test_hooks_gone_after_success_and_user_hooks_kept() -> None:
    model = small_model()
    calls = user_hooks(model)
    before_global, before_instance = global_hook_counts(), instance_hook_counts(model)
    with nan_magic.watch(model) as w:
        assert global_hook_counts() != before_global  # armed while inside
        model(torch.randn(2, 8)).sum().backward()
    assert w.report is None
    assert global_hook_counts() == before_global
    assert instance_hook_counts(model) == before_instance
    model(torch.randn(2, 8)).sum().backward()
    assert calls == ["pre", "fwd", "grad"] * 2  # the user's hooks ran inside and after


@pytest.mark.parametrize("failure", ["nonfinite", "unrelated", "interrupt"])
def test_hooks_gone_after_every_kind_of_exit(failure: str) -> None:
    model = small_model()
    user_hooks(model)
    before_global, before_instance = global_hook_counts(), instance_hook_counts(model)
    backward = torch.Tensor.backward
    expected = {"nonfinite": NonFiniteError, "unrelated": ValueError, "interrupt": KeyboardInterrupt}[failure]
    with pytest.raises(expected), nan_magic.watch(model):
        out = model(torch.randn(2, 8))
        if failure == "nonfinite":
            model(torch.full((2, 8), float("nan")))
        elif failure == "unrelated":
            raise ValueError("the user's own bug")
        else:
            out.sum().backward()
            raise KeyboardInterrupt
    assert global_hook_counts() == before_global
    assert instance_hook_counts(model) == before_instance
    assert torch.Tensor.backward is backward


def test_exception_inside_a_nested_forward_unwinds_the_module_stack() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), Boom()))
    healthy = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with nan_magic.watch(model, healthy) as w:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(1, 2))
        healthy(torch.randn(1, 2))
        assert w.forward.stack == []  # the always-called hooks popped every frame


def test_losses_bit_identical_with_and_without_the_watch() -> None:
    model_a = small_model()
    model_b = copy.deepcopy(model_a)
    plain = train(model_a, 20, watched=False)
    watched = train(model_b, 20, watched=True)
    assert plain == watched  # exact float equality, dropout included
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_one_watch_over_the_whole_loop_is_bit_identical_too() -> None:
    model_a = small_model()
    model_b = copy.deepcopy(model_a)
    plain = train(model_a, 10, watched=False)
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    with nan_magic.watch(model_b, opt) as w:
        watched = [_step(model_b, opt, x, y) for _ in range(10)]
    assert plain == watched
    assert w.step == 10 and len(w.history) == 10


def test_nested_watch_on_the_same_model_never_doubles_hooks() -> None:
    model = small_model()
    before = global_hook_counts()
    with nan_magic.watch(model):
        armed = global_hook_counts()
        with nan_magic.watch(model) as inner:
            assert global_hook_counts() == armed
            with pytest.raises(NonFiniteError):
                model(torch.full((1, 8), float("inf")))
        assert inner.report is not None and inner.report.phase == "data"
        assert global_hook_counts() == armed  # the outer watch is back
    assert global_hook_counts() == before


def test_a_watch_cannot_be_entered_twice() -> None:
    model = small_model()
    w = nan_magic.watch(model)
    with w, pytest.raises(RuntimeError, match="already active"):
        w.__enter__()


def test_decorator_form_watches_each_call() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    w = nan_magic.watch(model)

    @w
    def train_step() -> torch.Tensor:
        return run()

    with pytest.raises(NonFiniteError):
        train_step()
    assert w.report is not None and w.report.module == "1"
    assert train_step.__name__ == "train_step"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (torch.zeros(2), "cannot watch Tensor (torch.Tensor): expected an nn.Module"),
        ("model", "cannot watch str"),
        (42, "cannot watch int"),
        # A list of models is the likeliest slip: the message says how to give them.
        ([torch.nn.Linear(2, 2)], "cannot watch list (builtins.list): expected an nn.Module, a torch.optim.Optimizer "
                                  "or a GradScaler; give its items one by one: watch(model, opt), "
                                  "%%nantrace model, opt"),
    ],
)
def test_bad_targets_fail_before_anything_is_attached(target, message) -> None:
    before = global_hook_counts()
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nan_magic.watch(target)
    assert global_hook_counts() == before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_detect": "explode"}, "on_detect must be 'raise', 'warn' or 'log'"),
        ({"kinds": ["nan", "zero"]}, "kinds must be a non-empty subset"),
        ({"kinds": []}, "kinds must be a non-empty subset"),
        ({"history": 0}, "history must be at least 1"),
        ({"mode": "fast"}, "mode must be 'tiered' or 'full'"),
        ({"keep_last_good": "gpu"}, "keep_last_good must be 'cpu', 'device' or None"),
        ({"labels": ["a", "b"]}, "got 2 labels for 1 targets"),
    ],
)
def test_bad_options_are_one_line_errors(options, message) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        nan_magic.watch(small_model(), **options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"types": [3]}, "types must be class names or classes, not 3"),
        ({"include": [None]}, "include must be strings, not None"),
        ({"include": None}, "include must be a string or a list of them, not None"),
        ({"kinds": None}, "kinds must be a string or a list of them, not None"),
        ({"sample_size": "a"}, "sample_size must be an integer, not 'a'"),
        ({"full_every": 2.5}, "full_every must be an integer, not 2.5"),
        ({"ops": "yes"}, "ops must be True or False, not 'yes'"),
        ({"defer": "x"}, "defer must be True, False or None, not 'x'"),
        ({"log_file": 3}, "log_file must be a path, not 3"),
        ({"dump": 3}, "dump must be a path, not 3"),
    ],
)
def test_options_of_the_wrong_type_are_one_line_type_errors(options, message) -> None:
    before = global_hook_counts()
    with pytest.raises(TypeError, match=re.escape(message)) as caught:
        nan_magic.watch(small_model(), **options)
    assert "\n" not in str(caught.value)
    assert global_hook_counts() == before


def test_an_unknown_option_is_a_type_error_naming_it_and_every_option_is_in_the_signature() -> None:
    import dataclasses
    import inspect

    unknown = r"^watch\(\) got an unexpected keyword argument 'foo'; its options are on_detect"
    with pytest.raises(TypeError, match=unknown):
        nan_magic.watch(small_model(), foo=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'kind'; did you mean 'kinds'\?$"):
        nan_magic.watch(small_model(), kind="nan")
    parameters = inspect.signature(nan_magic.watch).parameters
    for option in dataclasses.fields(nan_magic.WatchConfig):
        assert parameters[option.name].default == option.default
        assert f"\n    {option.name}\n" in nan_magic.WatchConfig.__doc__  # documented where it is declared
    assert nan_magic.watch(small_model(), keep_last_good=True).config.keep_last_good == "cpu"


class _Exploding(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)


def test_a_single_string_is_one_name_and_a_class_is_its_qualified_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Exploding(), nn.Linear(4, 1))
    assert nan_magic.watch(model, kinds="nan").config.kinds == frozenset({"nan"})
    assert nan_magic.watch(model, types=nn.Linear).config.types == ("torch.nn.modules.linear.Linear",)
    assert nan_magic.watch(model, include="0*").config.include == ("0*",)
    for types in ("_Exploding", ["_Exploding"], [_Exploding]):
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, types=types, mode="full"):
            model(torch.randn(2, 4))
        assert (caught.value.report.module, caught.value.report.module_type) == ("1", "_Exploding"), types


def test_the_full_mode_watches_a_compiled_model_eagerly_with_one_notice() -> None:
    """Per-module hooks cannot see inside a compiled graph: the model runs eagerly instead (test_compiled.py)."""
    model = small_model()
    compiled = torch.compile(model, backend="aot_eager")
    for watched in (compiled, nn.Sequential(compiled)):
        notice = pytest.warns(nan_magic.NanMagicWarning, match=r"compiled with torch.compile; under mode=\"full\"")
        with notice, nan_magic.watch(watched, mode="full") as w:
            watched(torch.randn(2, 8))
        assert w.report is None


class _DispatchedOps(TorchDispatchMode):
    """The aten ops that ran inside the block, by name (``_transformer_encoder_layer_fwd``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _fused_encoder_ran(layer: nn.Module, x: torch.Tensor) -> tuple[bool, torch.Tensor]:
    with _DispatchedOps() as seen:
        out = layer(x)
    return "_transformer_encoder_layer_fwd" in seen.names, out


def test_transformer_fast_path_still_taken_under_the_watch() -> None:
    """Global hooks leave nn.TransformerEncoderLayer's fused inference path alone."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        fused, plain = _fused_encoder_ran(layer, x)
        assert fused  # the fast path exists for this layer and input
        with nan_magic.watch(layer):
            fused, watched = _fused_encoder_ran(layer, x)
        assert fused, "the watch made the layer take its slow path"
        assert torch.equal(plain, watched)
        # The negative control: an instance hook (what the watch must not
        # add) makes the layer skip the fused op, and the check sees it.
        handle = layer.register_forward_hook(lambda module, args, output: None)
        try:
            with nan_magic.watch(layer):
                fused, _ = _fused_encoder_ran(layer, x)
        finally:
            handle.remove()
        assert not fused


def test_nothing_kept_alive_after_the_watch() -> None:
    import gc
    import weakref

    model = small_model()
    with nan_magic.watch(model) as w:
        out = model(torch.randn(4, 8))
        ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None
    assert len(w.log.calls) == 0


def test_a_finished_step_is_freed_without_the_garbage_collector() -> None:
    import gc

    from nan_magic.hot.kept.call_records import Call, TensorRecord

    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    with nan_magic.watch(model, opt):
        _step(model, opt, x, y)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
        try:
            for _ in range(3):
                _step(model, opt, x, y)
            gc.collect()
            cyclic = [obj for obj in gc.garbage if isinstance(obj, (Call, TensorRecord))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    # Each new step cleared the one before: its calls and records went with their last reference.
    assert cyclic == []
