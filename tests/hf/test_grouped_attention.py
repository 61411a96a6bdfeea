"""`dart_hf.target.grouped_sdpa_attention` against transformers' own sdpa attention, and `tree_forwards`' scope."""

import types

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dart_hf.target import (check_attention, grouped_attention, grouped_sdpa_attention, tree_attention_mask,
                            tree_forwards)
from helpers.hf_models import tiny_target


def random_case(seed: int, b: int, heads: int, kv: int, n: int, s: int, bool_mask: bool):
    g = torch.Generator().manual_seed(seed)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv, is_causal=True)
    q = torch.randn(b, n, heads, 8, generator=g).transpose(1, 2)  # [B, H, N, hd], strided as the models make it
    k, v = torch.randn(b, kv, s, 8, generator=g), torch.randn(b, kv, s, 8, generator=g)
    see = torch.rand(b, n, s, generator=g) < 0.6
    see[..., 0] = True  # every query sees something
    mask = see[:, None] if bool_mask else torch.where(see, 0.0, torch.finfo(torch.float32).min)[:, None]
    return module, q, k, v, mask


@pytest.mark.parametrize("seed,b,heads,kv,n,s,bool_mask", [
    (0, 1, 9, 3, 4, 30, False), (1, 2, 4, 2, 7, 12, False), (2, 3, 8, 1, 5, 9, True), (3, 1, 6, 2, 61, 100, False),
])
def test_equals_transformers_sdpa_on_random_masks(seed, b, heads, kv, n, s, bool_mask):
    module, q, k, v, mask = random_case(seed, b, heads, kv, n, s, bool_mask)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = grouped_sdpa_attention(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (b, n, heads, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # control: the query heads stacked in the wrong order (g-major instead of kv-major) must not pass
    wrong_q = q.reshape(b, heads // kv, kv, n, 8).transpose(1, 2).reshape(b, heads, n, 8)
    wrong, _ = grouped_sdpa_attention(module, wrong_q, k, v, mask, scaling=0.3)
    if kv > 1:
        assert not torch.allclose(wrong, want, rtol=1e-3, atol=1e-4)


def test_attention_output_in_a_transposed_layout(monkeypatch):
    # CUDA's memory-efficient kernel returns [B, Hk, G*N, hd] laid out as [B, G*N, Hk, hd] (not viewable as heads)
    import dart_hf.target as target

    sdpa = target.F.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    module, q, k, v, mask = random_case(8, 2, 9, 3, 4, 20, False)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    monkeypatch.setattr(target.F, "scaled_dot_product_attention", transposed_layout)
    got, _ = grouped_sdpa_attention(module, q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_each_new_mask_is_used_inside_one_block():
    # the layers of one forward share one grouped mask; a new mask (the next step) must never get the old one
    import dart_hf.target as target

    module, q, k, v, first = random_case(4, 1, 4, 2, 3, 10, False)
    *_, second = random_case(5, 1, 4, 2, 3, 10, False)
    with grouped_attention():
        made = []
        for mask in (first, first, second, first):
            got, _ = grouped_sdpa_attention(module, q, k, v, mask)
            torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, mask)[0], rtol=1e-5, atol=1e-6)
            made.append(target._LAST_GROUPED_MASK.get()[0][2])
        assert made[0] is made[1] and made[1] is not made[2]  # one grouped mask per mask, a new one per new mask
        first.add_(torch.where(torch.rand(first.shape) < 0.5, -1e9, 0.0))  # changed in place: not the memo's any more
        got, _ = grouped_sdpa_attention(module, q, k, v, first)
        torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, first)[0], rtol=1e-5, atol=1e-6)


def test_other_cases_are_transformers_sdpa_itself():
    for n, mask_or_none in ((1, "mask"), (5, None)):  # one query; no mask
        module, q, k, v, mask = random_case(6, 1, 4, 2, n, 10, False)
        mask = mask if mask_or_none else None
        assert torch.equal(grouped_sdpa_attention(module, q, k, v, mask)[0],
                           sdpa_attention_forward(module, q, k, v, mask)[0])


def test_tree_forwards_matches_the_model_and_changes_nothing_outside(monkeypatch):
    import dart_hf.target as target

    model = tiny_target()
    stacked_calls = {"n": 0}
    sdpa = target.F.scaled_dot_product_attention

    def counting(query, *args, **kwargs):
        stacked_calls["n"] += query.shape[1] * 2 == model.config.num_attention_heads  # heads stacked 2 per kv head
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(target.F, "scaled_dot_product_attention", counting)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # a left-padded row: inside the block, transformers' mask construction still applies
    n = 4
    ancestors = torch.ones(2, n, n, dtype=torch.bool).tril()
    tree_mask = tree_attention_mask(ancestors, attention_mask.bool(), torch.float32)  # [2, 1, 4, 9 + 4]
    with torch.no_grad():
        def run():
            prompt = model(ids, attention_mask=attention_mask).logits
            cache = DynamicCache(config=model.config)
            model(ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            tree = model(ids[:, :n], position_ids=torch.arange(9, 9 + n).expand(2, n), attention_mask=tree_mask,
                         past_key_values=cache, use_cache=True).logits
            return prompt, tree

        want = run()
        with tree_forwards(model):
            assert model.config._attn_implementation == "sdpa"  # the model is not switched
            check_attention(model)  # what a second DART call sees while this one runs
            got = run()
        after = run()
    # inside the block every forward with a 4D mask took the grouped path (the padded prompts' masks are 4D too):
    # three forwards in `run`, none outside the block
    assert stacked_calls["n"] == 3 * model.config.num_hidden_layers
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(after, want):  # outside the block: the model's own kernels, bit for bit
        assert torch.equal(a, b)


def test_grouped_attention_ends_on_error_and_leaves_eager_alone(monkeypatch):
    import dart_hf.target as target

    with pytest.raises(RuntimeError, match="boom"):
        with grouped_attention():
            raise RuntimeError("boom")
    assert target._LAST_GROUPED_MASK.get() is None  # outside: transformers' own sdpa
    calls = []
    monkeypatch.setattr(target, "grouped_sdpa_attention", lambda *a, **k: calls.append(1))
    eager = tiny_target(attn="eager")
    ids = torch.randint(0, 96, (1, 5))
    mask = tree_attention_mask(torch.ones(1, 5, 5, dtype=torch.bool).tril(), torch.zeros(1, 0, dtype=torch.bool),
                               torch.float32)
    with torch.no_grad(), grouped_attention():
        eager(ids, attention_mask=mask)
    assert eager.config._attn_implementation == "eager" and not calls
