"""A reference to an earlier event of the same watch, as data (stdlib only, below the records).

A report made after the run went on past its first event (``on_detect="warn"``
or ``"log"``) says which event came first with an :class:`EventRef`, never
with that event's sentence: render/words/message.py writes the words from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nan_magic.phases import Phase
from nan_magic.tensor_refs import OUTPUT, TensorRef

__all__ = ["EventRef"]


@dataclass(frozen=True)
class EventRef:
    """Where an event was found: its step and phase, the producer module (and model), op and tensor.

    The fields mean what the :class:`~nan_magic.Report` fields of the same
    names mean: ``module`` is the qualified name within ``model`` (``""``
    its root, None outside every watched module), ``op`` the aten overload
    where the op is known.
    """

    step: int
    phase: Phase
    module: str | None
    module_type: str | None = None
    model: str | None = None
    op: str | None = None
    tensor: TensorRef = OUTPUT
