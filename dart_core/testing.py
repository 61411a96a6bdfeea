"""Heads with known behaviour, for tests and benchmarks of the decoding loops (not for real decoding)."""

from __future__ import annotations

import torch

from dart_core.config import DartConfig
from dart_core.head import DartHead


class ReplayHead(DartHead):
    """A head that predicts a known continuation: its logits peak at the tokens of `reference` that come next.

    `reference` [L] is the sequence the target will produce (prompt + continuation). After a forward whose last real
    row is at position r (its embedded token is reference[r+1]), row j predicts reference[r+2+j] (when the draft
    vocabulary holds it; set d2t before the first forward). With `wrong_every=k`, positions divisible by k predict a
    wrong token instead, so only parts of each tree are right. The real head math still runs (same cost as a trained
    head of this shape); only the logits are overwritten.
    """

    def __init__(self, config: DartConfig, reference: torch.Tensor, wrong_every: int = 0) -> None:
        super().__init__(config)
        self.reference = reference.reshape(-1).tolist()
        self.wrong_every = wrong_every
        self._draft_of: dict[int, int] | None = None

    def _draft_ids(self) -> dict[int, int]:
        """target id -> draft id, from d2t as it was at the first forward."""
        if self._draft_of is None:
            targets = (torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t).tolist()
            self._draft_of = {t: d for d, t in enumerate(targets)}
        return self._draft_of

    def forward(self, aux_hidden, shifted_ids, cache=None, lengths=None):
        logits = super().forward(aux_hidden, shifted_ids, cache=cache, lengths=lengths)  # [B, D+1, V]
        if cache is not None:
            last = cache.lengths - 1
        else:
            last = torch.full((logits.shape[0],), aux_hidden.shape[1] - 1) if lengths is None else lengths - 1
        out = logits.clone()
        draft_of = self._draft_ids()
        for b in range(out.shape[0]):
            for j in range(out.shape[1]):
                pos = int(last[b]) + 2 + j
                if pos < len(self.reference):
                    token = self.reference[pos]
                    if self.wrong_every and pos % self.wrong_every == 0:
                        token = (token + 1) % self.config.vocab_size
                    if token in draft_of:
                        out[b, j, draft_of[token]] = out[b, j].max() + 20.0
        return out

    @classmethod
    def from_head(cls, head: DartHead, reference: torch.Tensor, wrong_every: int = 0) -> "ReplayHead":
        """A replay head with `head`'s weights and shared embedding."""
        replay = cls(head.config, reference, wrong_every)
        replay.load_state_dict(head.state_dict())
        replay.ngram, replay.tree_config = head.ngram, head.tree_config
        if head.get_input_embeddings() is not None:
            replay.set_input_embeddings(head.get_input_embeddings())
        return replay
