"""Configuration of a DART draft head (`DartConfig`) and of the draft-tree search (`TreeConfig`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

CONFIG_NAME = "config.json"

# RoPE variants the head implements; anything else is refused when the config is read.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """The reference taps: the inputs of decoder layers 2, L//2 and L-3 of an L-layer target."""
    if num_target_layers < 4:
        raise ValueError(
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
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "draft_vocab_size", "draft_length", "head_dim", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DartConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab_size {self.vocab_size}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {self.hidden_act!r}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if len(self.target_layer_ids) != 3:
                raise ValueError(f"target_layer_ids must name 3 layers, got {self.target_layer_ids}")

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
            raise ValueError(
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
            raise ValueError(f"DART config is missing required field(s): {', '.join(missing)}")
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
    """Settings of the draft-tree beam search (reference defaults, DESIGN 2.3).

    Score of extending a candidate by a token at level l:
    `lw(l) * (ow(l) * log(p + 1e-10) + ngram_weight * log(q + 1e-10))` with `lw(l) = (l+1)**-level_weight_exponent`,
    `ow(l) = logit_weight_decay**l` and no n-gram term at level 0.
    """

    topk: int = 25
    beam_width: int = 20
    remain_total: int = 60
    ngram_weight: float = 0.5
    eos_token_id: Optional[int] = None
    level_weight_exponent: float = 0.7
    logit_weight_decay: float = 0.9
    max_depth: Optional[int] = None  # draft levels used (None: all the head predicts, D+1)

    def __post_init__(self) -> None:
        for name in ("topk", "beam_width", "remain_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TreeConfig.{name} must be a positive integer, got {value!r}")
        if self.max_depth is not None and (not isinstance(self.max_depth, int) or self.max_depth <= 0):
            raise ValueError(f"TreeConfig.max_depth must be a positive integer or None, got {self.max_depth!r}")
        if not (self.ngram_weight >= 0 and math.isfinite(self.ngram_weight)):
            raise ValueError(f"TreeConfig.ngram_weight must be a finite number >= 0, got {self.ngram_weight!r}")

    def level_weight(self, level: int) -> float:
        return (level + 1) ** -self.level_weight_exponent

    def logit_weight(self, level: int) -> float:
        return self.logit_weight_decay ** level

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TreeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown tree setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
