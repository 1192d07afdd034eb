"""The op tracer's origins known by memory hold only while that memory's storage lives (localize/ops/origins.py).

A forward value autograd saved reaches a backward op as a new Python object on the same memory, so the tracer
knows origins by memory as well as by identity. Once the storage is freed, the allocator hands its address to the
next tensor of that size, at version 0 as the noted one was: that tensor must not inherit the freed one's origin.
The suite failed on this once, in one full run only (``hunt15_batch_hard_triplet_sqrt_of_the_diagonal`` in
``mode="full"``): a bool mask the backward made, carrying a deliberate infinity's entry, was freed; the next mask,
at its address, made the sqrt's NaN benign, and the cause came out unclassified. Whether the address was reused
depended on the allocator's state (what the earlier tests, and the garbage collector, had freed).
A buffer two storages share (``torch.frombuffer``) gives the same address every time.
"""

from __future__ import annotations

import torch

from nan_magic.localize.ops.origins import BENIGN, OpFinding, Origin, Origins
from nan_magic.localize.ops.tracer import OpTracer


def test_a_freed_storages_address_lends_its_origin_to_no_later_tensor() -> None:
    buffer = bytearray(16)
    origins = Origins()
    first = torch.frombuffer(buffer, dtype=torch.float32)
    origins.note(first, BENIGN)
    address = first.untyped_storage().data_ptr()
    # A live alias (what autograd saves: another tensor object on the same storage) is found by memory.
    assert origins.entry(first.detach()) is BENIGN
    del first
    second = torch.frombuffer(buffer, dtype=torch.float32)  # a new storage at the freed one's address
    assert second.untyped_storage().data_ptr() == address and second._version == 0
    assert origins.memory_entry(second) is None
    assert origins.entry(second) is None


def test_an_origin_noted_by_memory_alone_goes_with_its_storage() -> None:
    with OpTracer() as tracer:
        made = torch.zeros(4) / torch.zeros(4)
    finding = tracer.origin_of(made)
    assert isinstance(finding, OpFinding) and finding.op == "aten.div.Tensor"
    buffer = bytearray(16)
    origins = Origins()
    saved = torch.frombuffer(buffer, dtype=torch.float32)
    origins.note_memory(saved, Origin(finding))  # a forward output's origin, by memory only
    found = origins.memory_entry(saved.detach())
    assert isinstance(found, Origin) and found.finding is finding
    del saved
    assert origins.memory_entry(torch.frombuffer(buffer, dtype=torch.float32)) is None
