"""dart_hf on tiny random transformers models: output identical to plain generate(), generate() features, errors."""

import dataclasses
import math

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import dart_hf
from dart_core import TreeConfig
from helpers.hf_models import BLOCKS, oracle_head, random_head, tiny_target
from helpers.sampling_checks import SMALL_TREE, chi_square_pvalue, exact_two_token_distribution, lossy_verify

PROMPTS = [torch.tensor([[5, 17, 33, 2, 9, 41, 12]]), torch.tensor([[60, 61, 62]])]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_identical_to_plain_generate(arch, attn):
    model = dart_hf.enable(tiny_target(arch, attn), False)
    for prompt in PROMPTS:
        plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
        random_out = model.generate(prompt, max_new_tokens=24, do_sample=False, dart_head=random_head(model))
        assert torch.equal(random_out, plain)
        good = oracle_head(model, plain[0], wrong_every=5)  # right except every 5th position
        good_out = model.generate(prompt, max_new_tokens=24, do_sample=False, dart_head=good, dart_tree_config=BLOCKS)
        assert torch.equal(good_out, plain)
        assert model.dart_stats.tau > 2.0  # whole blocks are accepted from the tree


def test_max_depth_limits_the_tree_levels():
    from dart_core import TreeConfig

    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=24, do_sample=False)
    good = oracle_head(model, plain[0])  # D=4: whole 4-token blocks would be accepted
    out = model.generate(PROMPTS[0], max_new_tokens=24, do_sample=False, dart_head=good,
                         dart_tree_config=TreeConfig(max_depth=2, remain_total=10))
    assert torch.equal(out, plain)
    assert max(model.dart_stats.accepted_lengths) == 2  # levels 1 and 2 only
    with pytest.raises(ValueError, match="max_depth must be a positive integer"):
        TreeConfig(max_depth=0)


def test_draft_vocab_smaller_than_target_vocab():
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=16, do_sample=False)
    head = random_head(model, draft_vocab=40)
    assert torch.equal(model.generate(PROMPTS[0], max_new_tokens=16, do_sample=False, dart_head=head), plain)


def test_assistant_model_route_uses_the_stock_loop_and_is_identical():
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(PROMPTS[0], max_new_tokens=20, do_sample=False,
                                      assistant_model=random_head(model)), plain)
    good = oracle_head(model, plain[0])
    assert torch.equal(model.generate(PROMPTS[0], max_new_tokens=20, do_sample=False, assistant_model=good), plain)
    assert sum(model.dart_stats.accepted_lengths) >= 12  # the chain was accepted through transformers' loop


def test_custom_generate_callable_on_a_model_that_is_not_enabled():
    model = tiny_target()
    plain = model.generate(PROMPTS[1], max_new_tokens=12, do_sample=False)
    out = model.generate(PROMPTS[1], max_new_tokens=12, do_sample=False, custom_generate=dart_hf.dart_decoding,
                         dart_head=oracle_head(model, plain[0]))
    assert torch.equal(out, plain)


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 9])
def test_max_new_tokens_and_max_length_exact_inside_accepted_blocks(new_tokens):
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=new_tokens, do_sample=False)
    head = oracle_head(model, model.generate(PROMPTS[0], max_new_tokens=30, do_sample=False)[0])
    out = model.generate(PROMPTS[0], max_new_tokens=new_tokens, do_sample=False, dart_head=head)
    assert torch.equal(out, plain) and out.shape[1] == PROMPTS[0].shape[1] + new_tokens
    out = model.generate(PROMPTS[0], max_length=PROMPTS[0].shape[1] + new_tokens, do_sample=False, dart_head=head)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("eos_kind", ["single", "list"])
def test_eos_inside_an_accepted_block(eos_kind):
    model = dart_hf.enable(tiny_target(), False)
    prompt = PROMPTS[0]
    full = model.generate(prompt, max_new_tokens=30, do_sample=False)[0]
    continuation = full[prompt.shape[1]:].tolist()
    eos = continuation[9]  # the 10th new token (or its first earlier occurrence) ends generation
    eos_arg = eos if eos_kind == "single" else [127 % model.config.vocab_size, eos]
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos_arg)
    assert plain.shape[1] < full.shape[0]
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos_arg,
                         dart_head=oracle_head(model, full), dart_tree_config=BLOCKS)
    assert torch.equal(out, plain)
    assert max(model.dart_stats.accepted_lengths) >= 3  # the EOS arrived inside a multi-token block


class EndsWith(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_checked_on_every_accepted_prefix():
    model = dart_hf.enable(tiny_target(), False)
    prompt = PROMPTS[0]
    full = model.generate(prompt, max_new_tokens=30, do_sample=False)[0]
    stop = full[prompt.shape[1] + 7].item()
    criteria = StoppingCriteriaList([EndsWith(stop)])
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria,
                         dart_head=oracle_head(model, full))
    assert torch.equal(out, plain) and out.shape[1] < full.shape[0]


def test_host_stops_only_for_generates_own_criteria():
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

    from dart_hf.stopping import HostStops

    assert HostStops.of(StoppingCriteriaList([MaxLengthCriteria(20), EosTokenCriteria([2, 7])])) == HostStops(
        20, frozenset({2, 7}))
    assert HostStops.of(StoppingCriteriaList([])) == HostStops(None, frozenset())
    for other in (EndsWith(3), MaxTimeCriteria(10.0), MaxLengthCriteria(600, max_position_embeddings=512)):
        assert HostStops.of(StoppingCriteriaList([MaxLengthCriteria(20), other])) is None


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_accepted_blocks():
    model = dart_hf.enable(tiny_target(), False)
    prompt = PROMPTS[0]
    plain = model.generate(prompt, max_new_tokens=20, do_sample=False)
    streamer = RecordingStreamer()
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, streamer=streamer,
                         dart_head=oracle_head(model, plain[0]))
    assert torch.equal(out, plain) and streamer.ended
    assert streamer.puts[0] == prompt[0].tolist()
    assert sum(streamer.puts[1:], []) == plain[0, prompt.shape[1]:].tolist()
    assert max(len(p) for p in streamer.puts[1:]) > 1  # several tokens per put


def test_return_dict_with_scores_logits_and_stats():
    model = dart_hf.enable(tiny_target(), False)
    prompt = PROMPTS[1]
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    plain = model.generate(prompt, **kwargs)
    out = model.generate(prompt, dart_head=oracle_head(model, plain.sequences[0]), **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == 10
    for mine, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.logits, plain.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    stats = out.dart_stats
    assert stats is model.dart_stats and stats.new_tokens == 10 and stats.steps >= 1 and stats.tau >= 1.0
    assert stats.acceptance_by_position()[0] > 0.5


@pytest.mark.parametrize("processors", [dict(repetition_penalty=1.4), dict(no_repeat_ngram_size=2),
                                        dict(min_new_tokens=6, eos_token_id=3)])
def test_greedy_with_prefix_dependent_processors(processors):
    model = dart_hf.enable(tiny_target(), False)
    for prompt in PROMPTS:
        plain = model.generate(prompt, max_new_tokens=16, do_sample=False, **processors)
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, dart_head=random_head(model), **processors)
        assert torch.equal(out, plain)
        good = model.generate(prompt, max_new_tokens=16, do_sample=False,
                              dart_head=oracle_head(model, plain[0]), **processors)
        assert torch.equal(good, plain)


# ---- sampling: exact enumeration ----------------------------------------------------------------------------------

SAMPLING_PROMPT = torch.tensor([[1, 2, 3, 4]])


def sample_pairs(model, head, draws, seed):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    for _ in range(draws):
        # a third token, so that the second is decided by a tree (a call's last token is the root's alone)
        out = model.generate(SAMPLING_PROMPT, max_new_tokens=3, do_sample=True, top_k=0, dart_head=head,
                             dart_tree_config=SMALL_TREE)
        counts[out[0, -3], out[0, -2]] += 1
    return counts


@pytest.mark.slow  # 3,500 generate() calls
def test_sampling_keeps_the_target_distribution_and_a_lossy_control_fails(monkeypatch):
    model = dart_hf.enable(tiny_target(vocab=8, layers=4, hidden=16, seed=3), False)
    exact = exact_two_token_distribution(model, SAMPLING_PROMPT).flatten()
    greedy = model.generate(SAMPLING_PROMPT, max_new_tokens=3, do_sample=False)[0]
    head = oracle_head(model, greedy, draft_length=2)  # drafts the likeliest tokens: acceptance happens often
    counts = sample_pairs(model, head, draws=2500, seed=0).flatten()
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert model.dart_stats.steps >= 1

    monkeypatch.setattr(dart_hf.loop, "verify_tree", lossy_verify)
    control = sample_pairs(model, head, draws=1000, seed=1).flatten()
    assert chi_square_pvalue(control, exact) < 1e-6


# ---- bad input --------------------------------------------------------------------------------------------------

def test_bad_input_fails_before_any_work():
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    pair = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="row 1 has padding after a token: DART needs left padding"):
        model.generate(pair, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), max_new_tokens=4, dart_head=head)
    with pytest.raises(ValueError, match="row 0 of the batch is all padding"):
        model.generate(pair, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]), max_new_tokens=4, dart_head=head)
    with pytest.raises(ValueError, match="streamers take one sequence"):
        model.generate(pair, max_new_tokens=4, dart_head=head, streamer=BaseStreamer())
    with pytest.raises(ValueError, match="output_scores / output_logits with dart_head need batch size 1"):
        model.generate(pair, max_new_tokens=4, dart_head=head, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match="num_beams=2"):
        model.generate(PROMPTS[0], max_new_tokens=4, num_beams=2, dart_head=head)
    with pytest.raises(ValueError, match="cannot be combined with assistant_model"):
        model.generate(PROMPTS[0], max_new_tokens=4, dart_head=head, assistant_model=head)
    with pytest.raises(TypeError, match="dart_head must be a dart_core.DartHead"):
        model.generate(PROMPTS[0], max_new_tokens=4, dart_head="head")
    with pytest.raises(ValueError, match="DynamicCache of full-attention and sliding-window layers only"):
        model.generate(PROMPTS[0], max_new_tokens=4, dart_head=head, cache_implementation="static")
    with pytest.raises(ValueError, match="padding after a token"):
        model.generate(PROMPTS[0], attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1]]), max_new_tokens=4,
                       dart_head=head)

    other = tiny_target(hidden=48)
    with pytest.raises(ValueError, match="target hidden_size 48 != head target_hidden_size 32"):
        dart_hf.enable(other, False).generate(PROMPTS[0], max_new_tokens=4, dart_head=random_head(model))
    with pytest.raises(ValueError, match="target vocab_size 80 != head vocab_size 96"):
        dart_hf.enable(tiny_target(vocab=80), False).generate(PROMPTS[0], max_new_tokens=4, dart_head=random_head(model))
    shallow = tiny_target(layers=4)
    deep_head = random_head(tiny_target(layers=12))
    with pytest.raises(ValueError, match="num_hidden_layers 4 is too few for taps"):
        dart_hf.enable(shallow, False).generate(PROMPTS[0], max_new_tokens=4, dart_head=deep_head)


def test_flash_attention_is_refused_with_a_hint():
    model = dart_hf.enable(tiny_target(), False)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model.generate(PROMPTS[0], max_new_tokens=4, dart_head=random_head(model))


def test_enable_keeps_the_class_name_and_is_idempotent():
    model = tiny_target()
    name = type(model).__name__
    assert dart_hf.enable(dart_hf.enable(model), False) is model
    assert type(model).__name__ == name and isinstance(model, dart_hf.DartGenerationMixin)
    assert math.isfinite(model.generate(PROMPTS[1], max_new_tokens=2).float().sum())


def test_cuda_graph_flag_falls_back_to_eager_off_cuda():
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=16, do_sample=False)
    with pytest.warns(UserWarning, match="dart_cuda_graph=True applies on CUDA only"):
        out = model.generate(PROMPTS[0], max_new_tokens=16, do_sample=False, dart_cuda_graph=True,
                             dart_head=oracle_head(model, plain[0]), dart_tree_config=BLOCKS)
    assert torch.equal(out, plain) and model.dart_stats.tau > 2.0
    with pytest.raises(ValueError, match="need dart_head"):
        model.generate(PROMPTS[0], max_new_tokens=4, dart_cuda_graph=True)


def test_one_rule_decides_the_tree_settings_and_the_calls_eos_wins(monkeypatch):
    from dart_hf import calibration, loop
    from dart_hf.target import tree_settings

    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    head.tree_config = TreeConfig(remain_total=5, eos_token_id=3)
    model.generation_config.eos_token_id = 3
    seen = []
    real = loop.TreeSearch

    def recording(head_, ngram, tree_config):
        seen.append(tree_config)
        return real(head_, ngram, tree_config)

    dart_hf.controller.controller_for(model, head)  # the first-call measurement, before the recording
    monkeypatch.setattr(loop, "TreeSearch", recording)
    fixed = TreeConfig(remain_total=5)
    model.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, dart_head=head, eos_token_id=7)
    # the call's EOS, the head's other settings (the size of each step is the controller's)
    assert {dataclasses.replace(s, remain_total=5) for s in seen} == {TreeConfig(remain_total=5, eos_token_id=7)}
    seen.clear()
    model.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, dart_head=head)
    assert {dataclasses.replace(s, remain_total=5) for s in seen} == {head.tree_config}
    assert head.tree_config == calibration.base_tree_config(model, head)
    seen.clear()
    model.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, dart_head=head, dart_tree_config=fixed)
    assert set(seen) == {TreeConfig(remain_total=5, eos_token_id=3)}  # a fixed tree: the model's EOS
    assert tree_settings(head, model.generation_config, TreeConfig(topk=4)) == TreeConfig(topk=4, eos_token_id=3)
