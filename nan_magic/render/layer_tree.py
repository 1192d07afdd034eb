"""The layer table as a tree: depth, the producer's parents, and what the rows without numbers mean."""

from __future__ import annotations

from collections.abc import Sequence

from nan_magic.records import LayerCall, TensorStats, module_label
from nan_magic.render.words.counted import counted

__all__ = [
    "CONTAINS_PRODUCER",
    "MOMENTS_NOTE",
    "UNMEASURED_MEANING",
    "contains",
    "depth",
    "inside",
    "layers_count",
    "missing_note",
    "row_labels",
    "shown_statuses",
    "unmeasured_note",
]


def depth(layer: LayerCall) -> int:
    """How deep the call's module sits in its model: 0 for the root (and code outside it), 1 for its children."""
    return len(layer.path) if layer.path is not None else 0


def contains(outer: LayerCall, inner: LayerCall) -> bool:
    """Whether ``outer``'s module is a parent (or grand-parent...) of ``inner``'s, in the same phase."""
    if outer.path is None or inner.path is None or outer.phase != inner.phase or outer.model != inner.model:
        return False
    return inside(inner.path, outer.path)


def row_labels(layers: Sequence[LayerCall], among: Sequence[LayerCall] | None = None) -> list[str]:
    """Each row's module as the tables spell it: ``0 (Linear)``, and ``0 (Linear) in D`` where the step's rows
    (``among``: all of them, where ``layers`` are the ones shown) are of several models (a GAN's step calls G and D:
    both roots are ``Sequential (root)``, both first layers ``0``)."""
    several = len({layer.model for layer in (layers if among is None else among) if layer.model is not None}) > 1
    return [module_label(layer.module, layer.module_type, layer.model if several else None) for layer in layers]


def inside(path: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    """Whether the module at ``path`` sits in the one at ``outer``: its child, grand-child... (not itself)."""
    return len(path) > len(outer) and path[:len(outer)] == outer


#: What the status column says of the producer's parents: the path to it down the tree.
CONTAINS_PRODUCER = "contains producer"


def shown_statuses(layers: Sequence[LayerCall]) -> list[str]:
    """Each row's status as the tables show it: the producer's parents say they contain it."""
    producer = next((layer for layer in layers if layer.status == "producer"), None)
    return [CONTAINS_PRODUCER if producer is not None and layer.status != "producer" and contains(layer, producer)
            else layer.status for layer in layers]


def layers_count(layers: Sequence[LayerCall]) -> str:
    """``"26 calls measured; 2 running, 3 not reached"``: what the layer table holds."""
    unmeasured: dict[str, int] = {}
    for layer in layers:
        if layer.stats is None:
            unmeasured[layer.status] = unmeasured.get(layer.status, 0) + 1
    # A call may have several rows (a tuple output, a value its own code passed on): calls are counted once.
    calls = len({layer.index for layer in layers if layer.stats is not None})
    measured = f"{counted(calls, 'call')} measured"
    return "; ".join([measured, ", ".join(f"{count} {status}" for status, count in unmeasured.items())]).rstrip("; ")


#: Why a row of the layer table has no numbers, by its status (records.UNMEASURED).
UNMEASURED_MEANING = {
    "running": "had not returned when the report was made",
    "not reached": "the report was made before it ran (a raising watch stops the step at the event)",
    "not called": "the step ran to its end without calling it",
    "unchecked": "passes a finite input through unmeasured (ReLU, GELU, dropout), or was not called",
    "not measured": "not checked on this step (a step that checks only the model's boundaries, where no replay "
                    "ran, or a module the include, exclude or types options leave out)",
}


def unmeasured_note(layers: Sequence[LayerCall]) -> str:
    """``"no numbers: not reached = the report was made before it ran ..."``, for the statuses shown; or ``""``."""
    shown = shown_statuses(layers)
    meanings = [f"{status}: {meaning}" for status, meaning in UNMEASURED_MEANING.items()
                if any(layer.stats is None and text == status for layer, text in zip(layers, shown))]
    return "Rows without numbers, " + "; ".join(meanings) + "." if meanings else ""


#: Said under a table whose rows have no mean and std, or only some.
MOMENTS_NOTE = (
    "mean and std are computed only for tensors still alive when the report was built "
    "(the producer's, the loss); every other call was read once, for its min and max"
)


def _why_rangeless(stats: TensorStats) -> str:
    """Why a measured row has no min and max: its kinds seen, not counted, by a probe of a tensor since freed
    (``"uncounted"``); finite values counted, not ranged (``"counted"``); or ``"no finite value"``."""
    if None in (stats.nan, stats.posinf, stats.neginf):
        return "uncounted"
    return "counted" if stats.nonfinite < stats.numel else "no finite value"


def missing_note(layers: Sequence[LayerCall], moments: bool = True) -> str:
    """What an empty number cell of a measured row means (a row without numbers: :func:`unmeasured_note`); ``""``
    where none is empty. ``moments``: the table shows mean and std (the text table does not)."""
    parts = []
    ranges = "min, max" + (", mean, std" if moments else "") + " and absmax"
    why = {_why_rangeless(layer.stats) for layer in layers if layer.stats is not None and layer.stats.min is None}
    if "no finite value" in why:
        parts.append(f"{ranges} are empty where the tensor held no finite value to measure")
    if "counted" in why:
        # A finite gradient checked by its sum (the default watch's backward boundaries): counts, no range; "no
        # finite value" said of it was false.
        parts.append(f"{ranges} are empty where the tensor was counted but its range not read (a gradient checked "
                     "by its sum, and freed before the report was built)")
    if "uncounted" in why:
        parts.append("a ? count is a kind the tensor held, its number unknown: it was freed before the report was "
                     "built, and its probe (a min and a max) shows which kinds it held, not how many nor its finite "
                     "range")
    if moments and any(layer.stats is not None and layer.stats.min is not None and layer.stats.mean is None
                       for layer in layers):
        parts.append(f"empty mean and std were not measured: {MOMENTS_NOTE}")
    return ("Empty cells are missing numbers (report.table's <NA>), not NaN values: " + "; ".join(parts) + ".") \
        if parts else ""
