"""The readers of older scenes: each older version's report, as plain data, made into this version's.

A scene stores its Report as plain data (plain.py); a field that changed its
type since is rebuilt here from what the older version stored, never parsed
from a sentence it wrote: an older sentence is kept, and shown, as written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nan_magic.plain import to_pairs
from nan_magic.records import Report, TensorRef

__all__ = ["as_version_7", "reasons_said", "typed_tensors", "warnings_said", "with_paths"]


def warnings_said(plain: Any) -> list[str | None]:
    """The sentences an older scene's early warnings were stored as (none where they carry facts)."""
    warnings = plain.get("warnings") if isinstance(plain, dict) else None
    said = [dict(item.items() if isinstance(item, dict) else item).get("message") for item in warnings or ()]
    return said if any(text is not None for text in said) else []


def typed_tensors(plain: dict[str, Any]) -> dict[str, Any]:
    """An older scene's report, whose layer rows and extreme-batch cause named their tensor by its words.

    A row's words are kept as written (``said``): they alone do not say the
    tensor's role. The batch of an extreme-batch cause was always an argument
    of the model call (``input[0]``, ``kwargs['x']``), whose reference holds
    that same path.
    """
    layers = tuple({**row, "tensor": None, "said": row["tensor"]} if isinstance(row.get("tensor"), str) else row
                   for row in plain.get("layers") or ())
    cause = plain.get("cause")
    if isinstance(cause, dict) and cause.get("reading") == "extreme-batch":
        cause = {**cause, "facts": tuple(
            (key, to_pairs(TensorRef.argument(value))) if key == "batch" and isinstance(value, str) else (key, value)
            for key, value in cause.get("facts") or ())}
    return {**plain, "layers": layers, "cause": cause}


#: The tensor facts an older scene stored by name, and the reference each name stands for: the batch
#: warnings' argument of the model call (``input[0]``), the optimizer notes' parameter.
_NAMED_TENSORS = {"extreme-input": TensorRef.argument, "constant-feature": TensorRef.argument,
                  "written-outside-optimizer": TensorRef.parameter, "optimizer-made-it": TensorRef.parameter}


def as_version_7(plain: dict[str, Any]) -> dict[str, Any]:
    """An older scene's report, whose early warnings and optimizer notes named their tensor by a string.

    A version 6 scene or older stored the batch warnings' tensor as its
    argument's path and the optimizer notes' as its parameter's name: each is
    that reference's own field, so the reference is rebuilt, not parsed. Its
    histograms' samples carry the labels the engine gave them: kept, as their
    titles.
    """
    def typed(record: Any) -> Any:
        made = _NAMED_TENSORS.get(str(record.get("kind"))) if isinstance(record, dict) else None
        if made is None:
            return record
        return {**record, "facts": tuple(
            (key, to_pairs(made(value))) if key == "tensor" and isinstance(value, str) else (key, value)
            for key, value in record.get("facts") or ())}

    samples = tuple({**sample, "title": sample.get("label")} if isinstance(sample, dict) else sample
                    for sample in plain.get("samples") or ())
    return {**plain, "warnings": tuple(typed(record) for record in plain.get("warnings") or ()),
            "note_facts": tuple(typed(record) for record in plain.get("note_facts") or ()), "samples": samples}


def with_paths(report: Report) -> Report:
    """An older scene's report, each layer (table row, per-module step's magnitude) with its module's path.

    The scene loader's compat path, and the one place the package reads a
    name it stored by its dots: a version 5 scene stores each layer's path
    (the names from the root down, as torch's ``named_modules`` walk gave them).
    """
    history = tuple(dataclasses.replace(entry, layers=tuple((name, value, dtype, _path(name) or ())
                                                            for name, value, dtype, *_ in entry.layers))
                    for entry in report.history)
    layers = tuple(dataclasses.replace(row, path=_path(row.module)) for row in report.layers)
    return dataclasses.replace(report, layers=layers, history=history)


def _path(module: str | None) -> tuple[str, ...] | None:
    if module is None:
        return None  # outside every module
    return tuple(module.split(".")) if module else ()  # "" is the root


def reasons_said(plain: dict[str, Any]) -> dict[str, Any]:
    """An older scene's report, whose fix trials kept why one was not run or not counted as its sentence.

    A version 7 scene or older stored a trial's reason as the words
    (``untried``): kept as a note of the kind ``said``, shown as written.
    """
    return {**plain, "fixes": tuple(
        {**trial, "reason": {"kind": "said", "facts": (("text", trial["untried"]),)}}
        if isinstance(trial, dict) and isinstance(trial.get("untried"), str) else trial
        for trial in plain.get("fixes") or ())}
