"""Session 30's user walk, what the person reads, checked without a kernel (fast).

The char-level LSTM notebook (tests/notebooks/user_s30/char_lstm.ipynb) computes ``torch.log(logits.softmax(-1))``;
after a learning-rate jump the softmax underflows and log's backward makes NaN. The report's stable remedy (the log
fused into log_softmax) was verified, but its suggested edit read ``log_probs = torch.log_softmax(-1)``: the tensor,
the receiver of the ``.softmax`` method, was dropped, so the line the person would paste computes log_softmax of -1.
"""

from __future__ import annotations

import pytest

from nan_magic import FixTrial, SourcePointer
from nan_magic.render.fixes import suggested_edit


@pytest.mark.parametrize(("line", "edit"), [
    ("log_probs = torch.log(logits.softmax(-1))", "log_probs = torch.log_softmax(logits, -1)"),
    ("log_probs = logits.softmax(dim=-1).log()", "log_probs = torch.log_softmax(logits, dim=-1)"),
    ("p = torch.log(self.head(h).sigmoid())", "p = torch.nn.functional.logsigmoid(self.head(h))"),
    ("z = torch.log(F.softmax(s, -1))", "z = torch.log_softmax(s, -1)"),  # a function of F: no receiver
    ("z = torch.log(torch.nn.functional.softmax(s, dim=1))", "z = torch.log_softmax(s, dim=1)"),
])
def test_the_fused_log_edit_keeps_the_tensor_a_method_was_called_on(line: str, edit: str) -> None:
    trial = FixTrial("stable", source=SourcePointer("train.py", 7, "<module>", line),
                     facts=(("function", "log"), ("form", "log_softmax")), finite=True)
    assert suggested_edit(trial) == f"train.py:7: {edit}"
