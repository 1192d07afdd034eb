"""DDP under a watch: every rank stops at one rank's event, named on every rank (issue 18).

Two processes on gloo, CPU, 127.0.0.1 (tests/distributed_worker.py). Every
scenario runs in one process group, one after the other, so the processes
start once; each rank stays alive after its error, as in a notebook, and
meets the others at a barrier before the next scenario, which would hang (and
fail here, at the join's deadline) if any rank were left inside a collective.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import distributed_worker as worker
import pytest
import torch
import torch.multiprocessing as mp
from faults import marked_line

from nan_magic.records import TensorRef

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

#: A hang fails the test at this deadline, well before the process group's own timeout would matter to CI.
JOIN_DEADLINE_S = 120

ROOT = Path(__file__).resolve().parents[1]
#: The parameter gradient the workers report, as its JSON form (to_dict) holds it.
_GRADIENT = {"role": "parameter gradient", "name": "0.weight", "path": "", "before": False}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn(function, world: int, out: Path) -> None:
    """Run ``function(rank, world, port, out)`` on ``world`` processes; a rank alive at the deadline fails the test."""
    context = mp.start_processes(
        function, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + JOIN_DEADLINE_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"a rank hung: not finished after {JOIN_DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """What each of two ranks saw in each scenario: ``seen[scenario][rank]``."""
    out = tmp_path_factory.mktemp("ddp")
    spawn(worker.run_all, 2, out)
    return {
        scenario: [json.loads((out / f"{scenario}.rank{rank}.json").read_text()) for rank in range(2)]
        for scenario in (*worker.SCENARIOS, *worker.BETWEEN_POINTS, *worker.AGREEMENT_EDGES, "healthy")
    }


def test_forward_fault_on_rank_1_stops_both_ranks_and_rank_0_names_rank_1(ranks):
    rank0, rank1 = ranks["forward_rank1"]
    assert rank1["error"] == "NonFiniteError"
    assert rank1["report"]["rank"] == 1 and rank1["report"]["world_size"] == 2
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == "rank 1 found a non-finite value at step 3: forward, 1 (LogLayer), aten.log.default"
    for seen in (rank0, rank1):
        # Both stopped at the fault's step, within seconds (no wait for the process group's timeout).
        assert seen["steps"] == worker.FAULT_STEP
        assert seen["seconds"] < 20
        report = seen["report"]
        assert (report["phase"], report["module"], report["module_type"], report["op"], report["step"]) == (
            "forward", "1", "LogLayer", "aten.log.default", worker.FAULT_STEP)
        assert f"distributed_worker.py:{marked_line('log', where=worker)}" in report["text"]
        assert re.search(r"^\s*rank\s+1 of 2$", report["text"], re.MULTILINE)
        assert seen["json_rank"] == 1
    # The fix trials ran on rank 1 alone: DDP's module replayed on copies needs no collective (test_fix_trials_...).
    assert ["eps", True, None] in rank1["report"]["fixes"]
    assert not any(note.startswith("no fix was tried") for note in rank1["report"]["notes"])
    # Rank 0's own gradients went NaN only through DDP's all-reduce; its report says so.
    assert rank0["local_tensor"] == _GRADIENT
    assert rank0["local_module"] == ["0", "Linear"]  # found by the user's name, which DDP's module tree lacks
    assert "rank 0 received it through the gradient all-reduce" in rank0["report"]["notes"][-1]


def test_backward_fault_on_rank_0_is_named_on_every_rank_as_rank_0s(ranks):
    rank0, rank1 = ranks["backward_rank0"]
    assert rank0["error"] == "NonFiniteError"
    assert rank1["error"] == "PeerNonFiniteError"
    assert rank1["message"] == "rank 0 found a non-finite value at step 3: backward, 1 (Root), aten.div.Tensor"
    for seen in (rank0, rank1):
        assert seen["steps"] == worker.FAULT_STEP
        report = seen["report"]
        assert (report["rank"], report["phase"], report["module"], report["module_type"]) == (
            0, "backward", "1", "Root")
    # Rank 1 saw the all-reduced NaN gradient, under the user's parameter name (no "module." of DDP).
    assert rank1["local_tensor"] == _GRADIENT
    assert rank1["report"]["notes"][-1].startswith("rank 1 received it through the gradient all-reduce")


def test_nan_batch_on_rank_1_is_data_there_and_named_on_rank_0(ranks):
    rank0, rank1 = ranks["data_rank1"]
    assert rank1["error"] == "NonFiniteError"
    seen = (rank1["report"]["phase"], TensorRef(**rank1["report"]["tensor"]))
    assert seen == ("data", TensorRef.argument("input[0]"))
    # The root is named as the user's model, not as DDP's wrapper.
    assert rank1["report"]["module_type"] == "Sequential"
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == "rank 1 found a non-finite value at step 3: data, Sequential (root)"
    assert rank0["steps"] == rank1["steps"] == worker.FAULT_STEP


LOG_AT_FAULT_STEP = (
    f"rank 1 found a non-finite value at step {worker.FAULT_STEP}: forward, 1 (LogLayer), aten.log.default"
)


@pytest.mark.parametrize("scenario", ["accumulation_rank1", "immediate_rank1"])
def test_an_event_judged_between_optimizer_steps_waits_for_the_next_one_and_every_rank_stops_there(ranks, scenario):
    # accumulation: judged when the next micro-batch starts; immediate (defer=False): judged mid-forward.
    # Either way rank 1 goes on to the optimizer step, where both ranks stop before it is taken.
    rank0, rank1 = ranks[scenario]
    assert rank1["error"] == "NonFiniteError"
    assert (rank1["report"]["phase"], rank1["report"]["module"], rank1["report"]["op"]) == (
        "forward", "1", "aten.log.default")
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == LOG_AT_FAULT_STEP
    for seen in (rank0, rank1):
        assert seen["steps"] == worker.FAULT_STEP
        assert seen["seconds"] < 20


def test_the_last_steps_parameters_judged_at_the_exit_stop_every_rank_there(ranks):
    rank0, rank1 = ranks["last_step_rank1"]
    assert rank1["error"] == "NonFiniteError"
    assert (rank1["report"]["phase"], rank1["report"]["step"]) == ("optimizer", 5)
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"].startswith("rank 1 found a non-finite value at step 5: optimizer")
    # Rank 0's own parameters are finite: only rank 1's learning rate was infinite.
    assert rank0["local_tensor"] is None
    for seen in (rank0, rank1):
        assert seen["steps"] == 6  # the loop ended; the exit judged the last step
        assert seen["seconds"] < 20


def test_inference_on_each_rank_stops_the_other_ranks_through_the_stop_channel(ranks):
    rank0, rank1 = ranks["inference_rank1"]
    assert rank1["error"] == "NonFiniteError"
    assert rank1["steps"] == worker.FAULT_STEP
    # No optimizer step lets the ranks meet: rank 0 reads the stop channel after each of its steps.
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == LOG_AT_FAULT_STEP
    assert rank0["steps"] < 40
    assert rank0["report"]["notes"][-1] == "rank 0 saw no non-finite value of its own at this step"


def test_a_ddp_model_evaluated_under_no_grad_stops_its_rank_at_once_and_the_other_soon_after(ranks):
    # Under no_grad DDP's forward runs no collective: rank 1 stops at its step, rank 0 reads the stop
    # channel after its next step, or at the watch's exit, where every rank of a DDP model meets.
    rank0, rank1 = ranks["ddp_inference_rank1"]
    assert (rank1["error"], rank1["steps"]) == ("NonFiniteError", worker.FAULT_STEP)
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == LOG_AT_FAULT_STEP
    assert rank0["seconds"] < 20


def test_a_ddp_model_syncing_its_buffers_stops_every_rank_at_the_watchs_exit(ranks):
    # Evaluated with gradients, DDP syncs the BatchNorm's buffers at every forward: rank 1 must not stop
    # alone mid-loop (rank 0 would wait in that sync), so its event waits for the exit, where both stop.
    rank0, rank1 = ranks["ddp_grad_inference_rank1"]
    assert rank1["error"] == "NonFiniteError"
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == LOG_AT_FAULT_STEP
    assert rank0["steps"] == rank1["steps"] == 6


def test_a_rank_that_stops_alone_and_exits_is_named_by_the_others(tmp_path):
    # Rank 1 held its forward event for the optimizer step, but its loop's torch.multinomial broke on
    # the NaN first: it raises its event from that error, posts it, and exits. Rank 0, waiting in
    # DDP's all-reduce, gets gloo's error and names rank 1's event from it.
    spawn(worker.crash_after_event, 2, tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"crash.rank{rank}.json").read_text()) for rank in range(2))
    assert (rank1["error"], rank1["cause"]) == ("NonFiniteError", "RuntimeError")
    assert rank1["message"].startswith("first non-finite value in forward step 3: 1 (LogLayer), op aten.log.default")
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == LOG_AT_FAULT_STEP
    assert rank0["cause"] in ("DistBackendError", "RuntimeError")
    assert rank0["steps"] == rank1["steps"] == worker.FAULT_STEP
    assert rank0["seconds"] < 20


def test_a_collapsing_grad_scaler_stops_every_rank_at_the_collapse_not_at_the_end_of_the_loop(ranks):
    # No optimizer step ever runs: the skipped scaler.step is where the ranks agree.
    seen = ranks["scaler_collapse"]
    assert sorted(rank["error"] for rank in seen) == ["NonFiniteError", "PeerNonFiniteError"]
    for rank in seen:
        assert rank["steps"] == 14  # the 15th skip in a row, of 40 iterations
        assert "grad-scaler-collapse" in rank["report"]["text"]
        assert rank["seconds"] < 20


def test_a_rank_leaving_a_watch_by_its_own_error_neither_delays_nor_confuses_the_next_watch(ranks):
    rank0, rank1 = ranks["after_an_exception"]
    # The first watch: rank 0 left normally, without waiting for rank 1, which left by its ValueError.
    assert rank0["first_exit_seconds"] < 5
    # The second: rank 1's last step made its parameters inf; both ranks stop at the exit's round.
    assert rank1["error"] == "NonFiniteError"
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"].startswith("rank 1 found a non-finite value at step 2: optimizer")
    assert rank0["seconds"] < 10


def test_an_optimizer_only_one_rank_steps_is_no_agreement_point(ranks):
    # Rank 0's probe optimizer steps a module of its own: a collective there would wait for rank 1 forever.
    for rank in ranks["probe_optimizer"]:
        assert (rank["error"], rank["steps"]) == (None, 3)
        assert rank["seconds"] < 20


def test_a_watch_entered_before_the_process_group_still_hears_of_another_ranks_event(tmp_path):
    # As `python -m nan_magic run` does: the watch starts first. Rank 1 fails at its first step.
    spawn(worker.inference_before_the_process_group, 2, tmp_path)
    rank0, rank1 = (
        json.loads((tmp_path / f"before_the_process_group.rank{rank}.json").read_text()) for rank in range(2)
    )
    assert (rank1["error"], rank1["steps"]) == ("NonFiniteError", 0)
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == "rank 1 found a non-finite value at step 0: forward, 1 (LogLayer), aten.log.default"
    assert rank0["steps"] < 40


def test_healthy_ddp_run_is_bit_identical_to_the_unwatched_run(ranks):
    for seen in ranks["healthy"]:
        assert seen["params"] == 4
        assert seen["identical"] is True


def test_four_ranks_all_stop_at_rank_3s_forward_fault(tmp_path):
    spawn(worker.last_rank_fails, 4, tmp_path)
    seen = [json.loads((tmp_path / f"forward_last_rank.rank{rank}.json").read_text()) for rank in range(4)]
    assert [rank["error"] for rank in seen] == ["PeerNonFiniteError"] * 3 + ["NonFiniteError"]
    for rank in seen[:3]:
        assert rank["message"] == "rank 3 found a non-finite value at step 3: forward, 1 (LogLayer), aten.log.default"
    assert {rank["steps"] for rank in seen} == {worker.FAULT_STEP}
    assert {rank["report"]["world_size"] for rank in seen} == {4}


TRAIN_SCRIPT = '''
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()


class LogLayer(nn.Module):
    offset = 2.0

    def forward(self, x):
        return torch.log(x.abs() + self.offset)


torch.manual_seed(0)
middle = LogLayer()
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), middle, nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    if step == 2 and rank == 1:
        middle.offset = -100.0
    opt.zero_grad()
    model(torch.randn(4, 4)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
'''

SUMMARY = "nan_magic: 2 ranks: rank 1 found a non-finite value at step 2: forward, 1 (LogLayer), aten.log.default"


def run_cli_ranks(tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """``python -m nan_magic run`` on two ranks, in torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    port = str(free_port())
    launched = [
        subprocess.Popen(
            [sys.executable, "-m", "nan_magic", "run", "--json", str(tmp_path / "report.json"), str(script)],
            env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]
    results = []
    try:
        for process in launched:
            out, err = process.communicate(timeout=JOIN_DEADLINE_S)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in launched:
            process.kill()
    return results


def test_cli_every_rank_exits_1_writes_its_own_report_and_rank_0_sums_up(tmp_path):
    rank0, rank1 = run_cli_ranks(tmp_path)
    assert (rank0.returncode, rank1.returncode) == (1, 1), rank0.stderr + rank1.stderr
    assert SUMMARY in rank0.stderr.splitlines()
    # the full report
    assert "first non-finite value in forward step 2: 1 (LogLayer), op aten.log.default" in rank0.stderr
    assert f"nan_magic: rank 1 stopped: {SUMMARY.split(': ', 2)[2]}" in rank1.stderr.splitlines()
    assert SUMMARY not in rank1.stderr
    for rank in range(2):
        written = json.loads((tmp_path / f"report.rank{rank}.json").read_text())
        assert (written["rank"], written["world_size"], written["module"], written["step"]) == (1, 2, "1", 2)
    assert not (tmp_path / "report.json").exists()


def test_cli_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # torchrun itself: ``python -m torch.distributed.run`` is what the torchrun command runs.
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "nan_magic", "run", str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=JOIN_DEADLINE_S,
    )
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert SUMMARY in output.splitlines()
    # torchrun's own summary: the first rank to exit did so with status 1 (the others may then get its SIGTERM).
    assert re.search(r"exitcode\s*: 1 ", output)


def test_fsdp1_forward_fault_on_rank_1_is_named_by_the_users_names(ranks):
    # FSDP1 (FullyShardedDataParallel, device_id=cpu on gloo), the middle block wrapped on its own, watched
    # with ops=True: the op is named without a replay (which FSDP's sharded forward rules out).
    rank0, rank1 = ranks["fsdp1_forward_rank1"]
    assert rank1["error"] == "NonFiniteError"
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == "rank 1 found a non-finite value at step 3: forward, 1 (LogLayer), aten.log.default"
    for seen in (rank0, rank1):
        assert seen["steps"] == worker.FAULT_STEP
        assert seen["seconds"] < 20
        report = seen["report"]
        # "1", not "_fsdp_wrapped_module.1._fsdp_wrapped_module"; LogLayer, not FullyShardedDataParallel.
        assert (report["phase"], report["module"], report["module_type"], report["op"], report["step"]) == (
            "forward", "1", "LogLayer", "aten.log.default", worker.FAULT_STEP)
        assert (report["rank"], report["world_size"]) == (1, 2)
        assert f"distributed_worker.py:{marked_line('log', where=worker)}" in report["text"]
        assert "_fsdp_wrapped_module" not in report["text"]
    # ops=True tries the remedies on a replay of the failing call, which FSDP's sharded forward rules out on one rank.
    assert rank1["report"]["fixes"] == [] and rank1["report"]["notes"] == [
        "no fix was tried under a process group of 2 ranks: the model is sharded by FSDP (its forward gathers "
        "parameters from every rank), and the other ranks are not replaying"]
    # Rank 0's own view: its shard of 0.weight's gradient (a view of the flat shard), under the user's names.
    assert rank0["local_tensor"] == _GRADIENT
    assert rank0["local_module"] == ["0", "Linear"]
    assert rank0["report"]["notes"][-1].startswith("rank 0 received it through the gradient all-reduce (or FSDP's")


@pytest.mark.parametrize("scenario", ["fsdp2_forward_rank1", "fsdp1_flat_forward_rank1"])
def test_a_sharded_models_fault_is_named_by_the_users_class_and_parameter_names(ranks, scenario):
    # FSDP2 (fully_shard makes the class FSDPLogLayer) and FSDP1 with use_orig_params=False (the optimizer
    # steps FlatParameters, "_fsdp_wrapped_module._flat_param", rank 0's shard holding 25 of 0.weight's 32
    # elements). The default (tiered) watch: a replay would run a sharded module again on one rank alone,
    # and its forward gathers parameters from every rank, so the module is named and the op is not.
    rank0, rank1 = ranks[scenario]
    assert rank1["error"] == "NonFiniteError"
    assert rank0["error"] == "PeerNonFiniteError"
    assert rank0["message"] == "rank 1 found a non-finite value at step 3: forward, 1 (LogLayer)"
    assert rank0["steps"] == rank1["steps"] == worker.FAULT_STEP
    # Rank 0's own view: its shard of a gradient that the reduce-scatter made NaN, by its user's name.
    assert rank0["local_tensor"] == _GRADIENT
    assert rank0["local_module"] == ["0", "Linear"]
    assert "_flat_param" not in rank0["report"]["text"]


# -- without processes: names, paths, and the report's rank in every rendering ---------------------


def test_a_flat_parameter_is_placed_as_the_parameter_its_non_finite_element_belongs_to_in_its_module():
    from torch import nn
    from torch.distributed.fsdp._flat_param import ParamInfo, _ShardParamInfo

    from nan_magic.distributed.ranks import ParameterPlace, parameter_place

    # What FSDP1 registers on a wrapped block "1" with use_orig_params=False: this rank's shard of the
    # concatenated lin.weight (elements 2..7 here) and lin.bias (both), found by its _param_infos and offsets.
    block = nn.Module()
    block.lin = nn.Linear(2, 2)
    flat = nn.Parameter(torch.zeros(9))
    flat._param_infos = (  # type: ignore[attr-defined]
        ParamInfo("weight", block.lin, "lin"), ParamInfo("bias", block.lin, "lin"))
    flat._shard_param_infos = (  # type: ignore[attr-defined]
        _ShardParamInfo(True, 0, 6, 2, 7), _ShardParamInfo(True, 6, 2, 0, 1))
    block.register_parameter("_flat_param", flat)
    model = nn.Sequential(nn.Linear(2, 2), block)
    values = torch.zeros(9)
    values[7] = float("nan")
    assert parameter_place("1._flat_param", [model], values) == ParameterPlace("1.lin.bias", "1.lin")
    values[3] = float("inf")
    assert parameter_place("1._flat_param", [model], values) == ParameterPlace("1.lin.weight", "1.lin")
    # The padding, or a finite tensor, leaves the flat parameter, held by the wrapped block.
    assert parameter_place("1._flat_param", [model], torch.zeros(9)) == ParameterPlace("1._flat_param", "1")
    padded = torch.zeros(9)
    padded[8] = float("nan")
    assert parameter_place("1._flat_param", [model], padded) == ParameterPlace("1._flat_param", "1")
    # Every other parameter is placed by the module it is registered on; a name in no model has no place.
    assert parameter_place("0.weight", [model], values) == ParameterPlace("0.weight", "0")
    assert parameter_place("param_groups[0][1]", [model], values) is None


def test_a_parameter_is_placed_in_the_module_it_is_registered_on_under_ddp_and_when_shared():
    from torch import nn

    from nan_magic.distributed.ranks import ParameterPlace, parameter_place

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))

    block = nn.Module()
    block.attn = Attention()
    model = nn.Module()
    model.block = nn.ModuleList([block])
    model.scale = nn.Parameter(torch.ones(1))
    model.head = nn.Linear(2, 2)
    model.tied = nn.Linear(2, 2)
    model.tied.weight = model.head.weight  # tied: named_parameters() names it by its first module only
    assert parameter_place("block.0.attn.w", [model], None) == ParameterPlace("block.0.attn.w", "block.0.attn")
    assert parameter_place("scale", [model], None) == ParameterPlace("scale", "")
    assert parameter_place("head.weight", [model], None) == ParameterPlace("head.weight", "head")
    assert parameter_place("tied.weight", [model], None) is None
    # A data-parallel wrapper's "module." is no part of the user's names (DataParallel: DDP needs a process group).
    wrapped = nn.DataParallel(model)
    assert parameter_place("block.0.attn.w", [wrapped], None) == ParameterPlace("block.0.attn.w", "block.0.attn")
    assert parameter_place("block.0.attn.w", [nn.Sequential()], None) is None


def test_wrapper_parts_leave_names_but_a_users_own_module_attribute_stays():
    from nan_magic.distributed.ranks import user_name, user_path

    ddp_root = frozenset({""})
    # As the names from the root down (a layer row's path): the wrapper's parts are no level of the tree.
    assert user_path("module.encoder.module.proj", ddp_root) == ("encoder", "module", "proj")
    assert user_path("module", ddp_root) == user_path("") == ()
    assert user_path("_orig_mod.layers._checkpoint_wrapped_module.0") == ("layers", "0")
    assert user_name("module.1.weight", ddp_root) == "1.weight"
    assert user_name("module", ddp_root) == ""
    # A user's submodule called "module" inside a DDP-wrapped model is the user's name.
    assert user_name("module.encoder.module.proj", ddp_root) == "encoder.module.proj"
    assert user_name("encoder.module.proj") == "encoder.module.proj"
    assert user_name("_orig_mod.layers._checkpoint_wrapped_module.0._fsdp_wrapped_module.fc") == "layers.0.fc"


def test_watch_names_modules_and_parameters_of_a_wrapped_model_by_the_users_names():
    from torch import nn

    from nan_magic.lifecycle.watch import Watch

    class Holder(nn.Module):  # a user's own attribute called "module"
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    model = nn.Sequential(nn.Linear(2, 2), Holder())
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    nn.Module.__init__(wrapped)  # the wrapper's module tree without a process group
    wrapped.module = model
    watch = Watch([wrapped])
    names = {info.name: info.module_type for info in watch.targets.modules.values()}
    assert names == {"": "Sequential", "0": "Linear", "1": "Holder", "1.module": "Linear"}
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    assert [name for name, _ in watch.optimizers.named_parameters(opt)] == [
        "0.weight", "0.bias", "1.module.weight", "1.module.bias"]


def test_output_paths_get_a_rank_suffix_only_when_several_ranks_run(monkeypatch):
    from nan_magic.distributed.ranks import per_rank_path

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert per_rank_path("out/report.json") == "out/report.json"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert per_rank_path("out/report.json") == "out/report.rank3.json"
    assert per_rank_path("nan_scene_step7") == "nan_scene_step7.rank3"


def test_rank_is_shown_in_text_html_and_json_and_absent_outside_a_process_group():
    from nan_magic.records import Phase, Report

    plain = Report(Phase.FORWARD, "fc", "Linear", 3, 1, 0, 0, 4)
    ranked = Report(Phase.FORWARD, "fc", "Linear", 3, 1, 0, 0, 4, rank=1, world_size=2)
    assert (plain.rank, plain.world_size) == (None, None)
    assert json.loads(ranked.to_json())["rank"] == 1 and json.loads(ranked.to_json())["world_size"] == 2
    assert re.search(r"^\s*rank\s+1 of 2$", ranked.to_text(), re.MULTILINE)
    assert "1 of 2" in ranked.to_html() and "1 of 2" not in plain.to_html()
    assert not re.search(r"^\s*rank\s", plain.to_text(), re.MULTILINE)


def test_fix_trials_under_several_ranks_run_only_where_no_collective_is_needed(monkeypatch):
    from torch import nn

    from nan_magic.fixes import runner
    from nan_magic.fixes.loss import LossCode
    from nan_magic.localize.outside.recorded_ops import RecordedOp

    monkeypatch.setattr(runner, "process_group", lambda: (1, 2))
    plain = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    runner._alone(plain, plain, [torch.optim.SGD(plain.parameters())], None)  # DDP's module: nothing to wait for
    synced = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))
    with pytest.raises(runner._NeedsRanks, match="of 2 ranks: a SyncBatchNorm in training mode syncs its"):
        runner._alone(synced, synced, [], None)
    runner._alone(synced.eval(), synced, [], None)  # in eval mode it uses its running statistics

    class ZeroRedundancyOptimizer(torch.optim.SGD):
        pass

    ZeroRedundancyOptimizer.__module__ = "torch.distributed.optim.zero_redundancy_optimizer"
    with pytest.raises(runner._NeedsRanks, match="the ZeroRedundancyOptimizer optimizer communicates across ranks"):
        runner._alone(None, None, [ZeroRedundancyOptimizer(plain.parameters())], None)
    mean = RecordedOp(torch.ops._c10d_functional.all_reduce.default, (), {}, None, None, 0, None)
    with pytest.raises(runner._NeedsRanks, match=r"the loss code runs a collective \(_c10d_functional.all_reduce"):
        runner._alone(plain, plain, [], LossCode([mean], 0, {}, None, False))


def test_several_is_asked_again_when_the_default_process_group_changes(monkeypatch):
    # Agreement.several keeps its answer while torch's default process group is the same object (it is asked at
    # every optimizer step): a group created after the watch began, or destroyed, is seen at the next ask.
    from nan_magic.distributed import agreement

    if agreement._WORLD is None:
        pytest.skip("this torch keeps its default process group elsewhere: several asks each time")
    asked = []
    monkeypatch.setattr(agreement, "process_group", lambda: asked.append(1) or group)
    group: tuple[int, int] | None = None
    watching = agreement.Agreement()
    asked.clear()
    assert not watching.several and not watching.several and len(asked) <= 1
    group = (0, 2)
    monkeypatch.setattr(agreement._WORLD, "_default_pg", object())  # init_process_group, as torch records it
    assert watching.several and watching.several
    assert len(asked) <= 2
    monkeypatch.setattr(agreement._WORLD, "_default_pg", None)  # destroy_process_group
    group = None
    assert not watching.several
    assert not agreement.Agreement(alone=True).several
