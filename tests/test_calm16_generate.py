"""Hugging Face ``generate`` with the logits processors that write -inf into the scores (min_new_tokens,
bad_words_ids, no_repeat_ngram_size, top-k / top-p sampling), beam search, left-padded batches: calm and
bit-identical in the five modes (issue 25; harness: test_calm16.py). The processors run in generate's own code,
between the model calls; the model's outputs stay finite.
"""

from __future__ import annotations

import pytest
import torch
from test_calm16 import Loop, assert_calm
from watching import FIVE_MODES

hf_models = pytest.importorskip("hf_models")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt() -> dict[str, torch.Tensor]:
    batch = hf_models.padded_batch(batch=2, length=5, left=True)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def generation(kind: str) -> Loop:
    model = (hf_models.llama() if kind.startswith("llama") else hf_models.gpt2()).eval()
    prompt = _prompt()
    options = {"max_new_tokens": 6, "pad_token_id": 0}
    if kind == "gpt2-processors-sampling":
        options |= {"do_sample": True, "top_k": 10, "top_p": 0.9, "temperature": 0.7, "min_new_tokens": 4,
                    "no_repeat_ngram_size": 2, "bad_words_ids": [[5], [7, 8]], "repetition_penalty": 1.3}
    elif kind == "gpt2-beam-search":
        options |= {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.8, "early_stopping": True,
                    "no_repeat_ngram_size": 2}
    else:  # llama: greedy with a minimum length (eos masked to -inf until then)
        options |= {"do_sample": False, "min_new_tokens": 5}

    def run() -> list[torch.Tensor]:
        torch.manual_seed(1)
        return [model.generate(**prompt, **options)]
    return Loop((model,), (model,), run)


KINDS = ["gpt2-processors-sampling", "gpt2-beam-search", "llama-min-new-tokens"]


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_processors_that_write_inf_is_calm(kind: str, options: dict) -> None:
    assert_calm(lambda: generation(kind), options)
