"""The words of a value a ``load_state_dict`` loaded non-finite (patches/loads.py): the note that names its line."""

from __future__ import annotations

from collections.abc import Callable

from nan_magic.note_records import Note
from nan_magic.plain import from_plain
from nan_magic.render.words.names import subject_label
from nan_magic.tensor_refs import TensorRef

__all__ = ["LOAD_NOTE_WRITERS"]

#: What called ``load_state_dict``, as the user wrote it.
_LOADERS = {"model": "a module's load_state_dict", "optimizer": "the optimizer's load_state_dict"}


def _loaded(note: Note) -> str:
    subject = subject_label(from_plain(TensorRef, note.fact("tensor")))
    return (f"{subject} was non-finite as {_LOADERS.get(note.fact('loader'), 'load_state_dict')} loaded it, at line "
            f"{note.fact('line')}: the state dict it was given held the value (a checkpoint saved after a run went "
            "bad?), and no op of this run made it")


LOAD_NOTE_WRITERS: dict[str, Callable[[Note], str]] = {"loaded-nonfinite": _loaded}
