"""Callers we did not write, with a head attached once (`dart_hf.enable(model, head)`): lm-evaluation-harness's
HFLM, pipelines, a chat loop that carries its cache across turns, pickling. Each gets exactly what plain
generate() gives it."""

import copy
import io
import pickle
import warnings

import pytest
import torch
from transformers import DynamicCache, pipeline

import dart_hf
from helpers.hf_models import attach, char_tokenizer, oracle_head, random_head, tiny_target

CONTEXTS = ["Q: what is 2+2?\nA:", "hello there", "Q: x\nA: y\n\nQ: z\nA:", "abc", "The cat sat", "Q: 7*6?\nA:",
            "def f(x):", "1, 2, 3,", "Once upon"]


def harness(model, tokenizer, batch_size):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=256)


def requests(contexts, max_gen_toks=24):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(ctx, {"until": ["Q:", "\n\n"], "max_gen_toks": max_gen_toks}))
            for i, ctx in enumerate(contexts)]


@pytest.fixture(scope="module")
def harness_model():
    return tiny_target(), char_tokenizer()


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_lm_eval_generate_until_equals_plain(harness_model, batch_size):
    model, tokenizer = harness_model
    model = copy.deepcopy(model)
    plain = harness(model, tokenizer, batch_size).generate_until(requests(CONTEXTS))
    attach(model, random_head(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dart_hf.DartFallbackWarning)  # every call decodes with DART
        out = harness(model, tokenizer, batch_size).generate_until(requests(CONTEXTS))
    assert out == plain
    assert model.dart_stats is not None and model.dart_stats.forwards > 0


# ---- an attached head: DART where it applies, plain generate() with one warning where not ---------------------

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])


def attached():
    model = tiny_target()
    plain = model.generate(PROMPT, max_new_tokens=16, do_sample=False)
    head = oracle_head(model, plain[0])
    return attach(model, head), head, plain


def test_every_generate_call_decodes_with_the_attached_head():
    model, head, plain = attached()
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), plain)
    assert model.dart_stats.tau > 2.0
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False, dart_head=False), plain)
    assert model.dart_stats is None  # per call: a plain call leaves no DART statistics


@pytest.mark.parametrize("kwargs,reason", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(cache_implementation="static"), "DynamicCache"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
])
def test_what_dart_does_not_do_runs_plain_with_one_warning(kwargs, reason):
    model, head, _ = attached()
    torch.manual_seed(0)
    want = model.generate(PROMPT, max_new_tokens=8, dart_head=False, **kwargs)
    torch.manual_seed(0)
    with pytest.warns(dart_hf.DartFallbackWarning, match=reason) as caught:
        got = model.generate(PROMPT, max_new_tokens=8, **kwargs)
    assert len(caught) == 1
    want = want.sequences if hasattr(want, "sequences") else want
    got = got.sequences if hasattr(got, "sequences") else got
    assert torch.equal(got, want) and model.dart_stats is None
    with pytest.raises((ValueError, TypeError)):  # asked for by name: DART's clear error
        model.generate(PROMPT, max_new_tokens=8, dart_head=head, **kwargs)


@pytest.mark.parametrize("kwargs,mode", [
    (dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
    (dict(dola_layers="high"), "dola_generation"),
    (dict(force_words_ids=[[3, 4]], num_beams=2), "constrained_beam_search"),
    (dict(num_beams=2, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
])
def test_modes_transformers_moved_to_the_hub_behave_as_plain(kwargs, mode):
    """They were decoded as greedy search: a custom_generate call skips transformers' own check of them."""
    model, head, _ = attached()
    with pytest.raises(ValueError, match="trust_remote_code") as plain:
        model.generate(PROMPT, max_new_tokens=8, dart_head=False, **kwargs)
    with pytest.warns(dart_hf.DartFallbackWarning, match=mode), pytest.raises(ValueError) as got:
        model.generate(PROMPT, max_new_tokens=8, **kwargs)
    assert str(got.value) == str(plain.value)
    with pytest.raises(dart_hf.NotApplicable, match=f"asks for {mode}"):
        model.generate(PROMPT, max_new_tokens=8, dart_head=head, **kwargs)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(synced_gpus=True), "synced_gpus"),
    (dict(attention_mask=torch.ones(1, PROMPT.shape[1] - 1, dtype=torch.long)), "position_ids shape"),
])
def test_what_plain_refuses_dart_refuses(kwargs, reason):
    """generate() drops synced_gpus and an all-ones mask before a custom_generate callable sees them: DART decoded
    both calls, which plain refuses."""
    model, head, _ = attached()
    with pytest.raises((ValueError, RuntimeError)) as plain:
        model.generate(PROMPT, max_new_tokens=8, dart_head=False, **kwargs)
    with pytest.warns(dart_hf.DartFallbackWarning, match=reason), pytest.raises(type(plain.value)):
        model.generate(PROMPT, max_new_tokens=8, **kwargs)
    with pytest.raises(dart_hf.NotApplicable, match=reason):
        model.generate(PROMPT, max_new_tokens=8, dart_head=head, **kwargs)


def test_caller_position_ids_are_used_as_plain_uses_them():
    """An absolute-position model (GPT-2), where position ids change the output; DART used its own."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=256)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    positions = torch.tensor([[0, 10, 20, 30, 40, 50, 60]])
    kwargs = dict(max_new_tokens=12, do_sample=False)
    default = model.generate(PROMPT, **kwargs)
    plain = model.generate(PROMPT, position_ids=positions, **kwargs)
    assert not torch.equal(plain, default)  # the control: the positions matter
    head = oracle_head(model, plain[0], wrong_every=3)
    dart_hf.enable(model, False)
    assert torch.equal(model.generate(PROMPT, position_ids=positions, dart_head=head, **kwargs), plain)
    assert model.dart_stats.forwards < 12


def test_int32_input_ids_give_int64_output_as_plain():
    model, head, plain = attached()
    out = model.generate(PROMPT.int(), max_new_tokens=16, do_sample=False)
    assert out.dtype == torch.int64 and torch.equal(out, plain) and model.dart_stats is not None


def test_token_healing_gets_the_calls_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.bos_token = "<pad>"  # heal_tokens needs one
    model, head, _ = attached()
    ids = tokenizer(["The cat sa"], return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=6, do_sample=False, token_healing=True, tokenizer=tokenizer)
    plain = model.generate(ids, dart_head=False, **kwargs)
    assert torch.equal(model.generate(ids, dart_head=head, **kwargs), plain)
    assert torch.equal(model.generate(ids, **kwargs), plain)


@pytest.mark.parametrize("eos", [-1, [-1, 9]])
def test_a_negative_eos_id_never_ends_a_sequence_as_in_plain(eos):
    """A negative EOS (a common way to turn EOS off) reached the tree search's settings, which refused it."""
    model, head, _ = attached()
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos)
    plain = model.generate(PROMPT, dart_head=False, **kwargs)
    assert torch.equal(model.generate(PROMPT, dart_head=head, **kwargs), plain)
    assert torch.equal(model.generate(PROMPT, **kwargs), plain) and model.dart_stats is not None


def test_token_ids_an_embedding_does_not_take_are_refused_as_plain_refuses_them():
    model, head, _ = attached()
    with pytest.raises(RuntimeError) as plain:
        model.generate(PROMPT.to(torch.int16), max_new_tokens=4, dart_head=False)
    with pytest.raises(dart_hf.NotApplicable, match="int16"):
        model.generate(PROMPT.to(torch.int16), max_new_tokens=4, dart_head=head)
    with pytest.warns(dart_hf.DartFallbackWarning, match="int16"), pytest.raises(RuntimeError) as got:
        model.generate(PROMPT.to(torch.int16), max_new_tokens=4)
    assert str(got.value) == str(plain.value)


@pytest.mark.parametrize("name,value", [("dart_ngram", False), ("dart_tree_config", {"remain_total": 5}),
                                        ("dart_tree_config", 8), ("dart_sync_timing", 1), ("dart_cuda_graph", "yes")])
def test_an_odd_dart_argument_is_a_type_error_naming_it(name, value):
    model, head, _ = attached()
    for extra in ({}, {"dart_head": head}):
        with pytest.raises(TypeError, match=name):
            model.generate(PROMPT, max_new_tokens=4, **{name: value}, **extra)


def test_another_assistant_runs_plain_assisted_generation():
    model, _, plain = attached()
    assistant = tiny_target()
    with pytest.warns(dart_hf.DartFallbackWarning, match="assistant_model"):
        out = model.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain)


def test_a_pipeline_on_an_enabled_model_gets_dart():
    vocab = 96
    model = tiny_target(vocab=vocab)
    tokenizer = char_tokenizer()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    texts = ["hello", "abc def", "x"]
    plain = generator(texts, max_new_tokens=10, do_sample=False, batch_size=2)
    attach(model, random_head(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dart_hf.DartFallbackWarning)
        out = generator(texts, max_new_tokens=10, do_sample=False, batch_size=2)
    assert out == plain and model.dart_stats is not None


def test_enable_checks_the_head_fits():
    model = tiny_target()
    with pytest.raises(ValueError, match="target hidden_size 48 != head target_hidden_size 32"):
        dart_hf.enable(tiny_target(hidden=48), random_head(model))


# ---- a chat loop that carries its cache across turns ------------------------------------------------------------

TURNS = [torch.tensor([[5, 17, 33, 2]]), torch.tensor([[9, 41, 12]]), torch.tensor([[60, 61]])]


def chat(model, head, turns=TURNS):
    """transformers' multi-turn pattern: one cache passed to every turn; each input = history + the new message ->
    (replies, the cache, target forwards per turn beyond the verify steps)."""
    cache = DynamicCache(config=model.config)
    history, replies, extra = torch.zeros(1, 0, dtype=torch.long), [], []
    for message in turns:
        ids = torch.cat((history, message), dim=1)
        counter, handle = count_forwards(model)
        out = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache, dart_head=head)
        handle.remove()
        extra.append(counter["n"] - (model.dart_stats.forwards if head is not False else 0))
        replies.append(out[0, ids.shape[1]:])
        history = out
    return replies, cache, extra


def count_forwards(model):
    counter = {"n": 0}

    def hook(*_):
        counter["n"] += 1

    return counter, model.register_forward_pre_hook(hook)


def test_a_cache_carried_across_turns_equals_plain():
    model = dart_hf.enable(tiny_target(), False)
    plain, plain_cache, _ = chat(model, False)
    replies, cache, extra = chat(model, random_head(model))
    assert all(torch.equal(a, b) for a, b in zip(replies, plain))
    assert cache.get_seq_length() == plain_cache.get_seq_length()  # every token but the last, as plain leaves it
    # the cache a DART turn leaves carries the head's state: every turn runs one prefill and its verify steps only
    assert extra == [1, 1, 1]
    assert getattr(cache, dart_hf.loop.CARRIED_ATTRIBUTE) is not None


def test_turns_continue_each_others_caches():
    # a plain turn continues a DART turn's cache and a DART turn a plain one's (its head state rebuilt)
    model = dart_hf.enable(tiny_target(), False)
    plain, _, _ = chat(model, False)
    head = random_head(model)
    cache = DynamicCache(config=model.config)
    history, replies = torch.zeros(1, 0, dtype=torch.long), []
    for i, message in enumerate(TURNS):
        ids = torch.cat((history, message), dim=1)
        counter, handle = count_forwards(model)
        out = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache,
                             dart_head=head if i % 2 == 0 else False)
        handle.remove()
        if i == 2:  # after a plain turn: one more forward rebuilds the head's rows of the cached prefix
            assert counter["n"] == model.dart_stats.forwards + 2
        replies.append(out[0, ids.shape[1]:])
        history = out
    assert all(torch.equal(a, b) for a, b in zip(replies, plain))


@pytest.mark.parametrize("modes", [("inference", "inference", "inference"), ("inference", "no_grad", "inference"),
                                   ("no_grad", "inference", "no_grad")])
def test_inference_mode_and_no_grad_alike_and_a_cache_crosses_between_them(modes):
    """`torch.inference_mode()` broke every DART call on a grouped-query sdpa model (the grouped-mask memo read the
    version counter inference tensors lack), and a cache filled under it failed the next turn outside it (the head
    cache's in-place append). Plain does both; so does DART, token for token."""
    model = dart_hf.enable(tiny_target(), False)  # 4 query heads over 2 key/value heads: the grouped sdpa path
    head = random_head(model)
    contexts = {"inference": torch.inference_mode, "no_grad": torch.no_grad}

    def turns(dart_head):
        cache = DynamicCache(config=model.config)
        history, replies = torch.zeros(1, 0, dtype=torch.long), []
        for message, mode in zip(TURNS, modes):
            with contexts[mode]():
                out = model.generate(torch.cat((history, message), dim=1), max_new_tokens=10, do_sample=False,
                                     past_key_values=cache, dart_head=dart_head)
            replies.append(out[0, history.shape[1] + message.shape[1]:].clone())
            history = out.clone()
        return replies

    plain = turns(False)
    assert all(torch.equal(a, b) for a, b in zip(turns(head), plain))


def test_a_cache_that_does_not_hold_the_input_prefix_is_continued_as_plain_continues_it():
    # chat templates re-tokenise the history: the cache may hold other tokens than the input at its positions
    model = dart_hf.enable(tiny_target(), False)
    outputs = []
    for head in (False, random_head(model)):
        cache = DynamicCache(config=model.config)
        first = model.generate(TURNS[0], max_new_tokens=6, do_sample=False, past_key_values=cache, dart_head=head)
        ids = torch.cat((first[:, :-2], torch.tensor([[7, 7, 8]])), dim=1)  # not the tokens the cache holds
        outputs.append(model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache,
                                      dart_head=head))
    assert torch.equal(outputs[0], outputs[1])


def test_a_cache_with_several_sequences_runs_plain_when_attached():
    model = dart_hf.enable(tiny_target(), random_head(tiny_target()))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cache = DynamicCache(config=model.config)
    want = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=model.config),
                          dart_head=False)
    with pytest.warns(dart_hf.DartFallbackWarning, match="batch size 1"):
        got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert torch.equal(got, want)


# ---- pickling -----------------------------------------------------------------------------------------------

def test_an_enabled_model_pickles_and_torch_saves_with_its_head():
    model, _, plain = attached()
    model.generate(PROMPT, max_new_tokens=4, do_sample=False)  # DART's kernels installed
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert type(clone).__name__ == type(model).__name__ and isinstance(clone, dart_hf.DartGenerationMixin)
        assert torch.equal(clone.generate(PROMPT, max_new_tokens=16, do_sample=False), plain)
        assert clone.dart_stats.tau > 2.0  # the attached head came along
