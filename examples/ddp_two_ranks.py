"""Two DDP ranks on the CPU; rank 1's batch goes NaN at step 3 and both ranks stop there.

``python examples/ddp_two_ranks.py`` spawns two processes (gloo, 127.0.0.1). Each trains the
same small model under ``nan_magic.watch``; at step 3 rank 1 feeds a batch holding a NaN. Rank 1
raises ``NonFiniteError`` (phase ``data``), rank 0 ``PeerNonFiniteError`` naming rank 1, and both
print their report's first lines: the same event, seen from each rank. Neither waits for the
process group's timeout.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nan_magic

FAULT_STEP = 3


def rank_main(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    try:
        with nan_magic.watch(model, opt):
            for step in range(10):
                batch = torch.randn(4, 8, generator=generator)
                if rank == 1 and step == FAULT_STEP:
                    batch[2, 5] = float("nan")  # a bad sample on rank 1 only
                opt.zero_grad()
                model(batch).pow(2).mean().backward()
                opt.step()
    except nan_magic.NonFiniteError as error:  # PeerNonFiniteError is one too
        report = error.report
        lines = "\n".join(f"    {line}" for line in report.to_text().splitlines()[:8])
        if isinstance(error, nan_magic.PeerNonFiniteError):
            lines += f"\n    note: {report.notes[-1]}"  # how the event reached this rank
        print(f"[rank {rank}] {type(error).__name__}: {error}\n{lines}\n", flush=True)
    dist.barrier()  # both ranks are here: neither is left inside a collective
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(rank_main, args=(port,), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
