"""The row's own context as a source of draft paths (docs/DESIGN.md §2.6).

Each row (prompt and output so far, ending with the tree root) keeps an index from every n-gram of the suffix
lengths `context_min_match..context_max_match` to the positions where it ends, updated with each step's new tokens
(`ContextRow.extend`), so a step never rescans the prompt. A step looks up the row's longest suffix that also ends
earlier, follows its latest occurrences and scores their continuations as one small trie (`ContextRow.paths`);
`ContextDrafter.propose` packs the B rows' tries as fixed-shape tensors (`ContextProposals`) that the tree search
merges with the head's candidates (`dart_core.tree.build_draft_trees(..., context=...)`).

Host-side Python: the per-step work is a few dict look-ups and at most `context_matches x context_depth` trie nodes
per row, whatever the context's length. `dart_core.reference.reference_context_paths` re-derives the paths by brute
force.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import torch

from dart_core.config import TreeConfig

# bits of `DraftTreeBatch.sources`: which search proposed a node (a path both proposed has both bits; the root and
# padding have none)
SOURCE_HEAD = 1  # the head's beam search (with the n-gram prior)
SOURCE_CONTEXT = 2  # a continuation of the row's own context

Tokens = Union[torch.Tensor, Sequence[int]]


def _token_list(tokens: Tokens) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() > 1:
            raise ValueError(f"a row's tokens must be 1-D, got shape {list(tokens.shape)}")
        return tokens.tolist()
    return [int(t) for t in tokens]


class ContextRow:
    """One sequence's tokens and its n-gram index: for each suffix length `length` in min_match..max_match, a dict
    from every `length`-gram of the tokens to the positions where it ends (ascending)."""

    def __init__(self, tokens: Tokens = (), min_match: int = 2, max_match: int = 4) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(min_match, max_match + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Tokens) -> None:
        """Append tokens (a step's accepted tokens and bonus) and index the n-grams that end at them."""
        start = len(self.tokens)
        self.tokens.extend(_token_list(tokens))
        seq = self.tokens
        for length, ends in self._ends.items():
            for end in range(max(start, length - 1), len(seq)):
                ends.setdefault(tuple(seq[end - length + 1:end + 1]), []).append(end)

    def _suffix(self, length: int) -> tuple:
        """The last `length` tokens (the key looked up)."""
        return tuple(self.tokens[len(self.tokens) - length:])

    def matches(self, count: int) -> tuple[int, list[int]]:
        """(m, ends): the longest suffix length m (min_match..max_match) whose tokens also end at an earlier
        position, and the latest `count` such end positions, latest first; (0, []) when there is none."""
        n = len(self.tokens)
        for length in range(min(self.max_match, n - 1), self.min_match - 1, -1):
            ends = self._ends[length].get(self._suffix(length))
            if not ends:
                continue
            stop = len(ends) - 1 if ends[-1] == n - 1 else len(ends)  # the suffix itself ends at n - 1
            if stop:
                return length, ends[max(0, stop - count):stop][::-1]
        return 0, []

    def continuations(self, count: int, depth: int, eos_token_id: Optional[int] = None) -> tuple[int, list[list[int]]]:
        """(m, continuations): the up to `depth` tokens after each of `matches(count)`'s end positions, each cut
        after its first EOS."""
        m, ends = self.matches(count)
        out = []
        for end in ends if depth > 0 else ():
            cont = self.tokens[end + 1:end + 1 + depth]
            if eos_token_id is not None and eos_token_id in cont:
                cont = cont[:cont.index(eos_token_id) + 1]
            out.append(cont)
        return m, out

    def paths(self, config: TreeConfig) -> list[tuple[int, int, int, float]]:
        """The row's context trie (docs/DESIGN.md §2.6): (token, parent entry or -1 for the root's children, depth,
        score) per entry, depth by depth and, within a depth, in the order of the first occurrence that reaches it
        (parents precede children). Empty when the source is off or nothing matches."""
        m, conts = self.continuations(config.context_matches, config.context_path_depth(), config.eos_token_id)
        return score_continuations(m, conts, config)


def score_continuations(m: int, conts: list[list[int]], config: TreeConfig) -> list[tuple[int, int, int, float]]:
    """The trie of continuations `conts` (ranked occurrences of a suffix match of length m) with the §2.6 scores:
    an entry reached by c of them, whose parent's children are reached by c+ of them in all, scores its parent's
    score + lw(depth - 1) * log(m * c / (1 + m * c+)), the root scoring 0."""
    entries: list[tuple[int, int, int, float]] = []
    index: dict[tuple, int] = {}  # path -> entry
    reach: dict[tuple, int] = {}  # path -> continuations that begin with it
    for cont in conts:
        for d in range(1, len(cont) + 1):
            reach[tuple(cont[:d])] = reach.get(tuple(cont[:d]), 0) + 1
    below: dict[tuple, int] = {(): len(conts)}  # path -> continuations that go on past it
    for path, c in reach.items():
        if len(path) > 1:
            below[path[:-1]] = below.get(path[:-1], 0) + c
    scores: dict[tuple, float] = {(): 0.0}
    for d in range(1, max(map(len, conts), default=0) + 1):
        for cont in conts:
            if len(cont) < d or tuple(cont[:d]) in index:
                continue
            path = tuple(cont[:d])
            parent = path[:-1]
            rho = m * reach[path] / (1 + m * below[parent])
            scores[path] = scores[parent] + config.level_weight(d - 1) * math.log(rho)
            index[path] = len(entries)
            entries.append((path[-1], index[parent] if parent else -1, d, scores[path]))
    return entries


@dataclasses.dataclass
class ContextProposals:
    """B rows' context tries, padded to a common width P = context_matches x context path depth.

    tokens [B, P] int64 target ids; parents [B, P] int64 entry of the parent in the same row (-1: the root);
    depths [B, P] int64 (1 = a child of the root); scores [B, P] float32. Unused entries: token 0, parent -1,
    depth 0, score -inf. Parents precede children. `ContextProposals(*p.tensors())` rebuilds it (a CUDA graph takes
    the tensors)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.parents, self.depths, self.scores)

    def to(self, device, non_blocking: bool = False) -> "ContextProposals":
        return ContextProposals(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    @classmethod
    def pack(cls, rows: list[list[tuple[int, int, int, float]]], width: int,
             device: Optional[torch.device] = None) -> "ContextProposals":
        """Entries per row (`ContextRow.paths`) -> padded tensors on `device` (from pinned memory without waiting for
        the device when it is a CUDA device)."""
        b = len(rows)
        tokens, parents, depths = [[0] * width for _ in range(b)], [[-1] * width for _ in range(b)], \
            [[0] * width for _ in range(b)]
        scores = [[float("-inf")] * width for _ in range(b)]
        for i, entries in enumerate(rows):
            if len(entries) > width:
                raise ValueError(f"row {i} has {len(entries)} context entries, more than the width {width}")
            for j, (token, parent, depth, score) in enumerate(entries):
                tokens[i][j], parents[i][j], depths[i][j], scores[i][j] = token, parent, depth, score
        out = cls(torch.tensor(tokens, dtype=torch.long).view(b, width),
                  torch.tensor(parents, dtype=torch.long).view(b, width),
                  torch.tensor(depths, dtype=torch.long).view(b, width),
                  torch.tensor(scores, dtype=torch.float32).view(b, width))
        device = torch.device(device) if device is not None else None
        if device is None or device.type == "cpu":
            return out
        if device.type == "cuda":  # a pageable copy would wait for the device's queue
            return ContextProposals(*(t.pin_memory() for t in out.tensors())).to(device, non_blocking=True)
        return out.to(device)


class ContextDrafter:
    """Context drafting for the B rows of a decoding batch (docs/DESIGN.md §2.6), on the host.

    `rows`: per row its tokens so far, prompt (without padding) and output, ending with the next tree's root (1-D
    tensors or int sequences), or `ContextRow`s kept from earlier (SGLang keeps one per request); `config`'s
    `context_*` settings. Then per step:

    - `extend(new_tokens)`: one entry per row, the tokens the step decided (accepted drafts + bonus), appended;
    - `select(keep)`: keep the rows `keep` ([B'] indices, in that order), when rows finish;
    - `propose(device)` -> `ContextProposals` [B, P] for `build_draft_trees(..., context=...)`, P = `width`.
    """

    def __init__(self, rows: Sequence[Union[Tokens, ContextRow]], config: TreeConfig) -> None:
        self.config = config
        lo, hi = config.context_min_match, config.context_max_match
        self.rows: list[ContextRow] = []
        for i, row in enumerate(rows):
            if isinstance(row, ContextRow):
                if (row.min_match, row.max_match) != (lo, hi):
                    raise ValueError(f"row {i} indexes suffixes of {row.min_match}..{row.max_match} tokens, the "
                                     f"config {lo}..{hi}")
                self.rows.append(row)
            else:
                self.rows.append(ContextRow(row, lo, hi))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """P: entries per row of every proposal (context_matches x context path depth; 0 with the source off)."""
        return self.config.context_matches * self.config.context_path_depth()

    def extend(self, new_tokens: Sequence[Tokens]) -> None:
        if len(new_tokens) != len(self.rows):
            raise ValueError(f"extend got {len(new_tokens)} rows of tokens for {len(self.rows)} rows")
        for row, tokens in zip(self.rows, new_tokens):
            row.extend(tokens)

    def select(self, keep: Union[torch.Tensor, Sequence[int]]) -> None:
        """Keep rows `keep` (a tensor is read back to the host)."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        self.rows = [self.rows[int(i)] for i in keep]

    def propose(self, device: Optional[torch.device] = None,
                roots: Optional[Sequence[int]] = None) -> ContextProposals:
        """Every row's context trie as `ContextProposals` [B, width] on `device`. With `roots` [B], a row whose last
        token is not its root proposes nothing."""
        if not self.config.context_draft:
            return ContextProposals.pack([[] for _ in self.rows], 0, device)
        rows = []
        for b, row in enumerate(self.rows):
            usable = roots is None or (row.tokens and row.tokens[-1] == int(roots[b]))
            rows.append(row.paths(self.config) if usable else [])
        return ContextProposals.pack(rows, self.width, device)


__all__ = ["ContextDrafter", "ContextProposals", "ContextRow", "SOURCE_CONTEXT", "SOURCE_HEAD",
           "score_continuations"]
