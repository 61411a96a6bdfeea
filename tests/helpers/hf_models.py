"""Tiny random transformers targets and DART heads for the HF integration tests."""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dart_bench import replay
from dart_bench.replay import ReplayHead
from dart_core import DartConfig, DartHead, TreeConfig

PAD = 0  # the tests' padding id

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
    cfg = target.config.get_text_config(decoder=True)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    draft_vocab = draft_vocab or vocab
    config = DartConfig(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=draft_vocab, draft_length=draft_length,
                        target_hidden_size=cfg.hidden_size, num_target_layers=cfg.num_hidden_layers)
    # a smaller draft vocab is every other token: draft id i -> target id 2i (offset i)
    return replay.random_head(config, std=0.3, seed=seed, d2t=torch.arange(draft_vocab) if draft_vocab < vocab else None)


# a fixed tree for exactness tests that need whole blocks accepted from the first step: the speed rule starts small
# and chooses by this CPU's speed, so those tests never rest on its choice
BLOCKS = TreeConfig()


def attach(model, head):
    """`dart_hf.enable(model, head)` with the head's own tree fixed: every call decodes with DART whatever this
    machine's speed (the tests of exactness never rest on the controller's verdict, which depends on the CPU)."""
    import dart_hf

    return dart_hf.enable(model, head, tree_config=head.tree_config or BLOCKS)


def oracle_head(target, reference: torch.Tensor, draft_length: int = 4, wrong_every: int = 0) -> ReplayHead:
    """A head that drafts the target's own continuation `reference` (wrong at every `wrong_every`-th position)."""
    return ReplayHead.from_head(random_head(target, draft_length=draft_length), reference, wrong_every)


# the sizes `tiny_causal_lm` gives every config attribute of these names that the architecture has
TINY_SIZES = dict(vocab_size=96, decoder_vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                  moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
                  shared_expert_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, ffn_dim=64, d_model=32, decoder_layers=4,
                  decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=4, encoder_attention_heads=4,
                  encoder_ffn_dim=64, n_positions=256, n_ctx=256, first_k_dense_replace=1, word_embed_proj_dim=32,
                  rotary_dim=8)
# sizes tied to others in some architectures (multi-head latent attention, grouped heads): left at their defaults by
# the later attempts of `tiny_causal_lm`
TIED_SIZES = ((), ("head_dim", "num_key_value_heads"),
              ("head_dim", "num_key_value_heads", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))


def _shrink(config, keep: tuple[str, ...]) -> None:
    settings = {**TINY_SIZES, **dict.fromkeys(("eos_token_id", "bos_token_id", "pad_token_id"))}
    for name in keep:
        settings.pop(name)
    for name, value in settings.items():
        try:
            if hasattr(config, name):
                setattr(config, name, value)
        except Exception:  # a derived (read-only) or validated attribute keeps its value
            pass
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:  # every kind the architecture mixes, within the 4 layers (unless derived from others)
        kinds = list(dict.fromkeys(kinds))
        try:
            config.layer_types = (kinds * 4)[:4]
        except AttributeError:
            pass


def tiny_causal_lm(model_type: str, seed: int = 0, **overrides):
    """A random 4-layer, 32-wide model of `model_type` from transformers' MODEL_FOR_CAUSAL_LM mapping (its default
    config shrunk by attribute name, `overrides` last), sdpa attention where it has it, eager otherwise; its output
    layer sharpened so that greedy runs vary; no EOS. The first shrink (`TIED_SIZES`) whose model builds and
    generates; otherwise the last attempt's error."""
    for attempt, keep in enumerate(TIED_SIZES):
        try:
            model = _tiny(model_type, seed, keep, overrides)
            model.generate(torch.tensor([[5, 17, 33]]), max_new_tokens=2, do_sample=False)
            return model
        except Exception:
            if attempt == len(TIED_SIZES) - 1:
                raise


def _tiny(model_type: str, seed: int, keep: tuple[str, ...], overrides: dict):
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    _shrink(config, keep)
    for name in ("text_config", "decoder", "vision_config", "audio_config"):
        sub = getattr(config, name, None)
        if sub is not None and not isinstance(sub, dict):
            _shrink(sub, keep)
    for name, value in overrides.items():
        setattr(config, name, value)
    config.tie_word_embeddings = False
    model = None
    for attn in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
            break
        except (ValueError, ImportError):
            if attn == "eager":
                raise
    model.eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    generation = model.generation_config
    generation.eos_token_id = generation.pad_token_id = generation.bos_token_id = None
    return model


def unpadded(row: torch.Tensor, mask_row: torch.Tensor) -> torch.Tensor:
    """A row of generate()'s output without its left padding (the replay head's reference)."""
    return row[int((mask_row == 0).sum()):]


def random_prompts(lengths, seed: int = 0, vocab: int = 96, low: int = 1) -> list[torch.Tensor]:
    """Random prompts of `lengths` tokens, ids in `low`..`vocab` - 1 (0 is the tests' padding)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen) for n in lengths]


def left_padded(prompts: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch: (ids [B, T] padded with `pad`, attention mask [B, T])."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def turn_writer():
    """A tiny target with a word tokenizer whose template ends a message with the special token <eot> (id 3), and
    an lm_head that makes <eot> likely, so sampled user turns end."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<eos>", "<eot>"] + [f"w{i}" for i in range(89)] + ["hello", "world", "user"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=["<eot>"])
    tok.chat_template = "hello {% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eot> {% endfor %}"
    target = tiny_target(seed=3)
    with torch.no_grad():
        target.lm_head.weight[3].mul_(4.0)
    return target, tok
