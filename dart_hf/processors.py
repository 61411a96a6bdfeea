"""generate()'s logits processors called as plain generate() calls them, one verified position at a time.

The rule for every callable plain `generate()` calls once per step with the whole batch (logits processors and
stopping criteria): it gets the caller's batch layout, row i holding row i's exact prefix, never one row alone.
Stopping criteria get plain's very calls (`dart_hf.stopping.Stopper` makes them in lockstep once every row has
reached the step). Logits processors decide the tokens themselves, so they are called before the other rows have
reached the step: plain calls its processor list with `input_ids` [B, T] (every row's prefix, left padding included)
and `scores` [B, V] and reads row i of the result for row i; DART verifies each row at its own pace, one tree node at
a time, so it calls the list once per visited node with the same layout: the row being verified in its own slot i
with that node's exact prefix, every other row its own tokens cut (or left-padded with generate()'s pad token) to
the same length with zero scores, and reads slot i. A processor that treats rows differently (per-row rules,
`prefix_allowed_tokens_fn`'s batch id, a prompt length per row) therefore applies row i's rule to row i, and one
that checks the batch size sees generate()'s.

That is exact for processors whose output for a row depends on that row's prefix and scores alone, and only for
those: plain calls a processor once per step, DART once per visited node, so one that counts its calls or keeps
anything else between calls gives other output. The rule (`processor_refusal`): a processor whose class transformers
defines is known (all of them are stateless but `STATEFUL`, which are refused by name); any other processor (a
custom class, a function, a subclass of transformers' own) cannot be told apart by its class, so DART refuses it by
name unless the caller declares the call's processors stateless (`generate(..., dart_stateless_processors=True)`).
A refusal is `NotApplicable` before any work; an attached head runs the call as plain `generate()` with one
warning. `prefix_allowed_tokens_fn` is a function of (batch id, prefix) by transformers' own contract.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# transformers' processors that keep state between calls (classifier-free guidance's cache of the unconditional
# pass, SynthID's watermarking context, Dia's per-row EOS countdown) or follow a whole-batch timeline (Whisper's):
# their calls cannot be replayed per verified node
STATEFUL = ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "WhisperTimeStampLogitsProcessor",
            "WhisperNoSpeechDetection", "SynthIDTextWatermarkLogitsProcessor", "DiaEOSDelayPatternLogitsProcessor")

RowProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, T], scores [1, V]) -> [1, V]


def _each(processors):
    """The processors of a list, nested lists flattened."""
    for p in processors or ():
        if isinstance(p, (list, tuple)):
            yield from _each(p)
        else:
            yield p


def _name(processor) -> str:
    """A processor's class name (a function's own name)."""
    return getattr(processor, "__qualname__", None) or type(processor).__name__


def _transformers_own(processor) -> bool:
    return type(processor).__module__.split(".")[0] == "transformers"


def stateful_processor(processors) -> Optional[str]:
    """The class name of the first processor of `processors` that transformers defines with state between calls,
    or None."""
    return next((_name(p) for p in _each(processors) if _transformers_own(p) and type(p).__name__ in STATEFUL), None)


def undeclared_processor(processors) -> Optional[str]:
    """The name of the first processor of `processors` whose class transformers does not define (whether it keeps
    state between calls is unknown), or None."""
    return next((_name(p) for p in _each(processors) if not _transformers_own(p)), None)


def processor_refusal(processors, declared_stateless: bool = False) -> Optional[str]:
    """Why DART cannot call `processors` as plain generate() calls them (module docstring), or None."""
    stateful = stateful_processor(processors)
    if stateful is not None:
        return (f"the logits processor {stateful} keeps state between calls (e.g. guidance_scale's unconditional "
                "pass), which DART's per-node verification cannot replay as plain generate() calls it")
    unknown = None if declared_stateless else undeclared_processor(processors)
    if unknown is not None:
        return (f"the logits processor {unknown} is not one of transformers' own, so DART cannot know whether it "
                "keeps state between calls: DART calls processors once per verified tree node, plain generate() once "
                "per step, so a processor that counts its calls (or keeps anything else) would give other output. "
                "If each row's result depends only on that row's input_ids and scores, pass "
                "dart_stateless_processors=True")
    return None


def _cut(tokens: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """tokens [L] -> [length]: its first `length` tokens, or left-padded with `pad` when shorter."""
    if tokens.shape[0] >= length:
        return tokens[:length]
    return torch.cat((tokens.new_full((length - tokens.shape[0],), pad), tokens))


def row_processor(processors, sequences: list[torch.Tensor], row: int, pad: Optional[int]) -> RowProcessor:
    """Caller's row `row`'s view of `processors` (module docstring): `sequences` holds every row's tokens so far
    ([1, L_r] each, left padding included); `pad` (0 when None) fills rows shorter than the prefix asked about."""
    if len(sequences) == 1:
        return processors
    pad = 0 if pad is None else pad

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        batch_ids = torch.stack([ids[0] if r == row else _cut(seq[0].to(ids.device), length, pad)
                                 for r, seq in enumerate(sequences)])  # [B, T]
        batch_scores = scores.new_zeros(len(sequences), scores.shape[-1])
        batch_scores[row] = scores[0]
        return processors(batch_ids, batch_scores)[row : row + 1]

    return call
