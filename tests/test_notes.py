"""A report's notes are data (Note: a kind and its facts); only render/words/note_words.py writes their sentences."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from watching import raised

import nan_magic
from nan_magic.hot.kept.finding import Finding
from nan_magic.note_records import Note
from nan_magic.plain import to_pairs
from nan_magic.records import Report, SourcePointer
from nan_magic.render.words import note_words

PACKAGE = Path(nan_magic.__file__).parent
#: The calls that make a note of the kind given as their first argument.
_MAKERS = {"Note", "of", "raised", "_failure", "_Gone"}


def _engine_trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path)))
            for path in sorted(PACKAGE.rglob("*.py")) if "render" not in path.relative_to(PACKAGE).parts]


def _name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _strings(node: ast.expr) -> list[str]:
    """The string constants ``node`` can be: ``"a"``, or both of ``"a" if c else "b"``."""
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []


def test_every_kind_of_note_the_engine_makes_has_its_words_and_every_kind_with_words_is_made() -> None:
    made: dict[str, str] = {}
    deliberate: dict[str, str] = {}
    for path, tree in _engine_trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
            if _name(node) == "mark_deliberate":
                deliberate.update((how, where) for how in _strings(node.args[1]))
            elif _name(node) in _MAKERS:
                made.update((kind, where) for kind in _strings(node.args[0]) if kind.islower() and " " not in kind)
    known = set(note_words._TEMPLATES) | set(note_words._WRITERS)
    assert {kind: where for kind, where in made.items() if kind not in known} == {}
    assert {how: where for how, where in deliberate.items() if how not in note_words._DELIBERATE} == {}
    assert known == set(made)  # no words for a kind nothing makes
    assert set(note_words._DELIBERATE) == set(deliberate)


def test_the_engine_never_appends_a_sentence_as_a_note() -> None:
    """A finding's notes are Notes (mypy holds it, this says where): no string built in the engine is one."""
    assert typing.get_type_hints(Finding)["notes"] == list[Note]
    assert typing.get_type_hints(Report)["note_facts"] == tuple[Note, ...]
    sentences = []
    for path, tree in _engine_trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("append", "extend") and "notes" in ast.unparse(node.func.value)
                    and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp))):
                sentences.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert sentences == []


def test_a_kind_fills_its_facts_into_its_words() -> None:
    assert Note.of("module-backward", module="encoder.1").text == (
        "the gradient flowing into encoder.1 was finite; the gradient its backward computed is not")
    # A module's name that is empty is the root's.
    assert Note.of("already-bad", name="fc.weight", module="").text == (
        "fc.weight was already non-finite when the root module read it")
    assert Note.of("scaler-skipped", in_a_row=2, total=5, scale=0.5).text == (
        "the GradScaler skipped this step: its scaled gradients were non-finite (2 skipped in a row, 5 in all; "
        "scale 0.5)")
    assert Note.of("restore", step=None).text.startswith("keep_last_good: no optimizer step ended finite")
    assert Note.of("scene-saved", path="d/s.pt", bytes=3 * 1024 * 1024).text.startswith("scene saved: d/s.pt (3.0 MB)")


def test_a_reason_is_a_note_held_in_the_note_it_explains() -> None:
    gone = Note.of("arguments-gone", module="block", reason=Note("rng-not-kept").pair)
    assert gone.text == ("block's arguments are gone by the deferred check (its random state was not kept); "
                         "watch with ops=True (%%nantrace --ops) for the op and line")
    finite = Note.of("backward-replay-finite", module="head").adding(ops_hint=True)
    assert finite.text == ("replay of head with gradients stayed finite; the op is unknown; "
                           "watch with ops=True (%%nantrace --ops) for the op and line")


def test_a_source_line_in_a_note_is_held_as_data_and_reads_as_the_pointer_does() -> None:
    pointer = SourcePointer("model.py", 12, "forward", "return a / b")
    note = Note.of("python-backward", op="aten.div.Tensor", node="DivBackward", created=to_pairs(pointer))
    assert note.text == ("aten.div.Tensor ran in a Python backward of DivBackward (a custom autograd.Function's "
                         f"backward, or a gradient hook), whose node was created at {pointer}")
    assert Note.of("inside", source=to_pairs(pointer)).text == f"inside {pointer}"


def test_an_exception_without_a_message_leaves_no_dangling_colon() -> None:
    assert Note.raised("forward-raised", IndexError()).text == "then the forward raised IndexError"
    assert Note.of("replay-raised", module="fc", error="IndexError", message="").text == (
        "replay of fc raised IndexError; the op is unknown")
    assert Note.raised("op-raised", RuntimeError("bad\nmore"), func="aten.multinomial.default").text == (
        "then aten.multinomial.default was called on it and raised RuntimeError: bad")


def test_a_kind_this_version_does_not_know_shows_its_facts() -> None:
    assert Note.of("from-a-later-version", step=3).text == "from-a-later-version: step 3"


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).pow(2).sum(1).sqrt()


def _loss_code_report() -> Report:
    torch.manual_seed(0)
    embed = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    anchor, negative = torch.randn(6, 8), torch.randn(6, 8)

    def step() -> None:
        a, p, n = embed(anchor), embed(anchor.clone()), embed(negative)
        F.relu(distance(a, p) - distance(a, n) + 1.0).mean().backward()

    return raised(step, embed)


def test_the_loss_region_is_its_nodes_names_and_render_counts_the_singular_ones() -> None:
    report = _loss_code_report()
    (region,) = [note for note in report.note_facts if note.kind == "loss-region"]
    assert region.fact("singular") == ("SqrtBackward0", "SqrtBackward0")
    assert "PowBackward0" in region.fact("nodes")
    assert "the ones whose derivative can be infinite: SqrtBackward0 x2" in region.text


def test_json_text_and_html_show_the_same_notes() -> None:
    report = _loss_code_report()
    assert len(report.notes) == len(report.note_facts) >= 3
    data = json.loads(report.to_json())
    assert data["notes"] == list(report.notes)  # the sentences, for a reader without nan_magic
    assert [note["kind"] for note in data["note_facts"]] == [note.kind for note in report.note_facts]
    text, html = report.to_text(), report.to_html()
    for note in report.notes:
        assert note in text
        assert note.replace("'", "&#x27;") in html
