"""Small Llama checkpoints with random weights that vLLM's CPU engine and transformers load offline.

`build_llama(directory, vocab_size=..., head_std=...)` writes config.json, safetensors weights, a
WordLevel tokenizer over the words `w0 .. w{V-1}` (plus `<unk> <s> </s> <pad>` and a few English
words) with a chat template, and a generation_config.json. Head size 64 (vLLM's CPU attention
needs it). `head_std` is the standard deviation the output layer is drawn with: the default
initialiser gives nearly flat logits, 0.35 gives logits with an LLM-like spread (std about 4, where
top-p 0.9 keeps tens of tokens). The bench of the vLLM plugin and its tests use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
WORDS = ("the a an of to and in is it that hello world once upon time there was little model which sampled "
         "tokens from random weights").split()
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def build_llama(directory: str | Path, *, vocab_size: int = 1000, hidden_size: int = 128, layers: int = 2,
                head_std: float | None = 0.5, seed: int = 0, kv_heads: int | None = None) -> Path:
    """Write the checkpoint into `directory` (created) and return it. Deterministic in `seed`.

    `hidden_size // 64` attention heads; `kv_heads` key/value heads (default: as many), e.g. 4 heads
    over 2 KV heads at hidden size 256 for a tensor-parallel engine of 2 ranks."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    index = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{index}", len(vocab))
        index += 1
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", model_max_length=4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=hidden_size // 64,
                         num_key_value_heads=kv_heads or hidden_size // 64, head_dim=64, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                            "pad_token_id": 3}))
    return out
