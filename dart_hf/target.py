"""What DART needs from a stock transformers decoder-only model: checks, taps, tree forwards and KV compaction."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dart_core import DartHead
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
    """The target over one tree block appended to `cache`: node_ids / positions [1, N], additive mask
    [1, 1, N, past+N] -> the model output (logits [1, N, V], hidden states at `layer_ids`). Few-row linear layers
    take the faster CPU product (`dart_core.matmul`)."""
    with few_row_linears(model):
        return model(input_ids=node_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                     use_cache=True, output_hidden_states=list(layer_ids))


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


def first_eos(generation_config) -> Optional[int]:
    """The (first) EOS id of a generation config, for the tree search's EOS ordering."""
    eos = generation_config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)
