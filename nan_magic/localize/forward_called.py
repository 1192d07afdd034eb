"""A watched module's ``forward`` called as a method: its own code is the module's, not the loop's.

``model.forward(x)`` bypasses the model's hooks (its children's still run), so the code in that ``forward`` runs
where the watch records the loop's code: a non-finite value it makes reaches the first child as a batch would (phase
``data``), or, made after its last child's call, the loss as the loss code's would (phase ``forward``, no module).
PRODUCT.md's phase and module say where the producer ran, a module's forward; so the frames that ran the op are
asked, at the event only, whether one of them is a watched module's ``forward``. The other way round, the loss
check's finding whose op the loop's code ran on outside data alone is the data's (:func:`made_by_data_code`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType

from torch import nn

from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.records import Note, Phase

__all__ = ["in_forward_called", "made_by_data_code"]

#: Frames walked out from the op's (a helper the forward called, the forward, the loop's line that called it).
_DEPTH = 32


def in_forward_called(finding: Finding, info_by_id: Callable[[int], ModuleInfo | None] | None) -> None:
    """Make a finding of the loop's code whose op ran inside a watched module's ``forward`` that module's event."""
    frame: FrameType | None = finding.frame
    if info_by_id is None:
        return
    for _ in range(_DEPTH):
        if frame is None:
            return
        module = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(module, nn.Module) and frame.f_code is getattr(type(module).forward, "__code__", None):
            info = info_by_id(id(module))
            if info is not None:
                finding.phase, finding.module = Phase.FORWARD, info.name
                finding.module_type, finding.model = info.module_type, info.model
                # (The loss check's "code outside the modules produced it" is not so: this module's code did.)
                finding.notes = [note for note in finding.notes if note.kind != "outside-made-it"]
                return
        frame = frame.f_back


def made_by_data_code(finding: Finding) -> None:
    """The loss check's finding whose op the loop's code (or a Dataset's) ran on outside data alone, a target it
    built: phase ``data`` (PRODUCT.md), and its note says so instead of the loss check's, which blamed the loss."""
    finding.phase = Phase.DATA
    finding.notes = [Note("data-code-made-it") if note.kind == "outside-made-it" else note for note in finding.notes]
