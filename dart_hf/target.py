"""What DART needs from a stock transformers decoder-only model: checks, taps, tree forwards and KV compaction."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from dart_core import DartHead, TreeConfig
from dart_core.errors import DartInputError
from dart_core.fit import TargetShape, check_fits
from dart_core.head import additive_mask
from dart_core.matmul import few_row_linears

# attention implementations that accept an arbitrary 4D additive mask (a tree mask)
TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclasses.dataclass(frozen=True)
class TargetPlan:
    """How to drive one target with one head: which hidden states to request (and concatenate, in this order)."""

    layer_ids: tuple[int, ...]  # HF `hidden_states` indices of the taps (0 = embedding output)


def plan_for(model, head: DartHead, tokenizer=None) -> TargetPlan:
    """Check that `head` fits `model` (and `tokenizer`) and share the target embedding with the head.

    Raises ValueError naming every mismatch and its numbers (`dart_core.fit`).
    """
    cfg = model.config.get_text_config()
    if getattr(cfg, "is_encoder_decoder", False) or getattr(model.config, "is_encoder_decoder", False):
        raise DartInputError("DART needs a decoder-only causal LM; got an encoder-decoder model")
    embedding = model.get_input_embeddings()
    vocab = int(embedding.weight.shape[0])
    shape = TargetShape(int(cfg.hidden_size), vocab, int(cfg.num_hidden_layers), f"the target {type(model).__name__}")
    layer_ids = check_fits(head.config, head.d2t, shape)
    if tokenizer is not None and len(tokenizer) > vocab:
        raise DartInputError(f"tokenizer has {len(tokenizer)} tokens, more than the target vocabulary ({vocab})")
    if head.get_input_embeddings() is not embedding:
        head.set_input_embeddings(embedding)
    return TargetPlan(layer_ids=tuple(layer_ids))


def check_attention(model) -> None:
    """Tree verification needs an attention implementation that takes a 4D additive mask."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION_IMPLEMENTATIONS:
        raise DartInputError(f"DART tree decoding needs attention that accepts a tree mask "
                             f"({', '.join(TREE_ATTENTION_IMPLEMENTATIONS)}); "
                             f"the model uses {impl!r}. Load it with attn_implementation='sdpa' "
                             f"(or call model.set_attn_implementation('sdpa')).")


def check_cache(cache) -> None:
    """Tree decoding compacts the KV cache in place; only full-attention DynamicCache layers support that."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache) or not all(type(layer) is DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])}) or [type(cache).__name__]
        raise DartInputError(f"DART tree decoding supports a DynamicCache of full-attention layers only; got "
                             f"{type(cache).__name__} with {', '.join(kinds)}. Leave cache_implementation unset "
                             f"(sliding-window, static, quantized and linear-attention caches are not supported).")


def tapped_hidden_states(outputs, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[B, T, 3*H] concatenation of the target's hidden states at the taps."""
    return torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)


def tree_attention_mask(ancestors: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, N, S+N]: node i of row b sees the cache columns with columns[b] True (not padding, not a
    hole left by compaction) and its own ancestors (and itself). ancestors [B, N, N] bool, columns [B, S] bool."""
    n = ancestors.shape[1]
    see = torch.cat((columns[:, None, :].expand(-1, n, -1), ancestors), dim=2)
    return additive_mask(see, dtype)


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] of a left-padded prompt as `generate()` makes them: real tokens count from 0, padding
    gets 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def tree_forward(model, node_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache,
                 layer_ids: tuple[int, ...]):
    """The target over one tree block appended to `cache`: node_ids / positions [B, N], additive mask
    [B, 1, N, past+N] -> the model output (logits [B, N, V], hidden states at `layer_ids`). Run inside
    `tree_forwards(model)` for the faster kernels."""
    return model(input_ids=node_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                 use_cache=True, output_hidden_states=list(layer_ids))


@contextlib.contextmanager
def tree_forwards(model) -> Iterator[None]:
    """Within the block, in this context only, `model`'s forwards take the kernels that suit tree verification:
    few-row linear layers the faster CPU product (`dart_core.matmul`), sdpa attention `grouped_sdpa_attention`.
    Results are those of the model's own kernels up to float rounding; other threads and code outside the block keep
    the model's own kernels."""
    with few_row_linears(model), grouped_attention():
        yield


# ---- grouped-query attention without copies of the keys and values ------------------------------------------------
SDPA_EXTRAS = ("position_bias", "softcap", "cache", "s_aux")  # what sdpa does beyond plain attention: left to it
# inside `grouped_attention`: [(mask, its version counter, G, grouped mask)] of the last mask seen, so that the layers
# of one forward share one grouped mask (the entry holds the mask, so `is` cannot match another tensor, and the
# version counter catches an in-place change); None outside (sdpa is transformers' own)
_LAST_GROUPED_MASK: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("dart_grouped_mask", default=None)
_SDPA_LOCK = threading.Lock()
_PLAIN_SDPA: list = []  # [the "sdpa" attention function registered before `_sdpa_dispatch`], once installed


def _sdpa_dispatch(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' "sdpa" attention once DART has used it: the function registered before (transformers' own),
    or inside `grouped_attention` in this context, `grouped_sdpa_attention`."""
    if _LAST_GROUPED_MASK.get() is None:
        return _PLAIN_SDPA[0](module, query, key, value, attention_mask, *args, **kwargs)
    return grouped_sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs)


def _install_sdpa_dispatch() -> None:
    """Register `_sdpa_dispatch` as transformers' "sdpa" attention (once; it calls the previous function outside
    DART's tree forwards, so every other forward computes exactly as before)."""
    if _PLAIN_SDPA:
        return
    from transformers import AttentionInterface

    with _SDPA_LOCK:
        if not _PLAIN_SDPA:
            _PLAIN_SDPA.append(AttentionInterface._global_mapping["sdpa"])
            AttentionInterface.register("sdpa", _sdpa_dispatch)


def grouped_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs):
    """transformers' sdpa attention, with the G query heads of each key/value head of a grouped-query model
    attending to that head without copying it.

    With a 4D mask and several queries transformers' sdpa copies every key/value head G times (`repeat_kv`: the
    whole cache, in every layer and step). Here the G query heads of a key/value head are stacked along the query
    axis instead, with the mask repeated to match: the same scores and softmax for every (head, query) pair.
    query [B, H, N, hd], key/value [B, H/G, S, hd], mask [B, 1, N, S] -> ([B, N, H, hd], None). Every other case
    (no mask, one query, no grouping, dropout, sdpa's extras) is transformers' own sdpa attention.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    b, h, n, hd = query.shape
    s = key.shape[2]
    if (groups == 1 or n == 1 or key.shape[1] * groups != h or value.shape[-1] != hd or attention_mask is None
            or tuple(attention_mask.shape[1:]) != (1, n, s) or dropout
            or any(kwargs.get(name) is not None for name in SDPA_EXTRAS)):
        return _plain_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    stacked = query.reshape(b, h // groups, groups * n, hd)  # head kv*G + g, query i -> row g*N + i of head kv
    mask = _grouped_mask(attention_mask, b, groups)  # [B, 1, G*N, S]
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)  # [B, H/G, G*N, hd]
    # reshape, not view: CUDA's memory-efficient kernel returns this shape in a transposed layout
    return out.reshape(b, h, n, hd).transpose(1, 2).contiguous(), None


def _plain_sdpa():
    """The sdpa attention DART's dispatch wraps (transformers' own before any DART call)."""
    if _PLAIN_SDPA:
        return _PLAIN_SDPA[0]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _grouped_mask(mask: torch.Tensor, batch: int, groups: int) -> torch.Tensor:
    """mask [B or 1, 1, N, S] -> [B, 1, G*N, S] (the N rows repeated G times); inside `grouped_attention`, made once
    per mask (every layer of a forward gets the same one) unless the mask changed in place (an inference tensor, made
    under `torch.inference_mode()`, keeps no version counter: the same object is taken as unchanged)."""
    slot = _LAST_GROUPED_MASK.get()
    version = (None if mask.is_inference() else mask._version, groups)
    if slot is not None and slot[0] is not None and slot[0][0] is mask and slot[0][1] == version:
        return slot[0][2]
    grouped = mask.expand(batch, -1, -1, -1).repeat(1, 1, groups, 1)
    if slot is not None:
        slot[0] = (mask, version, grouped)
    return grouped


@contextlib.contextmanager
def grouped_attention() -> Iterator[None]:
    """Within the block, in this context only, attention layers that use sdpa take `grouped_sdpa_attention`."""
    _install_sdpa_dispatch()
    token = _LAST_GROUPED_MASK.set([None])
    try:
        yield
    finally:
        _LAST_GROUPED_MASK.reset(token)


def keep_accepted_path(cache, past_len: int, paths: torch.Tensor, at_front: bool = False) -> None:
    """Drop the rejected tree nodes from every layer: keep the past and, per row b, the nodes paths[b] [B, k]
    (tree-block indices) moved to the front of its block; the cache ends at past_len + k. `at_front`: every row's
    path is already 0, 1, ..., a (nothing to move, only the cut)."""
    end = past_len + paths.shape[1]
    if at_front:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        return
    index = None
    for layer in cache.layers:
        if index is None or index.shape[1] != layer.keys.shape[1] or index.shape[3] != layer.keys.shape[3]:
            index = (past_len + paths)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        # accepted rows move to the front of the block in place; the slice is a view (the next update copies anyway)
        layer.keys[..., past_len:end, :] = layer.keys.gather(2, index)
        layer.values[..., past_len:end, :] = layer.values.gather(2, index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


def tree_settings(head: DartHead, generation_config, override: Optional[TreeConfig] = None) -> TreeConfig:
    """The tree settings a generate() call searches with (the one place that decides them): `override`, else the
    head's own, else the reference's; the EOS the search orders by is the call's (its generation config's first),
    when it has one."""
    base = override or head.tree_config or head.default_tree_config(None)
    eos = first_eos(generation_config)
    return base if eos is None or eos == base.eos_token_id else dataclasses.replace(base, eos_token_id=eos)


def first_eos(generation_config) -> Optional[int]:
    """The (first) EOS id of a generation config, for the tree search's EOS ordering."""
    eos = generation_config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)
