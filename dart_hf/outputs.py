"""The dict output of `generate(dart_head=..., return_dict_in_generate=True)`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclasses.dataclass
class DartGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `dart_stats` (a `dart_hf.DartStats`: steps, accepted lengths, tau, times)."""

    dart_stats: Optional[Any] = None
