"""The row's own context, and earlier calls' outputs, as sources of draft paths (docs/DESIGN.md §2.6, §2.7).

Each row (prompt and output so far, ending with the tree root) keeps an index from every n-gram of the suffix
lengths `context_min_match..context_max_match` to the positions where it ends, updated with each step's new tokens
(`ContextRow.extend`), so a step never rescans the prompt. A step looks up the row's longest suffix that also ends
earlier in the row or in an `OutputStore` of earlier outputs, follows its latest occurrences and scores their
continuations as one small trie (`ContextRow.paths`); where neither matches, an n-gram table may propose paths
instead (`ngram_paths`, model-free drafting). `ContextDrafter.propose` packs the B rows' tries as fixed-shape tensors
(`ContextProposals`) that the tree search merges with a head's candidates (`dart_core.tree.build_draft_trees(...,
context=...)`) or that make the whole tree without a head (`dart_core.tree.proposal_trees`).

Host-side Python: the per-step work is a few dict look-ups and at most `context_matches x context_depth` trie nodes
per source and row, whatever the context's length. `dart_core.reference.reference_context_paths` re-derives the
paths by brute force.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from dart_core.config import TreeConfig

if TYPE_CHECKING:
    from dart_core.ngram import NGramModel
    from dart_core.store import OutputStore

# bits of `DraftTreeBatch.sources`: which sources proposed a node (a path several proposed has several bits; the
# root and padding have none)
SOURCE_HEAD = 1  # the head's beam search (with the n-gram prior)
SOURCE_CONTEXT = 2  # a continuation of the row's own context
SOURCE_STORE = 4  # a continuation in an earlier call's output (`dart_core.store.OutputStore`)
SOURCE_NGRAM = 8  # the n-gram table's likeliest continuations (model-free drafting, where nothing else matched)
MODEL_FREE_SOURCES = SOURCE_CONTEXT | SOURCE_STORE | SOURCE_NGRAM

Tokens = Union[torch.Tensor, Sequence[int]]
# one proposed path node: (token, parent entry or -1 for the root's children, depth, score, source bits)
Entry = tuple[int, int, int, float, int]


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

    def _earlier_ends(self, length: int, count: int) -> list[int]:
        """The latest `count` positions before the last where the last `length` tokens also end, latest first."""
        ends = self._ends[length].get(self._suffix(length)) if length in self._ends else None
        if not ends:
            return []
        stop = len(ends) - 1 if ends[-1] == len(self.tokens) - 1 else len(ends)  # the suffix itself ends at n - 1
        return ends[max(0, stop - count):stop][::-1]

    def matches(self, count: int) -> tuple[int, list[int]]:
        """(m, ends): the longest suffix length m (min_match..max_match) whose tokens also end at an earlier
        position, and the latest `count` such end positions, latest first; (0, []) when there is none."""
        for length in range(min(self.max_match, len(self.tokens) - 1), self.min_match - 1, -1):
            ends = self._earlier_ends(length, count)
            if ends:
                return length, ends
        return 0, []

    def continuations(self, count: int, depth: int, eos_token_id: Optional[int] = None,
                      store: Optional["OutputStore"] = None) -> tuple[int, list[list[int]], list[int]]:
        """(m, continuations, their sources): the longest suffix length m (min_match..max_match) that also ends
        earlier in the row or in `store`, and the up to `depth` tokens after each of its latest `count` earlier ends
        in the row (source `SOURCE_CONTEXT`) then after each of its latest `count` occurrences in the store
        (`SOURCE_STORE`), each cut after its first EOS."""
        m, ends = self.matches(count)
        found = [(self.tokens[end + 1:end + 1 + depth], SOURCE_CONTEXT) for end in ends]
        if store is not None:  # a longer match in the store wins; one as long joins the row's own
            for length in range(min(self.max_match, len(self.tokens)), max(m, self.min_match) - 1, -1):
                extra = store.continuations(self._suffix(length), count, depth)
                if extra:
                    if length > m:
                        m, found = length, []
                    found += [(cont, SOURCE_STORE) for cont in extra]
                    break
        if not m:
            return 0, [], []
        if depth <= 0:
            return m, [], []
        conts = []
        for cont, _ in found:
            if eos_token_id is not None and eos_token_id in cont:
                cont = cont[:cont.index(eos_token_id) + 1]
            conts.append(cont)
        return m, conts, [source for _, source in found]

    def paths(self, config: TreeConfig, store: Optional["OutputStore"] = None) -> list[Entry]:
        """The row's context trie (docs/DESIGN.md §2.6; with `store`, §2.7): one `Entry` per node, depth by depth
        and, within a depth, in the order of the first continuation that reaches it (parents precede children).
        Empty when the source is off or nothing matches."""
        m, conts, sources = self.continuations(config.context_matches, config.context_path_depth(),
                                               config.eos_token_id, store)
        return score_continuations(m, conts, config, sources)


def score_continuations(m: int, conts: list[list[int]], config: TreeConfig,
                        sources: Optional[list[int]] = None) -> list[Entry]:
    """The trie of continuations `conts` (ranked occurrences of a suffix match of length m) with the §2.6 scores:
    an entry reached by c of them, whose parent's children are reached by c+ of them in all, scores its parent's
    score + lw(depth - 1) * log(m * c / (1 + m * c+)), the root scoring 0. An entry's source bits are those of
    the continuations that reach it (`sources`, one per continuation; default `SOURCE_CONTEXT`)."""
    sources = [SOURCE_CONTEXT] * len(conts) if sources is None else sources
    entries: list[Entry] = []
    index: dict[tuple, int] = {}  # path -> entry
    reach: dict[tuple, int] = {}  # path -> continuations that begin with it
    bits: dict[tuple, int] = {}  # path -> sources of those continuations
    for cont, source in zip(conts, sources):
        for d in range(1, len(cont) + 1):
            reach[tuple(cont[:d])] = reach.get(tuple(cont[:d]), 0) + 1
            bits[tuple(cont[:d])] = bits.get(tuple(cont[:d]), 0) | source
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
            entries.append((path[-1], index[parent] if parent else -1, d, scores[path], bits[path]))
    return entries


def ngram_paths(ngram: "NGramModel", tokens: Sequence[int], config: TreeConfig, budget: int) -> list[Entry]:
    """The n-gram table's likeliest continuations of `tokens` (ending with the root) as up to `budget` entries
    (docs/DESIGN.md §2.7): best first from the root, each node extended by its `context_matches` likeliest next
    tokens (`NGramModel.top_continuations`), a child scoring its parent's score + lw(depth - 1) * log q; at most
    `context_path_depth()` deep, nothing after an EOS. Parents precede children; source `SOURCE_NGRAM`."""
    depth_cap, width = config.context_path_depth(), config.context_matches
    history = list(tokens[len(tokens) - max(ngram.order - 1, 1):])
    entries: list[Entry] = []
    heap = [(0.0, 0, (), -1)]  # (-score, tie order, path, entry)
    pushed = 1
    while heap and len(entries) < budget:
        negative, _, path, entry = heapq.heappop(heap)
        if path:
            entries.append((path[-1], entry, len(path), -negative, SOURCE_NGRAM))
            entry = len(entries) - 1
            if config.eos_token_id is not None and path[-1] == config.eos_token_id:
                continue
        if len(path) >= depth_cap:
            continue
        for token, q in ngram.top_continuations(history + list(path), width):
            score = -negative + config.level_weight(len(path)) * math.log(q)
            heapq.heappush(heap, (-score, pushed, path + (token,), entry))
            pushed += 1
    return entries


@dataclasses.dataclass
class ContextProposals:
    """B rows' proposed paths (context, store or n-gram tries), padded to a common width P (`ContextDrafter.width`).

    tokens [B, P] int64 target ids; parents [B, P] int64 entry of the parent in the same row (-1: the root);
    depths [B, P] int64 (1 = a child of the root); scores [B, P] float32; sources [B, P] int64 source bits (default:
    `SOURCE_CONTEXT` for every used entry). Unused entries: token 0, parent -1, depth 0, score -inf, sources 0.
    Parents precede children. `ContextProposals(*p.tensors())` rebuilds it (a CUDA graph takes the tensors)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = torch.where(self.depths > 0, SOURCE_CONTEXT, 0).to(torch.long)

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.parents, self.depths, self.scores, self.sources)

    def to(self, device, non_blocking: bool = False) -> "ContextProposals":
        return ContextProposals(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    @classmethod
    def pack(cls, rows: list[list[Entry]], width: int, device: Optional[torch.device] = None) -> "ContextProposals":
        """Entries per row (`ContextRow.paths`, `ngram_paths`) -> padded tensors on `device` (from pinned memory
        without waiting for the device when it is a CUDA device)."""
        b = len(rows)
        tokens, parents, depths, sources = ([[fill] * width for _ in range(b)] for fill in (0, -1, 0, 0))
        scores = [[float("-inf")] * width for _ in range(b)]
        for i, entries in enumerate(rows):
            if len(entries) > width:
                raise ValueError(f"row {i} has {len(entries)} context entries, more than the width {width}")
            for j, (token, parent, depth, score, source) in enumerate(entries):
                tokens[i][j], parents[i][j], depths[i][j], scores[i][j], sources[i][j] = \
                    token, parent, depth, score, source
        out = cls(*(torch.tensor(x, dtype=torch.long).view(b, width) for x in (tokens, parents, depths)),
                  torch.tensor(scores, dtype=torch.float32).view(b, width),
                  torch.tensor(sources, dtype=torch.long).view(b, width))
        device = torch.device(device) if device is not None else None
        if device is None or device.type == "cpu":
            return out
        if device.type == "cuda":  # a pageable copy would wait for the device's queue
            return ContextProposals(*(t.pin_memory() for t in out.tensors())).to(device, non_blocking=True)
        return out.to(device)


class ContextDrafter:
    """Drafting from the rows' context (docs/DESIGN.md §2.6), an `OutputStore` of earlier outputs and an n-gram
    table (§2.7) for the B rows of a decoding batch, on the host.

    `rows`: per row its tokens so far, prompt (without padding) and output, ending with the next tree's root (1-D
    tensors or int sequences), or `ContextRow`s kept from earlier (SGLang keeps one per request); `config`'s
    `context_*` settings; `store`: earlier outputs matched like the row's own context; `ngram`: a table whose
    likeliest continuations a row proposes where neither matches (model-free drafting). Then per step:

    - `extend(new_tokens)`: one entry per row, the tokens the step decided (accepted drafts + bonus), appended;
    - `select(keep)`: keep the rows `keep` ([B'] indices, in that order), when rows finish;
    - `propose(device)` -> `ContextProposals` [B, P] for `build_draft_trees(..., context=...)`, P = `width`.
    """

    def __init__(self, rows: Sequence[Union[Tokens, ContextRow]], config: TreeConfig,
                 store: Optional["OutputStore"] = None, ngram: Optional["NGramModel"] = None) -> None:
        self.config, self.store, self.ngram = config, store, ngram
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
        """P: entries per row of every proposal (context_matches x context path depth, twice that with a store; 0
        with the source off)."""
        return (2 if self.store is not None else 1) * self.config.context_matches * self.config.context_path_depth()

    def extend(self, new_tokens: Sequence[Tokens]) -> None:
        if len(new_tokens) != len(self.rows):
            raise ValueError(f"extend got {len(new_tokens)} rows of tokens for {len(self.rows)} rows")
        for row, tokens in zip(self.rows, new_tokens):
            row.extend(tokens)

    def select(self, keep: Union[torch.Tensor, Sequence[int]]) -> None:
        """Keep rows `keep` (a tensor is read back to the host)."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        self.rows = [self.rows[int(i)] for i in keep]

    def propose(self, device: Optional[torch.device] = None, roots: Optional[Sequence[int]] = None,
                budget: Optional[int] = None) -> ContextProposals:
        """Every row's proposed paths as `ContextProposals` [B, width] on `device`: its context and store trie, else
        the n-gram table's best `budget` nodes (default: `width`). With `roots` [B], a row whose last token is not
        its root proposes nothing."""
        if not self.config.context_draft:
            return ContextProposals.pack([[] for _ in self.rows], 0, device)
        budget = self.width if budget is None else min(budget, self.width)
        rows = []
        for b, row in enumerate(self.rows):
            usable = roots is None or (row.tokens and row.tokens[-1] == int(roots[b]))
            entries = row.paths(self.config, self.store) if usable else []
            if usable and not entries and self.ngram is not None:
                entries = ngram_paths(self.ngram, row.tokens, self.config, budget)
            rows.append(entries)
        return ContextProposals.pack(rows, self.width, device)


__all__ = ["ContextDrafter", "ContextProposals", "ContextRow", "MODEL_FREE_SOURCES", "SOURCE_CONTEXT", "SOURCE_HEAD",
           "SOURCE_NGRAM", "SOURCE_STORE", "ngram_paths", "score_continuations"]
