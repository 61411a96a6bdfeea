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
- Each DART call without `dart_tree_config` chooses every step's tree from what DART measures while it runs
  (`dart_core.speed`: the head's acceptance curve and, where `calibrate` measured one, this machine's cost as
  priors, then every call's own step times and accepted lengths); an attached head decodes plain where DART does
  not pay.
  `tree_choice(model, head)` is the current choice; `calibrate(model, tokenizer, head)` measures a head's
  acceptance curve (`dart_hf.calibration`).
"""

from dart_core.cost import MachineCost
from dart_core.speed import TreeChoice
from dart_hf.calibration import DartCacheWarning, calibrate
from dart_hf.controller import tree_choice
from dart_hf.candidate import DartCandidateGenerator
from dart_hf.default import load_default
from dart_hf.enable import DartFallbackWarning, DartGenerationMixin, enable
from dart_hf.loop import DartStats, NotApplicable, dart_decoding, last_stats
from dart_hf.outputs import DartGenerateOutput
from dart_hf.smollm2 import load_smollm2

__all__ = ["DartCacheWarning", "DartCandidateGenerator", "DartFallbackWarning", "DartGenerateOutput", "DartGenerationMixin", "DartStats",
           "MachineCost", "NotApplicable", "TreeChoice", "calibrate", "dart_decoding", "enable", "last_stats",
           "load_default", "load_smollm2", "tree_choice"]
