"""Pure torch pieces of the SGLang worker's one head pass per round (no SGLang import; docs/DESIGN.md §1.4, §2.2).

A round's B requests each bring a ragged number of new real rows (the prompt's rows after prefill, root + accepted
nodes after a verify). The row-wise work (fc, embedding, norms, the q/k/v projection and the draft KV pool write)
runs over the rows PACKED back to back, [N = sum of counts, ...]: a real row's keys/values depend on that row
alone, so packing costs nothing and wastes nothing. The attention has one fixed-size query block per request (its
last real row and the D mask rows), so only the KEYS are ragged (each request's own cached prefix): they are
PADDED to the longest prefix of the round, [B, S, ...], with padding zeroed and masked out, which makes the whole
round one dense `scaled_dot_product_attention` call on any device, in `dart_core.head_math.draft_step` (a packed,
block-diagonal attention would cost B^2 and a varlen kernel is CUDA-only).

Shapes: B requests, counts [B] (>= 1 new rows each), N = counts.sum(), S = the longest prefix, D mask rows.
"""

from __future__ import annotations

import torch


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
