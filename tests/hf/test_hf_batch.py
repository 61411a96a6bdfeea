"""Batched DART in generate(): B left-padded sequences, each exactly what plain generate() gives on the same batch."""

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          PreTrainedTokenizerFast, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, pipeline)

import dart_hf
import dart_hf.processors
from helpers.hf_models import (BLOCKS, PAD, left_padded, oracle_head, random_head, random_prompts, tiny_target,
                               unpadded)
from helpers.sampling_checks import SMALL_TREE, chi_square_pvalue, exact_two_token_distribution, lossy_verify


@pytest.mark.parametrize("lengths", [(7, 3), (2, 9, 5), (4, 11, 1, 8, 6, 3, 10, 2)])
def test_every_row_equals_plain_generate_on_the_same_padded_batch(lengths):
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts(lengths, seed=len(lengths)))
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    plain = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, dart_head=random_head(model), **kwargs), plain)
    references = [unpadded(plain[b], mask[b]) for b in range(len(lengths))]
    out = model.generate(ids, dart_head=oracle_head(model, references, wrong_every=5), dart_tree_config=BLOCKS,
                         **kwargs)
    assert torch.equal(out, plain)
    stats = model.dart_stats
    assert set(stats.tau_by_row()) == set(range(len(lengths))) and min(stats.tau_by_row().values()) > 2.0
    assert stats.forwards < 20 and stats.new_tokens == 20 * len(lengths)


def test_a_row_that_stops_early_is_padded_and_leaves_the_batch():
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((6, 4, 9), seed=7))
    full = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    eos = int(full[1, ids.shape[1] + 4])  # row 1 ends at its 5th new token (or earlier)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    plain = model.generate(ids, **kwargs)
    assert bool((plain[1, -3:] == PAD).all())  # plain generate padded the finished row
    references = [unpadded(full[b], mask[b]) for b in range(3)]
    out = model.generate(ids, dart_head=oracle_head(model, references), **kwargs)
    assert torch.equal(out, plain)
    stats = model.dart_stats
    steps_of = {row: stats.batch_rows.count(row) for row in range(3)}
    assert steps_of[1] < max(steps_of.values())  # the finished row stopped drafting and verifying


def test_batch_of_one_with_left_padding_equals_plain():
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5,), seed=3))
    ids, mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), 1), torch.cat((torch.zeros(1, 3).long(), mask), 1)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                         dart_head=oracle_head(model, unpadded(plain[0], mask[0])))
    assert torch.equal(out, plain)


# ---- sampling per row ----------------------------------------------------------------------------------------

PROMPTS = (torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7]]))


def sample_pairs_by_row(model, head, ids, mask, draws, seed):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    counts = torch.zeros(ids.shape[0], vocab, vocab)
    accepted = 0
    for _ in range(draws):
        # a third token, so that the second is decided by a tree (a call's last token is the root's alone)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, top_k=0, dart_head=head,
                             dart_tree_config=SMALL_TREE, pad_token_id=PAD)
        for b in range(ids.shape[0]):
            counts[b, out[b, -3], out[b, -2]] += 1
        accepted += sum(model.dart_stats.accepted_lengths)
    return counts, accepted


@pytest.mark.slow  # 2,300 generate() calls
def test_sampling_keeps_each_rows_distribution_and_a_lossy_control_fails(monkeypatch):
    model = dart_hf.enable(tiny_target(vocab=8, layers=4, hidden=16, seed=3), False)
    ids = torch.tensor([[1, 2, 3, 4], [PAD, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    exact = [exact_two_token_distribution(model, p).flatten() for p in PROMPTS]
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    head = oracle_head(model, [unpadded(greedy[b], mask[b]) for b in range(2)], draft_length=2)
    counts, accepted = sample_pairs_by_row(model, head, ids, mask, draws=1500, seed=0)
    for b in range(2):
        assert chi_square_pvalue(counts[b].flatten(), exact[b]) > 1e-3
    assert accepted > 300  # drafts were accepted: the verification, not the bonus alone, made the samples

    monkeypatch.setattr(dart_hf.loop, "verify_tree", lossy_verify)
    control, _ = sample_pairs_by_row(model, head, ids, mask, draws=800, seed=1)
    assert max(chi_square_pvalue(control[b].flatten(), exact[b]) for b in range(2)) < 1e-6


# ---- pipeline ------------------------------------------------------------------------------------------------

def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A whitespace tokenizer over the words w0..w{vocab-1} (w0 is the pad token), padding on the left."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1", padding_side="left")


def test_text_generation_pipeline_with_batches():
    model = dart_hf.enable(tiny_target(), False)
    tokenizer = word_tokenizer(model.config.vocab_size)
    texts = ["w5 w17 w33 w2", "w60 w61", "w9 w41 w12 w7 w8 w3", "w44"]
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, batch_size=4)
    kwargs = dict(max_new_tokens=10, do_sample=False)
    plain = generator(texts, **kwargs)
    dart = generator(texts, dart_head=random_head(model), **kwargs)
    assert dart == plain
    assert set(model.dart_stats.batch_rows) == {0, 1, 2, 3}  # one batch of four through the DART loop


def test_a_stopped_row_is_padded_with_eos_when_there_is_no_pad_token():
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5, 8), seed=11))
    full = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    eos = int(full[0, ids.shape[1] + 2])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    plain = model.generate(ids, **kwargs)  # no pad_token_id: generate() pads with the EOS id
    out = model.generate(ids, dart_head=random_head(model), **kwargs)
    assert torch.equal(out, plain)


# ---- logits processors get plain's calls: row i is row i of the batch they receive ------------------------------

class RowRules(LogitsProcessor):
    """A custom processor that treats the rows of its batch differently: row r may not emit tokens = r (mod 3)."""

    def __init__(self):
        self.batch_sizes = set()

    def __call__(self, input_ids, scores):
        self.batch_sizes.add(input_ids.shape[0])
        ids = torch.arange(scores.shape[-1])
        for r in range(scores.shape[0]):
            scores[r, ids % 3 == r % 3] = -float("inf")
        return scores


@pytest.mark.parametrize("case", ["repetition_penalty", "row_rules", "prefix_fn", "sampled_row_rules"])
def test_processors_see_the_batch_as_plain_generate_shows_it(case):
    """repetition_penalty in a left-padded batch raised (the processor got one row of a batch it knew as B rows); a
    processor with per-row rules applied row 0's rule to every row; prefix_allowed_tokens_fn was refused."""
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5, 8, 3), seed=4))
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    head = oracle_head(model, reference[1], wrong_every=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, do_sample=case.startswith("sampled"))
    if case == "repetition_penalty":
        kwargs["repetition_penalty"] = 1.3
    elif case == "prefix_fn":
        kwargs["prefix_allowed_tokens_fn"] = lambda batch_id, sent: list(range(10 * batch_id + 1, 10 * batch_id + 40))
    results = []
    for dart_head in (False, head):
        declared = {}
        if case.endswith("row_rules"):
            rules = RowRules()
            kwargs["logits_processor"] = LogitsProcessorList([rules])
            if dart_head is not False:  # a custom processor: DART takes the caller's word that it keeps no state
                declared["dart_stateless_processors"] = True
        torch.manual_seed(0)
        results.append(model.generate(ids, dart_head=dart_head, **kwargs, **declared))
        if case.endswith("row_rules"):
            assert rules.batch_sizes == {3}  # never one row alone
    if case.startswith("sampled"):  # the draws differ; every row keeps its own rule
        new = results[1][:, ids.shape[1]:]
        assert all(bool((new[r] % 3 != r % 3).all()) for r in range(3))
    else:
        assert torch.equal(results[1], results[0])


class OwnTemperature(TemperatureLogitsWarper):
    """A subclass of one of transformers' processors: its result may read anything."""


def test_length_key_only_for_transformers_processors_that_read_the_length_against_a_threshold():
    from dart_hf.processors import length_key

    min_new = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=3, eos_token_id=2)
    key = length_key(LogitsProcessorList([min_new, TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)]))
    assert key(6) == key(7) == (True,) and key(8) == key(30) == (False,)
    assert length_key(LogitsProcessorList([TemperatureLogitsWarper(0.7)]))(9) == ()
    for other in (RepetitionPenaltyLogitsProcessor(1.2), OwnTemperature(0.7), lambda ids, scores: scores):
        assert length_key(LogitsProcessorList([min_new, other])) is None


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_rows_of_different_lengths_share_a_call_when_only_min_new_tokens_reads_the_length(monkeypatch, sample):
    """A batch whose rows accept different amounts: with min_new_tokens (and temperature when sampling) each depth of
    the walk makes one call per side of the threshold, not one per row length; greedy output stays plain's."""
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5, 8, 3, 6), seed=11))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, do_sample=sample)
    full = model.generate(ids, **kwargs)
    kwargs.update(eos_token_id=int(full[0, ids.shape[1] + 5]), min_new_tokens=8)
    if sample:
        kwargs.update(temperature=0.8, top_k=0)
    references = [unpadded(full[b], mask[b]) for b in range(4)]
    calls = []
    own_call = MinNewTokensLengthLogitsProcessor.__call__
    monkeypatch.setattr(MinNewTokensLengthLogitsProcessor, "__call__",
                        lambda self, i, s: calls.append(i.shape[1]) or own_call(self, i, s))
    outputs = {}
    for merged in (True, False):
        if not merged:
            monkeypatch.setattr(dart_hf.processors, "length_key", lambda processors: None)
        calls.clear()
        torch.manual_seed(0)
        outputs[merged] = model.generate(ids, dart_head=oracle_head(model, references, wrong_every=3), **kwargs)
        outputs[merged, "calls"] = len(calls)
    assert outputs[True, "calls"] < outputs[False, "calls"]
    if sample:  # merged calls draw rows together, so the draws differ; no row ends before its 8th new token
        new = outputs[True][:, ids.shape[1]:]
        assert not bool((new[:, :8] == kwargs["eos_token_id"]).any())
    else:
        torch.manual_seed(0)
        assert torch.equal(outputs[True], model.generate(ids, **kwargs))


def test_a_processor_with_state_between_calls_is_refused_by_name_and_an_attached_head_runs_plain():
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    kwargs = dict(max_new_tokens=8, do_sample=False, guidance_scale=1.5)
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor keeps state"):
        model.generate(ids, dart_head=head, **kwargs)
    plain = model.generate(ids, **kwargs)
    attached = dart_hf.enable(tiny_target(), head)
    with pytest.warns(dart_hf.DartFallbackWarning, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        assert torch.equal(attached.generate(ids, **kwargs), plain)


def test_pending_head_rows_grow_in_place_and_keep_each_sequences_rows_in_order():
    from dart_hf.loop import PendingRows

    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5]
    rows = [torch.randn(n, 4, generator=gen) for n in lengths]  # per sequence, its real rows (the reference)
    ids = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
    aux = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    pending = PendingRows(aux, torch.nn.utils.rnn.pad_sequence(ids, batch_first=True), torch.tensor(lengths))
    for step in range(12):
        if step == 7:  # the head reads them all; later rows start at 0 in the same buffers
            pending, rows, ids = pending.consumed(), [r[:0] for r in rows], [i[:0] for i in ids]
        counts = torch.randint(1, 4, (3,), generator=gen)
        new = torch.randn(3, int(counts.max()), 4, generator=gen)
        new_ids = torch.randint(0, 50, (3, int(counts.max())), generator=gen)
        before = pending.aux.clone()
        pending = pending.append(new, new_ids, counts)
        rows = [torch.cat((r, new[b, : counts[b]])) for b, r in enumerate(rows)]
        ids = [torch.cat((i, new_ids[b, : counts[b]])) for b, i in enumerate(ids)]
        assert pending.lengths.tolist() == [len(r) for r in rows] and pending.width >= max(map(len, rows))
        for b in range(3):
            assert torch.equal(pending.aux[b, : len(rows[b])], rows[b]) and torch.equal(pending.ids[b, : len(ids[b])],
                                                                                          ids[b])
        if step != 7:  # an earlier object's rows are untouched
            old_lengths = [len(r) - int(c) for r, c in zip(rows, counts)]
            assert all(torch.equal(pending.aux[b, :n], before[b, :n]) for b, n in enumerate(old_lengths))
    kept = pending.select(torch.tensor([2, 0]))
    assert kept.lengths.tolist() == [len(rows[2]), len(rows[0])]
    assert torch.equal(kept.aux[0, : len(rows[2])], rows[2]) and torch.equal(kept.ids[1, : len(ids[0])], ids[0])
