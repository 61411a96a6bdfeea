"""Tiny random transformers targets and DART heads for the HF integration tests."""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dart_core import DartConfig, DartHead
from dart_core.testing import ReplayHead

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


CHARS = "".join(c for c in string.ascii_letters + string.digits + " \n" + string.punctuation if c not in "`~")


def char_tokenizer():
    """A 96-token character-level tokenizer for the tiny targets: id 0 the pad, id 1 the EOS, then one token per
    character (letters, digits, space, newline, punctuation), so stop strings and JSON grammars can spell text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    return tokenizer


def tiny_target(arch: str = "llama", attn: str = "sdpa", vocab: int = 96, layers: int = 6, hidden: int = 32,
                seed: int = 0):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                        max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                        tie_word_embeddings=False, attn_implementation=attn)
    model = model_cls(config).eval()
    with torch.no_grad():  # sharper next-token distributions than the default init, so greedy runs vary
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def random_head(target, draft_length: int = 4, draft_vocab: int | None = None, seed: int = 1) -> DartHead:
    cfg = target.config
    vocab = cfg.vocab_size
    draft_vocab = draft_vocab or vocab
    torch.manual_seed(seed)
    head = DartHead(DartConfig(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                               draft_vocab_size=draft_vocab, draft_length=draft_length,
                               target_hidden_size=cfg.hidden_size, num_target_layers=cfg.num_hidden_layers))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
        if draft_vocab < vocab:  # a draft vocab of every other token: draft id i -> target id 2i
            head.d2t.copy_(torch.arange(draft_vocab))
    return head


def oracle_head(target, reference: torch.Tensor, draft_length: int = 4, wrong_every: int = 0) -> ReplayHead:
    """A head that drafts the target's own continuation `reference` (wrong at every `wrong_every`-th position)."""
    return ReplayHead.from_head(random_head(target, draft_length=draft_length), reference, wrong_every)
