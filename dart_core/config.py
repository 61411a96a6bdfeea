"""Configuration of a DART draft head (`DartConfig`) and of the draft-tree search (`TreeConfig`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

from dart_core.errors import DartInputError

CONFIG_NAME = "config.json"

# RoPE variants the head implements; anything else is refused when the config is read.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# A config implying more head parameters than this is refused before anything is allocated (2**34 fp32 numbers:
# 64 GiB; a head for a 70B target has well under 2**31).
MAX_HEAD_PARAMETERS = 2**34
# Tree sizes beyond these are refused: the verify forward grows with the node count and the beam search with
# topk x beam_width; the reference uses 60 nodes, topk 25, beam 20.
MAX_TREE_NODES = 1024
MAX_TOPK = 1024
MAX_BEAM_WIDTH = 1024
# Context drafting (docs/DESIGN.md §2.6): a path longer than this many tokens, more followed occurrences or a longer
# suffix than these are refused (each costs host time per step, and the match index grows with the suffix lengths).
MAX_CONTEXT_DEPTH = 64
MAX_CONTEXT_MATCHES = 32
MAX_CONTEXT_MATCH = 16


def check_int(owner: str, name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    """DartInputError unless `value` is an int (not a bool) >= minimum (or None when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise DartInputError(f"{owner}.{name} must be {kind}{' or None' if optional else ''}, got {value!r}")


def check_float(owner: str, name: str, value: Any, minimum: float = 0.0, strict: bool = False) -> None:
    """DartInputError unless `value` is a finite real number (not a bool) >= minimum (> minimum when `strict`)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < minimum or (strict and value == minimum)):
        raise DartInputError(f"{owner}.{name} must be a finite number {'>' if strict else '>='} {minimum}, "
                             f"got {value!r}")


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """The reference taps: the inputs of decoder layers 2, L//2 and L-3 of an L-layer target."""
    if num_target_layers < 4:
        raise DartInputError(
            f"DART taps layers 2, L//2 and L-3 of the target; a target with {num_target_layers} layers is too "
            "shallow (need at least 4)"
        )
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclasses.dataclass
class DartConfig:
    """Shape of a DART head (Llama-style fields as in official DART `config.json`) plus DART's own fields.

    `target_layer_ids` are the HF `hidden_states` indices the head reads (input of those decoder layers);
    when None they follow from `num_target_layers` by `default_target_layer_ids`.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    draft_length: int
    head_dim: Optional[int] = None
    target_hidden_size: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    num_target_layers: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads"):  # what head_dim is derived from
            check_int("DartConfig", name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise DartInputError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "draft_vocab_size", "draft_length", "head_dim", "target_hidden_size",
                     "max_position_embeddings"):
            check_int("DartConfig", name, getattr(self, name))
        check_int("DartConfig", "num_target_layers", self.num_target_layers, optional=True)
        check_float("DartConfig", "rms_norm_eps", self.rms_norm_eps, strict=True)
        check_float("DartConfig", "rope_theta", self.rope_theta, strict=True)
        if self.vocab_size >= 2**31:
            raise DartInputError(f"DartConfig.vocab_size {self.vocab_size} does not fit token ids in int32")
        if self.estimated_parameters() > MAX_HEAD_PARAMETERS:
            raise DartInputError(f"DartConfig describes a head of about {self.estimated_parameters():.3g} parameters "
                                 f"(vocab_size {self.vocab_size}, hidden_size {self.hidden_size}, intermediate_size "
                                 f"{self.intermediate_size}); more than {MAX_HEAD_PARAMETERS:.3g} is refused")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DartInputError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise DartInputError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise DartInputError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab_size {self.vocab_size}"
            )
        if self.hidden_act != "silu":
            raise DartInputError(f"only hidden_act='silu' is supported, got {self.hidden_act!r}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise DartInputError(f"rope_scaling type {rope_type!r} is not supported "
                                 f"(supported: {SUPPORTED_ROPE_TYPES})")
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers)
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            if (not isinstance(ids, (list, tuple)) or len(ids) != 3
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
                raise DartInputError(f"target_layer_ids must name 3 layers (integers >= 0), got {ids!r}")
            self.target_layer_ids = list(ids)

    def estimated_parameters(self) -> int:
        """Parameters of a head of this shape, its own embedding table included (fc, one layer, lm_head)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = 2 * h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim \
            + self.num_attention_heads * self.head_dim * h
        return 3 * self.target_hidden_size * h + attn + 3 * h * i + h * (self.draft_vocab_size + self.vocab_size)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def layer_ids_for(self, num_target_layers: int) -> list[int]:
        """The taps for a target with `num_target_layers` layers, checked against that target."""
        ids = self.target_layer_ids or default_target_layer_ids(num_target_layers)
        bad = [i for i in ids if not 0 <= i <= num_target_layers]
        if bad:
            raise DartInputError(
                f"head taps hidden states {ids} but the target has only {num_target_layers} layers "
                f"(valid indices 0..{num_target_layers})"
            )
        return list(ids)

    def get_text_config(self, *args, **kwargs) -> "DartConfig":
        """The config itself: transformers' assisted generation reads `assistant.config.get_text_config()`."""
        return self

    # ---- (de)serialisation -------------------------------------------------------------------------------
    _FIELDS_OUT = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                   "draft_vocab_size", "draft_length", "head_dim", "target_hidden_size", "rms_norm_eps",
                   "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act", "num_target_layers",
                   "target_layer_ids")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DartConfig":
        """Build from an official DART or this project's `config.json` dict (unknown fields go to `extra`)."""
        raw = dict(raw)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
                               "draft_length") if k not in raw]
        if missing:
            raise DartInputError(f"DART config is missing required field(s): {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: raw.pop(k) for k in list(raw) if k in known}
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        kwargs.setdefault("draft_vocab_size", kwargs["vocab_size"])
        if kwargs.get("rope_theta") is None:
            # transformers >= 5 keeps rope_theta inside rope_parameters
            params = raw.get("rope_parameters") or {}
            kwargs["rope_theta"] = params.get("rope_theta", 10000.0)
        kwargs["rope_theta"] = float(kwargs["rope_theta"])
        return cls(**kwargs, extra=raw)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update({k: getattr(self, k) for k in self._FIELDS_OUT})
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DartConfig":
        from dart_core.io import read_json_object

        file = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else str(path)
        return cls.from_dict(read_json_object(file))


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Settings of the draft-tree beam search (reference defaults, docs/DESIGN.md §2.3).

    Score of extending a candidate by a token at level l:
    `lw(l) * (ow(l) * log(p + 1e-10) + ngram_weight * log(q + 1e-10))` with `lw(l) = (l+1)**-level_weight_exponent`,
    `ow(l) = logit_weight_decay**l` and no n-gram term at level 0.

    `context_draft=True` adds the row's own context as a third source of paths (docs/DESIGN.md §2.6,
    `dart_core.context`): the `context_matches` latest occurrences of the longest suffix of the row (between
    `context_min_match` and `context_max_match` tokens) that occurs earlier in it, each followed for up to
    `context_depth` tokens, ranked against the head's candidates in the same `remain_total` nodes.
    `max_depth` bounds every node's depth, context paths' too.
    """

    topk: int = 25
    beam_width: int = 20
    remain_total: int = 60
    ngram_weight: float = 0.5
    eos_token_id: Optional[int] = None
    level_weight_exponent: float = 0.7
    logit_weight_decay: float = 0.9
    max_depth: Optional[int] = None  # deepest tree level (None: the head's D+1, or a context path's depth)
    context_draft: bool = True  # the row's own continuations as draft paths (docs/DESIGN.md §2.6; off: §2.3 alone)
    context_depth: int = 16  # tokens of each context path
    context_matches: int = 4  # occurrences of the longest matching suffix followed
    context_min_match: int = 2  # shortest suffix that counts as a match
    context_max_match: int = 4  # longest suffix looked up

    def __post_init__(self) -> None:
        for name, most in (("topk", MAX_TOPK), ("beam_width", MAX_BEAM_WIDTH), ("remain_total", MAX_TREE_NODES)):
            check_int("TreeConfig", name, getattr(self, name))
            if getattr(self, name) > most:
                raise DartInputError(f"TreeConfig.{name} {getattr(self, name)} is above the supported {most} (a tree "
                                     "of that size costs far more to verify than it can save)")
        check_int("TreeConfig", "max_depth", self.max_depth, optional=True)
        check_int("TreeConfig", "eos_token_id", self.eos_token_id, minimum=0, optional=True)
        check_float("TreeConfig", "ngram_weight", self.ngram_weight)
        check_float("TreeConfig", "level_weight_exponent", self.level_weight_exponent)
        check_float("TreeConfig", "logit_weight_decay", self.logit_weight_decay, strict=True)
        if not isinstance(self.context_draft, bool):
            raise DartInputError(f"TreeConfig.context_draft must be true or false, got {self.context_draft!r}")
        for name, most in (("context_depth", MAX_CONTEXT_DEPTH), ("context_matches", MAX_CONTEXT_MATCHES),
                           ("context_min_match", MAX_CONTEXT_MATCH), ("context_max_match", MAX_CONTEXT_MATCH)):
            check_int("TreeConfig", name, getattr(self, name))
            if getattr(self, name) > most:
                raise DartInputError(f"TreeConfig.{name} {getattr(self, name)} is above the supported {most}")
        if self.context_max_match < self.context_min_match:
            raise DartInputError(f"TreeConfig.context_max_match {self.context_max_match} is below context_min_match "
                                 f"{self.context_min_match}")

    def draft_levels(self, predicted: int) -> int:
        """How many of the `predicted` candidate levels (a head's D+1) the search reads: at most `max_depth`, and at
        most `remain_total`. Scores never increase from a node to its children and a parent precedes its children
        in the pool, so the best R pool entries never include a node deeper than R (the tree is the same)."""
        return min(predicted, self.max_depth or predicted, self.remain_total)

    def context_path_depth(self) -> int:
        """Tokens of each context path (docs/DESIGN.md §2.6): `context_depth`, at most `max_depth`; 0 when the source
        is off. (Paths deeper than `remain_total` are drafted but never selected: scores never increase along one.)"""
        if not self.context_draft:
            return 0
        return min(self.context_depth, self.max_depth or self.context_depth)

    def tree_depth(self, predicted: int) -> int:
        """The deepest node any tree of these settings can hold, for a head predicting `predicted` levels (D+1): the
        head's `draft_levels(predicted)` or, with context drafting, the context paths' depth, at most `remain_total`
        (what greedy acceptance and SGLang's `--speculative-num-steps` are sized by)."""
        return max(self.draft_levels(predicted), min(self.context_path_depth(), self.remain_total))

    def level_weight(self, level: int) -> float:
        return (level + 1) ** -self.level_weight_exponent

    def logit_weight(self, level: int) -> float:
        return self.logit_weight_decay ** level

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TreeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DartInputError(f"unknown tree setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ACCEPTANCE_KEY = "dart_acceptance"  # the head config.json key of its acceptance curve


@dataclasses.dataclass(frozen=True)
class AcceptanceCurve:
    """tau(R), the tokens a greedy verify step yields with a tree of R draft nodes (1 + the accepted drafts), measured
    for one head on one target (`dart_hf.calibration.measure_acceptance`) and shipped in the head's config.json.

    tau {R: tau}; steps / new_tokens / prompts: the size of the run behind it; target: the target it was measured on
    (a name); measured: the date."""

    tau: dict
    steps: int
    new_tokens: int
    prompts: int
    target: str = ""
    measured: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tau, dict) or not self.tau:
            raise DartInputError("acceptance curve: tau must be a non-empty {tree size: tau} mapping")
        try:
            tau = {int(r): float(t) for r, t in self.tau.items()}
        except (TypeError, ValueError) as err:
            raise DartInputError(f"acceptance curve: malformed tau entry ({err})") from None
        sizes = sorted(tau)
        if sizes[0] < 1 or any(not math.isfinite(tau[r]) or tau[r] < 1.0 for r in sizes):
            raise DartInputError("acceptance curve: tree sizes must be >= 1 and tau finite and >= 1")
        if any(tau[a] > tau[b] + 1e-9 for a, b in zip(sizes, sizes[1:])):
            raise DartInputError("acceptance curve: tau must not decrease with the tree size")
        for name in ("steps", "new_tokens", "prompts"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise DartInputError(f"acceptance curve: {name} must be a positive integer")
        object.__setattr__(self, "tau", {r: tau[r] for r in sizes})

    @classmethod
    def from_dict(cls, raw: Any) -> "AcceptanceCurve":
        if not isinstance(raw, dict):
            raise DartInputError(f"acceptance curve: expected an object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DartInputError(f"acceptance curve: unknown field(s) {unknown}")
        try:
            return cls(**raw)
        except TypeError as err:
            raise DartInputError(f"acceptance curve: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tau"] = {str(r): round(t, 4) for r, t in self.tau.items()}
        return out
