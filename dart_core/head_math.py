"""The DART head's forward as functions of its parts (docs/DESIGN.md §2.2): the one definition that inference
(`DartHead.step`), training (`DartHead.training_forward`), the EAGLE3-style drafter (`dart_core.eagle3`) and SGLang's
draft model (`dart_sglang.models.llama_dart`) call, each plugging in its own layers as a `HeadParts`.

A pass runs the head's one decoder layer over ROWS. A real row stands for a target position: its input is
cat(input_layernorm(embed(next token)), hidden_norm(fc(taps))), its residual fc(taps). A mask row is the learned
`mask_rep` (residual: its first H entries); a block of D mask rows after an anchor (a real row) predicts the positions
anchor+2..anchor+D+1. `Rows` describes each row by its anchor, its depth in its block and its block, which decides
both its RoPE position and which keys it sees (`visibility`): one rule for every caller.

Shapes: B sequences, R rows in a pass, S key columns, H hidden size, D draft length, Vd draft vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class HeadParts:
    """The layer's pieces as one implementation holds them (dart_core's modules, SGLang's parallel layers)."""

    dtype: torch.dtype  # the head's compute dtype: row inputs are cast to it
    embed: Callable  # ids [...] -> [..., H]
    fc: Callable  # taps [..., 3*Ht] -> [..., H]
    input_layernorm: Callable
    hidden_norm: Callable
    mask_rep: Optional[torch.Tensor]  # [2H] (None: a drafter without mask rows)
    qkv: Callable  # x [B, R, 2H], positions [B, R] -> q [B, heads, R, hd], k/v [B, kv, R, hd] (RoPE applied)
    o_proj: Callable  # [B, R, heads*hd] -> [B, R, H]
    post_attention_layernorm: Callable
    mlp: Callable
    norm: Callable
    vocab_logits: Callable  # [..., H] -> [..., Vd]
    scale: Optional[float] = None  # attention scale (None: 1/sqrt(hd))


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows of a pass, as queries or as key columns; each field [B or 1, R].

    anchor: a real row's own position, a mask row's anchor (the last real row it sees).
    depth: 0 for a real row, j (1..D) for the j-th mask row of its block. RoPE position = anchor + depth.
    block: the block a mask row belongs to (ignored for real rows).
    readable: whether the row's key may be read (False for padding and for unused cache columns).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    block: torch.Tensor
    readable: torch.Tensor

    def positions(self) -> torch.Tensor:
        """[B, R] RoPE positions."""
        return self.anchor + self.depth

    @staticmethod
    def real(positions: torch.Tensor, readable: torch.Tensor) -> "Rows":
        """Real rows at positions [B, R], their keys readable where readable [B, R]."""
        zeros = torch.zeros_like(positions[:1])
        return Rows(positions, zeros, zeros, readable)

    @staticmethod
    def mask_blocks(anchors: torch.Tensor, draft_length: int) -> "Rows":
        """One block of D mask rows after each anchor: anchors [B, A] -> A*D rows, block by block."""
        b, a = anchors.shape
        d = draft_length
        device = anchors.device
        depth = torch.arange(1, d + 1, device=device).repeat(a)[None]  # [1, A*D]
        block = torch.arange(a, device=device).repeat_interleave(d)[None]
        readable = torch.ones(1, a * d, dtype=torch.bool, device=device)
        return Rows(anchors.repeat_interleave(d, dim=1), depth, block, readable)

    @staticmethod
    def cat(*parts: "Rows") -> "Rows":
        """The rows of `parts`, one after another."""
        def joined(name: str) -> torch.Tensor:
            fields = [getattr(p, name) for p in parts]
            b = max(f.shape[0] for f in fields)
            return torch.cat([f.expand(b, -1) for f in fields], dim=1)

        return Rows(*(joined(f.name) for f in dataclasses.fields(Rows)))


def visibility(queries: Rows, keys: Rows) -> torch.Tensor:
    """bool [B, Q, S]: whether query row q may read key column s.

    A readable real key is seen by every row anchored at or after it; a mask key only by the rows of its own block
    at its depth or deeper (never by a real row)."""
    real_key = keys.depth[:, None, :] == 0
    sees_real = keys.anchor[:, None, :] <= queries.anchor[:, :, None]
    sees_mask = (keys.block[:, None, :] == queries.block[:, :, None]) & (keys.depth[:, None, :] <= queries.depth[:, :, None])
    return keys.readable[:, None, :] & torch.where(real_key, sees_real, sees_mask)


def step_rows(past_lengths: torch.Tensor, lengths: torch.Tensor, span: int, new_rows: int,
              draft_length: int) -> tuple[Rows, Rows]:
    """The rows of one drafting step: (queries, cached keys).

    A sequence holds past_lengths[b] cached rows (of `span` columns); T = `new_rows` new rows follow, of which the
    first lengths[b] are real (the rest padding), then one block of D mask rows anchored at the last real row."""
    device = lengths.device
    cached = torch.arange(span, device=device)[None]
    new = torch.arange(new_rows, device=device)[None]
    real = Rows.real(past_lengths[:, None] + new, new < lengths[:, None])
    queries = Rows.cat(real, Rows.mask_blocks((past_lengths + lengths - 1)[:, None], draft_length))
    return queries, Rows.real(cached.expand(len(lengths), span), cached < past_lengths[:, None])


def training_rows(anchors: torch.Tensor, num_real: int, draft_length: int) -> Rows:
    """The rows of a training pass: N real rows at 0..N-1, then a block of D mask rows per anchor [B, A]."""
    real = torch.arange(num_real, device=anchors.device)[None]
    return Rows.cat(Rows.real(real, torch.ones_like(real, dtype=torch.bool)),
                    Rows.mask_blocks(anchors, draft_length))


class Past(NamedTuple):
    """Cached keys/values [B, kv, S, hd] and the rows they belong to."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: Rows


def layer_input(parts: HeadParts, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """embedded / hidden [..., H] -> the layer's input cat(input_layernorm(embedded), hidden_norm(hidden)) [..., 2H]."""
    return torch.cat((parts.input_layernorm(embedded), parts.hidden_norm(hidden)), dim=-1)


def real_inputs(parts: HeadParts, taps: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real rows: taps [..., 3*Ht], next_ids [...] (the token after each row) -> (x [..., 2H], residual [..., H])."""
    s = parts.fc(taps.to(parts.dtype))
    return layer_input(parts, parts.embed(next_ids).to(parts.dtype), s), s


def with_mask_rows(parts: HeadParts, x: torch.Tensor, residual: torch.Tensor,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, R, 2H], residual [B, R, H] followed by `count` mask rows: ([B, R+count, 2H], [B, R+count, H])."""
    if not count:
        return x, residual
    mask_rows = parts.mask_rep.to(x.dtype).expand(x.shape[0], count, -1)
    return (torch.cat((x, mask_rows), dim=1),
            torch.cat((residual, mask_rows[..., : residual.shape[-1]]), dim=1))


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, see: torch.Tensor,
              scale: Optional[float] = None) -> torch.Tensor:
    """q [B, heads, Q, hd], keys/values [B, kv, S, hd] (grouped-query: heads a multiple of kv), see [B, Q, S] bool
    -> [B, Q, heads*hd]."""
    b, heads, q_len, hd = q.shape
    groups = heads // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=additive_mask(see, q.dtype),
                                         scale=scale)
    return out.transpose(1, 2).reshape(b, q_len, heads * hd)


def additive_mask(see: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility [B, Q, S] -> additive float mask [B, 1, Q, S] (0 visible, finfo.min hidden)."""
    zero = torch.zeros((), dtype=dtype, device=see.device)
    return torch.where(see, zero, torch.finfo(dtype).min)[:, None]


def attend(parts: HeadParts, x: torch.Tensor, residual: torch.Tensor, rows: Rows,
           past: Optional[Past] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's attention over `rows` (inputs x [B, R, 2H], residual [B, R, H]), after the `past` ones ->
    (h [B, R, H] after the attention residual, k/v [B, kv, R, hd] of the rows)."""
    q, k, v = parts.qkv(x, rows.positions())
    keys, values, key_rows = k, v, rows
    if past is not None and past.keys.shape[2]:
        keys, values = torch.cat((past.keys.to(k.dtype), k), dim=2), torch.cat((past.values.to(v.dtype), v), dim=2)
        key_rows = Rows.cat(past.rows, rows)
    out = attention(q, keys, values, visibility(rows, key_rows), parts.scale)
    return residual + parts.o_proj(out), k, v


def finish(parts: HeadParts, h: torch.Tensor) -> torch.Tensor:
    """h [..., H] after attention -> the layer's output (the MLP block)."""
    return h + parts.mlp(parts.post_attention_layernorm(h))


def logits(parts: HeadParts, h: torch.Tensor) -> torch.Tensor:
    """Layer outputs [..., H] -> draft-vocab logits [..., Vd] (the reference's double final norm)."""
    return parts.vocab_logits(parts.norm(parts.norm(h)))


def attend_new_rows(parts: HeadParts, x: torch.Tensor, residual: torch.Tensor, lengths: torch.Tensor,
                    past_keys: torch.Tensor, past_values: torch.Tensor, past_lengths: torch.Tensor,
                    num_mask_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T new rows (inputs x [B, T, 2H], residual [B, T, H]; the first lengths[b] real) after the cached rows
    past_keys/values [B, kv, S, hd] (the first past_lengths[b] real), then `num_mask_rows` mask rows -> (h [B, T+M, H]
    after the attention residual, k/v [B, kv, T+M, hd])."""
    queries, cached = step_rows(past_lengths, lengths, past_keys.shape[2], x.shape[1], num_mask_rows)
    x, residual = with_mask_rows(parts, x, residual, num_mask_rows)
    return attend(parts, x, residual, queries, Past(past_keys, past_values, cached))


def draft_step(parts: HeadParts, x: torch.Tensor, residual: torch.Tensor, lengths: torch.Tensor,
               past_keys: torch.Tensor, past_values: torch.Tensor, past_lengths: torch.Tensor,
               draft_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One drafting pass (`attend_new_rows` with D mask rows) -> (logits [B, D+1, Vd] of each sequence's last real
    row and its D mask rows, k/v [B, kv, T, hd] of the new rows)."""
    d = draft_length
    b, t = x.shape[:2]
    h, k, v = attend_new_rows(parts, x, residual, lengths, past_keys, past_values, past_lengths, d)
    last_real = (lengths - 1).clamp(min=0)
    keep = torch.cat((last_real[:, None], t + torch.arange(d, device=h.device).expand(b, d)), dim=1)  # [B, D+1]
    h = torch.gather(h, 1, keep[..., None].expand(b, d + 1, h.shape[-1]))
    return logits(parts, finish(parts, h)), k[:, :, :t], v[:, :, :t]


def training_pass(parts: HeadParts, x: torch.Tensor, residual: torch.Tensor, anchors: torch.Tensor,
                  draft_length: int) -> torch.Tensor:
    """All N real rows (x [B, N, 2H], residual [B, N, H]) and a block of D mask rows per anchor [B, A] in one pass
    -> logits [B, N + A*D, Vd]; each row sees what it would see in inference on its prefix."""
    n = x.shape[1]
    x, residual = with_mask_rows(parts, x, residual, anchors.shape[1] * draft_length)
    h, _, _ = attend(parts, x, residual, training_rows(anchors, n, draft_length))
    return logits(parts, finish(parts, h))
