"""What each rank of the distributed tests runs (spawned by tests/test_distributed.py).

A rank trains a tiny DDP model under a watch, catches whatever stops it,
and writes what its user would see (the error's class and message, the
report's fields) to ``out/rank<N>.json``. Only the module-level functions
here are spawned, so that ``torch.multiprocessing`` can import them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nan_magic
from nan_magic.fixes import runner

#: The step at which the faults below fire.
FAULT_STEP = 3


class LogLayer(nn.Module):
    """log of a shifted input; ``offset`` < -|x| makes it NaN (set on one rank only: not a buffer DDP syncs)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.abs() + self.offset)  # producer: log


class Root(nn.Module):
    """sqrt(gate * x**2): finite forward for any gate; with gate 0 its backward is inf * 0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.gate * x * x + 0.0)  # producer: sqrt


def tiny_model(middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), middle, nn.Linear(8, 1))


def init(rank: int, world: int, port: int) -> None:
    # Each spawned rank's fix trials get the time conftest.py's ``unhurried_fix_trials`` gives them in-process: their
    # budget is wall time, and a loaded CI machine must not leave untried a remedy a test expects verified.
    runner.MIN_BUDGET = 600.0
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )


def describe(error: BaseException | None) -> dict[str, Any]:
    """What the user sees of the error that stopped a rank, as JSON."""
    if error is None:
        return {"error": None}
    seen: dict[str, Any] = {"error": type(error).__name__, "message": str(error)}
    report = getattr(error, "report", None)
    if report is not None:
        seen["report"] = {
            "phase": str(report.phase), "module": report.module, "module_type": report.module_type,
            "op": report.op, "step": report.step, "rank": report.rank, "world_size": report.world_size,
            "tensor": report.to_dict()["tensor"], "notes": list(report.notes), "text": report.to_text(),
            "fixes": [[trial.kind, trial.finite, trial.untried] for trial in report.fixes],
        }
        seen["json_rank"] = json.loads(report.to_json())["rank"]
    local = getattr(error, "local_report", None)
    seen["local_tensor"] = local.to_dict()["tensor"] if local is not None else None
    seen["local_module"] = [local.module, local.module_type] if local is not None else None
    return seen


#: The runs every rank makes, in order, in one process group (one process start for all of them).
SCENARIOS = (
    "forward_rank1", "backward_rank0", "data_rank1", "fsdp2_forward_rank1", "fsdp1_forward_rank1",
    "fsdp1_flat_forward_rank1",
)

#: Runs of the agreement's edges: a GradScaler's skips, an exception exit, an optimizer of one rank.
AGREEMENT_EDGES = ("scaler_collapse", "after_an_exception", "probe_optimizer")

#: Runs whose event is judged between two optimizer steps' agreements (between_points).
BETWEEN_POINTS = (
    "accumulation_rank1", "immediate_rank1", "last_step_rank1", "inference_rank1", "ddp_inference_rank1",
    "ddp_grad_inference_rank1",
)


def run_all(rank: int, world: int, port: int, out: str) -> None:
    """Every faulty scenario, then the healthy comparison, in one process group."""
    init(rank, world, port)
    for scenario in SCENARIOS:
        train(rank, world, scenario, out)
    for scenario in BETWEEN_POINTS:
        between_points(rank, scenario, out)
    scaler_collapse(rank, out)
    after_an_exception(rank, out)
    probe_optimizer(rank, out)
    healthy(rank, out)
    leave()


def last_rank_fails(rank: int, world: int, port: int, out: str) -> None:
    """A forward fault on the last rank of a larger group (the 4-process test)."""
    init(rank, world, port)
    train(rank, world, "forward_last_rank", out)
    leave()


class InfiniteGradient(torch.autograd.Function):
    """Identity forward; its backward makes every gradient infinite, at any GradScaler scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")  # producer: infinite gradient


class Overflowing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(InfiniteGradient.apply(self.a(x)))


def scaler_collapse(rank: int, out: str) -> None:
    """A GradScaler skipping every step under DDP: no optimizer step ever runs, yet every rank must stop.

    The skipped ``scaler.step`` is an agreement point: the ranks stop at the
    collapse (15 skips in a row), not at the end of the loop.
    """
    torch.manual_seed(0)
    model = DistributedDataParallel(Overflowing())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    error: BaseException | None = None
    started, steps = time.monotonic(), 0
    try:
        with nan_magic.watch(model, opt, scaler):
            for _step in range(40):
                opt.zero_grad()
                scaler.scale(model(torch.randn(2, 4)).sum()).backward()
                scaler.step(opt)
                scaler.update()
                steps += 1
    except Exception as caught:
        error = caught
    record(rank, "scaler_collapse", out, error, steps, started)


def after_an_exception(rank: int, out: str) -> None:
    """Rank 1 leaves a first watch by an error of its own; a second watch must still agree, and at once.

    Every exit of a watch whose ranks step together takes part in one round
    through the store; rank 1's exception exit counts itself in without
    waiting, so rank 0 neither waits for it nor loses count of the rounds.
    """
    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_model(LogLayer()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(last_lr: float | None = None) -> None:
        for step in range(3):
            if last_lr is not None and step == 2:
                opt.param_groups[0]["lr"] = last_lr
            opt.zero_grad()
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()

    started = time.monotonic()
    try:
        with nan_magic.watch(model, opt):
            train()
            if rank == 1:
                raise ValueError("rank 1's own bookkeeping failed")
    except ValueError:
        pass
    first_exit = time.monotonic() - started
    error: BaseException | None = None
    try:
        with nan_magic.watch(model, opt):
            train(last_lr=float("inf") if rank == 1 else None)
    except Exception as caught:
        error = caught
    record(rank, "after_an_exception", out, error, 3, started, first_exit_seconds=first_exit)


def probe_optimizer(rank: int, out: str) -> None:
    """Rank 0 alone also steps a small probe's optimizer inside the watch: no collective may wait for rank 1."""
    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_model(LogLayer()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = nn.Linear(1, 1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.01)
    error: BaseException | None = None
    started, steps = time.monotonic(), 0
    try:
        with nan_magic.watch(model, opt):
            for _step in range(3):
                opt.zero_grad()
                output = model(torch.randn(2, 4))
                output.pow(2).mean().backward()
                opt.step()
                if rank == 0:
                    probe_opt.zero_grad()
                    probe(output.detach()).pow(2).mean().backward()
                    probe_opt.step()
                steps += 1
    except Exception as caught:
        error = caught
    record(rank, "probe_optimizer", out, error, steps, started)


def inference_before_the_process_group(rank: int, world: int, port: int, out: str) -> None:
    """The watch is entered before the process group starts (as ``python -m nan_magic run`` does); inference."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    middle = LogLayer()
    model = tiny_model(middle)
    error: BaseException | None = None
    started, steps = time.monotonic(), 0
    try:
        with nan_magic.watch(model):
            init(rank, world, port)
            for step in range(40):
                if rank == 1 and step == 0:
                    middle.offset = -100.0  # type: ignore[assignment]
                if rank == 0:
                    time.sleep(0.2)
                with torch.no_grad():
                    model(torch.randn(2, 4))
                steps += 1
    except Exception as caught:
        error = caught
    record(rank, "before_the_process_group", out, error, steps, started)
    leave()


def crash_after_event(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1's held event breaks ``torch.multinomial`` in its loop, and rank 1 exits.

    Rank 0 is then inside DDP's gradient all-reduce, waiting for rank 1: gloo
    fails it when rank 1's process ends, and rank 0 must name rank 1's event.
    """
    init(rank, world, port)
    torch.manual_seed(0)
    middle = LogLayer()
    model = DistributedDataParallel(tiny_model(middle))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    error: BaseException | None = None
    started = time.monotonic()
    steps = 0
    try:
        with nan_magic.watch(model, opt):
            for step in range(6):
                if rank == 1 and step == FAULT_STEP:
                    middle.offset = -100.0
                opt.zero_grad()
                out_ = model(torch.randn(2, 4))
                torch.multinomial(out_.abs().reshape(1, -1), 1)  # raises on rank 1's NaN
                out_.pow(2).mean().backward()
                opt.step()
                steps += 1
    except Exception as caught:
        error = caught
    seen = describe(error)
    seen.update(rank=rank, steps=steps, seconds=time.monotonic() - started)
    seen["cause"] = type(error.__cause__).__name__ if error is not None and error.__cause__ is not None else None
    with open(os.path.join(out, f"crash.rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(seen, handle)
    # Rank 1's process ends (gloo closes its connections); rank 0 serves the store and leaves last.
    time.sleep(1 if rank == 0 else 0)
    os._exit(0)


def leave() -> None:
    """End this rank once every result is written, without tearing the process group down.

    gloo's teardown after the failed steps' collectives now and then aborts the
    process ("terminate called without an active exception", SIGABRT: about one
    run in six), after the results are on disk; it is the harness's exit, not
    what the tests check, so the ranks agree to stop and leave at once.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, world: int, scenario: str, out: str) -> None:
    """One rank of a faulty run; ``scenario`` says which rank fails where."""
    middle: nn.Module = Root() if scenario == "backward_rank0" else LogLayer()
    model: nn.Module
    if scenario.startswith("fsdp2"):
        # FSDP2 on CPU/gloo: the middle block is sharded on its own, inside the sharded root.
        model = fully_shard(tiny_model(fully_shard(middle)))
    elif scenario.startswith("fsdp1"):
        # FSDP1 on CPU/gloo needs device_id=cpu (without it: "FSDP needs a non-CPU accelerator device").
        # The middle block is wrapped on its own, inside the wrapped root; "flat": use_orig_params=False,
        # the optimizer then steps FlatParameters, each holding several of the user's parameters.
        fsdp1 = functools.partial(
            FullyShardedDataParallel, device_id=torch.device("cpu"), use_orig_params="flat" not in scenario)
        model = fsdp1(tiny_model(fsdp1(middle)))
    else:
        model = DistributedDataParallel(tiny_model(middle))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    if scenario == "data_rank1":
        # DistributedSampler without shuffling gives rank 1 the odd indices: step 3's batch holds 13 and 15.
        data[13, 2] = float("nan")
    loader = DataLoader(TensorDataset(data), batch_size=2, sampler=DistributedSampler(
        TensorDataset(data), num_replicas=world, rank=rank, shuffle=False))
    error: BaseException | None = None
    started = time.monotonic()
    steps = 0
    try:
        # FSDP2: a replay would run a sharded module again on one rank alone (see test_distributed.py).
        # FSDP1 with use_orig_params=True is watched with op-level tracing (ops=True): it names the op, replay or not.
        with nan_magic.watch(model, opt, ops=scenario == "fsdp1_forward_rank1"):
            for step, (x,) in enumerate(loader):
                failing = world - 1 if scenario == "forward_last_rank" else 1
                if step == FAULT_STEP and scenario.endswith(("forward_rank1", "forward_last_rank")) and rank == failing:
                    middle.offset = -100.0  # type: ignore[assignment]
                if step == FAULT_STEP and scenario == "backward_rank0" and rank == 0:
                    middle.gate = 0.0  # type: ignore[assignment]
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                steps += 1
    except Exception as caught:  # the rank stays alive, as in a notebook
        error = caught
    record(rank, scenario, out, error, steps, started)


def record(
    rank: int, scenario: str, out: str, error: BaseException | None, steps: int, started: float, **extra: Any
) -> None:
    """Write what stopped this rank (and ``extra``), then meet the other ranks before the next scenario."""
    seen = describe(error)
    seen.update(rank=rank, steps=steps, seconds=time.monotonic() - started, **extra)
    if error is not None and error.__cause__ is not None:
        seen["cause"] = type(error.__cause__).__name__
    with open(os.path.join(out, f"{scenario}.rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(seen, handle)
    # Each rank stays alive after its error (as in a notebook): the next collective must not find
    # another rank still inside a collective of the failed step (that would hang, or abort gloo).
    dist.barrier()


def between_points(rank: int, scenario: str, out: str) -> None:
    """A fault on rank 1 judged between two optimizer steps' agreements; every rank must still stop.

    ``accumulation_rank1``: two micro-batches a step (DDP's ``no_sync`` on the
    first); the first micro-batch's forward fault is judged when the second
    starts. ``immediate_rank1``: ``defer=False``, checks judged mid-forward.
    ``last_step_rank1``: rank 1's last optimizer step makes its parameters
    inf (an infinite learning rate there only), judged at the watch's exit.
    ``inference_rank1``: each rank evaluates its own copy (no DDP, no
    optimizer). ``ddp_inference_rank1``: a DDP model evaluated under
    ``no_grad`` without an optimizer; ``ddp_grad_inference_rank1``: one with
    a BatchNorm (buffers) evaluated with gradients, whose every forward then
    syncs its buffers with the other ranks.
    """
    torch.manual_seed(0)
    middle = LogLayer()
    inner = tiny_model(middle)
    if scenario == "ddp_grad_inference_rank1":
        inner.insert(2, nn.BatchNorm1d(8))  # after the LogLayer: it stays module "1"
    inference = scenario.endswith("inference_rank1")
    no_grad = scenario != "ddp_grad_inference_rank1"
    model: nn.Module = inner if scenario == "inference_rank1" else DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    targets: tuple[Any, ...] = (model,) if inference else (model, opt)
    generator = torch.Generator().manual_seed(3 + rank)
    error: BaseException | None = None
    started = time.monotonic()
    steps = 0
    # Each rank evaluating its own copy runs on its own clock: rank 0's 40 paced steps leave rank 1 ample time.
    last = 40 if scenario == "inference_rank1" else 5
    try:
        with nan_magic.watch(*targets, defer=False if scenario == "immediate_rank1" else None):
            for step in range(last + 1):
                if rank == 1 and step == FAULT_STEP and scenario != "last_step_rank1":
                    middle.offset = -100.0
                if rank == 1 and step == last and scenario == "last_step_rank1":
                    opt.param_groups[0]["lr"] = float("inf")
                if inference:
                    if rank == 0:
                        time.sleep(0.2)  # its own work; no collective keeps the ranks in step
                    with torch.no_grad() if no_grad else contextlib.nullcontext():
                        model(torch.randn(2, 4, generator=generator))
                    steps += 1
                    continue
                opt.zero_grad()
                if scenario == "accumulation_rank1":
                    with model.no_sync():  # type: ignore[operator]
                        model(torch.randn(2, 4, generator=generator)).pow(2).mean().backward()
                model(torch.randn(2, 4, generator=generator)).pow(2).mean().backward()
                opt.step()
                steps += 1
    except Exception as caught:
        error = caught
    record(rank, scenario, out, error, steps, started)


def healthy(rank: int, out: str) -> None:
    """30 steps of the same DDP run with and without a watch: the parameters must be bit-identical."""
    results = []
    for watched in (False, True):
        model = DistributedDataParallel(tiny_model(LogLayer()))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(10 + rank)
        with nan_magic.watch(model, opt) if watched else _nothing():
            for _step in range(30):
                opt.zero_grad()
                model(torch.randn(4, 4, generator=generator)).pow(2).mean().backward()
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*results))
    with open(os.path.join(out, f"healthy.rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"rank": rank, "identical": same, "params": len(results[0])}, handle)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
