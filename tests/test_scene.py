"""The crash scene (dump, load, replay), roll-back (keep_last_good, restore) and the checkpoint guard."""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from watching import raised

import nan_magic
from nan_magic import NanMagicWarning
from nan_magic.plain import from_plain, to_pairs, to_plain
from nan_magic.records import Report, TensorRef
from nan_magic.render.words.replay_words import replay_line
from nan_magic.scene import last_good as snapshot

# -- a model whose failure has an obvious fix ----------------------------------------------------


class Norm(nn.Module):
    """LayerNorm by hand; ``eps`` 0 divides 0 by 0 on a constant row, the fix is ``eps > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


def build() -> tuple[nn.Sequential, torch.optim.Adam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Norm(), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


BATCHES = [torch.randn(8, 4, generator=torch.Generator().manual_seed(step)) for step in range(6)]


def step_on(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def collapse(model: nn.Sequential) -> None:
    """The first layer outputs zeros: every row entering Norm is constant (a forward event in Norm)."""
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()


def train(
    model: nn.Sequential, opt: torch.optim.Optimizer, *, bad_step: int, how: str = "collapse",
    kept: list[tuple[dict[str, Any], dict[str, Any]]] | None = None, device: str = "cpu",
) -> None:
    """Train on BATCHES; at ``bad_step`` make the forward (collapse) or the optimizer (lr = nan) fail."""
    for step, x in enumerate(BATCHES):
        if step == bad_step:
            if how == "collapse":
                collapse(model)
            else:
                opt.param_groups[0]["lr"] = float("nan")
        step_on(model, opt, x.to(device))
        if kept is not None:
            kept.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))


def same_bits(a: Any, b: Any) -> bool:
    """Equal bit for bit (NaN included), through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_bits, a, b))
    return a == b or (a != a and b != b)  # NaN scalars (an lr) are unequal to themselves



# -- dump and load ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "tiered"])
def test_dump_is_one_file_read_back_bit_for_bit(tmp_path, mode: str) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path), mode=mode)
    path = str(tmp_path / "nan_scene_step2.pt")
    assert report.scene == path and report.scene_bytes == os.path.getsize(path)
    assert os.listdir(tmp_path) == ["nan_scene_step2.pt"]  # written whole, no temporary left
    assert any(path in note and "KB" in note for note in report.notes)  # the report shows path and size

    scene = nan_magic.load_scene(path)
    assert (scene.step, scene.phase, scene.module) == (2, "forward", "1")
    assert scene.report.message == report.message and scene.report.scene == path
    assert set(scene.data) == set(nan_magic.scene.dump.SCENE_KEYS)
    # nothing ran after the event: the live objects are the state at the event
    assert same_bits(scene.data["models"]["Sequential"], model.state_dict())
    assert scene.data["optimizers"][0]["type"] == "Adam"
    assert same_bits(scene.data["optimizers"][0]["state"], opt.state_dict())
    assert same_bits(scene.batch, {"input[0]": BATCHES[2]})
    assert same_bits(scene.data["rng"]["event"]["cpu"], torch.get_rng_state())
    if mode == "full":  # the producer module's own call: its input, and the generators before the step
        assert (scene.call_module, scene.module) == ("1", "1")
        assert same_bits(scene.producer_inputs, {"input[0]": torch.zeros(8, 4)})
        assert scene.data["rng"]["step_source"] == "before-forward"
    else:  # the model call the tiered watch replayed: the batch, and the generators before that call
        assert (scene.call_module, scene.module) == ("", "1")
        assert same_bits(scene.producer_inputs, {"input[0]": BATCHES[2]})
        assert scene.data["rng"]["producer"] is not None
    assert scene.versions["torch"] == torch.__version__ and scene.versions["nan_magic"] == nan_magic.__version__
    assert scene.data["training"]["Sequential"] == {"": True, "0": True, "1": True, "2": True}
    assert scene.data["last_good"] is None  # no keep_last_good


def test_non_finite_state_survives_the_dump_bit_for_bit(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2, how="lr"), model, opt, dump=str(tmp_path))
    assert report.phase == "optimizer"
    saved = nan_magic.load_scene(report.scene).data
    assert not torch.isfinite(model[0].weight).all()
    assert same_bits(saved["models"]["Sequential"], model.state_dict())
    assert same_bits(saved["optimizers"][0]["state"], opt.state_dict())


def test_a_second_scene_in_the_same_folder_keeps_the_first(tmp_path) -> None:
    paths = []
    for _ in range(2):
        model, opt = build()
        paths.append(raised(lambda: train(model, opt, bad_step=1), model, opt, dump=str(tmp_path)).scene)  # noqa: B023
    assert [os.path.basename(path) for path in paths] == ["nan_scene_step1.pt", "nan_scene_step1-2.pt"]


def test_load_scene_refuses_other_files(tmp_path) -> None:
    other = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, other)
    with pytest.raises(ValueError, match="not a nan_magic scene"):
        nan_magic.load_scene(other)
    text = tmp_path / "notes.pt"
    text.write_text("not a pickle at all")
    with pytest.raises(ValueError, match=r"notes\.pt is not a nan_magic scene"):
        nan_magic.load_scene(text)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.pt is not a nan_magic scene"):
        nan_magic.load_scene(empty)


class WritesAFile:
    """A pickle that, when loaded unsafely, runs code: it creates the file ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (open, (self.target, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_load_scene_refuses_a_file_that_would_run_code(tmp_path, writer: str) -> None:
    target = tmp_path / "written_by_the_scene"
    hostile = tmp_path / "nan_scene_step0.pt"
    payload = {"format": nan_magic.scene.dump.SCENE_FORMAT, "version": 1, "report": WritesAFile(str(target))}
    if writer == "torch.save":
        torch.save(payload, hostile)
    else:
        with open(hostile, "wb") as handle:
            pickle.dump(payload, handle, protocol=2)
    with pytest.raises(ValueError) as caught:
        nan_magic.load_scene(hostile)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{hostile}: refused")
    assert "needs io.open" in message  # the function it would have called, named
    assert not target.exists()  # nothing ran


def test_nanreplay_refuses_a_file_that_would_run_code_in_one_line(ip, tmp_path) -> None:
    from IPython.core.error import UsageError

    target = tmp_path / "written_by_the_scene"
    hostile = tmp_path / "nan_scene_step0.pt"
    torch.save({"format": nan_magic.scene.dump.SCENE_FORMAT, "x": WritesAFile(str(target))}, hostile)
    with pytest.raises(UsageError, match="refused") as caught:
        ip.run_line_magic("nanreplay", str(hostile))
    assert "\n" not in str(caught.value) and not target.exists()


def test_a_scene_loads_with_plain_weights_only_and_its_report_is_plain_data(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)  # no allowlist: the file names no class
    plain = data["report"]
    assert isinstance(plain, dict) and plain["tensor"] == to_plain(report.tensor)
    assert from_plain(Report, plain).message == report.message
    scene = nan_magic.load_scene(report.scene)
    assert scene.report.tensor == report.tensor and scene.report.cause == report.cause
    assert scene.report.input_stats == report.input_stats and scene.report.layers == report.layers
    assert same_bits(data["models"]["Sequential"], model.state_dict())


def test_a_scenes_notes_are_plain_data_and_read_back_as_the_same_sentences(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    assert data["version"] == 8
    saved = data["report"]["note_facts"]
    assert saved == (  # a kind and its facts
        {"kind": "step-replayed", "facts": (("step", report.step),)},
        {"kind": "debug-in-replay", "facts": (("step", report.step),)},  # (round 19: %debug's frame is the replay's)
    )
    scene = nan_magic.load_scene(report.scene)
    # The scene was saved before the notes of its saving were added: the ones it holds read the same, but where
    # %debug opened (in the session that stopped: a reopened scene has no traceback; hunt-c-s41).
    assert scene.report.notes == report.notes[:1]
    assert scene.report.notes[0].startswith(f"named by replaying step {report.step}'s model call")
    assert report.notes[-1].startswith(f"scene saved: {report.scene} (")


def test_a_version_2_scene_whose_notes_were_sentences_still_shows_them(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    plain = dict(data["report"])
    del plain["note_facts"]
    plain["notes"] = ("the GradScaler skipped this step", "a sentence {with braces} as it was written")
    data["version"], data["report"] = 2, plain
    old = tmp_path / "version_2_scene.pt"
    torch.save(data, old)
    scene = nan_magic.load_scene(old)
    assert scene.report.notes == plain["notes"]
    assert "a sentence {with braces} as it was written" in scene.report.to_text()


def test_a_version_3_scene_whose_warnings_were_sentences_still_shows_them(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    plain = dict(data["report"])
    plain["warnings"] = ({"step": 1, "kind": "loss-spike", "message": "the loss reached 1e+09 {as written}",
                          "module": None, "value": 1e9},)
    data["version"], data["report"] = 3, plain
    old = tmp_path / "version_3_scene.pt"
    torch.save(data, old)
    scene = nan_magic.load_scene(old)
    assert [warning.message for warning in scene.report.warnings] == ["the loss reached 1e+09 {as written}"]


def test_a_version_6_scene_s_tensors_stored_by_name_read_back_as_typed_references(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    plain = dict(data["report"])
    # Before version 7 a batch warning named its tensor by the argument's path, an optimizer note and an
    # optimizer cause by the parameter's name (a state by its words).
    plain["warnings"] = ({"step": 1, "kind": "extreme-input", "module": None, "value": 1e9, "said": None,
                          "facts": (("tensor", "input[0]"), ("absmax", 1e9), ("limit", 1e6))},)
    plain["note_facts"] = ({"kind": "optimizer-made-it", "facts": (("optimizer", "Adam"), ("tensor", "0.weight"))},)
    plain["cause"] = {"label": "half-precision-overflow", "reading": "optimizer-state-overflow", "facts": (
        ("optimizer", "Adam"), ("subject", "state exp_avg_sq of 0.weight"), ("dtype", "float16"), ("nan", 0),
        ("posinf", 3), ("neginf", 0), ("lr", 1e-3), ("eps", 1e-8), ("limit", 65504.0), ("step", 2))}
    # and the engine labelled each histogram's sample.
    plain["samples"] = tuple({**sample, "label": f"sample {index}"} for index, sample in enumerate(plain["samples"]))
    data["version"], data["report"] = 6, plain
    old = tmp_path / "version_6_scene.pt"
    torch.save(data, old)
    back = nan_magic.load_scene(old).report
    assert dict(back.warnings[0].facts)["tensor"] == to_pairs(TensorRef.argument("input[0]"))
    assert back.warnings[0].message.startswith("input[0] of the batch holds |x| = 1e+09")
    assert back.note_facts[0].fact("tensor") == to_pairs(TensorRef.parameter("0.weight"))
    assert back.notes == ("the Adam step made 0.weight non-finite",)
    assert back.cause is not None and back.cause.hint.startswith("state exp_avg_sq of 0.weight overflowed float16")
    assert [sample.label for sample in back.samples] == [f"sample {index}" for index in range(len(report.samples))]


def test_a_version_1_scene_whose_report_was_pickled_as_records_is_refused_in_one_line(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    data = torch.load(report.scene, weights_only=True)
    data["version"], data["report"] = 1, from_plain(Report, data["report"])
    old = tmp_path / "old_scene.pt"
    torch.save(data, old)
    with pytest.raises(ValueError, match="older nan_magic") as caught:
        nan_magic.load_scene(old)
    assert "\n" not in str(caught.value)


class Schedule:
    """An object of the user's own class in an optimizer's options: pickles, but a safe load refuses it."""


def test_a_part_a_safe_load_would_refuse_is_left_out_and_the_rest_saved(tmp_path) -> None:
    model, opt = build()
    opt.param_groups[0]["schedule"] = Schedule()
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    left_out = [note for note in report.notes if "leaves out optimizers[0]['state']" in note]
    assert len(left_out) == 1 and "Schedule" in left_out[0], report.notes
    scene = nan_magic.load_scene(report.scene)  # loads, safely
    assert same_bits(scene.data["models"]["Sequential"], model.state_dict())
    assert scene.data["optimizers"][0]["state"] is None


# -- replay ------------------------------------------------------------------------------------


@pytest.fixture
def scene(tmp_path) -> nan_magic.Scene:
    model, opt = build()
    # The producer module's own call (the tiered default saves the model call: test_dump_is_one_file...).
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path), mode="full")
    return nan_magic.load_scene(report.scene, map_location="cpu")


def test_replay_reproduces_the_event_on_a_fresh_model_and_is_finite_after_the_fix(scene) -> None:
    fresh, _ = build()  # the user's model, rebuilt from the code
    scene.restore_into(fresh)
    before = copy.deepcopy(fresh.state_dict())
    result = scene.replay(fresh)
    assert result.reproduced
    assert (result.finding.op, result.finding.module, result.finding.nan) == ("aten.div.Tensor", "1", 32)
    assert result.finding.source.function == "forward"

    fresh[1].eps = 1e-5  # the fix
    fixed = scene.replay(fresh)
    assert not fixed.reproduced and fixed.finding is None
    # The replay returns data; render/words/replay_words.py writes the line %nanreplay prints.
    line = replay_line(scene.module, result.finding, result.note)
    assert line == f"replay of 1 reproduced 32 nan in aten.div.Tensor at {result.finding.source}"
    assert replay_line(scene.module, fixed.finding, fixed.note) == fixed.note.text  # the replay's own note
    assert fixed.note.text.startswith("replay of 1 on its recorded inputs stayed finite")
    assert replay_line("", None, None) == "replay of the root module stayed finite"
    assert same_bits(fresh.state_dict(), before)  # a replay leaves the model as it was


def test_replay_takes_the_arguments_given_instead_of_the_saved_ones(scene) -> None:
    fresh, _ = build()
    assert not scene.replay(fresh, torch.randn(8, 4)).reproduced
    assert scene.replay(fresh, torch.ones(8, 4)).reproduced


def test_rerun_step_repeats_the_whole_step_and_is_finite_after_the_fix(scene) -> None:
    fresh, fresh_opt = build()

    def failing_step() -> None:
        step_on(fresh, fresh_opt, scene.batch["input[0]"])

    watch = scene.rerun_step(failing_step, fresh, fresh_opt)
    assert watch.report is not None
    assert (watch.report.module, watch.report.op) == ("1", "aten.div.Tensor")  # op-level: the exact op
    # Numbered as the run it re-runs (round 21: the re-run's watch counted its one step as step 0).
    assert scene.step == 2 and watch.report.step == scene.step, watch.report.message
    assert f"step {scene.step}" in watch.report.message and [event.step for event in watch.events] == [scene.step]
    fresh[1].eps = 1e-5
    assert scene.rerun_step(failing_step, fresh, fresh_opt).report is None


def test_only_forward_producers_in_a_module_replay_alone(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=1, how="lr"), model, opt, dump=str(tmp_path))
    with pytest.raises(ValueError, match="rerun_step"):
        nan_magic.load_scene(report.scene).replay(model)


class Shifted(nn.Module):
    """``log(x - shift)``: NaN where ``x`` is below the shift; ``shift`` may come inside a tuple."""

    def forward(self, x: torch.Tensor, shift: Any) -> torch.Tensor:
        return torch.log(x - (shift[0] if isinstance(shift, tuple) else shift))


class CallsShifted(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.fc, self.shifted, self.nested = nn.Linear(4, 4), Shifted(), nested

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.full((4,), 100.0)
        return self.shifted(self.fc(x), (shift,)) if self.nested else self.shifted(self.fc(x), shift=shift)


def test_the_producers_call_is_saved_by_argument_and_replayed_from_it(tmp_path) -> None:
    model = CallsShifted(nested=False)
    report = raised(lambda: model(torch.ones(2, 4)), model, dump=str(tmp_path), mode="full")
    scene = nan_magic.load_scene(report.scene)
    assert scene.module == "shifted"
    call = scene.data["producer_call"]
    assert (list(call["args"]), list(call["kwargs"]), call["nested"]) == ([0], ["shift"], [])
    assert same_bits(call["kwargs"]["shift"], torch.full((4,), 100.0))
    assert same_bits(call["args"][0], scene.producer_inputs["input[0]"])
    result = scene.replay(CallsShifted(nested=False))
    assert result.reproduced and result.finding.op == "aten.log.default"


def test_a_producer_given_a_tensor_inside_a_container_asks_for_its_arguments(tmp_path) -> None:
    model = CallsShifted(nested=True)
    report = raised(lambda: model(torch.ones(2, 4)), model, dump=str(tmp_path), mode="full")
    scene = nan_magic.load_scene(report.scene)
    assert scene.data["producer_call"]["nested"] == ["input[1][0]"]
    with pytest.raises(ValueError, match=r"nested input \(input\[1\]\[0\]\)"):
        scene.replay(CallsShifted(nested=True))
    fresh = CallsShifted(nested=True)
    assert scene.replay(fresh, scene.producer_inputs["input[0]"], (torch.full((4,), 100.0),)).reproduced


class Stepped(nn.Module):
    """``h / (h - h)`` at step 3 only: the step is a plain Python argument (the notebook's ``model(xs, step)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.lin(x)
        return h / (h - h) if step == 3 else h


class SteppedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Stepped(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, step: Any = 0) -> torch.Tensor:
        return self.head(self.body(x, step.value if isinstance(step, Box) else step))


class Box:
    """An argument that is neither a tensor nor a plain Python value: a scene cannot hold it."""

    def __init__(self, value: int) -> None:
        self.value = value


def stepped_loop(model: nn.Module, boxed: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(0)
    xs = torch.randn(8, 4)
    for step in range(6):
        loss = model(xs, Box(step) if boxed else step).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    "options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True}, {"ops": True, "defer": True}],
    ids=["default", "defer", "full", "ops", "ops-defer"])
def test_a_producers_plain_python_argument_is_saved_and_replayed(tmp_path, options) -> None:
    # model(xs, step) was saved as model(xs): the replay ran with step=0 (the default) and stayed finite, and
    # %nanreplay said so, not that an argument was missing. The scene keeps plain Python arguments now. (ops+defer:
    # a TypeError for the missing step until gaps20: no call held its arguments; each keeps its plain ones there.)
    torch.manual_seed(0)
    model = SteppedNet()
    report = raised(lambda: stepped_loop(model), model, dump=str(tmp_path), **options)
    scene = nan_magic.load_scene(report.scene)
    call = scene.data["producer_call"]
    assert call["args"][1] == 3 and call["positional"] == 2
    result = scene.replay(model)
    assert result.reproduced and result.finding is not None and result.finding.op == "aten.div.Tensor"


def test_a_producers_argument_the_scene_cannot_hold_is_said_missing(tmp_path) -> None:
    torch.manual_seed(0)
    model = SteppedNet()
    report = raised(lambda: stepped_loop(model, boxed=True), model, dump=str(tmp_path))
    scene = nan_magic.load_scene(report.scene)
    assert scene.module == "body" and scene.call_module == ""
    with pytest.raises(ValueError, match="positional argument 1 as an object the scene does not hold"):
        scene.replay(model)
    assert scene.replay(model, scene.producer_inputs["input[0]"], 3).reproduced


def test_restore_into_needs_a_model_it_can_tell_apart(scene) -> None:
    with pytest.raises(RuntimeError, match="Missing key"):
        scene.restore_into(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no last-good state"):
        scene.restore_into(build()[0], state="last_good")
    with pytest.raises(ValueError, match="state must be 'auto', 'event' or 'last_good', not 'best'"):
        scene.restore_into(build()[0], state="best")
    with pytest.raises(ValueError, match="Linear has no submodule '1'"):
        scene.replay(nn.Linear(4, 4))


# -- roll back -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_restore_puts_back_the_last_finite_step_bit_for_bit(where: str) -> None:
    model, opt = build()
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    report = raised(lambda: train(model, opt, bad_step=3, how="lr", kept=kept), model, opt, keep_last_good=where)
    assert (report.phase, report.step) == ("optimizer", 3)
    assert "after step 2" in " ".join(report.notes)
    parameters = list(model.parameters())
    report.restore()
    assert same_bits(model.state_dict(), kept[2][0])
    assert same_bits(opt.state_dict(), kept[2][1])
    # the same Parameter objects, so the optimizer trains on from there
    assert list(model.parameters()) == parameters and opt.param_groups[0]["params"] == parameters
    step_on(model, opt, BATCHES[3])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    report.restore()  # the kept state did not move with the optimizer
    assert same_bits(opt.state_dict(), kept[2][1])


def test_copies_go_into_the_same_buffers_after_the_first_step() -> None:
    model, opt = build()
    buffers = []
    with nan_magic.watch(model, opt, keep_last_good="cpu") as watch:
        for x in BATCHES[:3]:
            step_on(model, opt, x)
            model_state = watch.last_good.state_of(model)
            buffers.append((model_state["0.weight"], watch.last_good.state_of(opt)["state"][0]["exp_avg"]))
            assert same_bits(model_state, model.state_dict())
    assert all(moment is buffers[0][1] for _weight, moment in buffers)
    # The model's state of the step before is kept too (the lr fix trial): two buffers, taking turns.
    assert buffers[2][0] is buffers[0][0] and buffers[1][0] is not buffers[0][0]


def test_in_warn_mode_later_finite_steps_do_not_move_the_reports_state() -> None:
    model, opt = build()
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with pytest.warns(RuntimeWarning), nan_magic.watch(model, opt, keep_last_good="cpu", on_detect="warn") as watch:
        train(model, opt, bad_step=99, kept=kept)  # 6 finite steps
        opt.param_groups[0]["lr"] = float("nan")
        step_on(model, opt, BATCHES[0])
        report = watch.report
        report.restore()  # roll back and go on training, under the same watch
        for x in BATCHES:
            step_on(model, opt, x)
    assert report.step == 6
    report.restore()
    assert same_bits(model.state_dict(), kept[5][0]) and same_bits(opt.state_dict(), kept[5][1])


def test_deferred_mode_keeps_a_finite_step_too() -> None:
    model, opt = build()
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    report = raised(lambda: train(model, opt, bad_step=5, kept=kept), model, opt, keep_last_good="cpu", defer=True)
    assert (report.phase, report.step) == ("forward", 5)
    # Step 4's result is read at step 5's check, after step 5's forward ran: its state was copied right after it,
    # and kept as the check found it finite, before the event: the state after step 4, as the immediate mode keeps.
    # (session 46; before, the check stopped at the event first and kept the state after step 3)
    assert "after step 4" in " ".join(report.notes)
    report.restore()
    assert same_bits(model.state_dict(), kept[4][0]) and same_bits(opt.state_dict(), kept[4][1])


def test_a_deferred_scene_holds_the_producers_inputs_recomputed_after_backward(tmp_path) -> None:
    model, opt = build()
    report = raised(lambda: train(model, opt, bad_step=5), model, opt, defer=True, dump=str(tmp_path))
    assert (report.module, report.op) == ("1", "aten.div.Tensor")  # found by replay at the check
    scene = nan_magic.load_scene(report.scene)
    assert list(scene.producer_inputs) == ["input[0]"]
    assert torch.isfinite(scene.producer_inputs["input[0]"]).all()
    fresh, _ = build()
    scene.restore_into(fresh)
    assert scene.replay(fresh).reproduced


def test_restore_says_why_it_cannot() -> None:
    model, opt = build()
    plain = raised(lambda: train(model, opt, bad_step=1, how="lr"), model, opt)
    with pytest.raises(RuntimeError, match="keep_last_good"):
        plain.restore()

    model, opt = build()
    first = raised(lambda: train(model, opt, bad_step=0, how="lr"), model, opt, keep_last_good=True)
    with pytest.raises(RuntimeError, match="no optimizer step ended finite"):
        first.restore()
    elsewhere = dataclasses.replace(first, restore_token=first.restore_token + 1)
    with pytest.raises(RuntimeError, match="not in this process"):
        elsewhere.restore()
    # a pickled copy made in this process still restores; older reports are released
    assert pickle.loads(pickle.dumps(first)).restore_token == first.restore_token
    reports = []
    for _ in range(snapshot.KEPT_REPORTS):
        model, opt = build()
        reports.append(raised(lambda: train(model, opt, bad_step=2, how="lr"), model, opt, keep_last_good=True))  # noqa: B023
    reports[-1].restore()
    with pytest.raises(RuntimeError, match="not in this process"):
        first.restore()


def test_dump_with_keep_last_good_holds_the_state_the_step_started_from(tmp_path) -> None:
    model, opt = build()
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    report = raised(
        lambda: train(model, opt, bad_step=2, how="lr", kept=kept), model, opt, dump=str(tmp_path),
        keep_last_good="cpu",
    )
    scene = nan_magic.load_scene(report.scene)
    assert scene.data["last_good"]["step"] == 1
    assert scene.data["rng"]["step_source"] == "after-last-good"
    fresh, fresh_opt = build()
    scene.restore_into(fresh, fresh_opt)  # auto: an optimizer event starts from the last good state
    assert same_bits(fresh.state_dict(), kept[1][0]) and same_bits(fresh_opt.state_dict(), kept[1][1])
    scene.restore_into(fresh, fresh_opt, state="event")
    assert same_bits(fresh.state_dict(), model.state_dict())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", ["cpu", "device"])
def test_cuda_roll_back_and_a_scene_read_on_the_cpu(tmp_path, where: str) -> None:
    model, _ = build()
    model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    report = raised(
        lambda: train(model, opt, bad_step=5, kept=kept, device="cuda"), model, opt, keep_last_good=where,
        dump=str(tmp_path),
    )
    assert report.module == "1"
    kept_step = 3 if "after step 3" in " ".join(report.notes) else 4  # deferred on CUDA: maybe one step older
    at_event = {key: value.cpu() for key, value in model.state_dict().items()}
    report.restore()
    assert same_bits(model.state_dict(), kept[kept_step][0]) and same_bits(opt.state_dict(), kept[kept_step][1])
    scene = nan_magic.load_scene(report.scene, map_location="cpu")
    assert same_bits(scene.data["models"]["Sequential"], at_event)
    assert scene.data["rng"]["event"]["cuda"] is not None
    fresh, _ = build()  # on the CPU
    scene.restore_into(fresh)
    assert scene.replay(fresh).reproduced


# -- writing never crashes the user's program ---------------------------------------------------


def test_a_folder_that_cannot_be_made_is_reported_not_raised(tmp_path) -> None:
    # A path below a regular file fails with ENOTDIR even for root (chmod would not stop root).
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model, opt = build()
    with pytest.warns(NanMagicWarning, match="could not save the scene"):
        report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(blocker / "scenes"))
    assert report.scene is None and report.phase == "forward" and report.module == "1"
    assert any("could not save the scene" in note and "NotADirectoryError" in note for note in report.notes)


def test_a_full_disk_is_reported_and_leaves_no_partial_file(tmp_path, monkeypatch) -> None:
    def full_disk(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        handle.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    model, opt = build()
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.warns(NanMagicWarning):
        report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    assert report.scene is None
    assert any("No space left on device" in note for note in report.notes)
    assert os.listdir(tmp_path) == []


def test_log_mode_runs_on_when_the_dump_fails(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    model, opt = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # even with warnings as errors
        with nan_magic.watch(model, opt, dump=str(tmp_path), on_detect="log") as watch:
            train(model, opt, bad_step=2)
    assert watch.report is not None and watch.report.scene is None


def test_an_unpicklable_part_is_left_out_and_the_rest_saved(tmp_path) -> None:
    model, opt = build()
    opt.param_groups[0]["on_step"] = lambda: None  # pickle cannot save a lambda
    report = raised(lambda: train(model, opt, bad_step=2), model, opt, dump=str(tmp_path))
    assert report.scene is not None
    assert any("leaves out optimizers[0]['state']" in note for note in report.notes)
    scene = nan_magic.load_scene(report.scene)
    assert same_bits(scene.data["models"]["Sequential"], model.state_dict())
    with pytest.raises(ValueError, match="does not hold this optimizer's state"):
        scene.restore_into(build()[0], build()[1])


# -- the magics ----------------------------------------------------------------------------------


def test_nantrace_dumps_and_nanreplay_rebuilds_the_scene(ip, tmp_path) -> None:
    from IPython.utils.capture import capture_output

    ip.user_ns.update(build=build, train=train, Norm=Norm)
    ip.run_cell("model, opt = build()")
    with capture_output():
        ip.run_cell(f"%%nantrace model opt --dump {tmp_path} --keep-last-good\ntrain(model, opt, bad_step=2)")
    report = ip.user_ns["_nan_report"]
    assert report.scene == str(tmp_path / "nan_scene_step2.pt") and report.restore_token is not None

    ip.run_cell("model, opt = build()")  # a new session: the model rebuilt from the code
    with capture_output() as captured:
        ip.run_line_magic("nanreplay", report.scene)
    assert "reproduced 32 nan in aten.div.Tensor" in captured.stdout
    assert isinstance(ip.user_ns["_nan_scene"], nan_magic.Scene)
    ip.run_cell("model[1].eps = 1e-5")
    with capture_output() as captured:
        ip.run_line_magic("nanreplay", f"{report.scene} model")
    assert "stayed finite" in captured.stdout


def test_nanreplay_usage_errors_are_one_line(ip, tmp_path) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="cannot read"):
        ip.run_line_magic("nanreplay", str(tmp_path / "missing.pt"))


# -- healthy-checkpoint guard -------------------------------------------------------------------


def test_guard_warns_before_saving_non_finite_entries_and_restores_torch_save(tmp_path) -> None:
    model, opt = build()
    original = torch.save
    with torch.no_grad():
        model[2].bias[1] = float("inf")
    with nan_magic.guard_checkpoints():
        assert torch.save is not original
        with pytest.warns(NanMagicWarning, match=r"model\.2\.bias \(1 \+inf\)") as caught:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
        assert caught[0].filename == __file__  # points at the user's torch.save line
        with pytest.warns(NanMagicWarning, match=r"^torch.save is about to write non-finite values: 2\.bias"):
            torch.save(model, tmp_path / "model.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "healthy.pt")  # healthy: silent
    assert torch.save is original
    assert same_bits(torch.load(tmp_path / "ckpt.pt")["model"], model.state_dict())  # still saved, as asked


def test_guard_enable_disable_and_nesting() -> None:
    original = torch.save
    outer = nan_magic.guard_checkpoints()
    with nan_magic.guard_checkpoints():
        pass
    assert torch.save is not original  # the outer guard is still on
    outer.disable()
    outer.disable()
    assert torch.save is original
