"""Heads with known behaviour, for tests and benchmarks of the decoding loops (not for real decoding)."""

from __future__ import annotations

from typing import Optional

import torch

from dart_core.config import DartConfig
from dart_core.head import DartHead


class ReplayHead(DartHead):
    """A head that predicts a known continuation: its logits peak at the tokens of the reference that come next.

    `reference` [L] is the sequence the target will produce (prompt + continuation), or a list of them, one per
    sequence of a batch (without left padding). After a forward whose last real row is at position r (its embedded
    token is reference[r+1]), row j predicts reference[r+2+j] (when the draft vocabulary holds it; set d2t before the
    first forward). A batch row follows the first reference whose token r+1 is the one it embeds. With
    `wrong_every=k`, positions divisible by k predict a wrong token instead, so only parts of each tree are right.
    The real head math still runs (same cost as a trained head of this shape); only the logits are overwritten.
    """

    def __init__(self, config: DartConfig, reference, wrong_every: int = 0) -> None:
        super().__init__(config)
        references = [reference] if isinstance(reference, torch.Tensor) else list(reference)
        self.references = [r.reshape(-1).tolist() for r in references]
        self.wrong_every = wrong_every
        self._draft_of: dict[int, int] | None = None

    def _draft_ids(self) -> dict[int, int]:
        """target id -> draft id, from d2t as it was at the first forward."""
        if self._draft_of is None:
            targets = (torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t).tolist()
            self._draft_of = {t: d for d, t in enumerate(targets)}
        return self._draft_of

    def _reference_of(self, last: int, embedded: int) -> list[int]:
        for reference in self.references:
            if last + 1 < len(reference) and reference[last + 1] == embedded:
                return reference
        return self.references[0]

    def step(self, aux_hidden, shifted_ids, lengths, past_keys, past_values, past_lengths):
        logits, k, v = super().step(aux_hidden, shifted_ids, lengths, past_keys, past_values, past_lengths)
        last = (past_lengths + lengths - 1).cpu()  # position of each batch row's last real row
        real = lengths.cpu()
        out = logits.clone()  # [B, D+1, V]
        draft_of = self._draft_ids()
        for row in range(out.shape[0]):
            reference = self._reference_of(int(last[row]), int(shifted_ids[row, int(real[row]) - 1]))
            for j in range(out.shape[1]):
                pos = int(last[row]) + 2 + j
                if pos < len(reference):
                    token = reference[pos]
                    if self.wrong_every and pos % self.wrong_every == 0:
                        token = (token + 1) % self.config.vocab_size
                    if token in draft_of:
                        out[row, j, draft_of[token]] = out[row, j].max() + 20.0
        return out, k, v

    @classmethod
    def from_head(cls, head: DartHead, reference, wrong_every: int = 0) -> "ReplayHead":
        """A replay head with `head`'s weights and shared embedding."""
        replay = cls(head.config, reference, wrong_every)
        replay.load_state_dict(head.state_dict())
        replay.ngram, replay.tree_config = head.ngram, head.tree_config
        if head.get_input_embeddings() is not None:
            replay.set_input_embeddings(head.get_input_embeddings())
        return replay


def shipped_shape(hidden_size: int, vocab_size: int, num_target_layers: int, draft_length: int,
                  draft_vocab_size: int = 8192) -> DartConfig:
    """The shipped SmolLM2 head's shape (1,536-wide MLP, 9 heads, 3 KV heads) for a target of these sizes."""
    return DartConfig(hidden_size=hidden_size, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, draft_length=draft_length,
                      target_hidden_size=hidden_size, num_target_layers=num_target_layers)


def random_head(config: DartConfig, std: float = 0.02, seed: int = 0, d2t: Optional[torch.Tensor] = None) -> DartHead:
    """A head of `config` with every weight drawn from N(0, `std`) after `torch.manual_seed(seed)`, and `d2t` as its
    draft-to-target offsets (None: random ones, drawn after the weights; a draft vocabulary as large as the target's
    keeps the identity): at `std` 0.02 it accepts next to nothing, at a trained head's cost."""
    torch.manual_seed(seed)
    head = DartHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, std)
        if d2t is not None:
            head.d2t.copy_(d2t)
        elif config.draft_vocab_size < config.vocab_size:
            head.d2t.copy_(torch.randint(0, config.vocab_size - config.draft_vocab_size, (config.draft_vocab_size,)))
    return head
