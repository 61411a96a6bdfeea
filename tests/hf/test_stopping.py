"""Stopping criteria under DART: every criterion gets exactly the calls plain generate() makes (same order, same
tensors, same scores), at any batch size, so any criterion, stateful or not, gives plain's output
(`dart_hf.stopping`)."""

import random

import pytest
import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

import dart_hf
from dart_hf.stopping import Stopper
from helpers.hf_models import PAD, char_tokenizer, left_padded, oracle_head, random_head, random_prompts, tiny_target, unpadded
from helpers.sampling_checks import SMALL_TREE, chi_square_pvalue, exact_two_token_distribution, lossy_verify


class Recorder(StoppingCriteria):
    """Records every call (a copy of input_ids and of scores) and answers like `inner` (default: never stop)."""

    def __init__(self, inner=None):
        self.inner, self.calls = inner, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), None if scores is None else [s.clone() for s in scores]))
        if self.inner is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return self.inner(input_ids, scores)


class DoneTracker(StoppingCriteria):
    """lm-evaluation-harness's MultiTokenEOSCriteria in miniature: a per-row done flag set once the row's generated
    part holds `token`, and ONE bool for the batch (True when every row is done)."""

    def __init__(self, token: int, prompt_len: int, batch: int):
        self.token, self.prompt_len, self.done = token, prompt_len, [False] * batch

    def __call__(self, input_ids, scores, **kwargs):
        for i in range(len(self.done)):  # IndexError if called with other rows than the whole batch
            self.done[i] = self.done[i] or self.token in input_ids[i, self.prompt_len:].tolist()
        return all(self.done)


class RowsAt(StoppingCriteria):
    """Finishes row r once the sequence is prompt_len + steps[r] long (one answer per row)."""

    def __init__(self, prompt_len: int, steps: list[int]):
        self.prompt_len, self.steps = prompt_len, steps

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([input_ids.shape[1] - self.prompt_len >= s for s in self.steps])


def same_calls(a: Recorder, b: Recorder) -> bool:
    if len(a.calls) != len(b.calls):
        return False
    for (ids_a, scores_a), (ids_b, scores_b) in zip(a.calls, b.calls):
        if not torch.equal(ids_a, ids_b) or (scores_a is None) != (scores_b is None):
            return False
        if scores_a is not None and (len(scores_a) != len(scores_b)
                                     or not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(scores_a, scores_b))):
            return False
    return True


def batch_heads(model, ids, mask, plain):
    """A head that drafts nothing useful and one that drafts each row's continuation (wrong at different
    positions, so that rows run at different paces)."""
    references = [unpadded(plain[b], mask[b]) for b in range(ids.shape[0])]
    return [random_head(model), oracle_head(model, references, wrong_every=3)]


# ---- the rule itself, on the host -----------------------------------------------------------------------------

class Same(StoppingCriteria):
    """`inner` under another class: the criteria get called (no host decisions)."""

    def __init__(self, inner):
        self.inner = inner
        if hasattr(inner, "eos_token_id"):  # what generate() looks for to pad finished rows
            self.eos_token_id = inner.eos_token_id

    def __call__(self, input_ids, scores, **kwargs):
        return self.inner(input_ids, scores, **kwargs)


@pytest.mark.parametrize("seed", range(8))
def test_host_decisions_equal_calling_the_criteria(seed):
    # generate()'s own max-length and EOS criteria are decided on the host, row by row as tokens arrive: the output
    # must equal calling them step by step in lockstep
    from transformers import GenerationConfig

    rng = random.Random(seed)
    batch, prompt_len = rng.randint(1, 4), rng.randint(1, 5)
    prompt = torch.randint(1, 8, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    config = GenerationConfig(max_length=prompt_len + rng.randint(1, 12), pad_token_id=0)
    eos = [rng.randint(1, 7) for _ in range(rng.randint(1, 2))]
    criteria = StoppingCriteriaList([MaxLengthCriteria(config.max_length), EosTokenCriteria(eos)])
    on_host = Stopper(prompt, criteria, config)
    called = Stopper(prompt, StoppingCriteriaList([Same(c) for c in criteria]), config)
    assert on_host.host is not None and called.host is None
    streams = [[rng.randint(1, 7) for _ in range(20)] for _ in range(batch)]
    position = [0] * batch
    while not (on_host.done and called.done):
        for row in range(batch):
            n = rng.randint(1, 4)  # rows advance by different numbers of tokens per step
            chunk = streams[row][position[row] : position[row] + n]
            position[row] += n
            for stopper in (on_host, called):
                if stopper.producing(row):
                    stopper.add(row, chunk)
        on_host.decide()
        called.decide()
    assert torch.equal(on_host.output(), called.output())
    # control: the same streams without the EOS criterion end later wherever an EOS came before the last step
    cap = config.max_length - prompt_len
    if any(t in eos for stream in streams for t in stream[: cap - 1]):
        other = Stopper(prompt, StoppingCriteriaList([MaxLengthCriteria(config.max_length)]), config)
        for row in range(batch):
            other.add(row, streams[row])
        other.decide()
        assert not torch.equal(other.output(), on_host.output())


# ---- through generate(), against plain generate() on the same padded batch -----------------------------------

@pytest.mark.parametrize("lengths", [(5,), (6, 3, 8), (4, 9, 2, 7, 5, 3, 8, 6)])
def test_a_stateful_batch_criterion_gets_plains_calls(lengths):
    # the harness's case: no EOS id, a per-row done tracker answering one bool for the batch, a left-padded batch
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts(lengths, seed=len(lengths)))
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    stop_token = int(free[0, ids.shape[1] + 3])  # row 0 produces it at its 4th new token
    outputs, records = [], []
    for head in [None] + batch_heads(model, ids, mask, free):
        recorder = Recorder(DoneTracker(stop_token, ids.shape[1], len(lengths)))
        kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                      stopping_criteria=StoppingCriteriaList([recorder]))
        outputs.append(model.generate(ids, **kwargs) if head is None else model.generate(ids, dart_head=head,
                                                                                          **kwargs))
        records.append(recorder)
    plain = outputs[0]
    for out, record in zip(outputs[1:], records[1:]):
        assert torch.equal(out, plain)
        assert same_calls(record, records[0])
    assert len(records[0].calls) >= 4


def test_rows_that_finish_first_and_last_with_and_without_an_eos_criterion():
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5, 8, 3), seed=4))
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    never = int(free.max()) + 1  # an EOS id no row produces: an EOS criterion exists, finished rows get padding
    for eos in (None, never):
        outputs, records = [], []
        for head in [None] + batch_heads(model, ids, mask, free):
            recorder = Recorder(RowsAt(ids.shape[1], [2, 13, 7]))  # row 0 first, row 1 last
            kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD,
                          eos_token_id=eos, stopping_criteria=StoppingCriteriaList([recorder]))
            outputs.append(model.generate(ids, **kwargs) if head is None else model.generate(ids, dart_head=head,
                                                                                              **kwargs))
            records.append(recorder)
        plain = outputs[0]
        assert plain.shape[1] == ids.shape[1] + 13
        assert bool((plain[0, ids.shape[1] + 2:] == PAD).all()) == (eos is not None)  # padded only beside an EOS
        for out, record in zip(outputs[1:], records[1:]):
            assert torch.equal(out, plain)
            assert same_calls(record, records[0])


def test_a_criterion_reading_scores_gets_plains_scores():
    # plain passes the processed scores of steps 1..t when output_scores is set (None otherwise)
    model = dart_hf.enable(tiny_target(), False)
    prompt = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])
    free = model.generate(prompt, max_new_tokens=16, do_sample=False)
    for output_scores in (False, True):
        records, outputs = [], []
        for head in (None, oracle_head(model, free[0], wrong_every=4)):
            recorder = Recorder()
            kwargs = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3, return_dict_in_generate=True,
                          output_scores=output_scores, stopping_criteria=StoppingCriteriaList([recorder]))
            out = model.generate(prompt, **kwargs) if head is None else model.generate(prompt, dart_head=head,
                                                                                       **kwargs)
            outputs.append(out.sequences)
            records.append(recorder)
        assert torch.equal(outputs[1], outputs[0]) and same_calls(records[1], records[0])
        assert (records[0].calls[-1][1] is None) == (not output_scores)
        if output_scores:
            assert len(records[0].calls[-1][1]) == 16


@pytest.mark.parametrize("eos", [None, "id"])
def test_stop_strings_at_batch_size_above_one(eos):
    vocab = 96
    model = dart_hf.enable(tiny_target(vocab=vocab), False)
    tokenizer = char_tokenizer()
    ids, mask = left_padded(random_prompts((4, 7, 2), seed=9, vocab=vocab))
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    stop = tokenizer.decode(free[1, ids.shape[1] + 3 : ids.shape[1] + 5])  # two words row 1 produces
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD, stop_strings=[stop],
                  tokenizer=tokenizer, eos_token_id=(int(free.max()) + 1 if eos else None))
    plain = model.generate(ids, **kwargs)
    assert plain.shape[1] < free.shape[1] or bool((plain == PAD).any())  # the stop string stopped a row
    for head in batch_heads(model, ids, mask, free):
        assert torch.equal(model.generate(ids, dart_head=head, **kwargs), plain)


@pytest.mark.slow  # statistical: 1,900 generate() calls
def test_sampling_under_called_criteria_keeps_each_rows_distribution_and_a_lossy_control_fails(monkeypatch):
    # the same statistical check as the host-decided case, with a criterion that must be called (lockstep)
    model = dart_hf.enable(tiny_target(vocab=8, layers=4, hidden=16, seed=3), False)
    ids = torch.tensor([[1, 2, 3, 4], [PAD, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    prompts = (torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7]]))
    exact = [exact_two_token_distribution(model, p).flatten() for p in prompts]
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    head = oracle_head(model, [unpadded(greedy[b], mask[b]) for b in range(2)], draft_length=2)

    def sample(draws, seed):
        torch.manual_seed(seed)
        counts = torch.zeros(2, 8, 8)
        for _ in range(draws):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, top_k=0, dart_head=head,
                                 dart_tree_config=SMALL_TREE, pad_token_id=PAD,
                                 stopping_criteria=StoppingCriteriaList([Recorder()]))
            for b in range(2):
                counts[b, out[b, -3], out[b, -2]] += 1
        return counts

    counts = sample(1200, 0)
    for b in range(2):
        assert chi_square_pvalue(counts[b].flatten(), exact[b]) > 1e-3
    monkeypatch.setattr(dart_hf.loop, "verify_tree", lossy_verify)
    control = sample(700, 1)
    assert max(chi_square_pvalue(control[b].flatten(), exact[b]) for b in range(2)) < 1e-6
