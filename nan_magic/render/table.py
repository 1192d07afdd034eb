"""The per-layer table as a pandas DataFrame, and its styled HTML form."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import pandas as pd
from pandas.io.formats.style import Styler

from nan_magic.records import UNMEASURED, LayerCall, Report
from nan_magic.render.common import (
    COLUMNS,
    counts_phrase,
    fmt_number,
    fmt_shape,
    in_call_order,
)
from nan_magic.render.layer_tree import (
    contains,
    depth,
    missing_note,
    row_labels,
    shown_statuses,
    unmeasured_note,
)
from nan_magic.render.words.names import row_tensor

#: CSS class of every cell of a row, by the row's role. Tests and the
#: stylesheet in :data:`TABLE_CSS` rely on these names.
PRODUCER_CLASS = "nm-producer"
PROPAGATED_CLASS = "nm-propagated"
BENIGN_CLASS = "nm-benign"
AFTER_CLASS = "nm-after"
#: The producer's parents (its module's enclosing modules): the path to it in the tree.
CONTAINS_CLASS = "nm-contains"
#: A module of the step without numbers of its own (records.UNMEASURED).
UNMEASURED_CLASS = "nm-unmeasured"

#: Colours are translucent so they read on light and dark notebook themes.
#: Alignment rules carry the report's class: a notebook's own table style
#: (JupyterLab right-aligns every cell of an HTML output) must not win.
TABLE_CSS = f"""
.nm-table {{ border-collapse: collapse; font-size: 12px; font-family: monospace; }}
.nm-table th, .nm-table td {{ padding: 2px 3px; text-align: right; white-space: nowrap; }}
.nan-magic-report table.nm-table td.nm-wrap {{ white-space: normal; overflow-wrap: anywhere; max-width: 12em; }}
.nan-magic-report table.nm-table td.nm-status {{ white-space: normal; max-width: 8em; }}
.nm-table th {{ position: sticky; top: 0; background: rgba(127, 127, 127, 0.25); }}
.nan-magic-report table.nm-table td.nm-left, .nan-magic-report table.nm-table th {{ text-align: left; }}
.nm-table td.{PRODUCER_CLASS} {{ background: rgba(230, 40, 40, 0.30); font-weight: bold; }}
.nm-table td.{PROPAGATED_CLASS} {{ background: rgba(240, 150, 20, 0.15); }}
.nm-table td.{BENIGN_CLASS} {{ background: rgba(40, 110, 230, 0.15); }}
.nm-table td.{AFTER_CLASS} {{ opacity: 0.55; }}
.nm-table td.{CONTAINS_CLASS} {{ font-weight: bold; }}
.nm-table td.{UNMEASURED_CLASS} {{ font-style: italic; opacity: 0.7; }}
.nm-table caption {{ caption-side: bottom; text-align: left; font-style: italic; padding-top: 2px; }}
""" + "".join(
    f".nan-magic-report table.nm-table td.nm-depth-{depth} {{ padding-left: {0.3 + 0.6 * depth:.1f}em; }}\n"
    for depth in range(1, 13)
)


def layer_table(report: Report) -> pd.DataFrame:
    """Per-layer statistics of the failing step, one row per recorded call.

    Parameters
    ----------
    report
        The report whose ``layers`` to tabulate.

    Returns
    -------
    pandas.DataFrame
        Columns ``call, phase, module, type, tensor, dtype, shape, min, max,
        mean, std, absmax, nan, +inf, -inf, status``, one row per call in
        the order the calls started, and one per module of the model that
        the step did not measure, placed in the model's module order, with
        its status (``running``, ``not reached``, ``not called``,
        ``unchecked``, ``not measured``) and no numbers. ``module``
        is the qualified name as recorded (``""`` root, ``None`` outside any
        module); statistics cover finite elements and are nullable floats,
        ``<NA>`` where not measured (never NaN, which in a NaN tool's table
        would read as a finding); counts are nullable integers, ``<NA>`` where
        unknown. ``frame.attrs["legend"]`` says what the missing cells mean.
    """
    layers = in_call_order(report.layers)
    frame = layers_frame(layers)
    frame.attrs["legend"] = " ".join(part for part in (missing_note(layers), unmeasured_note(layers)) if part)
    return frame


def layers_frame(layers: Sequence[LayerCall]) -> pd.DataFrame:
    """:func:`layer_table` for any sequence of rows (a filtered subset)."""
    records = [_record(layer) for layer in layers]
    frame = pd.DataFrame.from_records(records, columns=list(COLUMNS))
    # Object columns keep None apart from "" (outside any module vs the root);
    # pandas 3 would infer a string dtype and turn None into NaN.
    for column in ("module", "type", "shape"):  # (a shape not measured: None, not from_records' NaN)
        frame[column] = pd.Series([record.get(column) for record in records], dtype=object)
    for column in ("phase", "tensor", "dtype", "status"):
        # (pandas 3 infers a string dtype whose missing value is NaN: a row not measured read "tensor NaN")
        frame[column] = pd.array([record.get(column) for record in records], dtype="string")
    for column in ("min", "max", "mean", "std", "absmax"):
        # (Nullable: a statistic not measured is <NA>, never a NaN that reads as a non-finite value measured.)
        frame[column] = pd.array([record.get(column) for record in records], dtype="Float64")
    for column in ("nan", "+inf", "-inf"):
        frame[column] = frame[column].astype("Int64")
    frame["call"] = frame["call"].astype("Int64")
    return frame


def _record(layer: LayerCall) -> dict[str, object]:
    """One row of :func:`layers_frame`: a module the step did not measure has its status and nothing else."""
    stats = layer.stats
    row: dict[str, object] = {
        "call": layer.index, "phase": str(layer.phase), "module": layer.module, "type": layer.module_type,
        "tensor": row_tensor(layer) if stats is not None else None, "status": layer.status,
    }
    if stats is not None:
        row.update({
            "dtype": stats.dtype, "shape": stats.shape, "min": stats.min, "max": stats.max,
            "mean": stats.mean, "std": stats.std, "absmax": stats.absmax,
            "nan": stats.nan, "+inf": stats.posinf, "-inf": stats.neginf,
        })
    return row


def row_classes(layers: Sequence[LayerCall]) -> list[str]:
    """The CSS class of each row: producer, containing it, propagated, benign, unmeasured, after, or none.

    Rows after the producer's (and not inside it) are dimmed; a propagated
    row after the producer gets both classes so it stays marked while dimmed.
    """
    classes = []
    seen_producer = False
    producer = next((layer for layer in layers if layer.status == "producer"), None)
    for layer in layers:
        names = []
        if layer.status == "producer":
            names.append(PRODUCER_CLASS)
        elif producer is not None and contains(layer, producer):
            names.append(CONTAINS_CLASS)
        elif layer.status in UNMEASURED:
            names.append(UNMEASURED_CLASS)
        if layer.status == "propagated":
            names.append(PROPAGATED_CLASS)
        elif layer.status == "benign":
            names.append(BENIGN_CLASS)
        # Rows after the producer's are dimmed, but not its children's: they ran inside it, before it returned.
        if seen_producer and layer.status != "producer" and not (producer is not None and contains(producer, layer)):
            names.append(AFTER_CLASS)
        seen_producer = seen_producer or layer.status == "producer"
        classes.append(" ".join(names))
    return classes


#: Columns of the styled table, in order: what tells the story first (the
#: status and the non-zero counts), then the module as a tree (indented by
#: depth, torchinfo-style), then the numbers; ``module`` is the one spelling
#: of module and type together. Phase, tensor and dtype are dropped where every
#: row has the same (the caption says it), so that at 900 px nothing scrolls sideways.
VIEW_COLUMNS = (
    "call", "status", "non-finite", "module", "phase", "tensor", "dtype",
    "shape", "min", "max", "absmax", "mean", "std",
)
_LEFT_ALIGNED = frozenset({"status", "non-finite", "module", "phase", "tensor", "dtype", "shape"})
_SHARED = ("phase", "tensor", "dtype")
#: Long names wrap inside their cell rather than push the numbers out of sight at 900 px.
_WRAPPED = frozenset({"module", "tensor"})


def view_frame(layers: Sequence[LayerCall], among: Sequence[LayerCall] | None = None) -> pd.DataFrame:
    """The rows as shown: :data:`VIEW_COLUMNS`, module and type in one label, the counts in one phrase."""
    frame = layers_frame(layers)
    frame["module"] = pd.Series(
        row_labels(layers, among),
        index=frame.index, dtype=object,
    )
    frame["non-finite"] = pd.Series(
        [counts_phrase(layer.stats.nan, layer.stats.posinf, layer.stats.neginf) if layer.stats else ""
         for layer in layers],
        index=frame.index, dtype=object,
    )
    frame["status"] = pd.Series(shown_statuses(layers), index=frame.index, dtype=object)
    return frame[list(VIEW_COLUMNS)]


def has_moments(layers: Sequence[LayerCall]) -> bool:
    """Whether any row has a mean and std (only tensors alive at the report have them)."""
    return any(layer.stats is not None and layer.stats.mean is not None for layer in layers)


def style_layers(layers: Sequence[LayerCall], among: Sequence[LayerCall] | None = None) -> Styler:
    """A pandas Styler of ``layers`` with the producer's row highlighted.

    Parameters
    ----------
    layers
        The rows to show (callers cap them first: Styler output grows with
        every cell).
    among
        The step's rows, where ``layers`` are those a filter left: whether the
        modules are named with their model is told from all of them.

    Returns
    -------
    pandas.io.formats.style.Styler
        :data:`VIEW_COLUMNS` (mean and std dropped when no row has them; phase,
        tensor and dtype when every row has the same, said in the caption),
        classes from :func:`row_classes` on every cell, the module indented
        by its depth (``nm-depth-N``); render with
        ``.to_html()`` next to :data:`TABLE_CSS`; the table's classes are
        ``nm-table nm-layers``.
    """
    frame = view_frame(layers, among)
    if not has_moments(layers):
        frame = frame.drop(columns=["mean", "std"])
    # Folded only where every row has the same value: nunique() skips missing ones, so a running row (no tensor,
    # no dtype) beside the producer would fold the producer's "input[0]" away and caption "tensor nan".
    shared = [
        column for column in _SHARED if len(layers) > 1 and frame[column].notna().all() and frame[column].nunique() == 1
    ]
    caption = ", ".join(f"{column} {frame[column].iloc[0]}" for column in shared)
    frame = frame.drop(columns=shared)
    classes = row_classes(layers)

    # Indented from the shallowest row shown, as torchinfo's tree: no room spent on levels nobody sees.
    top = min((depth(layer) for layer in layers), default=0)

    def cell_class(names: str, column: str, layer: LayerCall) -> str:
        level = min(depth(layer) - top, 12)
        if column == "module" and level:
            names += f" nm-depth-{level}"
        if column in _WRAPPED:
            names += " nm-wrap"
        if column == "status":
            names += " nm-status"  # "contains producer" on two lines: the numbers stay in 900 px
        return f"{names} nm-left".strip() if column in _LEFT_ALIGNED else names

    class_frame = pd.DataFrame(
        [[cell_class(names, column, layer) for column in frame.columns] for names, layer in zip(classes, layers)],
        index=frame.index,
        columns=frame.columns,
    )
    numbers = [column for column in ("min", "max", "absmax", "mean", "std") if column in frame.columns]
    # Styler's ids are random by default: a notebook saved twice from the
    # same report would differ. Ids from the rows' content are stable.
    content = hashlib.sha1(frame.to_json(default_handler=str).encode()).hexdigest()[:8]
    styler = (
        Styler(frame, uuid=f"nm{content}", cell_ids=False)
        .hide(axis="index")
        .set_td_classes(class_frame)
        .set_table_attributes('class="nm-table nm-layers"')
        # Names come from user code: escape them like any other text.
        .format(escape="html", na_rep="")
        .format(fmt_number, subset=numbers, na_rep="")
        .format(fmt_shape, subset=["shape"], na_rep="")
    )
    return styler.set_caption(f"Every row: {caption}.") if caption else styler


def layers_html(layers: Sequence[LayerCall], among: Sequence[LayerCall] | None = None) -> str:
    """:func:`style_layers` as HTML, without what only Styler needs: its per-cell position classes
    (``data row12 col3``: no style refers to them) and the indentation between tags. A saved notebook
    carries the table twice (the static copy and the widget's state); this halves each."""
    html = style_layers(layers, among).to_html()
    html = re.sub(r'class="data row\d+ col\d+ ?', 'class="', html)
    return re.sub(r">\s+<", "><", html)
