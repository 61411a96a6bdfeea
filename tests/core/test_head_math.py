"""dart_core.head_math, the head's one forward: its visibility rule and attention against element-by-element
re-derivations of docs/DESIGN.md §2.2 on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from dart_core import head_math


def step_visibility_by_rule(past: list[int], lengths: list[int], span: int, t: int, d: int) -> torch.Tensor:
    """bool [B, T+D, span+T+D] of one drafting step, entry by entry: every row reads the cached rows its sequence
    holds; a real new row reads the real new rows up to itself; mask row m reads every real new row and mask rows
    1..m; padding is never read."""
    see = torch.zeros(len(past), t + d, span + t + d, dtype=torch.bool)
    for b in range(len(past)):
        for q in range(t + d):
            for c in range(span):
                see[b, q, c] = c < past[b]
            for j in range(t):
                see[b, q, span + j] = j < lengths[b] and (q >= t or j <= q)
            for m in range(d):
                see[b, q, span + t + m] = q >= t and m <= q - t
    return see


@pytest.mark.parametrize("seed", range(10))
def test_step_visibility_follows_the_rule(seed):
    g = torch.Generator().manual_seed(seed)
    b, t, d = (int(torch.randint(1, 5, (), generator=g)) for _ in range(3))
    span = int(torch.randint(0, 8, (), generator=g))
    past = torch.randint(0, span + 1, (b,), generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    queries, cached = head_math.step_rows(past, lengths, span, t, d)
    got = head_math.visibility(queries, head_math.Rows.cat(cached, queries))
    assert torch.equal(got, step_visibility_by_rule(past.tolist(), lengths.tolist(), span, t, d))
    # RoPE: real row i at past+i, mask row m (1..D) right after the last real row
    expected = [[p + i for i in range(t)] + [p + n - 1 + m for m in range(1, d + 1)]
                for p, n in zip(past.tolist(), lengths.tolist())]
    assert queries.positions().tolist() == expected


def training_visibility_by_rule(anchors: list[list[int]], n: int, d: int) -> torch.Tensor:
    """bool [B, N+A*D, N+A*D] of a training pass, entry by entry (docs/DESIGN.md §1.5)."""
    a = len(anchors[0])
    s = n + a * d
    see = torch.zeros(len(anchors), s, s, dtype=torch.bool)
    for b, row_anchors in enumerate(anchors):
        for q in range(s):
            for c in range(s):
                if q < n:
                    see[b, q, c] = c <= q
                elif c < n:
                    see[b, q, c] = c <= row_anchors[(q - n) // d]
                else:
                    see[b, q, c] = (q - n) // d == (c - n) // d and c <= q
    return see


@pytest.mark.parametrize("seed", range(6))
def test_training_visibility_follows_the_rule(seed):
    g = torch.Generator().manual_seed(seed)
    b, n, a, d = 2, int(torch.randint(1, 9, (), generator=g)), 3, int(torch.randint(1, 4, (), generator=g))
    anchors = torch.randint(0, n, (b, a), generator=g)
    rows = head_math.training_rows(anchors, n, d)
    assert torch.equal(head_math.visibility(rows, rows), training_visibility_by_rule(anchors.tolist(), n, d))


def attention_by_loop(q, keys, values, see, scale):
    """Grouped-query attention one (batch, head, query) at a time: query head h reads key/value head h // G."""
    b, heads, q_len, hd = q.shape
    groups = heads // keys.shape[1]
    out = torch.zeros(b, q_len, heads * hd, dtype=q.dtype)
    for i in range(b):
        for h in range(heads):
            for r in range(q_len):
                cols = see[i, r].nonzero().flatten()
                scores = torch.stack([q[i, h, r] @ keys[i, h // groups, c] * scale for c in cols])
                weights = torch.softmax(scores, dim=0)
                out[i, r, h * hd:(h + 1) * hd] = sum(w * values[i, h // groups, c] for w, c in zip(weights, cols))
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_attention_equals_a_per_head_loop(heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, q_len, s, hd = 2, 3, 5, 4
    q = torch.randn(b, heads, q_len, hd, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(b, kv_heads, s, hd, generator=g, dtype=torch.float64) for _ in range(2))
    see = torch.rand(b, q_len, s, generator=g) < 0.6
    see[..., 0] = True  # every query reads something
    got = head_math.attention(q, keys, values, see)
    torch.testing.assert_close(got, attention_by_loop(q, keys, values, see, 1 / math.sqrt(hd)))
    # control: reading key/value head h % kv instead of h // G differs whenever heads share a key/value head
    if 1 < heads // kv_heads < heads:
        wrong = head_math.attention(q, keys.repeat(1, heads // kv_heads, 1, 1)[:, :heads],
                                    values.repeat(1, heads // kv_heads, 1, 1)[:, :heads], see)
        assert not torch.allclose(wrong, got)
