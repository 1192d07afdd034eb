"""Tiny Hugging Face ``transformers`` models (random init from a config, no downloads) and the ways users train them.

Each *idiom* builds its model from a seed, runs a few steps, and returns what a user could compare: the outputs
(losses, logits, generated ids), the parameter gradients of the last step and the parameters after it. Run once
unwatched and once under a watch, the two must be bit-identical (tests/test_hf_models.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

transformers = __import__("pytest").importorskip("transformers")
transformers.logging.set_verbosity_error()  # tiny vocabularies: the stock configs' token ids are out of range

VOCAB, WIDTH = 128, 32
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def gpt2(**config: Any) -> nn.Module:
    """GPT-2 LM: ``transformer.h.N.attn``/``mlp``; ``lm_head`` tied to ``transformer.wte``."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=64, **_IDS)
    for key, value in config.items():
        setattr(cfg, key, value)
    return transformers.GPT2LMHeadModel(cfg)


def llama(**config: Any) -> nn.Module:
    """Llama LM: ``model.layers.N.self_attn``/``mlp``/``input_layernorm`` (RMSNorm), rotary embeddings."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **_IDS)
    for key, value in config.items():
        setattr(cfg, key, value)
    return transformers.LlamaForCausalLM(cfg)


def mistral(**config: Any) -> nn.Module:
    cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                     max_position_embeddings=64, sliding_window=4, **_IDS)
    for key, value in config.items():
        setattr(cfg, key, value)
    return transformers.MistralForCausalLM(cfg)


def bert(num_labels: int = 3, **config: Any) -> nn.Module:
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4,
                                  vocab_size=VOCAB, max_position_embeddings=64, num_labels=num_labels, **config)
    return transformers.BertForSequenceClassification(cfg)


def t5(**config: Any) -> nn.Module:
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=WIDTH, d_ff=64, d_kv=8, num_heads=4,
                                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **config)
    return transformers.T5ForConditionalGeneration(cfg)


def vit(**config: Any) -> nn.Module:
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4,
                                 image_size=16, patch_size=8, num_channels=3, num_labels=4, **config)
    return transformers.ViTForImageClassification(cfg)


def tokens(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))


def padded_batch(batch: int = 3, length: int = 8, left: bool = False) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (0 on the padding), ``labels`` (-100 on the padding), as a collator makes."""
    ids = tokens(batch, length)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        pad = slice(0, 2 * row) if left else slice(length - 2 * row, length)
        mask[row, pad] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class LoRALinear(nn.Module):
    """A LoRA adapter written by hand: the frozen base plus ``B @ A``, B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, names: tuple[str, ...] = ("q_proj", "v_proj")) -> nn.Module:
    """Freeze every parameter, then wrap each Linear called one of ``names`` in a trainable LoRALinear."""
    for p in model.parameters():
        p.requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in names and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child))
    return model


# ---------------------------------------------------------------- the idioms: (model, optimizer or None, run)


def _adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def _lm_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[dict[str, torch.Tensor]],
              outputs: list[torch.Tensor], autocast: torch.dtype | None = None) -> None:
    for batch in batches:
        if autocast is None:
            out = model(**batch)
        else:
            with torch.autocast("cpu", dtype=autocast):
                out = model(**batch)
        opt.zero_grad()
        out.loss.backward()
        outputs.append(out.loss.detach().clone())
        opt.step()


def idiom(name: str) -> tuple[nn.Module, torch.optim.Optimizer | None, Callable[[], list[torch.Tensor]]]:
    """``(model, optimizer, run)`` for the idiom ``name`` (see IDIOMS), built from seed 0; ``run()`` the outputs."""
    torch.manual_seed(0)
    outputs: list[torch.Tensor] = []
    model: nn.Module
    opt: torch.optim.Optimizer | None
    if name == "gpt2-labels":  # out = model(input_ids=..., labels=...); out.loss.backward(); tied lm_head
        model = gpt2()
        opt = _adamw(model)

        def run() -> list[torch.Tensor]:
            for _ in range(2):
                ids = tokens()
                out = model(input_ids=ids, labels=ids)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                outputs.extend([out.loss.detach(), out.logits.detach()])
            return outputs
    elif name in ("llama-padded", "mistral-padded"):  # model(**batch) with left padding and an attention mask
        model = llama() if name.startswith("llama") else mistral()
        opt = _adamw(model)
        batches = [padded_batch(left=True) for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "bert-padded":  # sequence classification, right padding, labels
        model = bert()
        opt = _adamw(model)
        batches = [padded_batch() for _ in range(2)]
        for batch in batches:
            batch["labels"] = torch.randint(0, 3, (3,))

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name in ("gpt2-checkpointing", "llama-checkpointing"):
        model = gpt2() if name.startswith("gpt2") else llama()
        model.gradient_checkpointing_enable()
        model.train()
        opt = _adamw(model)
        batches = [padded_batch() for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "llama-autocast-bf16":
        model = llama()
        opt = _adamw(model)
        batches = [padded_batch() for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs, autocast=torch.bfloat16)
            return outputs
    elif name in ("gpt2-bf16-weights", "llama-half"):
        model = gpt2().to(torch.bfloat16) if name.startswith("gpt2") else llama().half()
        # SGD: AdamW's eps=1e-8 is 0 in float16, and an embedding row no batch used divides 0 by 0 (an incident).
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        batches = [{"input_ids": (ids := tokens()), "labels": ids} for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "gpt2-generate":  # inference: generate() under a watch
        model = gpt2().eval()
        opt = None
        prompt = tokens(2, 4)

        def run() -> list[torch.Tensor]:
            outputs.append(model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
            torch.manual_seed(1)
            outputs.append(model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0))
            return outputs
    elif name == "gpt2-train-eval":  # a train step, an evaluation under no_grad, a train step
        model = gpt2()
        opt = _adamw(model)

        def run() -> list[torch.Tensor]:
            for _ in range(2):
                model.train()
                ids = tokens()
                out = model(input_ids=ids, labels=ids)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    ids = tokens()
                    outputs.append(model(input_ids=ids, labels=ids).loss)
            return outputs
    elif name == "llama-lora":
        model = add_lora(llama())
        opt = _adamw(model, lr=1e-2)
        batches = [padded_batch() for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "bert-frozen-base":  # frozen encoder, trainable classifier head
        model = bert()
        for p in model.bert.parameters():
            p.requires_grad_(False)
        opt = _adamw(model, lr=1e-2)
        batches = [padded_batch() for _ in range(2)]
        for batch in batches:
            batch["labels"] = torch.randint(0, 3, (3,))

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "t5-seq2seq":
        model = t5()
        opt = _adamw(model)
        batches = [{"input_ids": tokens(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long),
                    "labels": tokens(2, 5)} for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    elif name == "vit-images":
        model = vit()
        opt = _adamw(model)
        batches = [{"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.randint(0, 4, (2,))}
                   for _ in range(2)]

        def run() -> list[torch.Tensor]:
            _lm_steps(model, opt, batches, outputs)
            return outputs
    else:
        raise KeyError(name)
    return model, opt, run


IDIOMS = ["gpt2-labels", "llama-padded", "mistral-padded", "bert-padded", "gpt2-checkpointing",
          "llama-checkpointing", "llama-autocast-bf16", "gpt2-bf16-weights", "llama-half", "gpt2-generate",
          "gpt2-train-eval", "llama-lora", "bert-frozen-base", "t5-seq2seq", "vit-images"]


def state(model: nn.Module) -> list[torch.Tensor]:
    """The parameters and their gradients (None as an empty tensor), in order."""
    tensors = []
    for p in model.parameters():
        tensors.append(p.detach().clone())
        tensors.append(torch.empty(0) if p.grad is None else p.grad.detach().clone())
    return tensors


def traces(model: nn.Module) -> list[tuple[str, Any]]:
    """What a watch could leave on a model: per module its hooks, instance attributes and forward; per parameter
    its hooks. Compared before and after a watch."""
    found: list[tuple[str, Any]] = []
    for name, m in model.named_modules():
        found.append((name, (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                             len(m._backward_pre_hooks), len(m._state_dict_hooks), sorted(vars(m)),
                             vars(m).get("forward"))))
    for name, p in model.named_parameters():
        found.append((name, (len(p._backward_hooks or {}), type(p), p.requires_grad)))
    return found
