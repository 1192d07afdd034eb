"""The sentence of each kind of note (records: :class:`~nan_magic.note_records.Note`).

The engine keeps a note's facts; the words are all here. A template is filled from the note's facts; a kind whose
words depend on them has a function. Facts whose name ends in ``module`` hold a module's qualified name (``""`` for
the root, None where none): they read as ``the root module`` where empty. An ``error`` reads with its ``message``:
``ValueError: bad shape``, or the type alone. A note with the fact ``ops_hint`` ends with the advice to watch with
``ops=True``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from nan_magic.locations import SourcePointer
from nan_magic.note_records import Note
from nan_magic.plain import from_plain
from nan_magic.render.words.counted import counted, human_size
from nan_magic.render.words.fix_reasons import FIX_REASON_TEMPLATES, FIX_REASON_WRITERS
from nan_magic.render.words.load_words import LOAD_NOTE_WRITERS
from nan_magic.render.words.lr_words import LR_NOTE_TEMPLATES, LR_NOTE_WRITERS
from nan_magic.render.words.names import subject_label, tensor_label
from nan_magic.render.words.optimizer_replay_words import debug_later_step, optimizer_replay_finite, optimizer_replayed
from nan_magic.render.words.replay_words import STEP_REPLAY_TEMPLATES
from nan_magic.tensor_refs import TensorRef

__all__ = ["debugger_command", "note_text"]

_OPS = "watch with ops=True (%%nantrace --ops) for the op and line"
_GONE = "{module}'s arguments are gone by the deferred check ({reason}); " + _OPS
_FOUND = "{nan} nan, {posinf} +inf, {neginf} -inf in {op}"

#: The notes whose words are their facts filled into a template.
_TEMPLATES: dict[str, str] = {
    # localize/ops/called.py: a number torch passed itself
    "own-number": "the non-finite number the op was given is torch's own: torch.{function}, which the line calls, "
                  "is a composite that passes it (not a number the code set)",
    "log-edge": "{function}'s output is infinite in {count:~element} where its y is {edge:g}, its log's edge",
    "spread-divisor": "the divisor is the output of a {spread} (its autograd node or recorded op), not a count",
    **LR_NOTE_TEMPLATES,  # where a step's non-finite learning rate came from
    **FIX_REASON_TEMPLATES,  # why a fix trial was not run or not counted (FixTrial.reason)
    # hot/: the boundary checks
    "outside-made-it": "every watched module output of this step was finite: code outside the modules (the loss) "
                       "produced it",
    "data-code-made-it": "every watched module output of this step was finite: code outside the modules made it "
                         "from the data alone (a target or an input it built), not from a model's output",
    "outputs-were-bad": "some module outputs of this step were already non-finite",
    "given-gradient": "the loop gave this gradient to backward() (out.backward(gradient)): no watched code produced "
                      "it, and the backward would carry it into every gradient of the model",
    "entered-outside": "every watched module output of this step was finite; this tensor, which no watched code "
                       "produced, entered the code outside the modules (the loss) already non-finite",
    "outside-backward": "computed by the backward of code outside every watched module (e.g. the loss)",
    "ops-for-forward-line": "watch with ops=True (%%nantrace --ops) for the op and its forward line",
    "module-backward": "the gradient flowing into {module} was finite; the gradient its backward computed is not",
    "grads-overflowed": "the step's checks saw a parameter gradient overflow while the gradients into the model's "
                        "outputs stayed finite",
    "grads-read-at-exit": "the watch ended after this backward, before an optimizer step: its parameter gradients "
                          "were read then",
    "grads-read-unstepped": "no optimizer stepped after this backward: its parameter gradients were read when it "
                            "ended",
    "scaler-collapsing": "raised because the scale keeps collapsing ({skips:~skip} in a row, or a scale below 1)",
    "about-to-step": "{optimizer} was about to step with this gradient",
    "detected-deferred": "detected at the deferred check",
    "held-changed": "an input tensor of that call was changed in place after its forward",
    "held-freed": "an input tensor of that call was freed after its forward and cannot be recomputed",
    # localize/: the producer rule, the op tracer, the replays
    "already-bad": "{name} was already non-finite when {module} read it",
    "swapped-in": "torch.func.functional_call ran the model with a tensor of the loop's own code in {name}'s place: "
                  "it is no parameter of the model, and the op that made it is the producer",
    "own-code": "{module}'s own code made it, and passed it to {consumer} as {path}",
    "arguments-gone": _GONE,
    "not-kept": "its arguments were not kept",
    "rng-not-kept": "its random state was not kept",
    "op-raised": "then {func} was called on it and raised {error}",
    "forward-raised": "then the forward raised {error}",
    "anomaly-raised": "torch's anomaly detection stopped the backward ({message})",
    "buffer-written": "{op} wrote {buffer} non-finite when step {step}'s model call was run again from its buffers "
                      "as they were before it",
    "buffer-carried": "{op} made the non-finite value that {writer} wrote into {buffer} when step {step}'s model "
                      "call was run again from its buffers as they were before it",
    "buffer-written-from-zero": "{op} wrote {buffer} non-finite when step {step}'s model call was run again from "
                                "the buffer as the step left it, its non-finite elements as 0 (no copy from before "
                                "the call was kept): each of them came out non-finite again",
    "anomaly-unreplayed": "the backward was running in {module} or a module enclosing it when it stopped; no replay "
                          "of them (from a gradient of ones into their outputs, not the real one) stopped at a NaN "
                          "as it did, so the producer is unknown: " + _OPS,
    "refetched": "named by fetching the batch's samples from {dataset} again",
    "refetch-raised": "fetching the batch's samples from {dataset} again raised {error}",
    "collate-raised": "collating the batch's samples from {dataset} again (its loader's collate_fn) raised {error}",
    "iterable-dataset": "the batch came from {dataset}, an iterable dataset: its samples cannot be fetched again by "
                        "index, so the op that made the value is not named",
    "indices-unseen": "the batch's indices into {dataset} were not seen (drawn before the watch began, or "
                      "in_order=False), so its samples were not fetched again",
    "refetch-finite": "fetching the batch's {count:~sample} from {dataset} again made no non-finite value, and "
                      "they came back finite: it was drawn at random (a random transform), or made after "
                      "__getitem__ (the collate function)",
    "own-gradient-formula": "the gradients flowing into every module were finite; this parameter's own gradient "
                            "formula made it",
    "optimizer-unreplayable": "the {optimizer} step could not be replayed to name its op",
    "loop-wrote": "the loop's own code wrote {name} between backward() and the next step (a hand-written update)",
    "frame-let-go": "{debugger} opens where the step was judged, not in {function} at line {line}: that function had "
                    "returned and its frame was let go, its tensors too large to keep",
    "frame-ran-on": "{debugger} opens in {function} at line {line} with the locals of its last pass, not the producing "
                    "one: a loop ran that line again after it (later passes: {runs}); ops=True stops at the producing "
                    "pass",
    "debug-not-replayed": "{debugger} opens where the step was judged, not at the forward line: {reason}",
    # ... its reason (localize/replay/line_replay.py)
    "line-node-not-remade": "a replay of the call did not make that line's autograd node again",
    "line-call-not-kept": "no model call of the step that made that line's autograd node was kept to replay",
    "line-call-transformed": "the call that made that line's autograd node ran inside a torch.func transform (vmap, "
                             "jacrev)",
    "ops-keeps-no-call": "ops=True keeps the step's model calls for the fix trials only, and fixes=False (or "
                         "replay=False) keeps none",
    "debug-frame-returned": "{debugger} opens where the step was judged, not in {function} at line {line}: that "
                            "function had returned before the deferred check, and no replay runs it again",
    "loop-wrote-after-step": "the loop's own code wrote {name} after the optimizer step, before the next model call",
    "input-mutated": "{module} changed its input in place, so a replay cannot start from the values it received; "
                     + _OPS,
    "replay-found": "replay of {module} on its inputs found the op: replay reproduced " + _FOUND,
    "ran-inside": "{op} ran inside {op_module}, which is not checked on its own",
    "rng-redrawn": "the call's random state was not kept: its replay drew other random numbers",
    "found-in-enclosing": "{module}'s own arguments are gone by the deferred check ({reason}); a replay of "
                          "{outer_module}, which called it, found the op in {op_module}: " + _FOUND,
    "found-in-running": "a replay of {outer_module}, which called {module}, found the op in {op_module}: " + _FOUND,
    "found-picked": "{module} made a new kind of the infinity {op_module} passed on as benign: a replay of "
                    "{outer_module}, which called both, found that {op} picked it (a max or an index over a fully "
                    "masked row), " + _FOUND,
    "found-in-caller": "a replay of {outer_module} found the first non-finite value in {op_module}'s own code "
                       "({op}), before {module}, which passed it on",
    "freed-recomputed": "{path} was freed before the deferred check: its counts and values are from running "
                        "{module} again on the same inputs",
    "backward-not-kept": "{module}'s arguments were not kept, so its backward cannot be replayed; " + _OPS,
    "replay-raised": "replay of {module} raised {error}; the op is unknown",
    "replay-held": "replay of {module} gave a non-finite output that no op inside it produced: its inputs, "
                   "parameters, buffers or scalar arguments already held it",
    "replay-finite": "replay of {module} on its recorded inputs stayed finite; the op is unknown",
    "replay-generator-not-kept": "replay of {module} drew from a torch.Generator of the user's whose state at the "
                                 "call was not kept (a global or a closure's generator, or one passed by keyword), "
                                 "so it drew other numbers; the op is unknown",
    "replay-arguments-changed": "{module} changed an object it was given (a cache it appended to), so a replay of "
                                "it from that object does not repeat the call",
    "cannot-replay": "cannot replay {module}: {reason}",
    "backward-replay-raised": "replay of {module} with gradients raised {error}; the op is unknown",
    "backward-replay-finite": "replay of {module} with gradients stayed finite; the op is unknown",
    **STEP_REPLAY_TEMPLATES,
    "fused-apart": "{fused}, PyTorch's fused kernel for the whole layer (its inference fast path), made the value; a "
                   "replay with that fast path off (torch.backends.mha.set_fastpath_enabled(False)) made it again "
                   "and names the op inside the layer",
    "replay-interrupted": "the replay that names the producer was interrupted (the stop button, Ctrl-C): this is "
                          "what the step's boundary check saw, not the producer; run the cell again and let it finish "
                          "to name the module, op and line",
    "no-gradient-held": "no gradient flowing into the model's outputs was held for this step",
    "call-not-held": "its model call was no longer held (more than {max_calls} calls in the step)",
    "sharded-not-replayed": "a model sharded by FSDP is not replayed (its forward needs every rank)",
    "transform-not-replayed": "a call made inside a torch.func transform (vmap, jacrev) is not replayed: its "
                              "arguments were the transform's, gone once it returned",
    "inputs-modified": "the call's inputs were modified in place since the call",
    "step-replay-raised": "the replay raised {error}",
    # scene/, fixes/, distributed/
    "scene-failed": "could not record the scene: {error}",
    "scene-part-failed": "the scene leaves out {part}: {error}",
    "scene-part-refused": "the scene leaves out {part}: {reason}",
    "scene-save-failed": "could not save the scene in {folder}: {error}",
    "batch-lacks": "the scene's batch lacks {paths}: freed or changed in place before the event",
    "input-freed": "the scene lacks the producer's {path}: it was freed before the event",
    "input-changed": "the scene lacks the producer's {path}: the producer changed it in place",
    "fixes-no-op": "no fix was tried: the remedies fit the producer's op, which was not named; " + _OPS,
    "rank-saw-none": "rank {rank} saw no non-finite value of its own at this step",
    # a note of a scene written before notes were data: its sentence as it was
    "said": "{text}",
}

#: What made a deliberate infinity (the ``how`` of a ``deliberate`` note).
_DELIBERATE: dict[str, str] = {
    "mask-argument": "{path} is an infinite mask given as an argument",
    "mask-buffer": "{name} is an infinite mask held as a buffer",
    "scalar": "an infinite scalar, e.g. masked_fill(mask, -inf), or a mask carried on",
    "scalar-inside": "an op inside was given an infinite scalar, e.g. masked_fill(mask, -inf)",
    "scalar-in-replay": "a replay of {outer_module} showed an op of {module} given an infinite scalar",
}


def note_text(note: Note) -> str:
    """The sentence ``note`` stands for."""
    words = _WRITERS.get(note.kind)
    try:
        if words is not None:
            text = words(note)
        elif note.kind in _TEMPLATES:
            text = _fill(_TEMPLATES[note.kind], note)
        else:
            text = _as_found(note)  # a kind this version does not know (a scene of a later one)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        # A known kind whose values are not what its words take (a scene of another version): a sentence never
        # costs the user the report or the line it is in.
        text = _as_found(note)
    return f"{text}; {_OPS}" if note.fact("ops_hint") else text


def _as_found(note: Note) -> str:
    """A note's kind and its values as they are, for one whose words cannot be written."""
    return f"{note.kind}: " + ", ".join(f"{key} {value}" for key, value in note.facts)


def debugger_command() -> str:
    """What opens the report's frame here: ``%debug`` in an IPython session, ``pdb.pm()`` in a script or a CI log
    (where ``%debug`` means nothing). The notebook's HTML report says ``%debug``: it is shown in IPython."""
    ipython = sys.modules.get("IPython")
    return "%debug" if ipython is not None and ipython.get_ipython() is not None else "pdb.pm()"


def _fill(template: str, note: Note) -> str:
    values = {key: _word(key, value) for key, value in note.facts}
    values["debugger"] = debugger_command()
    if values.get("message"):  # an exception: ``ValueError: <its message>``, or its type alone
        values["error"] = f"{values['error']}: {values['message']}"
    return template.format_map(values)


class _Count(int):
    """A count in a template: ``{count:~sample}`` writes ``1 sample`` or ``3 samples`` (words/counted.py)."""

    def __format__(self, spec: str) -> str:
        return counted(int(self), spec[1:]) if spec.startswith("~") else int.__format__(self, spec)


def _word(key: str, value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return _Count(value)
    if key.endswith("module"):
        return value or "the root module"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and key == "reason":
        return note_text(Note.from_pair(value))  # a note's reason, itself a note
    return value


def _refetch_stored(note: Note) -> str:
    indices: tuple[Any, ...] = note.fact("indices")
    holding: int = note.fact("holding")
    listed = ", ".join(map(str, indices)) + (f" and {holding - len(indices)} more" if holding > len(indices) else "")
    at = f"at index {listed}" if holding == 1 else f"at indices {listed}"
    return (f"fetching the batch's {counted(note.fact('count'), 'sample')} from {note.fact('dataset')} again made "
            f"no non-finite value: it is stored in the dataset itself, {at} (dataset[{indices[0]}] shows it)")


def _deliberate(note: Note) -> str:
    how = _fill(_DELIBERATE[note.fact("how")], note)
    return f"a deliberate infinity ({how}): benign while what consumes it stays finite"


def _loss_region(note: Note) -> str:
    names: tuple[str, ...] = note.fact("nodes")
    suspects: tuple[str, ...] = note.fact("singular")
    # Each kind once, with its count where it ran more than once: "ran 9 autograd nodes (AddBackward0, ...)" listed
    # six names, and a reader counted them against the nine.
    sentence = f"the backward of that code ran {len(names)} autograd nodes ({_with_counts(names)})"
    if suspects:
        sentence += f"; the ones whose derivative can be infinite: {_with_counts(suspects)}"
    return sentence


def _with_counts(names: tuple[str, ...]) -> str:
    """``AddBackward0 x2, SqrtBackward0``: each name once, in order, counted where it came more than once."""
    return ", ".join(f"{name} x{names.count(name)}" if names.count(name) > 1 else name for name in dict.fromkeys(names))


def _scaler_skipped(note: Note) -> str:
    return (f"the GradScaler skipped this step: its scaled gradients were non-finite ({note.fact('in_a_row')} "
            f"skipped in a row, {note.fact('total')} in all; scale {note.fact('scale'):g})")


def _written_outside(note: Note) -> str:
    previous = note.fact("previous_check")
    since = "since the watch began" if previous is None else f"since it was last checked finite, after step {previous}"
    return (f"{_subject(note.fact('tensor'))} was non-finite after the {note.fact('optimizer')} step of step "
            f"{note.fact('step')}; the steps {since} were bounded steps, which cannot make a finite parameter "
            "non-finite short of the float32 limit: code outside the optimizer wrote it")


def _state_already(note: Note) -> str:
    why = ("a bounded step, which keeps finite state finite" if note.fact("bounded") else
           "in which no op made it from finite values")
    return (f"{_subject(note.fact('tensor'))} was non-finite after the {note.fact('optimizer')} step of step "
            f"{note.fact('step')}, {why}: it held the value before the step (an optimizer state loaded from a "
            f"checkpoint, or code outside the optimizer wrote it), and the step carried it into "
            f"{_subject(note.fact('parameter'))}")


def _optimizer_made_it(note: Note) -> str:
    return f"the {note.fact('optimizer')} step made {_subject(note.fact('tensor'))} non-finite"


def _python_backward(note: Note) -> str:
    node, created = note.fact("node"), note.fact("created")
    of = f" of {node}" if node else ""
    at = f", whose node was created at {_pointer(created)}" if created is not None else ""
    return (f"{note.fact('op')} ran in a Python backward{of} (a custom autograd.Function's backward, or a gradient "
            f"hook){at}")


def _inside(note: Note) -> str:
    return f"inside {_pointer(note.fact('source'))}"


def _outside_untraced(note: Note) -> str:
    return (f"the code outside the models ({' and '.join(note.fact('regions'))}) ran more ops a step than the watch "
            f"records ({note.fact('loss_budget')} for the loss, {note.fact('data_budget')} for data code): its op and "
            "line are not named")


def _debug_in_replay(note: Note) -> str:
    step, module = note.fact("step"), note.fact("module")
    call = f"step {step}'s model call" if step is not None else f"{module or 'the root module'}'s call"
    return (f"{debugger_command()} opens a replay of {call}, at the report's line; its locals are the replay's, as "
            "that line left them")


def _enclosing_missed(note: Note) -> str:
    op, replay = note.fact("op"), note.fact("replay")
    label = note.fact("module") or "the root module"
    found = (f"found {op} in {note.fact('op_module')}, not in {label}" if op is not None
             else note_text(Note.from_pair(replay)) if replay is not None else "stayed finite")
    return (f"{label}'s own arguments are gone by the deferred check ({_word('reason', note.fact('reason'))}), and a "
            f"replay of {note.fact('outer_module') or 'the root module'} {found}; {_OPS}")


def _computed_inside(note: Note) -> str:
    label = note.fact("module") or "the root module"
    inside = (f"cannot replay {label} for the backward op: the tensor whose gradient is not finite was computed "
              f"inside {label}, not passed to it")
    if note.fact("overflow"):
        return f"{inside}, and a replay of its overflow with a gradient of ones need not overflow where the real " \
               "gradient did"
    return f"{inside}, and it has no parameters"


def _restore(note: Note) -> str:
    step = note.fact("step")
    if step is None:
        return "keep_last_good: no optimizer step ended finite before this event; nothing to roll back to"
    return f"report.restore() puts back the model and optimizer state after step {step}"


def _refused(note: Note) -> str:
    what = note.fact("what") or "a pickle instruction torch does not load safely"  # (torch's message named no class)
    return (f"loading it needs {what}, which is neither a tensor nor a plain value and could run code (torch.load "
            "weights_only=True refuses it)")


def _scene_saved(note: Note) -> str:
    return (f"scene saved: {note.fact('path')} ({human_size(note.fact('bytes'))}); nan_magic.load_scene(path) or "
            "%nanreplay rebuilds it")


def _norm_stats_nonfinite(note: Note) -> str:
    names: tuple[str, ...] = note.fact("buffers")
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
    one = len(names) == 1
    return (f"{listed} in your model {'holds' if one else 'hold'} non-finite values now (a norm layer folds each "
            f"training batch into {'it' if one else 'them'} as its forward runs, and normalises by "
            f"{'it' if one else 'them'} in evaluation mode): put {'it' if one else 'them'} back before going on "
            "(report.restore() with keep_last_good=True, or a checkpoint)")


def _batch_lacks(note: Note) -> str:
    return _TEMPLATES["batch-lacks"].format(paths=", ".join(note.fact("paths")))


def _loss_unrecorded_suspects(note: Note) -> str:
    names = note.fact("tensors")
    one = len(names) == 1
    listed = names[0] if one else ", ".join(names[:-1]) + f" and {names[-1]}"
    return (f"{listed}, among your code's variables, {'is' if one else 'are'} non-finite too; the loss code ran too "
            f"many ops to be recorded, so whether it read {'it' if one else 'them'} is not known")


def _autograd_backward(note: Note) -> str:
    node = note.fact("node")
    return f"{note.fact('op')} ran in the backward of the forward line" + (f" ({node})" if node else "")


def _backward_replay_found(note: Note) -> str:
    return (f"replay of {note.fact('module') or 'the root module'}'s forward and backward (a gradient of ones into its "
            f"outputs) found the op: {note.fact('op')} in the backward of {note.fact('node') or 'an autograd node'}")


def _other_counts(note: Note) -> str:
    return f"the replay found {_event(note)}, but not the same counts at {_tensor(note.fact('seen'))}"


def _rank_reduced(note: Note) -> str:
    return (f"rank {note.fact('rank')} received it through the gradient all-reduce (or FSDP's reduce-scatter) (its "
            f"own first non-finite value: {_tensor(note.fact('tensor'))})")


def _rank_also_saw(note: Note) -> str:
    return f"rank {note.fact('rank')} also saw a non-finite value: {_event(note)}"


def _event(note: Note) -> str:
    """Another event in a few words: ``3 nan, 0 +inf, 0 -inf in output of fc (Linear), forward, op aten.div.Tensor``."""
    op = note.fact("op")
    return (f"{note.fact('nan')} nan, {note.fact('posinf')} +inf, {note.fact('neginf')} -inf in "
            f"{_tensor(note.fact('tensor'))} of {note.fact('where')}, {note.fact('phase')}"
            + (f", op {op}" if op else ""))


def _pointer(pairs: Any) -> SourcePointer:
    return from_plain(SourcePointer, pairs)


def _tensor(pairs: Any) -> str:
    return tensor_label(from_plain(TensorRef, pairs))


def _subject(pairs: Any) -> str:
    return subject_label(from_plain(TensorRef, pairs))


#: Why an output was not read (hot/reads.unread_parts' words), as a sentence's object.
_UNREAD: dict[str, str] = {
    "functorch": "a value inside torch.func.functionalize, whose inner tensor may not hold its pending writes yet",
    "nested": "a nested tensor",
    "meta": "a meta tensor, which holds no data",
}


def _unread_outputs(note: Note) -> str:
    """Whose outputs were not read, and why: ``the root module and module 1 (a value inside a torch.func ...)``."""
    names = [f"module {name}" if name else "the root module" for name in note.fact("modules")]
    if note.fact("more"):
        names.append(counted(note.fact("more"), "other module"))
    reasons = []
    for reason in note.fact("reasons"):
        if reason.startswith("object "):
            reasons.append(f"a {reason.removeprefix('object ')} object, whose tensors are not its own attributes")
        else:
            reasons.append(_UNREAD.get(reason, f"a {reason} tensor, whose own dispatch the watch does not run"))
    listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    return f"the output of {listed} ({'; '.join(reasons)})"


def _outputs_unread(note: Note) -> str:
    return (f"the watch could not read {_unread_outputs(note)}: every module output it did read was finite, and the "
            "loss was the first non-finite value it saw, so the unread outputs may hold the producer; the code "
            "outside the modules is named only because nothing read was non-finite before it")


def _entered_outside_unread(note: Note) -> str:
    return (f"every module output the watch read was finite, but it could not read {_unread_outputs(note)}; this "
            "tensor, which no code it read produced, entered the code outside the modules (the loss) already "
            "non-finite")


def _benign_replay_lacks(note: Note) -> str:
    return (f"its replay made only a deliberate infinity ({_event_counts(note)} in {note.fact('where')}), without the "
            f"{' or '.join(note.fact('kinds'))} the check saw: the replay ran from the module as it is now, which the "
            "loop changed after the call (an attribute, a parameter), so it is no reason to take the value as benign")


def _event_counts(note: Note) -> str:
    counts = ((note.fact("nan"), "nan"), (note.fact("posinf"), "+inf"), (note.fact("neginf"), "-inf"))
    return ", ".join(f"{count} {kind}" for count, kind in counts if count) or "no non-finite value"


#: The notes whose words depend on their facts beyond filling them in.
_WRITERS: dict[str, Callable[[Note], str]] = {
    "deliberate": _deliberate,
    "refetch-stored": _refetch_stored,
    "loss-region": _loss_region,
    "scaler-skipped": _scaler_skipped,
    "written-outside-optimizer": _written_outside,
    "state-already-nonfinite": _state_already,
    "optimizer-made-it": _optimizer_made_it,
    "python-backward": _python_backward,
    "inside": _inside,
    "outside-untraced": _outside_untraced,
    "optimizer-replay-finite": optimizer_replay_finite,
    "optimizer-replayed": optimizer_replayed,
    "enclosing-missed": _enclosing_missed,
    "computed-inside": _computed_inside,
    "restore": _restore,
    "refused": _refused,
    "scene-saved": _scene_saved,
    "batch-lacks": _batch_lacks,
    "norm-stats-nonfinite": _norm_stats_nonfinite,
    "autograd-backward": _autograd_backward,
    "debug-in-replay": _debug_in_replay,
    "debug-later-step": debug_later_step,
    "loss-unrecorded-suspects": _loss_unrecorded_suspects,
    "backward-replay-found": _backward_replay_found,
    "other-counts": _other_counts,
    "rank-reduced": _rank_reduced,
    "rank-also-saw": _rank_also_saw,
    "outputs-unread": _outputs_unread,
    "benign-replay-lacks": _benign_replay_lacks,
    "entered-outside-unread": _entered_outside_unread,
    **LR_NOTE_WRITERS, **LOAD_NOTE_WRITERS, **FIX_REASON_WRITERS,
}
