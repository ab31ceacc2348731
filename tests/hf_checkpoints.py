"""Tiny random Hugging Face checkpoints, made at test time with transformers' own config
classes and ``save_pretrained`` (sharded, so the index path is what gets loaded), plus a
locally trained tokenizer with a chat template. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# The same turns with the tools shown first (as Qwen2.5/3 templates show them: one JSON line each)
TOOLS_CHAT_TEMPLATE = ("{%- if tools %}<|im_start|>system\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}"
                       "<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Lockstep balances load across data-parallel ranks of a mixture-of-experts model.",
    "Every rank holds its own experts; tokens travel to them through an all-to-all.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Straße, café, naïve, 東京, 😀 — multi-byte text must stream without broken characters.",
    "def add(a, b):\n    return a + b\n",
] * 4

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path, kind: str = "bytelevel", vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE):
    """A small BPE trained on CORPUS: ``bytelevel`` (GPT-2/Qwen style) or ``metaspace``
    (Llama/Mistral style: ▁ for spaces, byte fallback). Saved as tokenizer.json and
    tokenizer_config.json (with the chat template) through transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    if kind != "bytelevel":
        # byte-fallback pieces <0x00>..<0xFF> are ordinary vocabulary (as in Llama/Mistral), not special
        vocab, merges = json.loads(tok.to_str())["model"]["vocab"], json.loads(tok.to_str())["model"]["merges"]
        for i in range(256):
            vocab.setdefault(f"<0x{i:02X}>", len(vocab))
        model = models.BPE(vocab, [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges],
                           byte_fallback=True)
        rebuilt = Tokenizer(model)
        rebuilt.normalizer, rebuilt.decoder = tok.normalizer, tok.decoder
        rebuilt.add_special_tokens(SPECIALS)
        tok = rebuilt
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def make_checkpoint(out: Path, arch: str, *, n_experts: int = 8, layers: int = 2, tokenizer: str | None = None,
                    chat_template: str = CHAT_TEMPLATE,
                    rope_scaling: dict | None = None, seed: int = 0, **overrides):
    """A random ``arch`` model ('qwen3_moe', 'mixtral', 'olmoe', 'deepseek_v2', 'deepseek_v3', 'qwen2_moe',
    'glm4_moe', 'gpt_oss') saved in ``out`` with a
    tokenizer; returns the transformers model (fp32, eval) for reference forwards."""
    import torch
    from transformers import (GenerationConfig, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    out.mkdir(parents=True, exist_ok=True)
    fast = make_tokenizer(out, tokenizer or ("metaspace" if arch == "mixtral" else "bytelevel"),
                          chat_template=chat_template)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(fast), hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False,
                  bos_token_id=fast.bos_token_id, eos_token_id=eos, pad_token_id=fast.pad_token_id)
    if rope_scaling:
        common["rope_scaling"] = rope_scaling
    common.update(overrides)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{"head_dim": 16, "moe_intermediate_size": 24, "num_experts": n_experts,
                                "norm_topk_prob": True, "decoder_sparse_step": 1, **common})
        cls = Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = MixtralConfig(num_local_experts=n_experts, **common)
        cls = MixtralForCausalLM
    elif arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
        cfg = DeepseekV2Config(**{"n_routed_experts": n_experts, "n_shared_experts": 2, "moe_intermediate_size": 16,
                                  "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                                  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                  "topk_method": "greedy", "routed_scaling_factor": 1.5, "norm_topk_prob": False,
                                  **{**common, "num_key_value_heads": common["num_attention_heads"]}})
        cls = DeepseekV2ForCausalLM
    elif arch == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        cfg = DeepseekV3Config(**{"n_routed_experts": n_experts, "n_shared_experts": 1, "moe_intermediate_size": 16,
                                  "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 12,
                                  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                  "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                  **{**common, "num_key_value_heads": common["num_attention_heads"]}})
        cls = DeepseekV3ForCausalLM
    elif arch == "olmoe":
        cfg = OlmoeConfig(num_experts=n_experts, **{"norm_topk_prob": False, **common})
        cls = OlmoeForCausalLM
    elif arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        cfg = Qwen2MoeConfig(**{"num_experts": n_experts, "moe_intermediate_size": 16,
                                "shared_expert_intermediate_size": 24, "norm_topk_prob": False, **common})
        cls = Qwen2MoeForCausalLM
    elif arch == "glm4_moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
        cfg = Glm4MoeConfig(**{"n_routed_experts": n_experts, "n_shared_experts": 1, "moe_intermediate_size": 16,
                               "first_k_dense_replace": 1, "head_dim": 16, "partial_rotary_factor": 0.5,
                               "use_qk_norm": True, "attention_bias": True, "n_group": 2, "topk_group": 1,
                               "routed_scaling_factor": 2.5, "norm_topk_prob": True, **common})
        cls = Glm4MoeForCausalLM
    elif arch == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM
        # a window shorter than the tests' prompts, on alternate layers; YaRN as gpt-oss ships it, scaled down
        cfg = GptOssConfig(**{"num_local_experts": n_experts, "head_dim": 16, "sliding_window": 6,
                              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                              for i in range(layers)],
                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "truncate": False},
                              **common})
        cls = GptOssForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():       # visible weights: the default init is tiny and near-uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2 if p.dim() > 1 and "embed" not in name else 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # V3's routing bias: a buffer, zero by default
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(out, max_shard_size="64KB")
    GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=[eos, fast.convert_tokens_to_ids("<|endoftext|>")],
                     pad_token_id=fast.pad_token_id).save_pretrained(out)
    return model
