"""`dart_hf.enable(model, head)`: teach an already-loaded transformers model DART generation, optionally with a head
every later `generate()` uses."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from typing import Optional

import torch

from dart_core import DartHead, Drafter, ModelFreeDrafter, OutputStore, TreeConfig
from dart_core.errors import DartInputError
from dart_core.store import check_store_cap
from dart_hf.candidate import DartCandidateGenerator
from dart_hf import compat
from dart_hf.compat import CAPTURE_HOOK, CAPTURE_HOOKS_FLAG
from dart_core.speed import Mode
from dart_core.step_policy import CallPolicy
from dart_hf.controller import PlainClock, controller_for, existing_controller, save_learned
from dart_hf.target import context_drafting
from dart_hf.loop import (DART_ARGUMENTS, ENABLED_MARKER, DartOptions, NotApplicable, _record_stats, dart_decoding,
                          last_stats)
from dart_runtime.matmul import few_row_linears

_SUBCLASSES: dict[type, type] = {}
# generate() arguments that pick another decoding method, which DART tree decoding does not combine with
OTHER_METHODS = ("custom_generate", "assistant_model", "prompt_lookup_num_tokens")


class DartFallbackWarning(UserWarning):
    """A `generate()` call on a model with an attached head ran as plain generate() (the message says why)."""


def _decoding(options: DartOptions, streamer, tokenizer, synced_gpus: bool, policy):
    """The `custom_generate` callable that decodes a call with `options` (generate() passes a callable neither the
    call's streamer, tokenizer, `synced_gpus` nor the step policy: they are bound here)."""
    dart = {f"dart_{field.name}": getattr(options, field.name) for field in dataclasses.fields(options)}
    return functools.partial(dart_decoding, synced_gpus=synced_gpus, dart_streamer=streamer, dart_tokenizer=tokenizer,
                             dart_step_policy=policy, **dart)


def _call_shape(inputs, kwargs: dict) -> tuple[int, int]:
    """(batch size, prompt length) of a generate() call, as far as its arguments tell ((1, 1) otherwise)."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return int(ids.shape[0]), int(ids.shape[1])
    return 1, 1


def fallback_kernels(model, batch_size: int):
    """The kernels of an attached call of `batch_size` sequences that runs as plain generate(): for a batch, the
    few-row product DART's own plain steps take (`few_row_linears`: the faster of two kernels on this machine, equal to
    float rounding), so that falling back costs what the speed rule measured DART's plain steps at; for a single
    sequence, whose steps are one-row products either way, the model's own."""
    return few_row_linears(model) if batch_size > 1 else contextlib.nullcontext()


class DartGenerationMixin:
    """Routes `generate(dart_head=...)` (or every call, with a head attached by `enable(model, head)`) to DART tree
    decoding and `generate(assistant_model=<DartHead>)` to transformers' assisted loop with a
    `DartCandidateGenerator`; everything else is the model's own `generate`."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        assistant = kwargs.get("assistant_model")
        if isinstance(assistant, Drafter) and not isinstance(assistant, DartHead):
            raise DartInputError(f"assistant_model takes a DartHead (a chain per step); a {type(assistant).__name__} "
                                 "drafts through dart_head= instead")
        asked = {name: kwargs.pop(name) for name in DART_ARGUMENTS if name in kwargs}  # dart_head, dart_ngram, ...
        dart_head = asked.pop("dart_head", None)
        attached = getattr(self, "_dart_attached", None)
        if dart_head is False or (dart_head is None and attached is None):  # plain generate()
            if any(value not in (None, False) for value in asked.values()):
                raise ValueError(f"{' / '.join(asked)} need dart_head=<DartHead> (or a head attached with "
                                 "dart_hf.enable(model, head))")
            _record_stats(self, None)
            return super().generate(inputs, generation_config, **kwargs)
        explicit = dart_head is not None
        if explicit and not isinstance(dart_head, Drafter):
            raise TypeError(f"dart_head must be a dart_core.DartHead or ModelFreeDrafter (or False for plain "
                            f"generate()), got {type(dart_head).__name__}")
        options = (DartOptions(dart_head) if explicit else attached).with_call(asked)
        if options.store is None:
            options = dataclasses.replace(options, store=getattr(self, "_dart_store", None))
        clash = next((name for name in OTHER_METHODS if kwargs.get(name) is not None), None)
        if clash is not None:
            if explicit:
                raise ValueError(f"dart_head cannot be combined with {clash}=")
            return self._plain_generate(f"the call passes {clash}=", inputs, generation_config, kwargs)
        context = context_drafting(options.head, options.tree_config, options.context_draft)
        stored = options.output_store is not None  # earlier outputs change what trees accept: apart estimates
        if options.tree_config is None:  # each step's tree chosen by what DART measures here (dart_hf.controller)
            controller = existing_controller(self, options.head, context, stored)
            mode, reason, shape = Mode.DART, None, _call_shape(inputs, kwargs)
            if controller is not None and not explicit:
                mode, reason = controller.call_mode(*shape)
            if mode == Mode.PLAIN:
                result = self._timed_plain_generate(controller, reason, shape[0], inputs, generation_config, kwargs)
                remember_outputs(options.output_store, inputs, kwargs, result, self._call_eos(generation_config, kwargs))
                return result
            # the controller is made (reading what earlier processes learned) once the call's checks have passed
            policy = CallPolicy(functools.partial(controller_for, self, options.head, context, stored),
                                may_go_plain=not explicit,
                                probe=mode == Mode.PROBE)
        else:  # a fixed tree; it teaches the controller, where a call made one
            controller = existing_controller(self, options.head, context, stored)
            policy = None if controller is None else CallPolicy(lambda: controller, may_go_plain=False,
                                                                fixed=options.tree_config.remain_total)
        dart_kwargs = dict(kwargs)
        streamer = dart_kwargs.pop("streamer", None)
        tokenizer = dart_kwargs.get("tokenizer")
        dart_kwargs["custom_generate"] = _decoding(options, streamer, tokenizer,
                                                   compat.synced_gpus(self, kwargs.get("synced_gpus")), policy)
        try:  # generate() drops the call's tokenizer on the custom_generate path: the two methods below get it here
            result = contextvars.copy_context().run(_with_tokenizer, tokenizer, super().generate, inputs,
                                                    generation_config, **dart_kwargs)
            remember_outputs(options.output_store, inputs, kwargs, result, self._call_eos(generation_config, kwargs))
            return result
        except NotApplicable as err:
            if explicit:
                raise
            return self._plain_generate(str(err), inputs, generation_config, kwargs)
        finally:
            if policy is not None:
                for message in policy.warnings:
                    warnings.warn(message, DartFallbackWarning, stacklevel=2)
                save_learned(policy.controller)

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None):
        # stop strings need the call's tokenizer
        return super()._get_stopping_criteria(generation_config, stopping_criteria,
                                              tokenizer if tokenizer is not None else _CALL_TOKENIZER.get())

    def heal_tokens(self, input_ids, tokenizer=None):
        # token healing needs the call's tokenizer
        return super().heal_tokens(input_ids, tokenizer if tokenizer is not None else _CALL_TOKENIZER.get())

    def _plain_generate(self, reason: str, inputs, generation_config, kwargs):
        """The call as plain generate(), after one warning naming `reason` (once per reason and call site)."""
        warnings.warn(f"DART does not apply to this generate() call ({reason}); it runs as plain generate()",
                      DartFallbackWarning, stacklevel=3)
        _record_stats(self, None)
        return super().generate(inputs, generation_config, **kwargs)

    def _timed_plain_generate(self, controller, reason: Optional[str], batch_size: int, inputs, generation_config,
                              kwargs):
        """The call of `batch_size` sequences as plain generate() because DART does not pay here (after `reason` as a
        warning, given once per regime), its steps timed for the controller (`PlainClock`), with `fallback_kernels`."""
        from transformers import StoppingCriteriaList

        if reason is not None:
            warnings.warn(reason, DartFallbackWarning, stacklevel=3)
        _record_stats(self, None)
        clock = PlainClock()
        timed = dict(kwargs, stopping_criteria=StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), clock]))
        try:
            with fallback_kernels(self, batch_size):
                return super().generate(inputs, generation_config, **timed)
        finally:
            clock.report(controller)
            save_learned(controller)

    def _call_eos(self, generation_config, kwargs: dict):
        """The EOS ids a call ends rows with: its `eos_token_id=`, else its generation config's, else the model's."""
        if kwargs.get("eos_token_id") is not None:
            return kwargs["eos_token_id"]
        return (generation_config if generation_config is not None else self.generation_config).eos_token_id

    @property
    def dart_store(self) -> Optional[OutputStore]:
        """The store of earlier outputs that DART calls on this model match (`dart_hf.enable(..., store=)`; None:
        none). `model.dart_store.clear()` forgets them."""
        return getattr(self, "_dart_store", None)

    @property
    def dart_stats(self):
        """The `DartStats` of this thread's last DART call on the model (None before one, or after a call that ran
        as plain generate()); `dart_hf.last_stats(model)`."""
        return last_stats(self)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if isinstance(assistant_model, DartHead):
            generator = DartCandidateGenerator(self, assistant_model, generation_config)
            _record_stats(self, generator.stats)
            return generator
        return super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)

    def __reduce_ex__(self, protocol):
        # pickled (torch.save, deepcopy) as the model's own class, which pickle can import; loading enables it again
        return _enabled_instance, (getattr(type(self), ENABLED_MARKER),), _picklable_state(self, {})


def _enabled_instance(cls: type):
    """An empty instance of `cls`, enabled; pickle then restores its state."""
    return enable(cls.__new__(cls), False, store=False)




def _picklable_state(module, memo: dict) -> dict:
    """`module.__dict__` for pickling, its submodules without transformers' output-capturing hooks (which the
    hidden states DART's forwards request installed; transformers installs them again on first use). Submodules
    that carry such hooks are shallow copies (tensors shared); the module itself is untouched."""
    from collections import OrderedDict

    state = dict(module.__dict__)
    state.pop(CAPTURE_HOOKS_FLAG, None)
    state["_forward_hooks"] = OrderedDict((k, h) for k, h in module._forward_hooks.items()
                                          if getattr(h, "__name__", "") != CAPTURE_HOOK)
    state["_modules"] = {name: _without_capture_hooks(child, memo) for name, child in module._modules.items()}
    return state


def _without_capture_hooks(module, memo: dict):
    if module is None or id(module) in memo:
        return memo.get(id(module), module)
    hooked = any(getattr(h, "__name__", "") == CAPTURE_HOOK for m in module.modules()
                 for h in m._forward_hooks.values())
    if not hooked:
        memo[id(module)] = module
        return module
    clone = module.__class__.__new__(module.__class__)
    memo[id(module)] = clone
    clone.__dict__.update(_picklable_state(module, memo))
    return clone


_CALL_TOKENIZER: contextvars.ContextVar = contextvars.ContextVar("dart_call_tokenizer", default=None)


def _with_tokenizer(call_tokenizer, generate, *args, **kwargs):
    """`generate(*args, **kwargs)` with `call_tokenizer` as the call's (run in a copied context)."""
    _CALL_TOKENIZER.set(call_tokenizer)
    return generate(*args, **kwargs)


PROMPT_TAIL = 16  # prompt tokens kept before each output in the store: a later call matches into the output from them


def remember_outputs(store: Optional[OutputStore], inputs, kwargs: dict, result, eos) -> None:
    """Keep each row of a finished call in `store` (when there is one): its last `PROMPT_TAIL` prompt tokens and its
    new tokens up to and including the first of the `eos` ids (an id, a list or a tensor of them, or None)."""
    if store is None:
        return
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    sequences = getattr(result, "sequences", result)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(sequences, torch.Tensor):
        return
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    eos = set(eos.flatten().tolist() if isinstance(eos, torch.Tensor) else
              eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    for prompt, keep, row in zip(ids.tolist(), mask.tolist(), sequences[:, ids.shape[1]:].tolist()):
        new = next((row[:i + 1] for i, t in enumerate(row) if t in eos), row)
        real = [t for t, k in zip(prompt, keep) if k]
        store.add(real[len(real) - PROMPT_TAIL:] + new if len(real) > PROMPT_TAIL else real + new)


def enable(model, head=None, *, ngram=None, tree_config: Optional[TreeConfig] = None, store=True, tokenizer=None):
    """Give `model` (a transformers causal LM) DART generation in place; returns the same object.

    `head`: the drafter every later `generate()` call decodes with where DART applies (pipelines and evaluation
    harnesses included): a `DartHead`, or by default (None) `dart_core.ModelFreeDrafter()`, which drafts from the
    context, earlier outputs and `ngram` on any model with no training; False attaches nothing (calls then use DART
    only with `generate(dart_head=...)`). `ngram` / `tree_config` override the drafter's own. `store`: the earlier
    outputs DART calls match (docs/DESIGN.md §2.7): True (an `OutputStore` of the default cap), a cap in tokens, an
    `OutputStore`, or False (none); `model.dart_store` holds it. `tokenizer`: the model's, against which an n-gram
    table is checked here (it is checked against the model's vocabulary in any case, and against a call's
    `tokenizer=` at the call).

    `generate()` learns `dart_head=`, `dart_ngram=`, `dart_tree_config=`, `dart_store=`, `dart_sync_timing=`,
    `dart_cuda_graph=` and accepts a `DartHead` as `assistant_model`. A call that asks for what DART does not do (beam
    search, several return sequences, another assistant, a static cache, ...) runs as plain generate() after one
    `DartFallbackWarning` naming the reason. `generate(dart_head=False)` is plain generate() for one call; an
    explicit `dart_head=` keeps DART's errors. A head must fit the model (checked here). The class keeps its name
    (pipelines and logging look at it).
    """
    if head is not None and head is not False and not isinstance(head, Drafter):
        raise TypeError(f"head must be a dart_core.DartHead or ModelFreeDrafter (or None / False), got "
                        f"{type(head).__name__}")
    store = _store(store)
    if head is None:
        head = ModelFreeDrafter()
    if head is not False:
        from dart_hf.target import plan_for

        from dart_hf.target import check_ngram_fits, check_tree_fits, tree_settings

        plan_for(model, head, tokenizer)
        options = DartOptions(head, ngram, tree_config)  # every refusal before the model changes
        check_tree_fits(head, tree_settings(head, model.generation_config, tree_config))
        table = ngram if ngram is not None else head.ngram
        if table is not None:
            check_ngram_fits(table, model, tokenizer)
    cls = type(model)
    if not issubclass(cls, DartGenerationMixin):
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            sub = type(cls.__name__, (DartGenerationMixin, cls), {"__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__,
                                                                  ENABLED_MARKER: cls})
            _SUBCLASSES[cls] = sub
        model.__class__ = sub
    model._dart_store = store
    model._dart_attached = None if head is False else options
    return model


def _store(store) -> Optional[OutputStore]:
    """`enable`'s `store` argument as a store or None; DartInputError for a cap that is not a positive size."""
    if store is True:
        return OutputStore()
    if store is False or store is None:
        return None
    if isinstance(store, OutputStore):
        return store
    return OutputStore(check_store_cap(store))
