"""dart_hf: DART inside Hugging Face transformers.

- `enable(model)` then `model.generate(input_ids, dart_head=head, ...)`: DART tree decoding (one target forward
  verifies a whole draft tree); output identical to plain `generate()`. `enable(model, head)` attaches the head:
  every later `generate()` (pipelines, evaluation harnesses) decodes with it where DART applies, else runs plain
  with a `DartFallbackWarning`.
- `last_stats(model)` (`model.dart_stats`): the `DartStats` of this thread's last DART call on the model.
- `model.generate(input_ids, assistant_model=head)` after `enable()`: transformers' own assisted loop with
  `DartCandidateGenerator` (a linear chain per step).
- `dart_decoding`: the tree loop as a `custom_generate` callable for models that are not enabled.
- `load_smollm2()`: the offline SmolLM2-135M-Instruct target; `load_default()`: it plus the shipped DART head.
- `calibrate(model, tokenizer, head)` / `tuned_tree_config(...)`: the tree size that decodes fastest on this machine
  (measured, cached; module `dart_hf.calibration`).
"""

from dart_hf.calibration import Calibration, cached_calibration, calibrate, tuned_tree_config
from dart_hf.candidate import DartCandidateGenerator
from dart_hf.default import load_default
from dart_hf.enable import DartFallbackWarning, DartGenerationMixin, enable
from dart_hf.loop import DartStats, dart_decoding, last_stats
from dart_hf.outputs import DartGenerateOutput
from dart_hf.smollm2 import load_smollm2

__all__ = ["Calibration", "DartCandidateGenerator", "DartFallbackWarning", "DartGenerateOutput",
           "DartGenerationMixin", "DartStats", "cached_calibration", "calibrate", "dart_decoding", "enable",
           "last_stats", "load_default", "load_smollm2", "tuned_tree_config"]
