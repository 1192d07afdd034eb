"""Plain records that flow from the engine to the renderers.

Everything here is stdlib only: no torch, no pandas, no IPython. Hooks create
these records (numbers, never strings), the renderers in ``nan_magic.render``
turn them into text, tables, figures and widgets. A :class:`Report` holds no
tensors, so it pickles, crosses processes and outlives the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from nan_magic.event_refs import EventRef
from nan_magic.fix_records import FixTrial
from nan_magic.locations import SourcePointer, cells_named
from nan_magic.note_records import Note
from nan_magic.phases import Phase
from nan_magic.plain import from_plain, jsonable, to_plain
from nan_magic.step_records import StepSummary
from nan_magic.tensor_refs import LOSS, OUTPUT, TensorRef, TensorRole

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

__all__ = [
    "KINDS", "LOSS", "UNMEASURED", "AbsorbedOp", "Cause", "EventRef", "FixTrial", "LayerCall", "Note",
    "Phase", "Report", "Sample", "SourcePointer", "StepSummary", "TensorRef", "TensorRole", "TensorStats",
    "module_label",
]

#: The three kinds of non-finite value, in the order reports show them.
KINDS = ("nan", "+inf", "-inf")

#: How a value outside every watched module is named (``module`` None).
OUTSIDE_MODULES = "code outside any watched module"
#: How the producer is named where no check saw the value and nothing named it (:attr:`Report.unlocated`).
UNLOCATED = "producer unknown"


def module_label(module: str | None, module_type: str | None = None, model: str | None = None) -> str:
    """The one spelling of a module in every view: ``encoder.0 (Linear)``, ``DivNet (root)``, ``main.0 in netD``.

    ``module`` is the qualified name (``""`` the root, None outside every
    watched module). The root has no name of its own, so its class names it.
    ``model``, given where a watch holds several, says which one it is in.
    """
    if module is None:
        return OUTSIDE_MODULES
    if not module:
        label = f"{module_type} (root)" if module_type else "(root)"
    else:
        label = f"{module} ({module_type})" if module_type else module
    return label + (f" in {model}" if model and not (module == "" and model == module_type) else "")


@dataclass(frozen=True)
class TensorStats:
    """Numbers describing one tensor.

    ``min``/``max``/``mean``/``std``/``absmax`` are taken over the *finite* elements only, and are ``None`` when they
    were not computed (the cheap per-call probe gives min/max only) or when no element is finite. Counts are ``None``
    when unknown (a tensor that was freed before the report was built only has its probe).
    """

    dtype: str
    shape: tuple[int, ...]
    numel: int
    nan: int | None = 0
    posinf: int | None = 0
    neginf: int | None = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    absmax: float | None = None
    zeros: int | None = None
    negatives: int | None = None
    first_bad_index: tuple[int, ...] | None = None

    @property
    def nonfinite(self) -> int:
        """Number of NaN and infinite elements (unknown counts count as 0)."""
        return (self.nan or 0) + (self.posinf or 0) + (self.neginf or 0)

    @property
    def kinds(self) -> frozenset[str]:
        """The non-finite kinds present: a subset of :data:`KINDS`."""
        present = zip(KINDS, (self.nan, self.posinf, self.neginf))
        return frozenset(kind for kind, count in present if count)

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0


LayerStatus = Literal[
    "ok", "producer", "propagated", "benign", "running", "not reached", "not called", "unchecked", "not measured",
]

#: Statuses of rows that have no numbers of their own (:attr:`LayerCall.stats` is None): a call that had
#: not returned when the report was made (``running``), or a module of the model the step did not measure:
#: ``not reached`` (the report was made, and a raising watch stopped the step, before it ran), ``not called``
#: (the step ran to its end without calling it), ``unchecked`` (a ReLU, GELU or dropout that passes a finite
#: input through unmeasured, or was not called), ``not measured`` (a tiered step checks the model's boundaries only;
#: a module left out by ``include``/``exclude``/``types``).
UNMEASURED: frozenset[str] = frozenset({"running", "not reached", "not called", "unchecked", "not measured"})


@dataclass(frozen=True)
class LayerCall:
    """One watched module call (or data entry) of the failing step, or a module of the model it did not measure.

    ``index`` numbers the calls as they began (None for a module not called, or not seen to be called); ``stats`` is
    None where the step has no numbers for the row (its status is then in :data:`UNMEASURED`).
    """

    index: int | None
    phase: Phase
    module: str | None
    module_type: str | None
    stats: TensorStats | None
    status: LayerStatus = "ok"
    #: Which of the call's tensors the row is (``output[1]``, the batch's ``input[0]``, a gradient, the loss);
    #: None only in an older scene's row, which kept its words (``said``).
    tensor: TensorRef | None = OUTPUT
    #: Its module's place in its model, the names from the root down (``("blocks", "0")``; ``()`` the root):
    #: the layer table's tree is drawn from it. None outside every watched module.
    path: tuple[str, ...] | None = None
    #: An older scene's tensor label (before version 6 a row stored its words), shown as written.
    said: str | None = None
    #: Its module's model, as the watch names it (``netD``): a GAN's G and D are both ``Sequential (root)``.
    model: str | None = None


@dataclass(frozen=True)
class Sample:
    """A bounded sample of one tensor's finite values, for histograms.

    ``producer`` is false for the samples of other layers of the failing step (the calls that returned just before the
    producer's). ``nan``, ``posinf``, ``neginf`` and ``zeros`` count the whole tensor, not the sample (None where not
    counted).
    """

    dtype: str
    values: tuple[float, ...]
    numel: int
    producer: bool = True
    nan: int | None = None
    posinf: int | None = None
    neginf: int | None = None
    zeros: int | None = None
    #: Which tensor it samples: the producer's (its op's output and operands, its module's inputs, output), another's.
    tensor: TensorRef | None = None
    #: The module whose call ``tensor`` is of, for another layer's sample and the producer module's output (``""``
    #: the root); None for the producer op's tensors and the loss. ``model``: another layer's model, as named.
    module: str | None = None
    #: Its title in a report's story (render/common.py's ``labelled_samples``), or an older scene's label.
    title: str | None = None
    model: str | None = None

    @property
    def label(self) -> str:
        """Its title: ``encoder.1 output``, ``(root) input[0]``, ``output of aten.log.default``."""
        return self.title if self.title is not None else _views().sample_label(self)


@dataclass(frozen=True)
class EarlyWarning:
    """A sign that a run is heading for a non-finite value, before it happens.

    ``kind`` is one of ``"overflow-risk"``, ``"loss-spike"``, ``"grad-norm-spike"``, ``"extreme-input"``,
    ``"constant-feature"``, ``"scale-falling"``, ``"grad-norm-overflow"``.
    """

    step: int
    kind: str
    #: The numbers it rests on, as ``(name, value)`` pairs (render/words/warning_words.py says them).
    facts: tuple[tuple[str, Any], ...] = ()
    module: str | None = None
    value: float | None = None
    #: An older scene's sentence, shown as written (its warnings had no facts).
    said: str | None = None

    @property
    def message(self) -> str:
        """The warning's sentence."""
        return self.said if self.said is not None else _views().warning_message(self.kind, self.facts)


@dataclass(frozen=True)
class Cause:
    """The likely cause of an event: its kind, which reading of it, and the plain values it rests on.

    ``label`` is the kind (``"learning-rate-too-high"``); ``reading`` names the sentence render/words/causes/ writes
    for it (one kind can be reached several ways); ``facts`` are ``(name, value)`` pairs of stdlib values (str, int,
    float, bool, None, tuples of them), so a scene stores a cause as plain data; ``hint`` and ``evidence`` are their
    words. Shown (``str``, IPython) as its label and hint: its dataclass repr spells every fact, the event's too."""

    label: str
    reading: str
    facts: tuple[tuple[str, Any], ...] = ()

    def fact(self, name: str, default: Any = None) -> Any:
        """The value of the fact ``name``, or ``default`` where the cause has none."""
        for key, value in self.facts:
            if key == name:
                return value
        return default

    # The sentences are written by render/, which sits above the records: reached through the views.
    @property
    def hint(self) -> str:
        """The one-line explanation with its fix."""
        return _views().cause_hint(self)

    @property
    def evidence(self) -> tuple[str, ...]:
        """The facts the diagnosis rests on, one line each."""
        return _views().cause_evidence(self)

    def __str__(self) -> str:
        return f"{self.label}: {self.hint}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"Cause({self.label!r}): {self.hint}")


@dataclass(frozen=True)
class AbsorbedOp:
    """A forward op whose non-finite output reached no boundary, read again by the producer.

    ``exp`` under ``torch.where(x < 20, exp(x), x)``: the +inf it makes is
    discarded in forward, and its backward multiplies it by a zero gradient
    (``0 * inf``). The producer is that backward op; this names the op whose
    absorbed infinity it read.
    """

    op: str
    module: str | None
    source: SourcePointer | None
    nan: int
    posinf: int
    neginf: int


@dataclass(frozen=True)
class Report:
    """Everything known about one non-finite event; holds no tensors.

    Attributes follow PRODUCT.md. ``module`` is the qualified name within
    ``model`` (``""`` for its root, ``None`` outside every watched module);
    ``tensor`` says which value went bad, as a :class:`TensorRef` (its role,
    name and path; ``str()`` gives ``output[1]``, ``parameter fc.weight``).
    """

    phase: Phase
    module: str | None
    module_type: str | None
    step: int
    nan: int
    posinf: int
    neginf: int
    numel: int
    tensor: TensorRef = OUTPUT
    model: str | None = None
    op: str | None = None
    source: SourcePointer | None = None
    benign: bool = False
    cause: Cause | None = None
    inputs_finite: bool = True
    first_bad_index: tuple[int, ...] | None = None
    dtype: str | None = None
    output_stats: TensorStats | None = None
    #: Where the op was named by a replay: ``(name, stats)`` of the producer module's output, which
    #: the check saw (``tensor`` and the counts are then the op's own output).
    module_output: tuple[TensorRef, TensorStats] | None = None
    #: The producer's inputs: the module call's arguments (role input) and the op's operands (role operand).
    input_stats: tuple[tuple[TensorRef, TensorStats], ...] = ()
    #: ``(operand, value)``: the op's Python-number arguments (``logits / t``, ``t = 0.0`` from a config: ``(("other",
    #: 0.0),)``; a backward op's only where not finite: autograd's own are finite); its tensors' stats lack them.
    numbers: tuple[tuple[str, float], ...] = ()
    layers: tuple[LayerCall, ...] = ()
    layers_dropped: int = 0
    samples: tuple[Sample, ...] = ()
    history: tuple[StepSummary, ...] = ()
    warnings: tuple[EarlyWarning, ...] = ()
    debug_frame: SourcePointer | None = None
    debug_locals: tuple[tuple[str, TensorStats], ...] = ()
    frames: tuple[SourcePointer, ...] = ()
    #: What the engine found or could not do, as data (:class:`Note`); :attr:`notes` gives their sentences.
    note_facts: tuple[Note, ...] = ()
    #: ``(reason, count)``: floating tensors the watch could not read and skipped
    #: ("nested", "meta", a dispatching subclass's name), so far in the watch.
    skipped: tuple[tuple[str, int], ...] = ()
    scene: str | None = None
    scene_bytes: int | None = None
    restore_token: int | None = None
    #: The absorbed forward op the producer read (see :class:`AbsorbedOp`), or None.
    absorbed: AbsorbedOp | None = None
    #: For a backward op, the autograd node that ran it (``"SqrtBackward0"``), else None.
    autograd_node: str | None = None
    #: The class of the optimizer whose step made the value non-finite (``"Adam"``), or that was about to step with
    #: the non-finite gradient; None where no optimizer was involved.
    optimizer: str | None = None
    #: That optimizer's ``eps`` and learning rate for the parameter (its parameter group's), where it has them; the
    #: eps its class defaults to (of torch's class it derives from: a ``WarmAdagrad(Adagrad)``'s 1e-10), if any.
    optimizer_eps: float | None = None
    optimizer_default_eps: float | None = None
    optimizer_lr: float | None = None
    #: ``(lr, weight_decay)`` of the watched optimizers' group whose product is largest, read at the event (a decay
    #: of 5e4 typed for 5e-4 scales the weights by 1 - lr * weight_decay a step); None where none decays.
    optimizer_decay: tuple[float, float] | None = None
    #: The rank of the process that found the event and the size of its process group
    #: (``torch.distributed``); None outside a process group.
    rank: int | None = None
    world_size: int | None = None
    #: Whether the replay of the failing step (the default, tiered watch) saw the event again at the same boundary
    #: with the same counts: True, False (the report holds what the checks saw), None where nothing was replayed.
    reproduced: bool | None = None
    #: For an event after the first real one (``on_detect="warn"``/``"log"``: the run went on),
    #: which event that was (:class:`EventRef`); None for the first.
    follows: EventRef | None = None
    #: How many models the watch held: with more than one, :attr:`where` says which model the
    #: module belongs to (a GAN's generator and discriminator both have ``main.0``).
    models_watched: int = 1
    #: Which of its step's top-level model calls the value came from, from the 2nd (gradient accumulation's
    #: micro-batch); None for the 1st, or where the phase has none (events.py: _model_call).
    model_call: int | None = None
    #: The remedies tried on a replay of the failing step (:class:`FixTrial`), verified ones first.
    fixes: tuple[FixTrial, ...] = ()
    #: Whether the watch traced every op (``ops=True``): its hints then never suggest rerunning with it.
    ops: bool = False

    # -- derived -------------------------------------------------------------

    @property
    def nonfinite_numbers(self) -> tuple[tuple[str, float], ...]:
        """The op's Python-number arguments that were not finite (``mask * float("-inf")``)."""
        return tuple((name, value) for name, value in self.numbers if not math.isfinite(value))

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def counts(self) -> dict[str, int]:
        """The three counts apart, keyed by :data:`KINDS`."""
        return {"nan": self.nan, "+inf": self.posinf, "-inf": self.neginf}

    @property
    def op_inputs(self) -> tuple[tuple[TensorRef, TensorStats], ...]:
        """The op's own operands where they were read (ops mode, a replay), else the module call's arguments."""
        own = tuple((ref, stats) for ref, stats in self.input_stats if not ref.is_argument)
        return own or self.input_stats

    def operand(self, name: str) -> TensorStats | None:
        """The op's operand named ``name`` by its schema (``"self"``, ``"other"``); before an in-place op."""
        for ref, stats in self.input_stats:
            if ref.role is TensorRole.OPERAND and ref.name == name:
                return stats
        return None

    @property
    def ref(self) -> EventRef:
        """This event as a reference, which the reports of the events after it hold (:attr:`follows`)."""
        return EventRef(self.step, self.phase, self.module, self.module_type, self.model, self.op, self.tensor)

    @property
    def notes(self) -> tuple[str, ...]:
        """The notes' sentences (written by render/words/note_words.py), in order."""
        return tuple(note.text for note in self.note_facts)

    @property
    def where(self) -> str:
        """Short human name of the producer: ``encoder.1 (Linear)``, ``DivNet (root)``, ``main.0 (Conv2d) in netD``."""
        model = self.model if self.models_watched > 1 else None
        return UNLOCATED if self.unlocated else module_label(self.module, self.module_type, model)

    @property
    def outputs_unread(self) -> bool:
        """Whether some module output of the step could not be read: "every output was finite" holds only of the
        ones read (the note ``outputs-unread`` says whose, and why)."""
        return any(note.kind in ("outputs-unread", "entered-outside-unread") for note in self.note_facts)

    @property
    def unlocated(self) -> bool:
        """No check saw the value and no replay or trace named it (torch's anomaly mode stopped a backward first)."""
        return self.module is None and self.op is None and not self.numel

    @property
    def message(self) -> str:
        """The one-line summary used as the exception message (written by :mod:`nan_magic.render.words.message`)."""
        return "".join(self.message_parts)

    @property
    def message_parts(self) -> tuple[str, str, str, str]:
        """:attr:`message` in its clauses: what and where, a separator, the op and its line, the counts.

        A long headline breaks between the first and the third (errors/frames.py).
        """
        return _views().message_parts(self)

    # -- views: render/ and scene/ sit above the records, so they are reached through
    # -- the ReportViews that nan_magic/__init__.py installs (see install_views) --

    @property
    def table(self) -> pd.DataFrame:
        """Per-layer statistics of the failing step as a pandas DataFrame."""
        return _views().table(self)

    def to_text(self, *, compact: bool = False) -> str:
        return _views().text(self, compact)  # (compact: the note under a script's uncaught error, render/text.py)

    def to_html(self, path: str | None = None) -> str:
        """A self-contained HTML report; also written to ``path`` if given."""
        html = _views().html(self)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(html)
        return html

    def restore(self) -> None:
        """Put the model and optimizer back to the last step that ended finite.

        Needs a watch with ``keep_last_good``; see :mod:`nan_magic.scene.last_good`.
        """
        _views().restore(self)

    def to_dict(self) -> dict[str, Any]:
        # Each cell's file named as the cell (locations.cells_named): the JSON is read after the kernel is gone.
        data = jsonable(cells_named(dataclasses.asdict(self)))
        if self.cause is not None:  # its sentences too, for a reader of the JSON without nan_magic
            data["cause"].update(hint=self.cause.hint, evidence=list(self.cause.evidence))
        data["notes"] = list(self.notes)  # the sentences too, as for the cause; and each trial's why not (untried)
        data["fixes"] = [{**fix, "untried": trial.untried} for fix, trial in zip(data["fixes"], self.fixes)]
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("Report(...)" if cycle else self.to_text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return _views().mimebundle(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``pickle``, ``%store``, a process pool) as its plain data, each file IPython compiled a cell into
        named as that cell: read back after a kernel restart, the report still says ``Cell In[2], line 7``, not a
        temporary file of the kernel that is gone (a scene's report is saved the same way)."""
        return (_report_from_plain, (cells_named(to_plain(self)),))


def _report_from_plain(plain: dict[str, Any]) -> Report:
    """A pickled :class:`Report` read back (:meth:`Report.__reduce__`)."""
    return from_plain(Report, plain)


class ReportViews(Protocol):
    """What a :class:`Report`'s views call: rendering and the roll-back, which sit above the records."""

    def table(self, report: Report) -> pd.DataFrame: ...

    def text(self, report: Report, compact: bool = False) -> str: ...

    def message_parts(self, report: Report) -> tuple[str, str, str, str]: ...

    def html(self, report: Report) -> str: ...

    def mimebundle(self, report: Report) -> dict[str, Any]: ...

    def restore(self, report: Report) -> None: ...

    def cause_hint(self, cause: Cause) -> str: ...

    def cause_evidence(self, cause: Cause) -> tuple[str, ...]: ...

    def warning_message(self, kind: str, facts: tuple[tuple[str, Any], ...]) -> str: ...

    def sample_label(self, sample: Sample) -> str: ...


_installed: list[ReportViews] = []


def install_views(views: ReportViews) -> None:
    """Serve every Report's views from ``views`` (``nan_magic/__init__.py`` does, on import)."""
    _installed[:] = [views]


def _views() -> ReportViews:
    # nan_magic/__init__.py runs before any of its modules and installs them.
    return _installed[0]
