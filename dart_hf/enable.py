"""`dart_hf.enable(model)`: teach an already-loaded transformers model `generate(dart_head=...)`."""

from __future__ import annotations

import functools

from dart_core import DartHead
from dart_hf.candidate import DartCandidateGenerator
from dart_hf.loop import dart_decoding

_SUBCLASSES: dict[type, type] = {}


class DartGenerationMixin:
    """Routes `generate(dart_head=...)` to DART tree decoding and `generate(assistant_model=<DartHead>)` to
    transformers' assisted loop with a `DartCandidateGenerator`; everything else is the model's own `generate`."""

    def generate(self, inputs=None, generation_config=None, *, dart_head: DartHead | None = None, dart_ngram=None,
                 dart_tree_config=None, dart_sync_timing: bool = False, dart_cuda_graph: bool = False, **kwargs):
        if dart_head is None:
            if dart_ngram is not None or dart_tree_config is not None or dart_sync_timing or dart_cuda_graph:
                raise ValueError("dart_ngram / dart_tree_config / dart_sync_timing / dart_cuda_graph need "
                                 "dart_head=<DartHead>")
            return super().generate(inputs, generation_config, **kwargs)
        if not isinstance(dart_head, DartHead):
            raise TypeError(f"dart_head must be a dart_core.DartHead, got {type(dart_head).__name__}")
        for clash in ("custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
            if kwargs.get(clash) is not None:
                raise ValueError(f"dart_head cannot be combined with {clash}=")
        # generate() drops these on the custom_generate path: hand them to the DART loop ourselves
        streamer = kwargs.pop("streamer", None)
        tokenizer = kwargs.pop("tokenizer", None)
        stop_strings = kwargs.pop("stop_strings", None)
        if generation_config is not None and getattr(generation_config, "stop_strings", None):
            stop_strings = stop_strings or generation_config.stop_strings
            generation_config = generation_config.__class__.from_dict(
                {**generation_config.to_dict(), "stop_strings": None})
        if stop_strings:
            kwargs["stopping_criteria"] = _with_stop_strings(kwargs.get("stopping_criteria"), stop_strings, tokenizer)
        kwargs["custom_generate"] = functools.partial(
            dart_decoding, dart_head=dart_head, dart_ngram=dart_ngram, dart_tree_config=dart_tree_config,
            dart_streamer=streamer, dart_tokenizer=tokenizer, dart_sync_timing=dart_sync_timing,
            dart_cuda_graph=dart_cuda_graph)
        return super().generate(inputs, generation_config, **kwargs)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if isinstance(assistant_model, DartHead):
            generator = DartCandidateGenerator(self, assistant_model, generation_config)
            self.dart_stats = generator.stats
            return generator
        return super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)


def _with_stop_strings(criteria, stop_strings, tokenizer):
    from transformers import StoppingCriteriaList, StopStringCriteria

    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate()")
    out = StoppingCriteriaList(list(criteria or []))
    out.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return out


def enable(model):
    """Give `model` (a transformers causal LM) DART generation in place; returns the same object.

    The class keeps its name (pipelines and logging look at it); `generate()` learns `dart_head=`, `dart_ngram=`,
    `dart_tree_config=`, `dart_sync_timing=`, `dart_cuda_graph=` and accepts a `DartHead` as `assistant_model`.
    """
    cls = type(model)
    if issubclass(cls, DartGenerationMixin):
        return model
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (DartGenerationMixin, cls), {"__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
        _SUBCLASSES[cls] = sub
    model.__class__ = sub
    return model
