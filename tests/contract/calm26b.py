"""The models people train, healthy, in every mode: silent, and the run left exactly as it was unwatched.

Hugging Face ``transformers`` models (tiny configs, random init, no downloads), each under
``attn_implementation="eager"`` and ``"sdpa"``: padded batches with their attention masks, labels with -100 on the
padding, gradient checkpointing on, tied embeddings where the model ties them, and a ``generate()`` after training
in the same watched cell (decoders, MoE decoders, encoder-decoders; encoders and ViT only train). Each row returns
the losses and generated ids, then the state (parameters, gradients, buffers, optimizer state, the RNG stream) and
what is left on the model and optimizer (calm26.finish).
calm26b_vision.py: the shapes of timm/torchvision models, a U-Net and a diffusion step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from contract import Case, Scenario
from contract.calm26 import finish

transformers = __import__("pytest").importorskip("transformers")
transformers.logging.set_verbosity_error()  # tiny vocabularies: the stock configs' token ids are out of range

VOCAB, WIDTH = 96, 32
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_DECODER = {"num_hidden_layers": 2, "hidden_size": WIDTH, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, **_IDS}


def _padded(batch: int = 3, length: int = 8, left: bool = False) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (0 on the padding) and ``labels`` (-100 on the padding), as a collator
    makes them."""
    ids = torch.randint(3, VOCAB, (batch, length))
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, slice(0, 2 * row) if left else slice(length - 2 * row, length)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_then_generate(model: nn.Module, batches: list[dict[str, torch.Tensor]],
                         generate: Callable[[], torch.Tensor] | None, reentrant: bool = True,
                         opt: torch.optim.Optimizer | None = None) -> Scenario:
    """Gradient checkpointing on (torch.utils.checkpoint, reentrant or not), AdamW over the batches, then
    ``generate()`` in eval mode: one watched cell."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> tuple[Any, ...]:
        losses = []
        for batch in batches:
            out = model(**batch)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(out.loss.detach())
        if generate is not None:
            model.eval()
            losses.append(generate())
            model.train()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _decoder_only(config_class: str, model_class: str, impl: str, reentrant: bool = True,
                  dtype: torch.dtype = torch.float32, forward: dict[str, Any] | None = None,
                  **config: Any) -> Scenario:
    """A causal LM (left-padded batches, as one pads for generation), then a greedy generate from a padded
    prompt. In float16, SGD: AdamW's eps=1e-8 is 0 in float16 (an unused embedding row would divide 0 by 0).
    ``forward``: more keyword arguments of the training calls."""
    forward = forward or {}
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(attn_implementation=impl, **config)
    model = getattr(transformers, model_class)(cfg).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2) if dtype == torch.float16 else None
    batches = [{**_padded(left=True), **forward} for _ in range(2)]
    prompt = _padded(2, 5, left=True)

    def generate() -> torch.Tensor:
        return model.generate(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"],
                              max_new_tokens=4, do_sample=False, pad_token_id=0)

    return _train_then_generate(model, batches, generate, reentrant, opt)


def _gpt2(impl: str) -> Scenario:
    """GPT-2: ``lm_head`` tied to ``transformer.wte``, dropout on (the RNG stream drawn from in every step)."""
    return _decoder_only("GPT2Config", "GPT2LMHeadModel", impl, n_layer=2, n_embd=WIDTH, n_head=4,
                         vocab_size=VOCAB, n_positions=64, **_IDS)


def _llama(impl: str) -> Scenario:
    """Llama: RMSNorm, rotary embeddings, grouped-query attention, tied embeddings; non-reentrant checkpointing
    (saved-tensor hooks recompute the block in backward)."""
    return _decoder_only("LlamaConfig", "LlamaForCausalLM", impl, reentrant=False, tie_word_embeddings=True,
                         **_DECODER)


def _llama_fp16(impl: str) -> Scenario:
    """Llama with float16 weights (model.half()), trained and generating in float16."""
    return _decoder_only("LlamaConfig", "LlamaForCausalLM", impl, dtype=torch.float16, **_DECODER)


def _qwen2(impl: str) -> Scenario:
    """Qwen2: Llama's shape with biased q/k/v projections, and a sliding window (Mistral's)."""
    return _decoder_only("Qwen2Config", "Qwen2ForCausalLM", impl, tie_word_embeddings=True, **_DECODER)


def _mistral(impl: str) -> Scenario:
    """Mistral with a sliding window shorter than the sequence: the mask hides more than the padding."""
    return _decoder_only("MistralConfig", "MistralForCausalLM", impl, sliding_window=4, **_DECODER)


def _mixtral(impl: str) -> Scenario:
    """Mixtral's sparse MoE: a router's top-2 of 4 experts, the load-balancing loss added to the LM loss
    (``output_router_logits`` in training; generate() runs without it)."""
    return _decoder_only("MixtralConfig", "MixtralForCausalLM", impl, num_local_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=0.02, forward={"output_router_logits": True}, **_DECODER)


def _qwen2_moe(impl: str) -> Scenario:
    """Qwen2-MoE: routed experts beside a sigmoid-gated shared expert, with the load-balancing loss."""
    return _decoder_only("Qwen2MoeConfig", "Qwen2MoeForCausalLM", impl, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=32,
                         forward={"output_router_logits": True}, **_DECODER)


def _bert(impl: str) -> Scenario:
    """BERT masked LM: right padding, the decoder tied to the word embeddings, -100 on the unmasked tokens."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
                                  num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                  attn_implementation=impl)
    model = transformers.BertForMaskedLM(cfg)
    batches = []
    for _ in range(2):
        batch = _padded()
        hidden = (torch.rand(batch["labels"].shape) < 0.3) & (batch["attention_mask"] == 1)
        batch["labels"] = batch["labels"].masked_fill(~hidden, -100)
        batch["input_ids"] = batch["input_ids"].masked_fill(hidden, 3)  # [MASK]
        batches.append(batch)
    return _train_then_generate(model, batches, None)


def _encoder_decoder(model: nn.Module, batches: list[dict[str, torch.Tensor]], source: dict[str, torch.Tensor],
                     ) -> Scenario:
    def generate() -> torch.Tensor:
        return model.generate(**source, max_new_tokens=4, do_sample=False)

    return _train_then_generate(model, batches, generate)


def _seq2seq_batches() -> list[dict[str, torch.Tensor]]:
    batches = []
    for _ in range(2):
        source, target = _padded(), _padded(3, 6)
        batches.append({"input_ids": source["input_ids"], "attention_mask": source["attention_mask"],
                        "labels": target["labels"]})
    return batches


def _t5(impl: str) -> Scenario:
    """T5: relative position buckets, the decoder's input the labels shifted right (-100 made pad)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=WIDTH, d_ff=64, d_kv=8, num_heads=4,
                                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                attn_implementation=impl)
    model = transformers.T5ForConditionalGeneration(cfg)
    batches = _seq2seq_batches()
    source = {k: v for k, v in _padded(2, 6).items() if k != "labels"}
    return _encoder_decoder(model, batches, source)


def _bart(impl: str) -> Scenario:
    """BART: learned positions, the shared embedding tied to the LM head, a final-logits bias buffer."""
    torch.manual_seed(0)
    cfg = transformers.BartConfig(encoder_layers=2, decoder_layers=2, d_model=WIDTH, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                  vocab_size=VOCAB, max_position_embeddings=64, decoder_start_token_id=2,
                                  forced_eos_token_id=None, attn_implementation=impl, **_IDS)
    model = transformers.BartForConditionalGeneration(cfg)
    batches = _seq2seq_batches()
    source = {k: v for k, v in _padded(2, 6).items() if k != "labels"}
    return _encoder_decoder(model, batches, source)


def _whisper(impl: str) -> Scenario:
    """Whisper: log-mel features through two convs (GELU), sinusoidal encoder positions, padded transcripts."""
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(encoder_layers=1, decoder_layers=1, d_model=WIDTH, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                     vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8,
                                     max_target_positions=16, decoder_start_token_id=1, begin_suppress_tokens=None,
                                     suppress_tokens=None, attn_implementation=impl, **_IDS)
    model = transformers.WhisperForConditionalGeneration(cfg)
    batches = [{"input_features": torch.randn(3, 8, 16), "labels": _padded(3, 6)["labels"]} for _ in range(2)]
    source = {"input_features": torch.randn(2, 8, 16)}
    return _encoder_decoder(model, batches, source)


def _wav2vec2_ctc(impl: str) -> Scenario:
    """Wav2Vec2 CTC on padded audio (a weight-normed positional conv, feature-extractor convs): one transcript
    longer than its frames, an impossible alignment whose infinite loss ``ctc_zero_infinity`` zeroes."""
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(vocab_size=12, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_feat_extract_layers=2, num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=4, ctc_zero_infinity=True, mask_time_prob=0.0,
                                      feat_extract_norm="layer", do_stable_layer_norm=True, pad_token_id=0,
                                      attn_implementation=impl)
    model = transformers.Wav2Vec2ForCTC(cfg)
    mask = torch.ones(3, 400, dtype=torch.long)
    mask[1, 300:] = mask[2, 200:] = 0
    labels = torch.randint(1, 12, (3, 30))  # row 2: 30 labels for its 19 frames
    labels[0, 10:] = labels[1, 5:] = -100
    batches = [{"input_values": torch.randn(3, 400) * mask, "attention_mask": mask, "labels": labels}
               for _ in range(2)]
    return _train_then_generate(model, batches, None)


def _vit(impl: str) -> Scenario:
    """ViT: patch embedding, a CLS token, learned positions; images in, labels, no generate."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
                                 num_attention_heads=4, image_size=16, patch_size=8, num_channels=3, num_labels=4,
                                 hidden_dropout_prob=0.1, attn_implementation=impl)
    model = transformers.ViTForImageClassification(cfg)
    batches = [{"pixel_values": torch.randn(3, 3, 16, 16), "labels": torch.randint(0, 4, (3,))} for _ in range(2)]
    return _train_then_generate(model, batches, None)


MODELS = {"gpt2": _gpt2, "llama": _llama, "llama-fp16": _llama_fp16, "qwen2": _qwen2, "mistral-window": _mistral,
          "mixtral-moe": _mixtral, "qwen2-moe": _qwen2_moe,
          "bert-mlm": _bert, "t5": _t5, "bart": _bart, "whisper": _whisper, "wav2vec2-ctc": _wav2vec2_ctc, "vit": _vit}

CASES = [
    Case(f"calm26b_{name}-{impl}", (lambda build=build, impl=impl: build(impl)), None, benign=0)
    for name, build in MODELS.items() for impl in ("eager", "sdpa")
]
