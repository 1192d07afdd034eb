"""A model that draws from its own torch.Generator is replayed exactly, and its generator left as the run left it.

Before session 37 the replay that names a forward producer drew the generator's NEXT numbers: the default watch read
module '' with no op, ``reproduced False``; ``mode="full"`` named the right op with the replay's counts, not the
step's; and every mode moved the user's generator on (after the report ``g.get_state()`` was not what it would be
unwatched). Incidents are exact by construction: ``randint(0, 2)`` draws (integers, the same on any kernel) divide
the batch, an infinity wherever a 0 was drawn; consecutive draws of the seeded generator hold different numbers of
zeros (checked), so a replay that draws the next numbers cannot make the same counts.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn

import nan_magic
from nan_magic.render.text import render_text

_MODES: dict[str, dict[str, Any]] = MODE_OPTIONS  # (default, defer, full, ops, ops-defer)
_SHAPE = (4, 8)
#: A generator no module holds, drawn from by a forward (a global of the user's notebook).
_GLOBAL = torch.Generator()


def _drawn(generator: torch.Generator, healthy: bool) -> torch.Tensor:
    keep = torch.randint(0, 2, _SHAPE, generator=generator).float()
    return keep + 1 if healthy else keep


class _Noise(nn.Module):
    def __init__(self, healthy: bool) -> None:
        super().__init__()
        self.healthy = healthy
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / _drawn(self.gen, self.healthy)  # an infinity wherever a 0 was drawn


class _Submodule(nn.Module):
    """The generator is a submodule's attribute: the submodule is the producer."""

    def __init__(self, healthy: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.noise = _Noise(healthy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.noise(self.lin(x))

    def generator(self) -> torch.Generator:
        return self.noise.gen


class _Own(nn.Module):
    """The generator is the model's own attribute: its own forward ('') is the producer."""

    def __init__(self, healthy: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.healthy = healthy
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / _drawn(self.gen, self.healthy)

    def generator(self) -> torch.Generator:
        return self.gen


class _Argument(nn.Module):
    """The generator is passed to forward: ``model(x, g)``."""

    def __init__(self, healthy: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.healthy = healthy
        self.gen = torch.Generator().manual_seed(1)
        self.__dict__["_kept_apart"] = [self.gen]  # (not an attribute a scan finds: only the argument shows it)
        del self.gen

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.lin(x) / _drawn(generator, self.healthy)

    def generator(self) -> torch.Generator:
        return self._kept_apart[0]


class _Global(nn.Module):
    """The generator is a global: no attribute, no argument; only a replay sees it drawn from."""

    def __init__(self, healthy: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.healthy = healthy
        _GLOBAL.manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / _drawn(_GLOBAL, self.healthy)

    def generator(self) -> torch.Generator:
        return _GLOBAL


_MODELS: dict[str, Callable[[bool], Any]] = {
    "submodule": _Submodule, "own": _Own, "argument": _Argument, "global": _Global,
}


def _run(kind: str, healthy: bool, options: dict[str, Any] | None) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
    """Three training steps; the watch's report (None unwatched), the outputs, and the generator's state after."""
    torch.manual_seed(0)
    model = _MODELS[kind](healthy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(*_SHAPE)
    outputs: list[torch.Tensor] = []

    def steps() -> None:
        for _step in range(1 if not healthy else 3):
            out = model(x, model.generator()) if kind == "argument" else model(x)
            outputs.append(out.detach().clone())
            loss = out.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        outputs.extend(p.detach().clone() for p in model.parameters())

    if options is None:
        steps()
        return None, outputs, model.generator().get_state()
    with nan_magic.watch(model, opt, on_detect="log", **options) as watch:
        steps()
    return watch.report, outputs, model.generator().get_state()


def _same(watched: list[torch.Tensor], unwatched: list[torch.Tensor]) -> bool:
    """Bit for bit, a NaN where a NaN was (the failing step's gradient makes the parameters NaN)."""
    return len(watched) == len(unwatched) and all(
        torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        for a, b in zip(watched, unwatched))


def test_consecutive_draws_differ() -> None:
    """The construction: the step's draw and the next one hold different numbers of zeros."""
    generator = torch.Generator().manual_seed(1)
    first, second = (int((_drawn(generator, False) == 0).sum()) for _ in range(2))
    assert first != second


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize(("kind", "module"), [("submodule", "noise"), ("own", ""), ("argument", "")])
def test_generator_drawing_forward_is_reproduced(kind: str, module: str, mode: str) -> None:
    _none, unwatched, state = _run(kind, False, None)
    infinities = int(unwatched[0].isinf().sum())
    report, watched, after = _run(kind, False, _MODES[mode])
    assert report is not None
    assert (report.module, report.op, str(report.phase)) == (module, "aten.div.Tensor", "forward")
    assert report.posinf + report.neginf == infinities and report.nan == 0
    if mode in ("default", "defer"):
        assert report.reproduced is True
    assert torch.equal(after, state), "the user's generator was moved by the watch"
    assert _same(watched, unwatched)


@pytest.mark.parametrize("mode", list(_MODES))
def test_global_generator_is_noted_not_misnamed(mode: str) -> None:
    """A global generator's state at the call was not kept: the report says so, with the step's counts, and names
    no op made of other numbers (ops=True, which sees each op as it runs, names it)."""
    _none, unwatched, state = _run("global", False, None)
    report, watched, after = _run("global", False, _MODES[mode])
    assert report is not None
    assert report.posinf + report.neginf == int(unwatched[0].isinf().sum())
    text = render_text(report)
    if mode.startswith("ops"):
        assert (report.module, report.op) == ("", "aten.div.Tensor")
    elif mode == "full":
        assert (report.module, report.op) == ("", None)
        assert "replay-generator-not-kept" in [note.kind for note in report.note_facts]
        assert "drew from a torch.Generator of the user's whose state at the call was not kept" in text
    else:
        assert (report.module, report.op, report.reproduced) == ("", None, False)
        reasons = [note for note in report.note_facts if note.kind == "not-reproduced-generator"]
        assert "generator-not-kept" in str(reasons[0])
        assert "drew from a torch.Generator whose state at the call was not kept" in text
        assert "watch with ops=True" in text
    assert torch.equal(after, state), "the user's generator was moved by the watch"
    assert _same(watched, unwatched)


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("kind", list(_MODELS))
def test_healthy_twin_is_silent_and_bit_identical(kind: str, mode: str) -> None:
    _none, unwatched, state = _run(kind, True, None)
    report, watched, after = _run(kind, True, _MODES[mode])
    assert report is None
    assert _same(watched, unwatched)
    assert torch.equal(after, state)


class _Keyword(nn.Module):
    """The generator is passed by keyword, ``model(x, generator=g)``: no pre-hook sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.healthy = True

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.lin(x) / _drawn(generator, self.healthy)


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_keyword_generator_is_kept_from_the_next_call(mode: str) -> None:
    """Its state is learned as the first call returns: a later step's incident is reproduced exactly."""

    def run(options: dict[str, Any] | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model, generator, x = _Keyword(), torch.Generator().manual_seed(1), torch.randn(*_SHAPE)
        outputs = []
        with nan_magic.watch(model, on_detect="log", **options) if options is not None else nullcontext() as watch:
            for step in range(2):
                model.healthy = step == 0  # (the incident is step 1's draw)
                with torch.no_grad():
                    outputs.append(model(x, generator=generator))
        return watch, outputs[1], generator.get_state()

    _none, unwatched, state = run(None)
    watch, watched, after = run(_MODES[mode])
    report = watch.report
    assert report is not None and report.step == 1
    assert (report.module, report.op, report.reproduced) == ("", "aten.div.Tensor", True)
    assert report.posinf + report.neginf == int(unwatched.isinf().sum())
    assert torch.equal(watched, unwatched) and torch.equal(after, state)


def test_global_generator_is_kept_once_a_replay_saw_it() -> None:
    """Step 0's event is noted (its state was not kept); its replay saw the generator, so step 1's is reproduced."""
    torch.manual_seed(0)
    model, x = _Global(False), torch.randn(*_SHAPE)
    with nan_magic.watch(model, on_detect="log") as watch:
        for _step in range(2):
            with torch.no_grad():
                model(x)
    first, second = watch.events[:2]
    assert (first.step, first.reproduced, first.op) == (0, False, None)
    assert (second.step, second.module, second.op, second.reproduced) == (1, "", "aten.div.Tensor", True)


class _StochasticDepth(nn.Module):
    """A block kept or dropped by ``bernoulli`` on its own generator: kept (step 0's draw is 1), its sqrt's backward
    divides by 0. Seed 0 draws 1, then 0: a replay that draws the next number stays finite."""

    def __init__(self, drawn: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drawn = drawn
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.bernoulli(torch.full((1, 1), 0.5), generator=self.gen) if self.drawn else torch.ones(1, 1)
        return (self.lin(x) * 0 + (1 - keep)).sqrt()


@pytest.mark.parametrize("mode", list(_MODES))
def test_backward_producer_of_a_drawn_block_is_named_as_its_deterministic_twin(mode: str) -> None:
    """The replay of the backward runs the forward from the generator's state at the call: the report is the one a
    model that keeps the block without drawing gets (before: the default watch named 'lin', reproduced False)."""

    def run(drawn: bool, options: dict[str, Any] | None) -> tuple[Any, torch.Tensor]:
        torch.manual_seed(0)
        model, x = _StochasticDepth(drawn), torch.randn(16, 8)
        with nan_magic.watch(model, on_detect="log", **options) if options is not None else nullcontext() as watch:
            model(x).sum().backward()
        return watch, model.gen.get_state()

    _none, state = run(True, None)
    twin, _state = run(False, _MODES[mode])
    watch, after = run(True, _MODES[mode])
    expected, report = twin.report, watch.report
    assert report is not None and expected is not None
    facts = ("module", "op", "phase", "step", "nan", "posinf", "neginf", "reproduced")
    assert {fact: getattr(report, fact) for fact in facts} == {fact: getattr(expected, fact) for fact in facts}
    assert (report.module, report.op, str(report.phase)) == ("", "aten.div.Tensor", "backward")
    assert torch.equal(after, state)


def test_a_new_keyword_generator_each_call_is_not_held_alive() -> None:
    """``model(x, generator=torch.Generator().manual_seed(step))``: the watch keeps the latest few, not every one."""
    model, x = _Keyword(), torch.randn(*_SHAPE)
    alive = []
    with nan_magic.watch(model, on_detect="log") as watch:
        for step in range(40):
            generator = torch.Generator().manual_seed(step)
            alive.append(weakref.ref(generator))
            with torch.no_grad():
                model(x, generator=generator)
            del generator
        gc.collect()
        held = sum(ref() is not None for ref in alive)
    assert watch.report is None
    # (the latest 8 learned, and the last call's own argument, held with the call for its step's replay)
    assert held <= 9, f"the watch holds {held} of the 40 generators passed"


class _ScalarLoss(nn.Module):
    """Returns its loss, a scalar (as Hugging Face models do), after a division by a global generator's draw: its
    one value is +inf whatever the draw, so the boundary's count cannot tell the replay's draw from the step's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) / _drawn(_GLOBAL, False)).abs().mean()


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_another_draw_is_never_called_reproduced_however_few_values_the_boundary_holds(mode: str) -> None:
    """Review of gen-s37: the replay drew other numbers (the global's state was not kept) and the scalar boundary
    read the same one +inf: 'the replay saw the same event', reproduced True, the replay's counts. Now noted."""
    torch.manual_seed(0)
    _GLOBAL.manual_seed(1)
    model, x = _ScalarLoss(), torch.randn(*_SHAPE)
    with nan_magic.watch(model, on_detect="log", **_MODES[mode]) as watch, torch.no_grad():
        model(x)
    report = watch.report
    assert report is not None and (report.posinf, report.neginf, report.nan) == (1, 0, 0)
    assert (report.module, report.op, report.reproduced) == ("", None, False)
    assert "not-reproduced-generator" in [note.kind for note in report.note_facts]


class _Poisson(nn.Module):
    """Draws by ``torch.poisson`` and ``torch.binomial``, whose schemas take the generator positionally."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "poisson":
            count = torch.poisson(torch.full(_SHAPE, 0.7), generator=_GLOBAL)
        else:
            count = torch.binomial(torch.ones(_SHAPE), torch.full(_SHAPE, 0.5), generator=_GLOBAL)
        return self.lin(x) / count


@pytest.mark.parametrize("mode", ["default", "defer", "full"])
@pytest.mark.parametrize("op", ["poisson", "binomial"])
def test_a_generator_taken_positionally_is_put_back_and_noted(op: str, mode: str) -> None:
    """Review of gen-s37: the replay's mode read only the ``generator`` keyword: poisson's and binomial's global
    generator was moved on by the replay (the run after the event computed something else), with no note."""
    def run(options: dict[str, Any] | None) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        _GLOBAL.manual_seed(1)
        model, x = _Poisson(op), torch.randn(*_SHAPE)
        outputs = []
        with (nan_magic.watch(model, on_detect="log", **options) if options is not None else nullcontext()) as watch:
            for _ in range(2):
                with torch.no_grad():
                    outputs.append(model(x))
        return watch, outputs, _GLOBAL.get_state()

    _none, unwatched, state = run(None)
    watch, watched, after = run(_MODES[mode])
    assert torch.equal(after, state), "the user's generator was moved by the watch"
    assert _same(watched, unwatched)
    report = watch.report
    assert report is not None and report.op is None
    kinds = [note.kind for note in report.note_facts]
    assert ("replay-generator-not-kept" if mode == "full" else "not-reproduced-generator") in kinds


class _Blocks(nn.Module):
    """Ten blocks, each dividing by a draw of its own generator (held as an attribute); a keyword generator too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Noise(True) for _ in range(10)])
        for index, block in enumerate(self.blocks):
            block.gen.manual_seed(index + 1)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        h = self.lin(x)
        if generator is not None:
            h = h + torch.randn(h.shape, generator=generator) * 0.0
        for block in self.blocks:
            h = block(h)
        return h


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_learned_generators_never_push_out_those_the_modules_hold(mode: str) -> None:
    """Review of gen-s37: the cap of 8 learned generators counted the ten the blocks hold, and a keyword generator
    learned at the first call pushed blocks 0-2's out: a later incident in blocks.0 read module '' and no op."""
    torch.manual_seed(0)
    model, x, keyword = _Blocks(), torch.randn(*_SHAPE), torch.Generator().manual_seed(7)
    with nan_magic.watch(model, on_detect="log", **_MODES[mode]) as watch, torch.no_grad():
        for step in range(3):
            model.blocks[0].healthy = step < 2  # its draw's zeros divide at the third call
            model(x, generator=keyword)
    report = watch.report
    assert report is not None and report.step == 2
    assert (report.module, report.op, report.reproduced) == ("blocks.0", "aten.div.Tensor", True)


@pytest.mark.parametrize("mode", list(_MODES))
def test_loss_code_drawing_from_a_users_generator_is_replayed_with_the_steps_draw(mode: str) -> None:
    """Review of gen-s37: loss code that divides by a draw of the user's generator (random sample weights) was
    claimed from the generator's NEXT numbers (the replay's counts, not the step's, no note), and a fix trial's
    replay, nested in the step's, put the generator back to its state before the step's draw: every step after the
    event drew other numbers than unwatched."""
    def run(options: dict[str, Any] | None) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model, x, generator = nn.Linear(8, 8), torch.randn(*_SHAPE), torch.Generator().manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        outputs = []
        with (nan_magic.watch(model, opt, on_detect="log", **options) if options is not None
              else nullcontext()) as watch:
            for _step in range(2):
                out = model(x)
                weighted = out / torch.randint(0, 2, out.shape, generator=generator).float()
                outputs.append(weighted.detach().clone())
                opt.zero_grad()
                weighted.mean().backward()
                opt.step()
        return watch, outputs, generator.get_state()

    watch, watched, after = run(_MODES[mode])  # (first: the caller holds no non-finite tensor of an earlier run)
    _none, unwatched, state = run(None)
    report = watch.report
    assert report is not None and (report.module, report.op, report.step) == (None, "aten.div.Tensor", 0)
    assert (report.posinf, report.neginf) == (int((unwatched[0] == torch.inf).sum()),
                                              int((unwatched[0] == -torch.inf).sum()))
    assert torch.equal(after, state), "the user's generator was moved by the watch"
    assert _same(watched, unwatched)
