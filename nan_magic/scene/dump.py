"""The crash scene: everything needed to try a fix on exactly the failing step.

At the first real event :func:`record_scene` hands the roll-back state to
:mod:`nan_magic.scene.last_good` (``keep_last_good``) and, with ``dump``,
saves the scene in one ``torch.save`` file in that folder, named
``nan_scene_step{N}.pt``. :func:`~nan_magic.scene.load.load_scene`
(scene_replay.py) reads it back as a ``Scene`` that restores the state into a
model the user provides and replays the producer module (or the whole step)
under op-level tracing.

The file is a dict of plain values (see :data:`SCENE_KEYS`): state dicts,
tensors, strings and numbers, the :class:`~nan_magic.Report` included, as
plain data (:mod:`nan_magic.plain`). It loads with plain
``torch.load(weights_only=True)``, no allowlist: a scene file passed between
teammates cannot run code when opened, and :func:`load_scene` refuses, in one
line, a file that needs anything more. The model is saved as its ``state_dict`` only (never as
a pickled object, whose class would have to be imported and could run
code); the user rebuilds the model from their code and restores into it.
The file is written to a temporary file in the same folder and renamed into
place, so a scene file is either complete or absent. Writing never raises into the
user's program: a full disk or a folder that cannot be created ends up as a
note in the report and a :class:`~nan_magic.NanMagicWarning`; a part that
cannot be collected or pickled is left out, with a note, and the rest saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import platform
import re
import secrets
import warnings
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.distributed.ranks import per_rank_path
from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.hot.kept.call_records import argument_path
from nan_magic.hot.kept.held import running_arguments
from nan_magic.hot.kept.rng import RngState, capture_rng_state
from nan_magic.hot.reads import version_of
from nan_magic.locations import cells_named
from nan_magic.plain import to_plain
from nan_magic.records import Note, Phase, Report, TensorRole
from nan_magic.scene.last_good import keep
from nan_magic.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.kept.finding import Finding
    from nan_magic.options import WatchConfig
    from nan_magic.scene.last_good import LastGood

__all__ = [
    "REFUSED_GLOBAL", "SCENE_FORMAT", "SCENE_KEYS", "SCENE_VERSION",
    "SceneSource", "record_scene", "refusal", "safe_load",
]


@dataclass(frozen=True)
class SceneSource:
    """What a watch hands over at an event for its scene: settings, targets, the step's calls, kept state."""

    config: WatchConfig
    roots: list[tuple[str | None, nn.Module]]
    optimizers: list[torch.optim.Optimizer]
    scalers: list[Any]
    #: The step's calls, read only when the scene is saved (reading makes the pending gradient calls).
    calls: Callable[[], Iterable[Call]]
    #: The generators' state before the failing step's top-level forward call, when one is running.
    running_rng: RngState | None
    last_good: LastGood
    #: A call's arguments as it was made (its held arguments, or the step replay's copy of a top-level call's),
    #: None where nothing kept them: the scene saves the plain Python ones (``model(x, step)``'s ``step``).
    arguments: Callable[[Call], tuple[tuple[Any, ...], dict[str, Any]] | None] = lambda _call: None

SCENE_FORMAT = "nan_magic.scene"
#: Raised as what a scene holds changes; load_scene reads each older version's parts where it meets them.
SCENE_VERSION = 8

#: What a scene file holds (a dict with these keys; a part that could not be
#: saved is None and the report says why):
#:
#: - ``format``, ``version``: ``"nan_magic.scene"``, 8
#: - ``report``: the :class:`~nan_magic.Report` of the event, as plain data (:func:`nan_magic.plain.to_plain`)
#: - ``step``, ``phase``, ``module``, ``kinds``: the event in brief, and the kinds watched
#: - ``models``: ``{name: state_dict}`` of every watched model, as at the event
#: - ``training``: ``{name: {module name: training flag}}``
#: - ``optimizers``, ``scalers``: ``[{"type": class name, "state": state_dict}]``
#: - ``last_good``: ``{"step", "models", "optimizers"}`` after the last finite step
#:   (with ``keep_last_good``), else None
#: - ``batch``: ``{path: tensor}`` that entered the model in the failing step
#:   (``"input[0]"``, ``"kwargs['mask']"``; prefixed ``"name:"`` with several models)
#: - ``producer_inputs``: ``{path: tensor}`` the producer module was called with, or, where the
#:   tiered watch replayed the whole model call, the inputs of that call
#: - ``producer_call``: the same tensors by argument, ``{"args": {position: tensor}, "kwargs": {keyword: tensor},
#:   "nested": [path]}`` (None where no module call produced the event; absent in older scenes), with the plain
#:   Python arguments among them (an int, a string) and ``"positional"``, how many it took, where the call was kept
#: - ``call_module``: the qualified name of the module whose call ``producer_inputs`` are (the
#:   producer, or the top-level model call that held it); absent in older scenes: ``module``
#: - ``rng``: ``{"step": {"cpu", "cuda"} or None, "step_source", "event": {"cpu", "cuda"}}``; ``step_source``:
#:   ``"before-forward"`` (taken before the failing step's top-level forward call), ``"after-last-good"`` (right
#:   after the last step that ended finite) or ``"unknown"``
#: - ``versions``: ``{"torch", "python", "nan_magic", "cuda", "platform"}``
SCENE_KEYS = (
    "format", "version", "report", "step", "phase", "module", "kinds", "models", "training",
    "optimizers", "scalers", "last_good", "batch", "producer_inputs", "producer_call", "call_module", "rng",
    "versions",
)


# -- recording -------------------------------------------------------------------


def record_scene(source: SceneSource, finding: Finding, report: Report) -> Report:
    """At the first real event: save the scene (``dump``) and arm ``restore()``; return the report.

    Never raises: whatever fails is described in the returned report's notes.
    """
    notes: list[Note] = []
    try:
        # Collected first: arming restore() hands the last finite step's state over.
        folder = source.config.dump
        scene = _collect(source, finding, report, notes) if folder else None
        if source.config.keep_last_good:
            kept_step = source.last_good.step
            report = dataclasses.replace(report, restore_token=keep(source.last_good))
            notes.append(Note.of("restore", step=kept_step))
        if folder and scene is not None:
            report = _save(scene, folder, report, notes)
    except Exception as error:  # the user's run must never fail because of the scene
        notes.append(_failure("scene-failed", error))
    return dataclasses.replace(report, note_facts=(*report.note_facts, *notes))


def _collect(source: SceneSource, finding: Finding, report: Report, notes: list[Note]) -> dict[str, Any]:
    """The scene as a dict (see :data:`SCENE_KEYS`); a part that fails to collect is None."""
    parts: dict[str, Callable[[], Any]] = {
        "models": lambda: {name: module.state_dict() for name, module in _named_roots(source)},
        "training": lambda: {
            name: {sub_name: sub.training for sub_name, sub in module.named_modules()}
            for name, module in _named_roots(source)
        },
        "optimizers": lambda: [_typed_state(opt, opt.state_dict()) for opt in source.optimizers],
        "scalers": lambda: [_typed_state(scaler, scaler.state_dict()) for scaler in source.scalers],
        "last_good": lambda: _last_good(source),
        "batch": lambda: _batch(source, notes),
        "producer_inputs": lambda: _producer_inputs(finding, notes),
        # Evaluated in order, after the inputs: the same copies, by argument.
        "producer_call": lambda: _producer_call(finding, scene.get("producer_inputs") or {}, source),
        "rng": lambda: _rng(source, finding),
        "versions": _versions,
    }
    scene: dict[str, Any] = {
        "format": SCENE_FORMAT,
        "version": SCENE_VERSION,
        "report": cells_named(to_plain(report)),
        "step": report.step,
        "phase": str(report.phase),
        "module": report.module,
        "call_module": finding.call.info.name if finding.call is not None and finding.call.info is not None
        else report.module,
        "kinds": sorted(source.config.kinds),
    }
    for key, collect in parts.items():
        try:
            scene[key] = collect()
        except Exception as error:  # a user's state_dict hook may fail; save the rest
            scene[key] = None
            notes.append(_failure("scene-part-failed", error, part=key))
    return scene


def _save(scene: dict[str, Any], folder: str, report: Report, notes: list[Note]) -> Report:
    try:
        # One folder for every rank; each rank's file has its own suffix (distributed.py).
        path = _write_scene(scene, folder, per_rank_path(f"nan_scene_step{report.step}"), notes)
    except Exception as error:  # disk full, no permission, not a folder...
        note = _failure("scene-save-failed", error, folder=folder)
        notes.append(note)
        _warn(note.text)
        return report
    size = os.path.getsize(path)
    notes.append(Note.of("scene-saved", path=path, bytes=size))
    return dataclasses.replace(report, scene=path, scene_bytes=size)


def _write_scene(scene: dict[str, Any], folder: str, stem: str, notes: list[Note]) -> str:
    """Save ``scene`` atomically as ``folder/stem.pt`` (or ``stem-2.pt``...) and return the path.

    A part that cannot be pickled, or that a safe load would refuse (an
    optimizer option or a module's extra state holding an object of the
    user's class), is left out (set to None, with a note) and the rest is
    saved: every scene file loads with ``weights_only=True``. Raises OSError
    (disk full, no permission) and, should even the pruned scene not
    pickle, the pickling error.
    """
    os.makedirs(folder, exist_ok=True)
    path = _free_name(folder, stem)
    try:
        _save_atomically(scene, path)
        safe = _loads_safely(path)
    except OSError:
        raise
    except Exception:  # pickling errors come in many types
        safe = False
    if not safe:
        for key in list(scene):
            scene[key] = _prune(scene[key], key, notes)
        _save_atomically(scene, path)
    return path


def safe_load(source: Any, **options: Any) -> Any:
    """``torch.load(weights_only=True)``, no allowlist: a scene holds tensors and plain values only."""
    return torch.load(source, weights_only=True, **options)


def _loads_safely(path: str) -> bool:
    """Whether a saved scene loads with ``weights_only=True``.

    Memory-mapped onto the CPU: the check reads the pickled structure, not
    the tensors' bytes.
    """
    try:
        safe_load(path, map_location="cpu", mmap=True)
    except pickle.UnpicklingError:
        return False
    return True


def _save_atomically(scene: dict[str, Any], path: str) -> None:
    # A temporary name in the same folder (so the rename is atomic), created
    # with open() rather than mkstemp so the file gets the usual permissions.
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as handle:
            torch.save(scene, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        # Never leave a half-written file behind, whatever interrupted the write.
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _prune(value: Any, label: str, notes: list[Note], depth: int = 0) -> Any:
    """``value`` without the entries that cannot be pickled or loaded safely (replaced by None, with a note).

    Each part is saved and loaded back in memory: this runs only after the
    whole scene failed to save or to load safely, never on the usual path.
    """
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        safe_load(buffer)
        return value
    except Exception as error:  # pickling errors come in many types
        if depth < 2 and isinstance(value, dict):
            return {key: _prune(item, f"{label}[{key!r}]", notes, depth + 1) for key, item in value.items()}
        if depth < 2 and type(value) in (list, tuple):
            return type(value)(_prune(item, f"{label}[{index}]", notes, depth + 1) for index, item in enumerate(value))
        if isinstance(error, pickle.UnpicklingError):
            notes.append(Note.of("scene-part-refused", part=label, reason=_refused(error).pair))
        else:
            notes.append(_failure("scene-part-failed", error, part=label))
        return None


def _free_name(folder: str, stem: str) -> str:
    """A path that does not exist yet: earlier scenes in the same folder are kept."""
    path = os.path.join(folder, f"{stem}.pt")
    number = 2
    while os.path.exists(path):
        path = os.path.join(folder, f"{stem}-{number}.pt")
        number += 1
    return path


# -- the parts -------------------------------------------------------------------------


def _named_roots(source: SceneSource) -> list[tuple[str, nn.Module]]:
    """The watched models under unique names: their label, else their class name."""
    named: dict[str, nn.Module] = {}
    for label, module in source.roots:
        named[_unique(label or type(module).__name__, named)] = module
    return list(named.items())


def _unique(base: str, taken: Container[str]) -> str:
    name, number = base, 2
    while name in taken:
        name, number = f"{base}#{number}", number + 1
    return name


def _typed_state(owner: Any, state: Any) -> dict[str, Any]:
    return {"type": type(owner).__name__, "state": state}


def _last_good(source: SceneSource) -> dict[str, Any] | None:
    """The state kept after the last finite step (``keep_last_good``), under the scene's names."""
    last_good = source.last_good
    if last_good.step is None:
        return None
    return {
        "step": last_good.step,
        "models": {name: last_good.state_of(module) for name, module in _named_roots(source)},
        "optimizers": [_typed_state(opt, last_good.state_of(opt)) for opt in source.optimizers],
    }


def _batch(source: SceneSource, notes: list[Note]) -> dict[str, torch.Tensor]:
    """Copies of the tensors that entered the watched models in the failing step."""
    entries: list[tuple[str, str, torch.Tensor]] = []
    gone: list[str] = []
    for call in source.calls():
        if call.phase != Phase.DATA or call.info is None:
            continue
        owner = call.info.model or call.info.module_type
        for record in call.outputs:
            tensor = record.live()
            if tensor is None:
                gone.append(str(record.path))
            else:
                entries.append((owner, str(record.path), tensor))
    if gone:
        notes.append(Note.of("batch-lacks", paths=tuple(gone)))
    several = len({owner for owner, _path, _tensor in entries}) > 1
    batch: dict[str, torch.Tensor] = {}
    for owner, path, tensor in entries:
        batch[_unique(f"{owner}:{path}" if several else path, batch)] = _copy(tensor)
    return batch


def _producer_inputs(finding: Finding, notes: list[Note]) -> dict[str, torch.Tensor]:
    """Copies of the tensors the producer module was called with (else the finding's inputs)."""
    if finding.call is None or finding.call.phase == Phase.DATA:
        return {str(ref): _copy(tensor) for ref, tensor in finding.inputs}
    inputs: dict[str, torch.Tensor] = {}
    # At the deferred check a freed input may have been recomputed for the replay (localize/replay/producer_call.py).
    recomputed = {ref.path: tensor for ref, tensor in finding.inputs if ref.role is TensorRole.INPUT}
    for path, _argument, _record, ref, version in finding.call.inputs:
        tensor = ref()
        if tensor is None and path in recomputed:
            inputs[path] = _copy(recomputed[path])
        elif tensor is None:
            notes.append(Note.of("input-freed", path=path))
        elif version_of(tensor) != version:
            notes.append(Note.of("input-changed", path=path))
        else:
            inputs[path] = _copy(tensor)
    return inputs


#: The Python values a scene saves as a call's arguments: what ``torch.load(weights_only=True)`` reads back.
_SCALARS = (type(None), bool, int, float, str)


def _producer_call(
    finding: Finding, inputs: dict[str, torch.Tensor], source: SceneSource | None = None
) -> dict[str, Any] | None:
    """The producer module's saved inputs by argument, to call it again (``Scene.replay``); None without a call.

    ``{"args": {position: tensor}, "kwargs": {keyword: tensor}, "nested": [path, ...]}``: an argument
    that held its tensors inside a container is listed in ``nested`` (the scene cannot rebuild it). Where the
    call's arguments were kept (``source.arguments``), its plain Python arguments too (a scalar, a string: what a
    safe load reads back), and ``"positional"``: how many positional arguments it took, so that a replay missing
    one (an object the scene cannot hold) says so instead of running with the parameter's default.
    """
    if finding.call is None or finding.call.phase == Phase.DATA:
        return None
    call: dict[str, Any] = {"args": {}, "kwargs": {}, "nested": []}
    # Kept for a per-module watch's replay; else the step replay's copy of a top-level call; else, the event
    # inside the call (the op tracer's), its running frame's.
    held = finding.call.held
    made = (held.args, held.kwargs) if held is not None else source.arguments(finding.call) if source else None
    if made is None and finding.call.module is not None:
        made = running_arguments(finding.call.module)
    if made is None:  # (ops=True judged at the step's end: the call kept its plain arguments alone)
        made = finding.call.plain
    if made is not None:
        args, kwargs = made
        call["positional"], call["keywords"] = len(args), sorted(kwargs)
        call["args"].update({index: value for index, value in enumerate(args) if type(value) in _SCALARS})
        call["kwargs"].update({key: value for key, value in kwargs.items() if type(value) in _SCALARS})
    for path, argument, _record, _ref, _version in finding.call.inputs:
        if path not in inputs:
            continue
        positional = isinstance(argument, int)
        if path != argument_path("input" if positional else "kwargs", argument):
            call["nested"].append(path)
        else:
            call["args" if positional else "kwargs"][argument] = inputs[path]
    return call


def _rng(watched: SceneSource, finding: Finding) -> dict[str, Any]:
    """The generators' state at the event, before the producer's call, and to re-run the step from."""
    step, source = None, "unknown"
    running = watched.running_rng
    if running is not None:
        # The watch takes it before each module call it may replay.
        step, source = running, "before-forward"
    elif watched.last_good.rng is not None:
        step, source = watched.last_good.rng, "after-last-good"
    return {
        "step": _rng_dict(step),
        "step_source": source,
        "producer": _rng_dict(finding.rng_state),
        "event": _rng_dict(capture_rng_state()),
    }


def _rng_dict(state: RngState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    return {"cpu": state.cpu.clone(), "cuda": [s.clone() for s in state.cuda] if state.cuda is not None else None}


def _versions() -> dict[str, str | None]:
    return {
        "torch": str(torch.__version__),  # a TorchVersion, which a safe load would refuse
        "python": platform.python_version(),
        "nan_magic": __version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    # A copy: the live tensor may change after the event, and a view would
    # drag its whole base storage into the file.
    return tensor.detach().clone()


def _failure(kind: str, error: BaseException, **facts: Any) -> Note:
    return Note.of(kind, **facts, error=type(error).__name__, message=str(error))


def _warn(message: str) -> None:
    # Warnings turned into errors (-W error) must not turn a failed dump into a crash.
    with contextlib.suppress(Warning):
        warnings.warn(f"nan_magic {message}", NanMagicWarning, stacklevel=4)


#: How torch's refusal names the class or function a file would call.
REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refusal(error: pickle.UnpicklingError) -> str:
    """Why a safe load refused, in a few words (torch's own message runs to a paragraph)."""
    return _refused(error).text


def _refused(error: pickle.UnpicklingError) -> Note:
    found = REFUSED_GLOBAL.search(str(error))  # torch's message names the class it refused
    return Note.of("refused", what=found[1] if found else None)
