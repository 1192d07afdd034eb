"""The user's ``saved_tensors_hooks``, listed while a watch is active so that a replay packs as the call did (gaps24).

The rows that name a float16 pack's op in every mode are in tests/contract/hunt23.py (``_saved_half``); these hold
what the listing itself must do: follow the contexts out as they close, leave nothing behind however the watch ends,
and leave checkpointing's own contexts (which belong to the running checkpoint) unlisted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

import nan_magic
from nan_magic.hot.kept.saved_hooks import ENTERED
from nan_magic.patches import registry as patches
from tests.faults import marked_line

_TORCHS = (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__)


def _torchs() -> bool:
    return (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__) == _TORCHS


def _listed() -> list[object]:
    return list(ENTERED)


def _pack(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def test_the_contexts_entered_in_a_watch_are_listed_innermost_last_and_followed_out() -> None:
    model = nn.Linear(3, 1)
    with nan_magic.watch(model):
        outer, inner = saved_tensors_hooks(_pack, _unpack), torch.autograd.graph.save_on_cpu()
        with outer:
            with inner:
                assert _listed() == [outer, inner]
            assert _listed() == [outer]
        assert _listed() == []
    assert _torchs() and patches.installed() == []


def test_a_watch_that_ends_inside_the_users_context_leaves_nothing_listed() -> None:
    model = nn.Linear(3, 1)
    with saved_tensors_hooks(_pack, _unpack):
        with nan_magic.watch(model):
            hooks = saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
            assert _listed() == [hooks]
        assert _listed() == [] and _torchs()
        hooks.__exit__(None, None, None)  # (torch's own exit: the watch no longer follows it)
        model(torch.ones(2, 3)).sum().backward()  # the user's outer hooks still pack
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._inner, x, use_reentrant=False)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(ENTERED))
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("options", [pytest.param({}, id="default"), pytest.param({"mode": "full"}, id="full")])
def test_checkpointings_own_contexts_are_not_listed(options: dict) -> None:
    torch.manual_seed(0)
    model = _Checkpointed()
    with nan_magic.watch(model, **options) as watch:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    assert watch.report is None and model.seen and set(model.seen) == {0}


class _RootOfSquare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.sqrt(h * h)  # producer: root of square


@pytest.mark.parametrize("options", [pytest.param({}, id="default"), pytest.param({"defer": True}, id="deferred"),
                                     pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops")])
def test_a_result_packed_to_float16_zero_is_named_and_its_fix_tried_as_packed(options: dict) -> None:
    # sqrt saves its result for the backward: about 1e-8 here, 0 once packed to float16, so the backward divides by
    # 0 (finite forward). The replays ran unpacked: the default watch named 0.fc (the gradient it was handed) with
    # no op, full mode no op, and no fix was tried; the fix trial packs too (fixes/step.py), and eps verifies.
    torch.manual_seed(0)
    model = nn.Sequential(_RootOfSquare(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].fc.weight.mul_(1e-9)
        model[0].fc.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _step in range(3):
            with saved_tensors_hooks(lambda t: t.half(), lambda t: t.float()):
                loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (str(report.phase), report.module, report.step, report.op) == ("backward", "0", 0, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == marked_line("root of square", where=_RootOfSquare)
    assert [(fix.kind, fix.finite) for fix in report.fixes] == [("eps", True)]


def test_full_mode_without_fixes_replays_a_modules_backward_packed_as_the_call_was() -> None:
    # mode="full", fixes=False keeps no top-level call: the per-module backward replay (module_run.replay_backward)
    # named no op, its forward run outside the loop's float16 pack ("backward-replay-finite"). The call's held
    # arguments note the context it ran under, and the replay packs as it did.
    torch.manual_seed(0)
    model = nn.Sequential(_RootOfSquare(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].fc.weight.mul_(1e-9)
        model[0].fc.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, mode="full", fixes=False):
        for _step in range(3):
            with saved_tensors_hooks(lambda t: t.half(), lambda t: t.float()):
                loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (str(report.phase), report.module, report.step, report.op) == ("backward", "0", 0, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == marked_line("root of square", where=_RootOfSquare)
    assert _listed() == [] and _torchs()
