"""What DART needs from a stock transformers decoder-only model: checks, taps, tree forwards and KV compaction."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from dart_core import Drafter, TreeConfig
from dart_core.errors import DartInputError
from dart_core.fit import TargetShape, check_fits
from dart_core.head_math import additive_mask
from dart_runtime.matmul import few_row_linears
from dart_hf.compat import attention_implementation, registered_attention

# attention implementations that accept an arbitrary 4D additive mask (a tree mask)
TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclasses.dataclass(frozen=True)
class TargetPlan:
    """How to drive one target with one head: which hidden states to request (and concatenate, in this order)."""

    layer_ids: tuple[int, ...]  # HF `hidden_states` indices of the taps (0 = embedding output)


def plan_for(model, head: Drafter, tokenizer=None) -> TargetPlan:
    """Check that `head` fits `model` (and `tokenizer`) and share the target embedding with a head that reads hidden
    states; a drafter that reads none taps no layer.

    Raises ValueError naming every mismatch and its numbers (`dart_core.fit`).
    """
    cfg = model.config.get_text_config()
    if getattr(cfg, "is_encoder_decoder", False) or getattr(model.config, "is_encoder_decoder", False):
        raise DartInputError("DART needs a decoder-only causal LM; got an encoder-decoder model")
    embedding = model.get_input_embeddings()
    vocab, width = (int(n) for n in embedding.weight.shape)
    if tokenizer is not None and len(tokenizer) > vocab:
        raise DartInputError(f"tokenizer has {len(tokenizer)} tokens, more than the target vocabulary ({vocab})")
    if not head.reads_hidden_states:
        return TargetPlan(layer_ids=())
    if width != int(cfg.hidden_size):
        raise DartInputError(f"{type(model).__name__} embeds tokens in {width} dimensions and its hidden states have "
                             f"{cfg.hidden_size}: a DART head shares the target's embedding table, which needs the two "
                             "equal")
    shape = TargetShape(int(cfg.hidden_size), vocab, int(cfg.num_hidden_layers), f"the target {type(model).__name__}")
    layer_ids = check_fits(head.config, head.d2t, shape)
    if head.get_input_embeddings() is not embedding:
        head.set_input_embeddings(embedding)
    return TargetPlan(layer_ids=tuple(layer_ids))


def check_tree_fits(head: Drafter, tree_config: TreeConfig) -> None:
    """DartInputError, naming both numbers, when `head` cannot draft trees of `tree_config` (what its drafting pass
    or the tree search would refuse only after the prefill): a DART head's pass takes the best `topk` tokens of its
    draft vocabulary at each level, so `topk` must not exceed that vocabulary. A drafter with a drafting pass of its
    own (`Eagle3Head` takes at most its vocabulary; model-free drafting has none) is not checked here."""
    from dart_core.head import DartHead

    if not isinstance(head, DartHead) or type(head).draft is not DartHead.draft:
        return
    vocab = int(head.config.draft_vocab_size)
    if tree_config.topk > vocab:
        raise DartInputError(f"the tree settings take topk={tree_config.topk} candidates per level, more than the "
                             f"head's draft vocabulary of {vocab} tokens (use TreeConfig(topk=...) of at most {vocab})")


def check_ngram_fits(ngram, model, tokenizer=None) -> None:
    """DartInputError when the n-gram table `ngram` was not counted for `model`'s vocabulary or, given,
    `tokenizer` (`dart_core.ngram.check_ngram_tokenizer`: sizes, contents, special tokens)."""
    from dart_core.ngram import check_ngram_tokenizer

    vocab = int(model.get_input_embeddings().weight.shape[0])
    if tokenizer is not None:
        check_ngram_tokenizer(ngram, tokenizer, vocab)
    elif ngram.vocab_bound > vocab or (ngram.tokenizer is not None and ngram.tokenizer["vocab_size"] > vocab):
        raise DartInputError(f"the n-gram table was counted for a vocabulary of "
                             f"{max(ngram.vocab_bound, (ngram.tokenizer or {}).get('vocab_size', 0))} tokens, more "
                             f"than the model's {vocab}")


# model types whose attention adds an ALiBi position bias built from a 2D padding mask, which a tree mask replaces
ALIBI_MODEL_TYPES = ("bloom", "mpt")


def check_architecture(model) -> None:
    """What a tree forward needs of the architecture itself: a KV cache it fills and position information a 4D
    mask does not replace. Raises DartInputError naming what is missing."""
    import inspect

    cfg = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if cfg.model_type in ALIBI_MODEL_TYPES or getattr(cfg, "alibi", False) is True:
        raise DartInputError(f"{name} adds an ALiBi position bias built from a 2D padding mask; a tree forward "
                             "passes a 4D tree mask instead")
    takes = inspect.signature(model.forward).parameters
    if "past_key_values" not in takes:
        raise DartInputError(f"{name} computes without a KV cache (its forward takes no past_key_values); DART "
                             "verifies a tree against the cached prefix")
    missing = [arg for arg in ("attention_mask", "position_ids") if arg not in takes]
    if missing:
        raise DartInputError(f"{name}'s forward takes no {' / '.join(missing)}; a tree forward gives each node its "
                             "own position and the ancestors it sees")


def check_attention(model) -> None:
    """Tree verification needs an attention implementation that takes a 4D additive mask."""
    impl = attention_implementation(model.config)
    if impl not in TREE_ATTENTION_IMPLEMENTATIONS:
        raise DartInputError(f"DART tree decoding needs attention that accepts a tree mask "
                             f"({', '.join(TREE_ATTENTION_IMPLEMENTATIONS)}); "
                             f"the model uses {impl!r}. Load it with attn_implementation='sdpa' "
                             f"(or call model.set_attn_implementation('sdpa')).")


# the attention layer types (transformers' `layer_types`) whose masks DART builds for a tree
TREE_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """The target's attention layers as tree masks must serve them."""

    window: Optional[int]  # W of the windowed layers (a query at index i sees keys at indices > i - W), or None
    by_type: bool  # both full and sliding layers: the model takes its masks as a dict by layer type


def attention_layout(model) -> AttentionLayout:
    """The window each of `model`'s attention layers looks through, as its own forward and cache decide it.

    A decoding step's query sees the keys its cache layer holds (a sliding-window cache layer of window W: the last
    W-1 and itself; the cache's layers as transformers builds them from the config) within the mask the forward gives
    the layer (`_mask_windows`); the narrower of the two is the layer's window. Raises DartInputError naming the
    layers a tree mask cannot serve: chunked, linear or state-space layers, a sliding-window cache of window 1 (it keeps
    every position, so plain decoding's queries look past their window), layers that share one mask but hold different
    positions or look through different windows."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    types, kwargs = get_layer_types_and_kwargs(cfg)
    other = sorted(set(types) - set(TREE_LAYER_TYPES))
    if other:
        raise DartInputError(f"DART tree decoding masks full-attention and sliding-window layers only; "
                             f"{name} has {', '.join(other)} layers")
    kept = [kw.get("sliding_window") if kind == "sliding_attention" else None for kind, kw in zip(types, kwargs)]
    if any(kind == "sliding_attention" and w is None for kind, w in zip(types, kept)):
        raise DartInputError(f"{name} has sliding-window layers but no sliding_window in its config")
    for window in {w for w in kept if w is not None}:
        if not isinstance(window, int) or window < 2:
            raise DartInputError(f"{name}'s sliding-window layers have sliding_window={window}; transformers' "
                                 "sliding-window cache keeps every position at a window below 2 (it keeps the last "
                                 "W-1), so plain decoding looks past the window and DART cannot verify as it does")
    masked = _mask_windows(model, cfg, types)
    for window in {w for w in masked if w is not None}:
        if not isinstance(window, int) or window < 1:
            raise DartInputError(f"{name} masks its layers with sliding_window={window}, which hides every key")
    windows = [_narrower(k, m) for k, m in zip(kept, masked)]
    if _masks_by_type(model, cfg) and len(set(types)) > 1:  # a dict of masks, each layer takes its type's
        groups = {kind: {(k is None, w) for t, k, w in zip(types, kept, windows) if t == kind} for kind in set(types)}
        if groups["full_attention"] == {(True, None)} and len(groups["sliding_attention"]) == 1:
            return AttentionLayout(next(iter(groups["sliding_attention"]))[1], True)
        raise DartInputError(f"DART tree decoding needs one window for each layer type; {name}'s layers "
                             f"{_per_layer(types, windows)}")
    if len({k is None for k in kept}) > 1 or len(set(windows)) > 1:  # one mask for every layer
        raise DartInputError(f"{name} gives every layer one mask, but its layers hold different positions or look "
                             f"through different windows ({_per_layer(types, windows)}): DART tree decoding needs "
                             "them alike")
    return AttentionLayout(windows[0] if windows else None, False)


def _narrower(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else min(a, b)


def _per_layer(types: list[str], windows: list[Optional[int]]) -> str:
    return ", ".join(f"{i}: {kind} window {w}" for i, (kind, w) in enumerate(zip(types, windows)))


def _forward_module(model):
    """The module whose forward builds `model`'s attention masks (its decoder's class's module)."""
    import inspect

    try:
        decoder = model.get_decoder()
    except Exception:  # a model without a separate decoder builds its masks itself
        decoder = model
    return inspect.getmodule(type(decoder if decoder is not None else model))


def _declares_layer_types(cfg) -> bool:
    """Whether the config's class has a `layer_types` field (a model that masks each layer by its type), rather than
    `layer_types` being an attribute only the cache reads (Mistral's family)."""
    fields = getattr(type(cfg), "__dataclass_fields__", None)
    if fields is not None:
        return "layer_types" in fields
    return any("layer_types" in getattr(k, "__annotations__", {}) for k in type(cfg).__mro__)


def _masks_by_type(model, cfg) -> bool:
    """Whether the forward gives each layer the mask of its `layer_types` entry (and so takes a dict of masks)."""
    return _declares_layer_types(cfg) and hasattr(_forward_module(model), "create_sliding_window_causal_mask")


def _mask_windows(model, cfg, types: list[str]) -> list[Optional[int]]:
    """The window of the mask `model`'s forward gives each layer (None: a causal mask), per architecture as
    transformers 5 writes them: a forward that never builds a sliding-window mask gives every layer a causal one; one
    whose config declares `layer_types` gives each sliding layer a window of `config.sliding_window` and each full
    one a causal mask; the rest (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE, ...) give every layer one mask,
    sliding with `config.sliding_window` whenever it is set, whatever `layer_types` says."""
    if not hasattr(_forward_module(model), "create_sliding_window_causal_mask"):
        return [None] * len(types)
    window = getattr(cfg, "sliding_window", None)
    if not _declares_layer_types(cfg):
        return [window] * len(types)
    return [window if kind == "sliding_attention" else None for kind in types]


def check_cache(cache) -> None:
    """Tree decoding compacts the KV cache in place: DynamicCache layers of full or sliding-window attention."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    kinds = (DynamicLayer, DynamicSlidingWindowLayer)
    if not isinstance(cache, DynamicCache) or not all(type(layer) in kinds for layer in cache.layers):
        found = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])}) or [type(cache).__name__]
        raise DartInputError(f"DART tree decoding supports a DynamicCache of full-attention and sliding-window "
                             f"layers only; got {type(cache).__name__} with {', '.join(found)}. Leave "
                             f"cache_implementation unset (static, offloaded, quantized and linear-attention caches "
                             f"are not supported).")


@contextlib.contextmanager
def whole_sliding_layers(cache) -> Iterator[None]:
    """Within the block the cache's sliding-window layers keep every position they receive, as full layers do (tree
    blocks are compacted after the forward); on leaving, each keeps the last W-1, as plain decoding leaves it."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    for layer in sliding:
        layer.update = functools.partial(_update_keeping_all, layer)
    try:
        yield
    finally:
        for layer in sliding:
            del layer.update
            if layer.is_initialized:
                layer.keys = layer.keys[..., -layer.sliding_window + 1 :, :]
                layer.values = layer.values[..., -layer.sliding_window + 1 :, :]


def sliding_dropped(cache, columns: int) -> int:
    """Of the `columns` cache columns full layers hold, how many the sliding layers have already let go."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and layer.is_initialized:
            return columns - layer.keys.shape[-2]
    return 0


def _update_keeping_all(layer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """A sliding-window layer's `update` as a full layer's: keep everything, return everything."""
    from transformers.cache_utils import DynamicLayer

    layer.cumulative_length += key_states.shape[-2]
    return DynamicLayer.update(layer, key_states, value_states)


def crop_cache(cache, tokens: int) -> None:
    """Drop the last `tokens` positions of every layer (inside `whole_sliding_layers` for sliding layers)."""
    for layer in cache.layers:
        if layer.is_initialized and tokens:
            layer.keys, layer.values = layer.keys[..., :-tokens, :], layer.values[..., :-tokens, :]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length -= tokens


def tapped_hidden_states(outputs, layer_ids: tuple[int, ...], ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T, 3*H] concatenation of the target's hidden states at the taps; without taps, [B, T, 0] rows shaped as
    the forward's input `ids` [B, T] (a drafter that reads no hidden states)."""
    if not layer_ids:
        return torch.zeros(*ids.shape, 0, device=ids.device)
    return torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)


def hidden_state_request(layer_ids: tuple[int, ...]):
    """A forward's `output_hidden_states` for the taps: those layers, or False without taps."""
    return list(layer_ids) if layer_ids else False


def tree_attention_mask(ancestors: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype,
                        depths: Optional[torch.Tensor] = None, layout: Optional[AttentionLayout] = None,
                        dropped: int = 0):
    """Additive mask [B, 1, N, S+N]: node i of row b sees the cache columns with columns[b] True (not padding, not a
    hole left by compaction) and its own ancestors (and itself). ancestors [B, N, N] bool, columns [B, S] bool.

    With a sliding-window `layout` (and the nodes' `depths` [B, N]), sliding layers see only what plain decoding's
    window shows: tokens fewer than W before the node in the row's own sequence, over the columns they still hold (all
    but the first `dropped`) -> that mask [B, 1, N, S-dropped+N], or a dict of both masks by layer type."""
    n = ancestors.shape[1]
    see = torch.cat((columns[:, None, :].expand(-1, n, -1), ancestors), dim=2)
    if layout is None or layout.window is None:
        return additive_mask(see, dtype)
    w = layout.window
    index = columns.long().cumsum(dim=1) - 1  # [B, S] each real column's index in its row's sequence
    nodes = columns.sum(dim=1, keepdim=True) + depths  # [B, N] each node's index in that sequence
    near = torch.cat((index[:, None, :] > nodes[:, :, None] - w, depths[:, None, :] > depths[:, :, None] - w), dim=2)
    sliding = additive_mask((see & near)[..., dropped:], dtype)
    if not layout.by_type:
        return sliding
    return {"full_attention": additive_mask(see, dtype), "sliding_attention": sliding}


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] of a left-padded prompt as `generate()` makes them: real tokens count from 0, padding
    gets 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def tree_forward(model, node_ids: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor], cache,
                 layer_ids: tuple[int, ...]):
    """The target over one tree block appended to `cache`: node_ids / positions [B, N], additive mask
    [B, 1, N, past+N] (None: the model's own causal mask, for a block that is a chain over a cache of tokens alone) ->
    the model output (logits [B, N, V], hidden states at `layer_ids`). Run inside `tree_forwards(model)` for the
    faster kernels."""
    return model(input_ids=node_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                 use_cache=True, output_hidden_states=hidden_state_request(layer_ids))


@contextlib.contextmanager
def tree_forwards(model) -> Iterator[None]:
    """Within the block, in this context only, `model`'s forwards take the kernels that suit tree verification:
    few-row linear layers the faster CPU product (`dart_runtime.matmul`), sdpa attention `grouped_sdpa_attention`.
    Results are those of the model's own kernels up to float rounding; other threads and code outside the block keep
    the model's own kernels."""
    with few_row_linears(model), grouped_attention():
        yield


def verify_kernels(model, rows: int) -> contextlib.AbstractContextManager:
    """The kernels of a verify forward over `rows` rows (the batch's tree nodes): `tree_forwards(model)` for two or
    more, the model's own for one (a batch-of-one plain step computes exactly as a plain `generate()` step, with no
    dispatch per layer)."""
    return tree_forwards(model) if rows > 1 else contextlib.nullcontext()


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
            _PLAIN_SDPA.append(registered_attention("sdpa"))
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
    path is already 0, 1, ..., a (nothing to move, only the cut). A sliding-window layer (inside
    `whole_sliding_layers`) that let go of its first positions before the block holds the same block at its end."""
    end = past_len + paths.shape[1]
    for layer in cache.layers:
        if not layer.is_initialized:  # a layer the forwards leave empty (cross-attention without its inputs)
            continue
        dropped = 0
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer
            dropped = layer.cumulative_length - layer.keys.shape[-2]
            layer.cumulative_length = end
        start, stop = past_len - dropped, end - dropped
        if not at_front:
            index = (start + paths)[:, None, :, None]  # [B, 1, k, 1]
            for states in (layer.keys, layer.values):  # keys and values may differ in width (latent attention)
                # accepted rows move to the front of the block in place; the slice is a view (the next update copies)
                states[..., start:stop, :] = states.gather(2, index.expand(-1, states.shape[1], -1, states.shape[3]))
        layer.keys, layer.values = layer.keys[..., :stop, :], layer.values[..., :stop, :]


def tree_settings(head: Drafter, generation_config, override: Optional[TreeConfig] = None,
                  context_draft: Optional[bool] = None) -> TreeConfig:
    """The tree settings a generate() call searches with (the one place that decides them): `override`, else the
    head's own, else the reference's; context drafting as `context_drafting` decides; the EOS the search orders by
    is the call's (its generation config's first), when it has one."""
    base = override or head.tree_config or head.default_tree_config(None)
    context = context_drafting(head, override, context_draft)
    if context != base.context_draft:
        base = dataclasses.replace(base, context_draft=context)
    eos = first_eos(generation_config)
    return base if eos is None or eos == base.eos_token_id else dataclasses.replace(base, eos_token_id=eos)


def context_drafting(head: Drafter, override: Optional[TreeConfig] = None,
                     context_draft: Optional[bool] = None) -> bool:
    """Whether a call drafts from the row's own context (docs/DESIGN.md §2.6): never for a head whose trees are its
    own expansion's (`Eagle3Head`); else the call's `dart_context_draft`, else its tree settings' `context_draft`,
    else the head's."""
    if not head.DRAFTS_WITH_CONTEXT:
        return False
    if context_draft is not None:
        return context_draft
    return (override or head.tree_config or head.default_tree_config(None)).context_draft


def first_eos(generation_config) -> Optional[int]:
    """The first EOS id of a generation config that is a token (>= 0; a negative id never ends a sequence), for the
    tree search's EOS ordering."""
    eos = generation_config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    ids = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    return next((int(i) for i in ids if int(i) >= 0), None)
