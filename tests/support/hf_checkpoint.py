"""A tiny on-disk Hugging Face causal-LM checkpoint, built offline for the end-to-end tests.

`build_tiny_checkpoint(directory)` writes, with `save_pretrained`: a 2-layer LlamaForCausalLM with
random weights (seeded), a WordLevel tokenizer trained on a few sentences and wrapped in
PreTrainedTokenizerFast, config.json, and a generation_config.json carrying sampling keys
(`TINY_GENERATION_CONFIG`). Nothing touches the network (tests/conftest.py sets HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model samples the next token from its logits",
    "every request has a seed and a position",
    "greedy decoding picks the most likely token",
    "top k keeps the twenty best candidates and top p keeps the nucleus",
    "the sampler reads the checkpoint generation config",
    "once upon a time there was a tiny llama in a big field",
    "she sells sea shells by the sea shore",
]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
TINY_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 12}
MAX_POSITION_EMBEDDINGS = 64


def build_tiny_checkpoint(directory: str | Path) -> Path:
    """Write the tiny checkpoint into `directory` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.save_pretrained(out)

    config = LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITION_EMBEDDINGS, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=raw.token_to_id("<pad>"), tie_word_embeddings=False,
                         initializer_range=0.2)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(**TINY_GENERATION_CONFIG, bos_token_id=bos, eos_token_id=eos,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    return out
