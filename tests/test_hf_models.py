"""Hugging Face ``transformers`` models, trained the way users train them: silent when healthy, right about where.

The models are tiny (2 layers, width 32, vocabulary 128) and built from configs with random weights: no downloads.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import IDIOMS, idiom, state, traces
from watching import FIVE_MODES

import nan_magic


#: Each idiom's unwatched outputs and final state, computed once for its five modes.
_UNWATCHED: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", IDIOMS)
def test_a_healthy_model_is_silent_untouched_and_bit_identical(name: str, options: dict) -> None:
    if name not in _UNWATCHED:
        model, opt, run = idiom(name)
        _UNWATCHED[name] = run(), state(model)
    expected, expected_state = _UNWATCHED[name]

    model, opt, run = idiom(name)
    before = traces(model)
    with nan_magic.watch(model, *([] if opt is None else [opt]), **options) as w:
        outputs = run()
    assert w.report is None and w.events == []
    assert traces(model) == before  # no hook, attribute or wrapped forward of ours left
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(got, want) for got, want in zip(state(model), expected_state, strict=True))
    if name.startswith("gpt2"):  # the tied lm_head stays tied
        assert model.lm_head.weight is model.transformer.wte.weight
