"""Hugging Face ``generate`` with the logits processors that write -inf into the scores (min_new_tokens,
bad_words_ids, no_repeat_ngram_size, top-k / top-p sampling), beam search, left-padded batches: calm and
bit-identical in the five modes (issue 25; harness: test_calm16.py). The processors run in generate's own code,
between the model calls; the model's outputs stay finite. And a fine-tuning loop with everything at once (LoRA,
gradient checkpointing, fp16 with the default GradScaler, accumulation, OneCycleLR, mostly ignored labels).
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


def lora_checkpointing_fp16_accumulation() -> Loop:
    """Everything at once, as a fine-tuning notebook does it: LoRA on a frozen Llama, gradient checkpointing,
    float16 autocast with the default GradScaler, unscale_ + clipping, accumulation over two batches, OneCycleLR,
    left padding, a batch whose labels are nearly all -100."""
    model = hf_models.add_lora(hf_models.llama())
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=3)
    scaler = torch.amp.GradScaler("cpu")
    batches = [hf_models.padded_batch(left=True) for _ in range(3)]
    batches[1]["labels"][:] = -100
    batches[1]["labels"][0, -1] = 5

    def run() -> list[torch.Tensor]:
        out = []
        for i, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss / 2
            scaler.scale(loss).backward()
            if i % 2 == 1 or i == len(batches) - 1:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            out.append(loss.detach())
        return out
    return Loop((model, opt, scaler), (model, opt, scaler), run)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_fine_tuning_notebooks_loop_with_everything_at_once_is_calm(options: dict) -> None:
    assert_calm(lora_checkpointing_fp16_accumulation, options)
