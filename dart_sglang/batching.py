"""Pure torch pieces of the SGLang worker's one head pass per round (no SGLang import; docs/DESIGN.md §1.4, §2.2).

A round's B requests each bring a ragged number of new real rows (the prompt's rows after prefill, root + accepted
nodes after a verify). The row-wise work (fc, embedding, norms, the q/k/v projection and the draft KV pool write)
runs over the rows PACKED back to back, [N = sum of counts, ...]: a real row's keys/values depend on that row
alone, so packing costs nothing and wastes nothing. The attention has one fixed-size query block per request (its
last real row and the D mask rows), so only the KEYS are ragged (each request's own cached prefix): they are
PADDED to the longest prefix of the round, [B, S, ...], with padding zeroed and masked out, which makes the whole
round one dense `scaled_dot_product_attention` call on any device (a packed, block-diagonal attention would cost
B^2 and a varlen kernel is CUDA-only).

Shapes: B requests, counts [B] (>= 1 new rows each), N = counts.sum(), S = the longest prefix, D mask rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_offsets(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """counts [B] -> [N]: each packed row's index inside its request (0..counts[b]-1). `total` = N if known
    (spares a device sync)."""
    starts = counts.cumsum(0) - counts  # [B], first packed row of each request
    total = int(counts.sum()) if total is None else total
    return torch.arange(total, device=counts.device) - starts.repeat_interleave(counts, output_size=total)


def last_rows(counts: torch.Tensor) -> torch.Tensor:
    """counts [B] -> [B]: the packed index of each request's last row."""
    return counts.cumsum(0) - 1


def packed_positions(starts: torch.Tensor, counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """starts [B] (rows the request already had), counts [B] -> [N] int64: the position of every packed row."""
    total = int(counts.sum()) if total is None else total
    return starts.repeat_interleave(counts, output_size=total) + segment_offsets(counts, total)


def accepted_rows(accept_lens: torch.Tensor, block: int, total: int | None = None) -> torch.Tensor:
    """accept_lens [B] (root + accepted drafts) -> [N]: the indices of the accepted rows in a verify output laid
    out in blocks of `block` rows per request, accepted path first in each block."""
    total = int(accept_lens.sum()) if total is None else total
    b = torch.arange(accept_lens.shape[0], device=accept_lens.device)
    return block * b.repeat_interleave(accept_lens, output_size=total) + segment_offsets(accept_lens, total)


def shift_within(ids: torch.Tensor, counts: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """ids [N] packed prompt tokens, counts [B], tails [B] -> [N]: the token after each row (§2.1's shift), each
    request's ids moved left by one inside its own segment with its tail token last."""
    out = ids.roll(-1)
    out[last_rows(counts)] = tails.to(out.dtype)
    return out


def packed_slots(req_to_token: torch.Tensor, pool_indices: torch.Tensor, positions: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
    """req_to_token [R, C] (token slot of position p of request row r), pool_indices [B], positions [N], counts [B]
    -> [N] int64: the token slot of every packed row."""
    rows = pool_indices.long().repeat_interleave(counts, output_size=positions.shape[0])
    return req_to_token[rows, positions].long()


def padded_slots(req_to_token: torch.Tensor, pool_indices: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """req_to_token [R, C], pool_indices [B], lengths [B] (>= 1) -> (slots [B, S] int64, valid [B, S] bool),
    S = max(lengths): request b's slots of positions 0..lengths[b]-1, left-aligned; slots[~valid] are 0."""
    span = int(lengths.max())
    slots = req_to_token[pool_indices.long(), :span].long()
    valid = torch.arange(span, device=lengths.device)[None, :] < lengths[:, None]
    return slots.masked_fill(~valid, 0), valid


def gather_padded(buffer: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """buffer [P, ...] (a KV pool), slots/valid [B, S] -> [B, S, ...]: the valid slots' entries, zeros elsewhere
    (whatever a pool holds at unused slots never reaches the attention, not even as 0 * NaN)."""
    out = buffer.new_zeros(*slots.shape, *buffer.shape[1:])
    out[valid] = buffer[slots[valid]]
    return out


def block_positions(lengths: torch.Tensor, num_mask_rows: int) -> torch.Tensor:
    """lengths [B] -> [B, D+1]: the query block's positions, the last real row (lengths-1) then the D mask rows."""
    return lengths[:, None] - 1 + torch.arange(num_mask_rows + 1, device=lengths.device)


def block_visibility(lengths: torch.Tensor, span: int, num_mask_rows: int) -> torch.Tensor:
    """lengths [B], span S >= max(lengths), D -> bool [B, D+1, S+D]: which key column each query sees.

    Columns 0..S-1 are the request's cached real rows (its own last row included), padded to S; columns S+m are
    mask row m+1's key. Query 0 (the last real row) sees the request's real rows; mask row j (query j) also sees
    mask rows 1..j; no query sees padding (§2.2 step 3, the mask rows after the real rows, causal)."""
    d = num_mask_rows
    cols = torch.arange(span + d, device=lengths.device)
    real = cols[None, None, :] < lengths[:, None, None]  # [B, 1, S+D]; False for every mask column (>= S)
    query = torch.arange(d + 1, device=lengths.device)
    mask = (cols[None, :] >= span) & (cols[None, :] - span < query[:, None])  # [D+1, S+D]
    return real | mask[None]


def block_attention(q: torch.Tensor, mask_k: torch.Tensor, mask_v: torch.Tensor, past_k: torch.Tensor,
                    past_v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The query blocks of B requests in one attention call.

    q [B, D+1, heads, hd] (RoPE applied); mask_k/mask_v [B, D, kv, hd]: the mask rows' keys/values; past_k/past_v
    [B, S, kv, hd]: each request's cached real rows (its last real row's included), padded (`gather_padded`);
    lengths [B] -> [B, D+1, heads*hd] (before o_proj)."""
    b, q_len, heads, hd = q.shape
    span, kv_heads = past_k.shape[1], past_k.shape[2]
    keys = torch.cat((past_k.to(mask_k.dtype), mask_k), dim=1)  # [B, S+D, kv, hd]
    values = torch.cat((past_v.to(mask_v.dtype), mask_v), dim=1)
    groups = heads // kv_heads
    keys = keys.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, heads, S+D, hd]
    values = values.repeat_interleave(groups, dim=2).transpose(1, 2)
    see = block_visibility(lengths, span, q_len - 1)[:, None]  # [B, 1, D+1, S+D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=see, scale=scale)
    return out.transpose(1, 2).reshape(b, q_len, heads * hd)  # [B, D+1, heads*hd]
