"""generate()'s logits processors called as plain generate() calls them, one verified position at a time.

The rule for every callable plain `generate()` calls once per step with the whole batch (logits processors and
stopping criteria): it gets the caller's batch layout, row i holding row i's exact prefix, never one row alone.
Stopping criteria get plain's very calls (`dart_hf.stopping.Stopper` makes them in lockstep once every row has
reached the step). Logits processors decide the tokens themselves, so they are called before the other rows have
reached the step: plain calls its processor list with `input_ids` [B, T] (every row's prefix, left padding included)
and `scores` [B, V] and reads row i of the result for row i; DART verifies each row at its own pace, a tree depth at a
time, so it calls the list once per depth of the walk and prefix length with the same layout: each row verified there
in its own slot i with its visited node's exact prefix and scores, every other row its own tokens cut (or left-padded
with generate()'s pad token) to the same length with zero scores, and reads those slots. A step that verifies the
roots alone of rows of equal length makes plain's very call. A processor that treats rows differently (per-row rules,
`prefix_allowed_tokens_fn`'s batch id, a prompt length per row) therefore applies row i's rule to row i, and one
that checks the batch size sees generate()'s.

That is exact for processors whose output for a row depends on that row's prefix and scores alone, and only for
those: plain calls a processor once per step, DART once per depth of its walk, so one that counts its calls or keeps
anything else between calls gives other output. The rule (`processor_refusal`): a processor whose class transformers
defines is known (all of them are stateless but `STATEFUL`, which are refused by name); any other processor (a
custom class, a function, a subclass of transformers' own) cannot be told apart by its class, so DART refuses it by
name unless the caller declares the call's processors stateless (`generate(..., dart_stateless_processors=True)`). A
refusal is `NotApplicable` before any work; an attached head runs the call as plain `generate()` with one warning.
`prefix_allowed_tokens_fn` is a function of (batch id, prefix) by transformers' own contract.

Prefixes of different lengths share one call (`length_key`) when every processor is one of transformers' own whose
result reads nothing of input_ids (temperature, top-k/p and the like) or only its length against a threshold
(`min_length`, `min_new_tokens`) that every prefix of the call is on the same side of: the shorter prefixes are then
left-padded to the longest, which no processor of the call can tell from plain's layout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dart_core.verify import BatchedProcessor

# transformers' processors that keep state between calls (classifier-free guidance's cache of the unconditional
# pass, SynthID's watermarking context, Dia's per-row EOS countdown) or follow a whole-batch timeline (Whisper's):
# their calls cannot be replayed per verified node
STATEFUL = ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "WhisperTimeStampLogitsProcessor",
            "WhisperNoSpeechDetection", "SynthIDTextWatermarkLogitsProcessor", "DiaEOSDelayPatternLogitsProcessor")

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


# transformers' processors (`transformers.generation.logits_process`) whose result reads nothing of input_ids
IDS_FREE = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
            "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "SuppressTokensLogitsProcessor",
            "InfNanRemoveLogitsProcessor", "LogitNormalization")
_LOGITS_PROCESS = "transformers.generation.logits_process"


def _length_threshold(processor) -> Optional[Callable[[int], bool]]:
    """Prefix length -> whether `processor` acts, for transformers' processors that read input_ids only as its length
    against one threshold (min_length, min_new_tokens); None for any other."""
    name = type(processor).__name__
    shortest = getattr(processor, "min_length", None)
    if name == "MinLengthLogitsProcessor" and isinstance(shortest, int):
        return lambda length: length < shortest
    skip, least = getattr(processor, "prompt_length_to_skip", None), getattr(processor, "min_new_tokens", None)
    if name == "MinNewTokensLengthLogitsProcessor" and isinstance(skip, int) and isinstance(least, int):
        return lambda length: length - skip < least
    return None


def length_key(processors) -> Optional[Callable[[int], tuple]]:
    """`BatchedProcessor.length_key` for `processors`: prefix length -> what each processor's result depends on when
    every processor is one of transformers' own that reads nothing of input_ids (`IDS_FREE`) or only its length
    against a threshold (`_length_threshold`), so prefixes of different lengths with one key share a call; else None
    (one call per prefix length)."""
    thresholds = []
    for p in _each(processors):
        if type(p).__module__ != _LOGITS_PROCESS:
            return None
        if type(p).__name__ in IDS_FREE:
            continue
        threshold = _length_threshold(p)
        if threshold is None:
            return None
        thresholds.append(threshold)
    return lambda length: tuple(threshold(length) for threshold in thresholds)


def _cut(tokens: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """tokens [L] -> [length]: its first `length` tokens, or left-padded with `pad` when shorter."""
    if tokens.shape[0] >= length:
        return tokens[:length]
    return torch.cat((tokens.new_full((length - tokens.shape[0],), pad), tokens))


def batch_processor(processors, sequences: list[torch.Tensor], rows: list[int], pad: Optional[int]) -> BatchedProcessor:
    """`processors` in the caller's batch layout (module docstring), for `dart_core.verify.verify_tree`: tree row j is
    the caller's row rows[j]; `sequences` holds every caller's row's tokens so far ([1, L_r] each, left padding
    included); `pad` (0 when None) fills rows shorter than the prefix asked about. Prefixes of different lengths
    share a call where `length_key` shows the processors' result cannot tell them apart."""
    pad = 0 if pad is None else pad

    def call(tree_rows: list[int], ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        caller_rows = [rows[j] for j in tree_rows]
        if caller_rows == list(range(len(sequences))):  # the whole batch in the caller's order: plain's own call
            return processors(ids, scores)
        slots = torch.tensor(caller_rows, device=ids.device)
        batch_ids = torch.stack([_cut(seq[0].to(ids.device), ids.shape[1], pad) for seq in sequences])  # [B, T]
        batch_ids[slots] = ids
        batch_scores = scores.new_zeros(len(sequences), scores.shape[-1])
        batch_scores[slots] = scores
        return processors(batch_ids, batch_scores)[slots]

    return BatchedProcessor(call, length_key(processors))
