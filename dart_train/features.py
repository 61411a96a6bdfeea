"""What the head learns from: the target's tapped hidden states and logits, computed on the fly (no feature cache).

`collate` right-pads a list of `(tokens, prompt_length)` samples; `target_features` runs the target once over the
padded batch under `torch.no_grad()` and returns `aux` [B, T, 3*Ht] (hidden states at the head's taps, HF
`hidden_states[i]` for i in the taps, concatenated in tap order) and the target's logits [B, T, V] — or only the
draft-vocabulary columns [B, T, Vd] when `vocab_ids` is given, computed from those rows of the output projection
(cheaper than the full LM head for large vocabularies). Padding positions hold garbage that the loss ignores.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass
class TrainingBatch:
    """A right-padded batch: input_ids / attention_mask [B, T] int64, lengths / prompt_lengths [B] int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor

    def to(self, device) -> "TrainingBatch":
        return TrainingBatch(*(t.to(device) for t in dataclasses.astuple(self)))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(samples: Sequence[tuple[np.ndarray, int]], pad_id: int = 0) -> TrainingBatch:
    """Right-pad `(tokens, prompt_length)` samples to the longest one."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    width = max(len(tokens) for tokens, _ in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (tokens, _) in enumerate(samples):
        ids[i, : len(tokens)] = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        mask[i, : len(tokens)] = 1
    lengths = torch.tensor([len(t) for t, _ in samples], dtype=torch.long)
    prompts = torch.tensor([min(int(p), len(t)) for t, p in samples], dtype=torch.long)
    return TrainingBatch(ids, mask, lengths, prompts)


def _restricted_head_ok(model) -> bool:
    """Whether logits are exactly `last_hidden_state @ W.T (+ b)` (no soft-capping or scaling after the projection)."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return False
    out = model.get_output_embeddings()
    return isinstance(out, torch.nn.Linear) and hasattr(model, "get_decoder")


@torch.no_grad()
def target_features(model, layer_ids: Sequence[int], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    vocab_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T, 3*Ht], logits [B, T, V] float32, or [B, T, len(vocab_ids)] with `vocab_ids`)."""
    from dart_hf.target import tapped_hidden_states

    layer_ids = list(layer_ids)
    if vocab_ids is not None and _restricted_head_ok(model):
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  output_hidden_states=layer_ids, use_cache=False)
        proj = model.get_output_embeddings()
        bias = proj.bias[vocab_ids] if proj.bias is not None else None
        logits = F.linear(out.last_hidden_state, proj.weight[vocab_ids], bias)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=layer_ids,
                    use_cache=False)
        logits = out.logits if vocab_ids is None else out.logits[..., vocab_ids]
    return tapped_hidden_states(out, tuple(layer_ids)), logits.float()
