"""What each attention layer of a target sees, under plain decoding and under a DART tree forward.

`plain_views` runs a left-padded prompt, then N one-token decoding steps as plain generate() runs them (2D mask,
position ids, the model's own cache); `dart_views` runs the same prompt, then the N tokens as one DART chain (a tree
whose nodes are each other's ancestors) through `attention_layout`, `tree_attention_mask` and `tree_forward`, as a
verify step does. Both record, for every attention call, the mask the layer was given and the keys it attended over,
and turn them into the positions each query sees: {(layer, row, step): frozenset of sequence indices}, where a
padding column counts as "pad". Comparing the two compares the masks DART builds with the model's own, layer by
layer.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dart_hf import target as dart_target

PAD = "pad"


@contextlib.contextmanager
def recorded_attention(model, calls: list):
    """Within the block every attention call of `model` (sdpa, or its modeling file's eager function) appends
    (layer index, mask, key length, query length) to `calls`, then runs the attention it would have run."""
    dart_target._install_sdpa_dispatch()  # installed first, so that it never wraps the recorder
    registry = ALL_ATTENTION_FUNCTIONS._global_mapping  # shared by every AttentionInterface (Doge makes its own)
    registered = registry["sdpa"]

    def recording(attention):
        def record(module, query, key, value, attention_mask, *args, **kwargs):
            mask = attention_mask.detach().clone() if isinstance(attention_mask, torch.Tensor) else attention_mask
            calls.append((getattr(module, "layer_idx", None), mask, key.shape[-2], query.shape[-2]))
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        return record

    modules = {inspect.getmodule(type(m)) for m in model.modules()}
    eager = {m: m.eager_attention_forward for m in modules if hasattr(m, "eager_attention_forward")}
    registry["sdpa"] = recording(registered)
    for module, function in eager.items():
        module.eager_attention_forward = recording(function)
    try:
        yield
    finally:
        for module, function in eager.items():
            module.eager_attention_forward = function
        registry["sdpa"] = registered


def _visible(mask, row: int, query: int, keys: int, queries: int) -> list[bool]:
    """Which of `keys` keys query `query` of `row` attends to under `mask` (None: sdpa's own causal rule)."""
    if mask is None:
        return [queries == 1 or j <= keys - queries + query for j in range(keys)]
    m = mask[min(row, mask.shape[0] - 1), 0, min(query, mask.shape[2] - 1)]
    seen = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    if seen.shape[-1] == 1:
        return [bool(seen[0])] * keys
    if seen.shape[-1] < keys:
        raise AssertionError(f"a mask over {seen.shape[-1]} keys for {keys} keys")
    return [bool(s) for s in seen[:keys]]


def _views(calls, columns_total, pads: list[int], reals: list[int], prompt: int, step_of) -> dict:
    """{(layer, row, step): frozenset of the sequence indices (or PAD) the query sees}. The keys of a call are the
    last `keys` of `columns_total(call)` columns; prompt columns (index < prompt) count from each row's padding."""
    if not calls:
        raise AssertionError("no attention call was recorded")
    views = {}
    for number, (layer, mask, keys, queries) in enumerate(calls):
        total = columns_total(number)
        for row in range(len(pads)):
            for query in range(queries):
                seen = set()
                for j, visible in enumerate(_visible(mask, row, query, keys, queries)):
                    if not visible:
                        continue
                    column = total - keys + j
                    if column >= prompt:
                        seen.add(reals[row] + column - prompt)
                    elif column >= pads[row]:
                        seen.add(column - pads[row])
                    else:
                        seen.add(PAD)
                views[(layer, row, step_of(number, query))] = frozenset(seen)
    return views


def _prefill(model, ids, mask):
    cache = DynamicCache(config=model.config)
    positions = dart_target.prompt_positions(mask)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def plain_views(model, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor):
    """(views, logits [B, N, V]) of N plain one-token decoding steps over `tokens` [B, N] after the prompt."""
    cache = _prefill(model, ids, mask)
    calls, logits, steps = [], [], []
    reals = mask.sum(dim=1)
    prompt = ids.shape[1]
    for s in range(tokens.shape[1]):
        step_mask = torch.cat((mask, torch.ones(mask.shape[0], s + 1, dtype=mask.dtype)), dim=1)
        before = len(calls)
        with recorded_attention(model, calls):
            out = model(input_ids=tokens[:, s : s + 1], attention_mask=step_mask, position_ids=(reals + s)[:, None],
                        past_key_values=cache, use_cache=True)
        steps += [s] * (len(calls) - before)
        logits.append(out.logits[:, -1])
    pads = [prompt - int(r) for r in reals]
    views = _views(calls, lambda n: prompt + steps[n] + 1, pads, reals.tolist(), prompt, lambda n, q: steps[n])
    return views, torch.stack(logits, dim=1)


@torch.no_grad()
def dart_views(model, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor):
    """(views, logits [B, N, V]) of one DART verify forward over `tokens` [B, N] as a chain after the prompt (raises
    DartInputError where `attention_layout` refuses the model)."""
    layout = dart_target.attention_layout(model)
    cache = _prefill(model, ids, mask)
    b, n = tokens.shape
    prompt = ids.shape[1]
    reals = mask.sum(dim=1)
    calls = []
    with dart_target.whole_sliding_layers(cache):
        ancestors = torch.ones(b, n, n, dtype=torch.bool).tril()
        depths = torch.arange(n).expand(b, -1)
        dtype = next(model.parameters()).dtype
        tree_mask = dart_target.tree_attention_mask(ancestors, mask.bool(), dtype, depths, layout,
                                                    dart_target.sliding_dropped(cache, prompt))
        with dart_target.tree_forwards(model), recorded_attention(model, calls):
            out = dart_target.tree_forward(model, tokens, reals[:, None] + depths, tree_mask, cache, (0,))
    pads = [prompt - int(r) for r in reals]
    views = _views(calls, lambda _: prompt + n, pads, reals.tolist(), prompt, lambda _, q: q)
    return views, out.logits


def padded_prompt(length: int = 10, pad: int = 3, vocab: int = 96, seed: int = 0):
    """ids [2, length] and their left-padded mask (row 0 with `pad` padding columns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def differences(plain: dict, dart: dict) -> list[str]:
    """The (layer, row, step) whose views differ, described."""
    out = []
    for key in sorted(set(plain) | set(dart), key=str):
        if plain.get(key) != dart.get(key):
            out.append(f"layer {key[0]} row {key[1]} step {key[2]}: plain sees {sorted(plain.get(key, ()), key=str)}, "
                       f"DART {sorted(dart.get(key, ()), key=str)}")
    return out
