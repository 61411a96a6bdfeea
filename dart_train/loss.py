"""Training a drafter: the training forward on padded batches (many anchors per sequence in one pass), anchors, and
the distillation loss.

Notation (docs/DESIGN.md §2.1): a sequence x[0..T-1]; real row p (p = 0..T-2) pairs the target's tapped hidden states at
position p, aux[p], with the embedding of x[p+1]. For an anchor p the inference head (`DartHead.forward` over real
rows 0..p) returns D+1 outputs: output k (k = 0..D) predicts x[p+2+k], whose teacher distribution is the target's
next-token distribution at position p+1+k.

Training forward, one pass for a whole sequence and A anchors p_1..p_A (`DartHead.training_forward`):

    rows = [N real rows 0..N-1][block of D mask rows for p_1] ... [block of D mask rows for p_A]

- real row i: input cat(input_layernorm(embed(shifted_ids[i])), hidden_norm(fc(aux[i]))), residual fc(aux[i]),
  RoPE position i; it sees real rows <= i (plain causal attention). Its output is prediction k=0 for anchor i.
- mask row j (j = 1..D) of the block of anchor p: input mask_rep, residual mask_rep[:H], RoPE position p+j; it sees
  real rows <= p and rows 1..j of its OWN block, never another block and never a later real row. Its output is
  prediction k=j for anchor p.

With that mask every output equals the inference forward on the prefix (`head(aux[:, :p+1], shifted_ids[:, :p+1])`),
which `tests/cli/test_train.py` checks to 1e-5 (and checks that a leaky mask fails).

Loss (`dart_loss`): forward KL(P_k || Q_k) at each eligible prediction, where P = softmax(target logits restricted
to the draft vocabulary, renormalised) and Q = softmax(head logits). A prediction of x[m] (m = p+2+k) is eligible
when m < T (the token exists in the sequence) and m >= prompt_length (it is a response token). The loss is

    loss = sum_k gamma**k * mean_k,    mean_k = (sum of KL over eligible predictions at k) / max(1, #eligible at k)

i.e. each k is averaged over its own eligible predictions (k=0 over all eligible real rows, k >= 1 over the eligible
mask rows of the sampled anchors) and the per-k means are summed with weights gamma**k (not divided by sum gamma**k).
Per-position accuracy: argmax Q == argmax P.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from dart_core import DartHead


# ---- the training forward -------------------------------------------------------------------------------------------
def clear_padding(aux: torch.Tensor, shifted_ids: torch.Tensor,
                  lengths: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [B, N, 3*Ht] and shifted_ids [B, N] with the rows at or past `lengths` [B] (right padding) set to 0.

    Padding rows are hidden from every valid row by the mask, but attention multiplies their values by a weight of
    exactly 0, and 0 * inf = NaN: a non-finite value in a padding row (the target's hidden state at a padded
    position) would poison every row of the batch and, through the backward pass, the weights.
    """
    if lengths is None:
        return aux, shifted_ids
    real = torch.arange(shifted_ids.shape[1], device=shifted_ids.device)[None] < lengths.to(shifted_ids.device)[:, None]
    return torch.where(real[..., None], aux, 0.0), torch.where(real, shifted_ids, 0)


class TrainingForward(nn.Module):
    """The drafter's `training_forward` on a right-padded batch as a module (what DistributedDataParallel wraps:
    gradients sync through its forward). `lengths` [B] (default N): real rows of each batch row; the rows past it
    are cleared (`clear_padding`) and, as long as every anchor lies inside its row's real rows, only disturb later
    padding rows, never valid ones."""

    def __init__(self, head: DartHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, aux, shifted_ids, anchors, lengths=None):
        return self.head.training_forward(*clear_padding(aux, shifted_ids, lengths), anchors)


# ---- anchors --------------------------------------------------------------------------------------------------------
def anchor_range(seq_length: int, prompt_length: int, draft_length: int) -> tuple[int, int]:
    """[lo, hi) of anchors p whose block has at least one eligible prediction: some k in 1..D with
    prompt_length <= p+2+k < seq_length."""
    lo = max(0, prompt_length - 2 - draft_length)
    hi = seq_length - 3  # p + 3 < T
    return lo, max(lo, hi)


def choose_anchors(seq_lengths: torch.Tensor, prompt_lengths: torch.Tensor, num_anchors: int, draft_length: int,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A] int64 sorted, valid [B, A] bool): up to A distinct anchors per row, uniformly among the
    useful ones (`anchor_range`); rows with fewer fill the rest with anchor 0, valid False."""
    b = seq_lengths.shape[0]
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for i in range(b):
        lo, hi = anchor_range(int(seq_lengths[i]), int(prompt_lengths[i]), draft_length)
        count = hi - lo
        if count <= 0:
            continue
        if count <= num_anchors:
            picked = torch.arange(lo, hi)
        else:
            picked = lo + torch.randperm(count, generator=generator)[:num_anchors].sort().values
        anchors[i, : picked.numel()] = picked
        valid[i, : picked.numel()] = True
    return anchors, valid


# ---- loss -----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LossOutput:
    """loss: the weighted objective (differentiable). Per k = 0..D (detached, float64 sums so they add up over
    batches and ranks): kl_sum, correct (argmax agreement), count (eligible predictions)."""

    loss: torch.Tensor
    kl_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    @property
    def kl(self) -> list[float]:
        return (self.kl_sum / self.count.clamp(min=1)).tolist()

    @property
    def accuracy(self) -> list[float]:
        return (self.correct / self.count.clamp(min=1)).tolist()


def kl_and_agreement(target_logits: torch.Tensor, head_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL(softmax(target) || softmax(head)) and argmax agreement over the last dim -> ([...], [...] bool)."""
    t = target_logits.float()
    log_p = torch.log_softmax(t, dim=-1)
    log_q = torch.log_softmax(head_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = head_logits.argmax(-1) == t.argmax(-1)
    return kl, agree


def dart_loss(real_logits: torch.Tensor, block_logits: torch.Tensor, target_logits: torch.Tensor,
              anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_lengths: torch.Tensor,
              prompt_lengths: torch.Tensor, gamma: float = 0.6) -> LossOutput:
    """The loss of the module docstring.

    real_logits [B, N, Vd], block_logits [B, A, D, Vd] from `DartHead.training_forward`; target_logits [B, T, Vd] with
    T >= N + 1: the target's logits at every position, already restricted to the draft vocabulary (columns
    `draft_to_target(arange(Vd))`); seq_lengths / prompt_lengths [B] (T_b and the prompt tokens of each row).
    """
    b, n, _ = real_logits.shape
    d = block_logits.shape[2]
    device = real_logits.device
    seq_lengths = seq_lengths.to(device)[:, None]
    prompt_lengths = prompt_lengths.to(device)[:, None]

    # k = 0: real row p predicts x[p+2] from the target's distribution at p+1
    p = torch.arange(n, device=device)[None]
    eligible0 = (p + 2 < seq_lengths) & (p + 2 >= prompt_lengths)  # [B, N]
    # k = 1..D: block row j of anchor p predicts x[p+2+j] from the target's distribution at p+1+j
    j = torch.arange(1, d + 1, device=device)
    predicted = anchors.to(device)[:, :, None] + 2 + j  # [B, A, D]
    eligible = (predicted < seq_lengths[:, :, None]) & (predicted >= prompt_lengths[:, :, None])
    eligible &= anchor_valid.to(device)[:, :, None]
    src = (predicted - 1).clamp(max=target_logits.shape[1] - 1)  # [B, A, D]
    rows = torch.arange(b, device=device)[:, None, None]

    # only eligible predictions enter the softmaxes: an ineligible row may hold anything (padding, a non-finite
    # value), and a masked-out NaN would still poison the gradient (0 * NaN) if it were computed
    kl0, agree0 = kl_and_agreement(target_logits[:, 1: n + 1][eligible0], real_logits[eligible0])  # [E0]
    klk, agreek = kl_and_agreement(target_logits[rows, src][eligible], block_logits[eligible])  # [Ek]
    k_of = j.expand_as(eligible)[eligible] - 1  # [Ek] position k-1 of each eligible block prediction

    kl_sum = torch.cat((kl0.sum()[None], torch.zeros(d, dtype=klk.dtype, device=device).index_add(0, k_of, klk)))
    count = torch.cat((eligible0.sum()[None], eligible.sum(dim=(0, 1)))).to(torch.float64)
    correct = torch.cat((agree0.sum()[None], torch.zeros(d, dtype=torch.long, device=device).index_add(
        0, k_of, agreek.long()))).to(torch.float64)
    weights = gamma ** torch.arange(d + 1, device=device, dtype=kl_sum.dtype)
    loss = (weights * kl_sum / count.clamp(min=1).to(kl_sum.dtype)).sum()
    return LossOutput(loss=loss, kl_sum=kl_sum.detach().to(torch.float64), correct=correct, count=count)
