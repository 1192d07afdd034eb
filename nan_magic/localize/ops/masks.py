"""Deliberate infinities: which infinite tensors are attention masks, not faults.

A float attention mask (``nn.Transformer.generate_square_subsequent_mask``,
a ``key_padding_mask`` turned float, ``masked_fill(mask, -inf)`` on zeros)
holds -inf on purpose. Passed to a model as an argument, or held as a buffer,
it is benign for as long as what consumes it stays finite (PRODUCT.md,
"benign"); a consumer that turns it into a new non-finite kind (softmax over
a fully masked row gives NaN) is the producer, and so is a reduction that
carries the mask's -inf on over a row it masked entirely (a logsumexp over
nothing is -inf: the loss it feeds is infinite, its gradient NaN), or a sum
that adds masked positions up (:func:`reduces_a_mask`).

The rule, for a tensor that holds a non-finite value:

* it holds no NaN (NaN is never deliberate), and
* its infinities all have one sign (a mask adds -inf, or +inf before a min;
  a tensor holding both is arithmetic gone wrong), and
* it holds a finite element (a mask that hides everything hides nothing
  deliberately: ``torch.full(shape, inf)`` is an overflow), and
* either its name (the argument's or buffer's) says ``mask``, or says it is an
  attention bias (``attn_bias``, xformers' and MPT's name; ``alibi``,
  ``position_bias``: then its finite values may be anything: an additive bias
  with a mask folded in, as ALiBi or T5 relative biases do; a plain ``bias``
  says nothing of attention and does not count), or every finite element is 0 (the pure
  additive mask) and it is not the first positional argument, which is the
  batch (``log`` of a 0/1 feature gives the same 0/-inf values as a mask).

A batch feature that overflowed to +inf sits among non-zero finite values
under a name such as ``input[0]``: it fails the last condition and stays a
``data`` event. When the tensor itself is gone (the deferred check runs after
a temporary mask was freed), only its probe is known, ``(min, max)``: it
must then be named as a mask, and the probe show one sign of infinity (the
other end of its range is then finite) and no NaN.

The verdict for a live tensor reads it once (one small host transfer on a
GPU), and is remembered for that tensor object while it is unchanged, so a
mask kept in a buffer or built once before the loop is read once per watch.
"""

from __future__ import annotations

import inspect
import math
import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nan_magic.hot.reads import is_checkable, read_probe, version_of

__all__ = ["DeliberateMasks", "argument_name", "is_additive_mask", "names_a_mask", "reduces_a_mask"]

#: ``mask`` anywhere; or an attention bias, the name a mask folded into a bias goes by (xformers' and MPT's
#: ``attn_bias``, ``attention_bias``, ``alibi``, ``alibi_bias``, T5's ``position_bias``, ``rel_pos_bias``).
_MASK_NAME = re.compile(r"mask|alibi|(attn|attention|position|pos)_bias", re.IGNORECASE)


def names_a_mask(name: str | None) -> bool:
    """Whether an argument or buffer name says it is a mask (``tgt_mask``, ``attn_mask``, ``causal_mask``), or an
    attention bias a mask may be folded into (``attn_bias``, ``alibi``, ``position_bias``)."""
    return name is not None and _MASK_NAME.search(name) is not None


def argument_name(module: nn.Module, argument: int | str | None) -> str | None:
    """The ``forward`` parameter name of an argument, given by its position or keyword (call_records.py).

    Positional arguments are named from the signature of ``module.forward``;
    ``None`` where the signature does not say (``*args``) or the argument is unknown.
    """
    if argument is None or isinstance(argument, str):
        return argument
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    index = argument
    if index < len(parameters) and parameters[index].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    ):
        return parameters[index].name
    return None


class DeliberateMasks:
    """The mask verdicts of one watch, and which masks were already reported as benign events."""

    def __init__(self) -> None:
        # id(tensor) -> (weak tensor, its version, verdict); a tensor's id may be reused after it dies.
        self._verdicts: dict[int, tuple[weakref.ref[torch.Tensor], int, bool]] = {}
        self._reported: set[tuple[str | None, str]] = set()
        # Tensors given as deliberate (:meth:`give`), by id: a replay's copies of what the watch judged so.
        self._given: dict[int, weakref.ref[torch.Tensor]] = {}

    def give(self, tensor: torch.Tensor) -> None:
        """Take ``tensor`` as a deliberate infinity whatever its values: a step replay's copy of an argument the watch
        judged deliberate where it was made (another watched model's output masked with -inf, replay/tiered)."""
        self._given[id(tensor)] = weakref.ref(tensor)

    def is_mask(self, tensor: torch.Tensor, name: str | None, first: bool = False) -> bool:
        """The rule of the module docstring, for a live tensor known to hold a non-finite value.

        ``first``: the tensor is the first positional argument (the batch).
        """
        given = self._given.get(id(tensor))
        if given is not None and given() is tensor:
            return True
        named = names_a_mask(name)
        if first and not named:
            return False
        entry = self._verdicts.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == version_of(tensor):
            return entry[2]
        verdict = _holds_a_mask(tensor, named)
        if len(self._verdicts) > 256:
            self._verdicts = {key: value for key, value in self._verdicts.items() if value[0]() is not None}
        self._verdicts[id(tensor)] = (weakref.ref(tensor), version_of(tensor), verdict)
        return verdict

    def probe_is_mask(self, low: float, high: float, name: str | None) -> bool:
        """The rule when only the probe ``(min, max)`` is left: named a mask, one sign, no NaN."""
        if math.isnan(low) or math.isnan(high) or not names_a_mask(name):
            return False
        return (low == -math.inf) != (high == math.inf)

    def buffers(self, module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """The module's floating buffers (recursively) that hold a non-finite value and are deliberate masks."""
        found = []
        for name, buffer in module.named_buffers():
            if not is_checkable(buffer):  # a meta or nested buffer has nothing to read (hot/reads.py)
                continue
            low, high = read_probe(buffer)
            if math.isfinite(low) and math.isfinite(high):
                continue
            if self.is_mask(buffer, name.rsplit(".", 1)[-1]):
                found.append((prefix + name, buffer))
        return found

    def first_sighting(self, module: str | None, tensor: str) -> bool:
        """True the first time a mask is seen at this place: it is recorded as one benign event per watch."""
        key = (module, tensor)
        if key in self._reported:
            return False
        self._reported.add(key)
        return True


def is_additive_mask(tensor: torch.Tensor) -> bool:
    """The rule of the module docstring for a tensor with no name to go by: 0 where attended, ±inf where not.

    For the op tracer (a tensor entering the traced code) and the loss code's
    data (outside/entering.py): no NaN, one sign of infinity, a finite element, and
    every finite element 0. A real tensor only; a sparse one is judged by its stored values (:func:`_holds_a_mask`).
    """
    if not is_checkable(tensor) or tensor.is_complex():
        return False
    return _holds_a_mask(tensor, named=False)


def opened_in_place(record: Any) -> bool:
    """Whether a batch tensor that entered with -inf and no NaN, no mask then (all -inf), was opened into one by
    the model in place before its consumer read it: a static KV cache's additive bias, ``bias[..., n] = 0`` at each
    decode step. Written since its probe, it now holds only 0 and -inf, and a 0 (every slot opened: all 0). Asked
    as the step that held it ends (hot/kept/held_batch.py): any other -inf batch is the event it was."""
    if record is None or "nan" in record.kinds or "+inf" in record.kinds or record.ref is None:
        return False
    tensor = record.ref()
    if tensor is None or version_of(tensor) == record.version or not is_checkable(tensor) or tensor.is_complex():
        return False
    with torch.no_grad():
        x = tensor.detach()
        zero = x == 0
        flags = torch.stack([(zero | (x == -math.inf)).all(), zero.any()]).tolist()
    return bool(flags[0] and flags[1])


def _stored(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The values ``tensor`` stores, and whether it has elements it does not store (a sparse tensor's zeros).

    A sparse COO tensor is coalesced first: a duplicate's values add up (-inf and +inf at one index are NaN). Only
    ops every sparse layout has: no comparison or reduction of the sparse tensor itself.
    """
    if tensor.layout is torch.strided:
        return tensor, False
    # CSR, CSC, BSR, BSC store each element once: their values as they are.
    values = tensor.coalesce().values() if tensor.layout is torch.sparse_coo else tensor.values()
    return values, values.numel() < tensor.numel()


def _holds_a_mask(tensor: torch.Tensor, named: bool) -> bool:
    with torch.no_grad():
        x, unstored = _stored(tensor.detach())  # a sparse bias: its stored values, the rest 0 (finite, attended)
        finite = torch.isfinite(x)
        # One transfer: [any NaN, any +inf, any -inf, any finite, any finite non-zero].
        flags = torch.stack([
            torch.isnan(x).any(), (x == math.inf).any(), (x == -math.inf).any(), finite.any(),
            (finite & (x != 0)).any(),
        ]).tolist()
    has_nan, has_posinf, has_neginf, has_finite, has_nonzero = flags
    if has_nan or has_posinf == has_neginf or not (has_finite or unstored):  # NaN, both signs or none, all infinite
        return False
    return named or not has_nonzero


#: Reductions whose -inf from deliberate -inf inputs means a whole row was masked (the module docstring).
_MASKED_REDUCTIONS = ("aten.logsumexp.",)
#: Reductions that add up what they are given: an infinity from a mask in their input is in their output.
_SUMS = ("aten.sum.", "aten.mean.", "aten.nansum.", "aten.nanmean.")


def reduces_a_mask(op: str, out_kinds: frozenset[str], output: torch.Tensor) -> bool:
    """Whether ``op``, given only benign infinities, is the producer of its infinities.

    A logsumexp over nothing (a fully masked row) is -inf; a sum or mean whose
    every result took in a masked position (label smoothing or an entropy
    over a vocabulary masked with -inf) has no finite value left to be a mask:
    the mask was added up instead of left out. A sum that leaves finite values
    (masks combined, ``torch.stack([causal, padding]).sum(0)``) is still a mask.
    """
    if "-inf" in out_kinds and op.startswith(_MASKED_REDUCTIONS):
        return True
    if not out_kinds or not op.startswith(_SUMS):
        return False
    with torch.no_grad():
        return not bool(torch.isfinite(output).any())


def selects_whole_rows(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether an index op selects whole rows of its source: it indexes leading dimensions only and leaves the last
    one whole (``logits[live]``, ``index_select(0, rows)``).

    A mask's rows it selects are still masks, each row as whole as it was: a softmax or logsumexp over them is
    judged as it would be on the mask itself (over a row masked entirely it is the producer). Any other consumer that
    makes a new kind of them names the selection (origins.Picked.whole_rows): a mask over time, not over the last
    dimension, has whole rows of -inf, and selecting a padded step is the fault. An index that reaches into the last
    dimension (``gather(-1, actions)``, ``trans[prev, cur]``) picks masked positions one by one.
    """
    source = args[0] if args else kwargs.get("self")
    if not isinstance(source, torch.Tensor) or source.dim() < 2:
        return False
    packet = func.overloadpacket.__name__
    if packet == "index_select":
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        return int(dim) % source.dim() != source.dim() - 1
    if packet not in ("index", "_unsafe_index"):
        return False
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    consumed = sum(
        index.dim() if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) else 1
        for index in indices
    )
    return consumed < source.dim()
