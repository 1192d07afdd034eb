"""Session 33's walk (tests/notebooks/user_s33/): what a person read that was wrong, asserted in-process.

``%nanwatch on --ops=yes`` (a flag given a value, as people write ``--ops=True``) answered argparse's
"UsageError: %nanwatch: argument --ops: ignored explicit argument 'yes'", which says nothing a person can act on. A
flag given a value now says that the flag takes no value and how to write it, for both magics and every flag.

A division by zero named its divisor by the op's schema: "divided by zero (`other` (16,) held 1 zero of 16)" under a
line that divides ``(bce * target).sum((1, 2, 3)) / target.sum((1, 2, 3))``, and a log of zeros said "log got 128
zeros ... in `self` of aten.log.default": the reader had to work out which tensor `other` or `self` was. The cause now
names it as the line writes it: "(`target.sum((1, 2, 3))` (16,) held 1 zero of 16)", "in `probs` (`self` of
aten.log.default in ...)"; where the line does not say it unambiguously the schema name stays.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError
from torch import nn

from nan_magic import NonFiniteError, watch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


@pytest.mark.parametrize(("magic", "line", "said"), [
    ("nanwatch", "on --ops=yes", "%nanwatch: --ops takes no value: write --ops alone, not --ops=yes"),
    ("nanwatch", "--defer=true", "%nanwatch: --defer takes no value: write --defer alone, not --defer=true"),
    ("nantrace", "--full=1", "%%nantrace: --full takes no value: write --full alone, not --full=1"),
])
def test_a_flag_given_a_value_says_it_takes_none(ip, magic: str, line: str, said: str) -> None:
    model = nn.Linear(2, 2)
    ip.user_ns["model"] = model
    with pytest.raises(UsageError) as caught:
        if magic == "nantrace":
            ip.run_cell_magic("nantrace", line, "model(torch.ones(1, 2))")
        else:
            ip.run_line_magic("nanwatch", line)
    assert str(caught.value) == said
    assert "\n" not in str(caught.value)
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing attached
    assert "nan_magic: off" in _status(ip)


def _status(ip) -> str:
    from IPython.utils.capture import capture_output
    with capture_output() as shown:
        ip.run_line_magic("nanwatch", "status")
    return shown.stdout


def _seg_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    fg_bce = (bce * target).sum((1, 2, 3)) / target.sum((1, 2, 3))  # a mask without a lesion: 0 / 0
    return fg_bce.mean()


def test_a_division_by_zero_names_the_divisor_as_the_line_writes_it() -> None:
    torch.manual_seed(0)
    model = nn.Conv2d(1, 1, 3, padding=1)
    masks = (torch.rand(4, 1, 8, 8) > 0.5).float()
    masks[2] = 0
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        _seg_loss(model(torch.randn(4, 1, 8, 8)), masks).backward()
    hint = caught.value.report.cause.hint
    assert "divided by zero (`target.sum((1, 2, 3))` (4,) held 1 zero of 4), giving 1 NaN (0/0)" in hint, hint
    assert "`other`" not in hint


def test_a_log_of_zeros_names_its_operand_as_the_line_writes_it() -> None:
    torch.manual_seed(0)
    policy = nn.Linear(3, 4)
    with pytest.raises(NonFiniteError) as caught, watch(policy, fixes=False):
        probs = (policy(torch.ones(2, 3)) / 1e-4).softmax(-1)
        logp = torch.log(probs)
        (-(probs * logp).sum(-1)).mean().backward()
    hint = caught.value.report.cause.hint
    assert hint.startswith("log got "), hint
    assert " zeros and 0 negatives in `probs` (`self` of aten.log.default in the code at " in hint, hint


def test_a_log_of_a_module_input_keeps_the_input_name() -> None:
    """Where the zeros are the module's own input, that name (``input[0] of ...``) stays: the user passed it."""

    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    model = nn.Sequential(nn.Identity(), Log())
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        model(torch.zeros(3))
    assert "log got 3 zeros and 0 negatives in input[0] of 1 (Log)" in caught.value.report.cause.hint


RECSYS_SCRIPT = '''import torch
from torch import nn
import torch.nn.functional as F
import nan_magic

torch.manual_seed(0)
history = torch.randint(1, 200, (50, 5))
history[7, 3:] = 0                       # a user with 3 items, padded with item 0
pos = torch.randint(1, 200, (50,))


class TwoTower(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.items = nn.Embedding(200, d, padding_idx=0)
        self.proj = nn.Linear(d, d)

    def cosine(self, a, b):
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))

    def forward(self, hist, cand):
        h, c = self.items(hist), self.items(cand)
        return self.cosine(self.proj(h.mean(1)), c) + self.cosine(h, c[:, None]).sum(-1)


model = TwoTower()
opt = torch.optim.Adam(model.parameters(), lr=5e-3)
with nan_magic.watch(model, opt):
    for i in range(0, 50, 10):
        loss = F.softplus(-model(history[i:i + 10], pos[i:i + 10])).mean()
        opt.zero_grad(); loss.backward(); opt.step()
'''


def test_the_recommender_as_a_plain_script_prints_the_text_report(tmp_path) -> None:
    """recsys_cosine.ipynb as ``python recsys.py`` with ``nan_magic.watch``: the traceback ends at the user's line,
    then the text report, with the divisor named as the line writes it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "recsys.py"
    script.write_text(RECSYS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    err = done.stderr
    assert ("    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))\nnan_magic.errors.exceptions."
            "NonFiniteError: first non-finite value in forward step 0: TwoTower (root), op aten.div.Tensor at ") in err

    assert "divided by zero (`a.norm(dim=-1) * b.norm(dim=-1)` (10, 5) held 2 zeros of 50)" in err, err
    assert "  first at    index (7, 3)" in err and "recsys.py:19, in cosine" in err, err
