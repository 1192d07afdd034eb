"""What the magics say to a user who turns the watch off, asks its status or runs an empty cell (round 20).

Each case is what a user hit in a real kernel: ``%nanwatch status`` forgot the last report one healthy cell
after it; ``%nanwatch off`` said "watch off" when nothing was on, and when the cell's own ``%nanwatch`` stayed
armed (the NaN below the off line still raised); a ``%%nantrace`` cell of comments alone ran in silence.
"""

from __future__ import annotations

import pytest
from conftest import global_hook_counts
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(3, 1)
nan_batch = torch.full((2, 3), float('nan'))
"""


@pytest.fixture
def ns(ip):
    ip.run_cell(SETUP)
    ip.user_ns.pop("_nan_report", None)
    yield ip.user_ns
    with capture_output():
        ip.run_line_magic("nanwatch", "off")
    ip.user_ns.pop("_nan_report", None)  # (the shell is one for the whole session: later modules expect none)


def run(ip, cell: str):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


@pytest.mark.parametrize("arm", ["%nanwatch on", "%%nantrace"])
def test_status_keeps_the_last_report_past_the_healthy_cells_after_it(ip, ns, arm: str) -> None:
    # Under %nanwatch on, each cell ends its own run of the watch: the status named the last report only in the
    # cell right after the failure; one healthy cell later it said nothing of it. The same after a healthy
    # %%nantrace cell.
    failing = "y = model(nan_batch)"
    if arm == "%nanwatch on":
        run(ip, arm)
    else:
        failing = "%%nantrace\n" + failing
    result, _ = run(ip, failing)
    assert result.error_in_exec is not None
    message = ns["_nan_report"].message
    for healthy in ("z = model(torch.ones(2, 3))", "print('between')", "%%nantrace\nz = model(torch.ones(2, 3))"):
        result, _ = run(ip, healthy)
        assert result.error_in_exec is None
    _, status = run(ip, "%nanwatch status")
    assert f"last report: {message}" in status.stdout.splitlines(), status.stdout


def test_off_with_nothing_on_says_so(ip, ns) -> None:
    # It said "nan_magic: watch off", as if it had turned something off.
    result, captured = run(ip, "%nanwatch off")
    assert result.error_in_exec is None
    assert captured.stdout.splitlines() == ["nan_magic: no watch is on (nothing to turn off)"]


def test_off_turns_off_the_watch_this_cell_armed(ip, ns) -> None:
    # "%nanwatch model" then "%nanwatch off": it said "watch off", the status "armed for this cell", and the NaN
    # below the off line raised NonFiniteError.
    before = global_hook_counts()
    result, captured = run(
        ip,
        "%nanwatch model\n%nanwatch off\n%nanwatch status\ny = model(nan_batch)\nprint('ran', bool(y.isnan().any()))",
    )
    assert result.error_in_exec is None, result.error_in_exec
    said = [line for line in captured.stdout.splitlines() if not line.startswith("last report: ")]
    assert said == ["nan_magic: watch off", "nan_magic: off", "ran True"]
    assert global_hook_counts() == before


def test_off_inside_a_nantrace_cell_says_the_cell_stays_watched(ip, ns) -> None:
    # It said "watch off", and the NaN below it raised: the %%nantrace cell's watch is the magic's, to its end.
    run(ip, "%nanwatch on")
    result, captured = run(ip, "%%nantrace\n%nanwatch off\ny = model(nan_batch)")
    assert result.error_in_exec is not None
    assert captured.stdout.splitlines()[0] == (
        "nan_magic: watch off for the following cells; this %%nantrace cell stays watched to its end"
    )
    _, status = run(ip, "%nanwatch status")
    assert status.stdout.splitlines()[0] == "nan_magic: off"


@pytest.mark.parametrize("body", ["# nothing here yet\n", "\n# a comment\n\n   # another\n"])
def test_a_nantrace_cell_of_comments_alone_is_empty(ip, ns, body: str) -> None:
    # It ran nothing and said nothing: no report, no error, as if the watch had found the code healthy.
    before = global_hook_counts()
    result, _ = run(ip, "%%nantrace\n" + body)
    error = result.error_in_exec
    assert isinstance(error, UsageError), error
    assert str(error) == "%%nantrace: the cell is empty; put the code to watch below the magic line"
    assert global_hook_counts() == before


LOSS_CODE = """
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
net_opt = torch.optim.SGD(net.parameters(), lr=0.1)
def share_loss(out, y):
    err = (out - y) ** 2
    return (err / err.sum(0, keepdim=True)).max()
"""
LOSS_CODE_TRAINING = """%%nantrace --dump {folder}
for step in range(4):
    x = torch.randn(8, 4)
    y = net(x).detach() if step == 2 else torch.randn(8, 1)
    loss = share_loss(net(x), y)
    net_opt.zero_grad(); loss.backward(); net_opt.step()
"""


def test_nanreplay_that_cannot_replay_leaves_the_scene_it_points_at(ip, ns, tmp_path) -> None:
    # The producer ran in the loss code (no module): %nanreplay said "re-run the whole step with scene.rerun_step(...)"
    # and left no scene: the user had none to call it on.
    ip.run_cell(LOSS_CODE)
    run(ip, LOSS_CODE_TRAINING.format(folder=tmp_path))
    ns.pop("_nan_scene", None)
    (path,) = tmp_path.glob("*.pt")
    result, _ = run(ip, f"%nanreplay {path} net")
    error = result.error_in_exec
    assert isinstance(error, UsageError), error
    assert "scene.rerun_step(step, model, optimizer)" in str(error)
    assert str(error).endswith(" (the scene is loaded as _nan_scene)") and "\n" not in str(error)
    scene = ns["_nan_scene"]
    assert (scene.phase, scene.module, scene.step) == ("forward", None, 2)


# -- options as typed (round 21: argparse took --ful for --full) ---------------------------------------------------


@pytest.mark.parametrize(
    ("line", "typed", "meant"),
    [
        ("%nanwatch on model --ful", "--ful", "--full"),
        ("%%nantrace model --def\ny = model(nan_batch)", "--def", "--defer"),
        ("%nanreplay scene.pt --no-rest", "--no-rest", "--no-restore"),
    ],
)
def test_an_abbreviated_option_is_a_one_line_usage_error_naming_the_options(ns, ip, line, typed, meant) -> None:
    result, _captured = run(ip, line)
    error = result.error_in_exec or result.error_before_exec
    assert isinstance(error, UsageError), error
    said = str(error)
    assert "\n" not in said and f"unrecognized arguments: {typed} (did you mean {meant}?)" in said, said
    assert "the options are " in said and meant in said.split("the options are ")[1], said
    assert "_nan_report" not in ns  # nothing ran watched


def test_an_option_like_no_other_is_not_given_a_guess(ns, ip) -> None:
    result, _captured = run(ip, "%nanwatch on model --bogus")
    said = str(result.error_in_exec or result.error_before_exec)
    assert "unrecognized arguments: --bogus; the options are --defer," in said, said


# -- %nanwatch on watches the rest of its own cell (round 21: a loop under the on line ran unwatched) ----------------


def test_nanwatch_on_watches_the_rest_of_its_cell_then_every_cell(ip, ns) -> None:
    result, _captured = run(ip, "%nanwatch on model\nz = model(torch.ones(2, 3))\ny = model(nan_batch)")
    assert type(result.error_in_exec).__name__ == "NonFiniteError", result.error_in_exec
    assert ns["_nan_report"].step == 1  # the cell's second call: the same count as in the cells after it
    ns.pop("_nan_report")
    result, _captured = run(ip, "y = model(nan_batch)")  # and the cells after it, as before
    assert type(result.error_in_exec).__name__ == "NonFiniteError", result.error_in_exec
    run(ip, "%nanwatch off")
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in ns["model"].modules())


def test_nanwatch_on_called_outside_a_cell_holds_nothing_until_the_next_cell(ip, ns) -> None:
    with capture_output():
        ip.run_line_magic("nanwatch", "on model")  # (a direct call, as a script or a test makes it: no cell's end)
    assert not ns["model"]._forward_hooks and not ns["model"]._forward_pre_hooks
    result, _captured = run(ip, "y = model(nan_batch)")
    assert type(result.error_in_exec).__name__ == "NonFiniteError", result.error_in_exec
