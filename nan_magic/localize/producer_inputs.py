"""What a call received, for the producer rule: its inputs' kinds before it ran, its parameters, its masks.

:class:`CallInputs` is the input side of :class:`~nan_magic.localize.producer.ProducerRule` (which mixes it in):
the kinds a call was given (in-place aware), a non-finite parameter or buffer of its module, and the deliberate
infinities (ops/masks.py) among them, recorded once as benign events. Apart from producer.py so that the rule itself
(made here, or passed on) reads in one sitting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nan_magic.hot.kept.call_records import FIRST_ARGUMENT, Call, TensorRecord
from nan_magic.hot.kept.finding import Finding, mark_deliberate, record_ref
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.hot.reads import is_checkable, relevant_kinds, version_of
from nan_magic.hot.stats import kinds_of
from nan_magic.hot.wrapped import unwrapped
from nan_magic.localize.ops.masks import DeliberateMasks, argument_name
from nan_magic.records import Phase, TensorRef, TensorRole

__all__ = ["CallInputs"]


class CallInputs:
    """The input side of :class:`~nan_magic.localize.producer.ProducerRule`: what a call received."""

    # Set by the class that mixes this in.
    _emit: Callable[[Finding], None]
    deliberate: DeliberateMasks
    held: HeldBatch
    kinds: frozenset[str]

    def input_kinds(self, call: Call) -> tuple[frozenset[str], frozenset[str]]:
        """Kinds the call's inputs held *before* the call (in-place aware): ``(passed on, deliberate)``.

        The second holds the kinds of deliberate infinities (a mask) that the
        call may consume: inputs recorded as benign, and masks (ops/masks.py).
        """
        kinds: set[str] = set()
        deliberate: set[str] = set()
        for path, argument, record, ref, version in call.inputs:
            tensor = ref()
            if tensor is not None and version_of(tensor) == version:
                found = kinds_of(tensor)
            elif record is not None and not record.pending:
                # Mutated in place by this module: its value before the call is
                # what the producer rule compares against, and the probe of the
                # call that made it still knows it.
                found, tensor = record.kinds, None
            else:
                continue
            if not found:
                continue
            # (A batch held for its step, benign until it proves not to be, is no deliberate infinity: held_batch.py.)
            held = self.held.finding is not None and self.held.finding.record is record
            if (record is not None and record.status == "benign" and not held) or self.is_benign_input(
                call, path, argument, tensor, record
            ):
                deliberate |= found
            else:
                kinds |= found
        wanted = self.kinds
        return relevant_kinds(frozenset(kinds), wanted), relevant_kinds(frozenset(deliberate), wanted)

    def _bad_parameter(self, call: Call) -> tuple[TensorRef, torch.Tensor] | None:
        """A non-finite parameter or buffer of the called module (recursively), by its role; deliberate masks
        excepted (a rotary embedding's ``inv_freq`` made infinite by ``rope_theta=0`` is a buffer)."""
        prefix = f"{call.name}." if call.name else ""
        module = call.module
        masks = {id(buffer) for _name, buffer in self.deliberate.buffers(module, prefix)}
        named = [
            *((TensorRole.PARAMETER, *item) for item in module.named_parameters()),
            *((TensorRole.BUFFER, *item) for item in module.named_buffers()),
        ]
        for role, name, tensor in named:
            if id(tensor) in masks:
                continue
            if (inner := unwrapped(tensor)) is not None:  # (its own weight under a torch.func transform: read inside)
                tensor = inner
            if is_checkable(tensor) and relevant_kinds(kinds_of(tensor), self.kinds):
                return TensorRef(role, prefix + name), tensor
        return None

    # -- deliberate infinities (ops/masks.py) ---------------------------------------------

    def is_benign_input(
        self,
        call: Call,
        path: str,
        argument: int | str | None,
        tensor: torch.Tensor | None,
        record: TensorRecord | None = None,
    ) -> bool:
        """Whether a non-finite argument of ``call`` (``path``, its ``argument``) is a deliberate mask (ops/masks.py).

        ``tensor`` is the live value; when it is gone, ``record``'s probe
        decides, which takes a name that says mask.
        """
        name = argument_name(call.module, argument) if call.module is not None else None
        if tensor is not None:
            return self.deliberate.is_mask(tensor, name, first=path == FIRST_ARGUMENT)
        return record is not None and self.deliberate.probe_is_mask(record.low, record.high, name)

    def _mask_buffer_kinds(self, call: Call) -> frozenset[str]:
        """The kinds the call's deliberate mask buffers hold; each is recorded once as a benign event."""
        prefix = f"{call.name}." if call.name else ""
        kinds: set[str] = set()
        for name, buffer in self.deliberate.buffers(call.module, prefix):
            kinds |= kinds_of(buffer)
            if self.deliberate.first_sighting(call.name, name):
                finding = Finding(Phase.FORWARD, call, TensorRef(TensorRole.BUFFER, name), bad=buffer.detach())
                self._emit(mark_deliberate(finding, "mask-buffer", name=name))
        return frozenset(kinds)

    def _note_mask(self, call: Call, record: TensorRecord, tensor: torch.Tensor | None) -> None:
        """Mark a deliberate mask given as an argument benign; its first sighting there is a benign event."""
        record.status = "benign"
        if not self.deliberate.first_sighting(call.name, str(record.path)):
            return
        role = TensorRole.INPUT if call.phase == Phase.DATA else TensorRole.MODULE_OUTPUT
        finding = Finding(
            call.phase,
            call,
            record_ref(record, role),
            bad=_detached(tensor),
            record=record,
            bad_stats=record.stats() if tensor is None else None,
            inputs_finite=False,
        )
        self._emit(mark_deliberate(finding, "mask-argument", path=str(record.path)))


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach() if tensor is not None else None
