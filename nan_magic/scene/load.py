"""A crash scene read back: restored into the user's model, and the failing call or step replayed.

:func:`load_scene` reads a file that a watch saved with ``dump=`` (scene.py
writes it and defines its format) as a :class:`Scene`: the state is restored
into a model the user rebuilt from their code, then the producer module, or
the whole step, replays under op-level tracing to try a fix.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.hot.kept.rng import RngState, capture_rng_state, restore_rng_state
from nan_magic.localize.replay.module_run import ReplayResult, replay_module
from nan_magic.plain import from_plain
from nan_magic.records import Note, Phase, Report
from nan_magic.scene.dump import REFUSED_GLOBAL, SCENE_FORMAT, SCENE_VERSION, refusal, safe_load
from nan_magic.scene.older_scenes import as_version_7, reasons_said, typed_tensors, warnings_said, with_paths

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.lifecycle.watch import Watch

__all__ = ["Scene", "load_scene"]

#: The notes that say where ``%debug`` or ``pdb.pm()`` opened in the session that saved the scene.
_DEBUGGER_NOTES = frozenset({"debug-in-replay", "debug-not-replayed", "debug-frame-returned", "debug-later-step"})


def load_scene(path: str | os.PathLike[str], *, map_location: Any = None) -> Scene:
    """Read a scene saved by a watch with ``dump=``.

    Parameters
    ----------
    path
        A ``nan_scene_step{N}.pt`` file.
    map_location
        As for :func:`torch.load`: ``"cpu"`` reads a scene saved on a GPU
        on a machine without one.

    Raises
    ------
    ValueError
        One line naming the file: it is not a scene, or it needs more than
        a scene holds to load (a class or function other than tensors and
        plain values), which could run code; it is refused without running
        anything.

    Notes
    -----
    The file is read with plain ``torch.load(weights_only=True)``: a scene
    holds tensors and plain values only (its report as plain data), so a
    scene file from someone else cannot run code when opened. A version 1
    scene, which pickled its report as nan_magic's records, is refused in
    one line: record the event again.

    Examples
    --------
    >>> scene = nan_magic.load_scene("dumps/nan_scene_step41.pt")  # doctest: +SKIP
    >>> scene.restore_into(model, opt)                              # doctest: +SKIP
    >>> model.norm.eps = 1e-5                                       # try a fix
    >>> scene.replay(model).reproduced                              # doctest: +SKIP
    False
    """
    path = os.fspath(path)
    try:
        data = safe_load(path, map_location=map_location)
    except pickle.UnpicklingError as error:
        refused = REFUSED_GLOBAL.search(str(error))  # torch's message names the class it refused
        if refused and refused[1].startswith("nan_magic."):
            raise ValueError(f"{path}: a scene of an older nan_magic (format 1, its report pickled as nan_magic's "
                             "records), which this version does not read: record the event again") from None
        if refused:
            raise ValueError(f"{path}: refused, {refusal(error)}") from None
        # Not a pickle torch can read (a text file reads as unknown instructions).
        raise ValueError(f"{path} is not a nan_magic scene file") from None
    except (EOFError, KeyError):  # what torch.load raises on a file that is no pickle at all
        raise ValueError(f"{path} is not a nan_magic scene file") from None
    if not isinstance(data, dict) or data.get("format") != SCENE_FORMAT:
        raise ValueError(f"{path} is not a nan_magic scene file")
    if isinstance(data.get("version"), int) and data["version"] > SCENE_VERSION:
        # (It opens: its plain data loads, but facts of kinds this version does not know read as found.)
        warnings.warn(f"{path}: written by a newer nan_magic (scene version {data['version']}; this one reads up to "
                      f"{SCENE_VERSION}): some of its report may read as bare kinds; upgrade nan_magic to read it all",
                      stacklevel=2)
    return Scene(path, data)


class Scene:
    """A crash scene read back by :func:`load_scene`.

    Attributes
    ----------
    path
        The file it was read from.
    data
        Everything the file holds (see :data:`SCENE_KEYS`).
    report
        The event's Report.
    step, phase, module
        The failing step, the phase and the producer module's qualified name.
    batch
        ``{path: tensor}``: what entered the watched model in the failing step.
    producer_inputs
        ``{path: tensor}``: what the producer module was called with.
    versions
        Versions of torch, Python, nan_magic and CUDA that wrote it.
    """

    def __init__(self, path: str, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        plain = data["report"]
        if data.get("version", 0) < 6 and isinstance(plain, dict):
            plain = typed_tensors(plain)
        if data.get("version", 0) < 7 and isinstance(plain, dict):
            plain = as_version_7(plain)
        if data.get("version", 0) < 8 and isinstance(plain, dict):
            plain = reasons_said(plain)
        report = from_plain(Report, plain)
        if isinstance(plain, dict) and plain.get("notes") and not plain.get("note_facts"):
            # A version 2 scene kept its notes as sentences: shown as they were written.
            said = tuple(Note.of("said", text=text) for text in plain["notes"])
            report = dataclasses.replace(report, note_facts=said)
        sentences = warnings_said(plain)
        if sentences:
            # A scene of version 3 or older kept its warnings as sentences: shown as they were written.
            report = dataclasses.replace(report, warnings=tuple(
                dataclasses.replace(warning, said=text) for warning, text in zip(report.warnings, sentences)))
        if data.get("version", 0) < 5:
            # A scene of version 4 or older kept no layer's place in its model: read from its module's name.
            report = with_paths(report)
        # Where %debug (pdb.pm()) opens was said of the session that saved it: a reopened scene has no traceback.
        kept = tuple(note for note in report.note_facts if note.kind not in _DEBUGGER_NOTES)
        self.report: Report = dataclasses.replace(
            report, scene=path, scene_bytes=os.path.getsize(path), note_facts=kept)
        self.step: int = data["step"]
        self.phase = Phase(data["phase"])
        self.module: str | None = data["module"]
        #: The module whose call ``producer_inputs`` are: the producer, or the model call that held it.
        self.call_module: str | None = data.get("call_module", self.module)
        self.batch: dict[str, torch.Tensor] = data.get("batch") or {}
        self.producer_inputs: dict[str, torch.Tensor] = data.get("producer_inputs") or {}
        self.versions: dict[str, str | None] = data.get("versions") or {}

    def __repr__(self) -> str:
        return f"Scene({self.path!r}: {self.report.message})"

    @property
    def rng_state(self) -> RngState | None:
        """The RNG state to re-run the failing step from, where known (see ``data['rng']``)."""
        return self._saved_rng("step")

    @property
    def producer_rng_state(self) -> RngState | None:
        """The RNG state right before the producer module's call (its dropout masks), where known."""
        return self._saved_rng("producer")

    def _saved_rng(self, key: str) -> RngState | None:
        saved = (self.data.get("rng") or {}).get(key)
        if saved is None:
            return None
        # CUDA generator states can only be set where CUDA is available.
        cuda = tuple(saved["cuda"]) if saved["cuda"] is not None and torch.cuda.is_available() else None
        return RngState(cpu=saved["cpu"], cuda=cuda)

    # -- state ------------------------------------------------------------------

    def restore_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: Any = None,
        *,
        state: str = "auto",
    ) -> None:
        """Load the saved state into ``model`` (and optimizers, GradScalers) the user provides.

        Parameters
        ----------
        model
            A model of the same architecture (a fixed version of it is fine:
            only parameters and buffers are loaded, and train/eval modes set).
        optimizer, scaler
            One, or several in the order the watch saw them.
        state
            ``"event"``: as at the event; ``"last_good"``: after the last step
            that ended finite (needs ``keep_last_good``); ``"auto"``: the
            state the failing step started from, i.e. ``"last_good"`` for an
            optimizer-phase event (the step had already changed the
            parameters) and ``"event"`` otherwise.
        """
        source = self._state(state)
        name, saved = self._pick_model(source["models"] or {}, model)
        model.load_state_dict(saved)
        modes = (self.data.get("training") or {}).get(name, {})
        for sub_name, sub in model.named_modules():
            if sub_name in modes:
                sub.training = modes[sub_name]
        _load_each("optimizer", _as_list(optimizer), source["optimizers"] or [])
        _load_each("GradScaler", _as_list(scaler), self.data.get("scalers") or [])

    def _state(self, state: str) -> dict[str, Any]:
        last_good = self.data.get("last_good")
        if state == "auto":
            state = "last_good" if self.phase == Phase.OPTIMIZER and last_good else "event"
        if state == "event":
            return {"models": self.data.get("models"), "optimizers": self.data.get("optimizers")}
        if state == "last_good":
            if not last_good:
                raise ValueError("this scene has no last-good state: watch with keep_last_good and dump together")
            return last_good
        raise ValueError(f"state must be 'auto', 'event' or 'last_good', not {state!r}")

    def _pick_model(self, models: dict[str, Any], model: nn.Module) -> tuple[str, Any]:
        """The saved model ``model`` stands for: the only one, the producer's, or the one with its keys."""
        candidates = {name: saved for name, saved in models.items() if saved is not None}
        if len(candidates) == 1:
            return next(iter(candidates.items()))
        keys = set(model.state_dict())
        matching = [name for name, saved in candidates.items() if set(saved) == keys]
        if self.report.model in matching:
            return self.report.model, candidates[self.report.model]
        if len(matching) == 1:
            return matching[0], candidates[matching[0]]
        raise ValueError(
            f"cannot tell which saved model {type(model).__name__} stands for; the scene has "
            f"{', '.join(candidates) or 'none'}"
        )

    # -- replay -------------------------------------------------------------------

    def replay(self, model: nn.Module, *args: Any, **kwargs: Any) -> ReplayResult:
        """Run the producer module of ``model`` (or the model call that held it) again, under op-level tracing.

        ``model`` is used as it is: call :meth:`restore_into` first to give it
        the scene's weights, then change what you want to try (``model.norm.eps
        = 1e-5``, a patched ``forward``). The replay runs under ``no_grad`` and
        leaves the model, its buffers and the RNG as they were.

        Parameters
        ----------
        model
            The model that holds the producer (found by its qualified name).
        *args, **kwargs
            The call's arguments, instead of the saved ones (needed when the
            producer took non-tensor or nested arguments).

        Returns
        -------
        ReplayResult
            ``reproduced`` and ``finding`` (the op and line) when the
            non-finite value came back; ``reproduced`` False after a fix.
        """
        report = self.report
        if report.phase != Phase.FORWARD or report.module is None:
            where = " outside every module" if report.module is None else ""
            raise ValueError(
                f"the producer ran in {report.phase}{where}: only a forward producer module can be replayed "
                "alone; re-run the whole step with scene.rerun_step(step, model, optimizer)"
            )
        called = self.call_module if self.call_module is not None else report.module
        try:
            module = model.get_submodule(called)
        except AttributeError:
            raise ValueError(
                f"{type(model).__name__} has no submodule {called!r} (the call that held the producer "
                f"{report.module!r}, a {report.module_type})"
            ) from None
        if not args and not kwargs:
            args, kwargs = self.producer_call()
        device = next((t.device for t in (*module.parameters(), *module.buffers())), None)
        if device is not None:
            args, kwargs = _moved(args, device), _moved(kwargs, device)
        rng = self.producer_rng_state or (self.rng_state if called == "" else None)
        return replay_module(
            module,
            args,
            kwargs,
            rng_state=rng or capture_rng_state(),
            kinds=frozenset(self.data.get("kinds") or ("nan", "inf")),
            module_name=called,
        )

    def producer_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The producer's saved inputs as ``(args, kwargs)``.

        Raises
        ------
        ValueError
            When they cannot be rebuilt: the call took non-tensor positional
            arguments (not saved) or nested containers.
        """
        call = self.data.get("producer_call")
        if call is None:
            raise ValueError(
                "the scene holds no producer call (no module call produced the event, or an older nan_magic saved "
                "it): pass the arguments yourself, scene.replay(model, *args, **kwargs)"
            )
        if call["nested"]:
            raise ValueError(
                f"the producer was called with a nested input ({call['nested'][0]}): pass the arguments yourself, "
                "scene.replay(model, *args, **kwargs)"
            )
        positional: dict[int, torch.Tensor] = call["args"]
        keywords: dict[str, torch.Tensor] = dict(call["kwargs"])
        # (How many it took, and its keywords, where the call was kept: else what was saved is all there is to go by.)
        count, names = call.get("positional", len(positional)), call.get("keywords", sorted(keywords))
        missing = [*(f"positional argument {index}" for index in range(count) if index not in positional),
                   *(f"keyword argument {name!r}" for name in names if name not in keywords)]
        if missing:
            raise ValueError(
                f"the producer was called with {', '.join(missing)} as an object the scene does not hold (neither a "
                "tensor nor a plain Python value): pass the arguments yourself, scene.replay(model, *args, **kwargs)"
            )
        if sorted(positional) != list(range(len(positional))):
            raise ValueError(
                "the producer was called with non-tensor positional arguments, which the scene does not hold: "
                "pass the arguments yourself, scene.replay(model, *args, **kwargs)"
            )
        return tuple(positional[index] for index in sorted(positional)), keywords

    def rerun_step(
        self,
        step: Callable[[], Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: Any = None,
        *,
        ops: bool = True,
        state: str = "auto",
    ) -> Watch:
        """Re-run the whole failing step under a watch (op-level by default).

        Restores the state the step started from (see :meth:`restore_into`)
        and the RNG state where the scene knows it, then calls ``step()``,
        which the user writes with ``scene.batch`` (the scene holds what
        entered the model; targets or a loss computed outside it are the
        user's to supply).

        Returns
        -------
        Watch
            Its ``report`` is None when the step stayed finite; the watch
            records and continues (``on_detect="log"``), it never raises.

        Notes
        -----
        Exact where the step is a function of the saved state, batch and RNG.
        The RNG state is the one before the failing step's top-level forward
        (forward events) or right after the last finite step
        (``keep_last_good``, checked right after each step); otherwise the
        current state is used and dropout draws other masks.
        """
        from nan_magic.lifecycle.entry import watch

        self.restore_into(model, optimizer, scaler, state=state)
        watcher = watch(model, *_as_list(optimizer), *_as_list(scaler), on_detect="log", ops=ops)
        rng = self.rng_state
        if rng is not None:
            restore_rng_state(rng)
        with watcher:
            step()
        _numbered_as_the_run(watcher, self.step)
        return watcher


def _numbered_as_the_run(watcher: Watch, first: int) -> None:
    """Number what the re-run's watch found as the run it re-runs: it counted the one step it saw as step 0.

    (Afterwards, not by starting the watch's counter at ``first``: the tiered watch's per-module steps and an
    optimizer's first step are judged from that counter.)
    """
    if first == 0:
        return

    def later(item: Any) -> Any:  # a report, a step's summary, an early warning, an event reference
        return dataclasses.replace(item, step=item.step + first)

    def renumbered(report: Report) -> Report:
        return dataclasses.replace(
            later(report),
            history=tuple(map(later, report.history)),
            warnings=tuple(map(later, report.warnings)),
            follows=None if report.follows is None else later(report.follows),
        )

    outcome = watcher.outcome
    report = outcome.report
    numbered = outcome.report = None if report is None else renumbered(report)
    # (The report is also among the events, as the same object: it stays so.)
    outcome.events[:] = [numbered if numbered is not None and event is report else renumbered(event)
                         for event in outcome.events]
    for kept in (watcher.history, watcher.warnings):
        items = list(kept)
        kept.clear()
        kept.extend(map(later, items))


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _load_each(kind: str, owners: list[Any], saved: list[dict[str, Any] | None]) -> None:
    if len(owners) > len(saved):
        raise ValueError(f"the scene holds the state of {len(saved)} {kind}(s), not {len(owners)}")
    for owner, entry in zip(owners, saved):
        if entry is None or entry.get("state") is None:
            raise ValueError(f"the scene does not hold this {kind}'s state (see the report's notes)")
        # A copy: an optimizer adopts tensors on its own device without copying,
        # and training on must not change the scene.
        owner.load_state_dict(copy.deepcopy(entry["state"]))


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _moved(item, device) for key, item in value.items()}
    return value  # a plain Python argument (model(x, step)'s step)
