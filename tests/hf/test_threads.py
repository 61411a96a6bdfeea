"""A DART call changes nothing another call can observe: concurrent DART and plain calls on one model each equal
their solo result, per-call statistics stay per call and per thread, and an interrupt at any phase leaves the model
computing exactly as before."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch import nn

import dart_hf
from dart_runtime import matmul
from dart_hf import target as target_module
from helpers.hf_models import oracle_head, random_head, tiny_target

PROMPTS = [torch.tensor([[5, 17, 33, 2, 9, 41, 12]]), torch.tensor([[60, 61, 62]]), torch.tensor([[7, 7, 8, 1]])]


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave at almost every bytecode
    yield
    sys.setswitchinterval(before)


def plain_logits(model) -> list[torch.Tensor]:
    """What plain forwards compute: a prompt, and a few-token continuation over a cache (the shapes a tree forward
    has, so a leaked kernel would show)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = [model(PROMPTS[0]).logits]
        cache = DynamicCache(config=model.config)
        model(PROMPTS[0], past_key_values=cache, use_cache=True)
        out.append(model(PROMPTS[1], past_key_values=cache, use_cache=True).logits)
    return out


def run_threads(jobs, names=None) -> list:
    results, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as err:  # noqa: BLE001  reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, job), name=names[i] if names else None)
               for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_concurrent_dart_and_plain_calls_each_equal_their_solo_result(fast_switching, monkeypatch):
    # the few-row product on every few-row input, measured or not, and a record of the threads that ran it
    monkeypatch.setattr(matmul, "kernel_choice", lambda weight, rows: True)
    ran_in = []
    transposed = matmul.transposed_linear

    def recorded(*args):
        ran_in.append(threading.current_thread().name)
        return transposed(*args)

    monkeypatch.setattr(matmul, "transposed_linear", recorded)
    model = dart_hf.enable(tiny_target(), False)
    before = plain_logits(model)
    solo = [model.generate(p, max_new_tokens=16, do_sample=False, dart_head=False) for p in PROMPTS]
    heads = [oracle_head(model, s[0], wrong_every=3) for s in solo]
    jobs, names = [], []
    for _ in range(3):
        jobs += [lambda i=i: model.generate(PROMPTS[i], max_new_tokens=16, do_sample=False, dart_head=heads[i])
                 for i in range(len(PROMPTS))]
        jobs += [lambda: plain_logits(model)]
        names += ["dart"] * len(PROMPTS) + ["plain"]
    ran_in.clear()
    results = run_threads(jobs, names)
    assert "dart" in ran_in and "plain" not in ran_in  # DART's kernel ran in DART's calls only
    for i, out in enumerate(results):
        if isinstance(out, list):
            assert all(torch.equal(a, b) for a, b in zip(out, before)), "a plain call computed with DART's kernels"
        else:
            assert torch.equal(out, solo[i % (len(PROMPTS) + 1)])
    ran_in.clear()
    assert all(torch.equal(a, b) for a, b in zip(plain_logits(model), before)) and not ran_in  # nothing left behind


def test_statistics_are_per_call_and_per_thread(fast_switching):
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPTS[0], max_new_tokens=12, do_sample=False)
    good, bad = oracle_head(model, plain[0]), random_head(model)

    def call(head):
        out = model.generate(PROMPTS[0], max_new_tokens=12, do_sample=False, dart_head=head,
                             return_dict_in_generate=True)
        return out.dart_stats, model.dart_stats

    for returned, seen in run_threads([lambda: call(good), lambda: call(bad)] * 3):
        assert returned is seen  # each thread sees its own call's statistics
    assert model.dart_stats is None  # this thread made no call
    model.generate(PROMPTS[0], max_new_tokens=4, do_sample=False, dart_head=good)
    assert model.dart_stats is not None
    with pytest.raises(ValueError):
        model.generate(PROMPTS[0], max_new_tokens=4, num_beams=2, dart_head=good)
    assert model.dart_stats is None  # a refused call leaves no earlier call's statistics


PHASES = [("prefill", dart_hf.loop, "prefill"), ("draft", dart_hf.loop, "draft"),
          ("verify", dart_hf.loop, "verify_step"), ("tree forward", dart_hf.loop, "tree_forward"),
          ("compaction", dart_hf.loop, "keep_accepted_path"), ("stopping", dart_hf.loop.Stopper, "decide"),
          ("attention", target_module, "grouped_sdpa_attention"), ("linear", matmul, "transposed_linear")]


@pytest.mark.parametrize("name,owner,attribute", PHASES, ids=[p[0] for p in PHASES])
@pytest.mark.parametrize("at_call", [1, 3])
def test_an_interrupt_at_any_phase_leaves_the_model_as_it_was(monkeypatch, name, owner, attribute, at_call):
    if name == "prefill" and at_call > 1:
        pytest.skip("one prefill per call")
    monkeypatch.setattr(matmul, "kernel_choice", lambda weight, rows: True)
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    model.generate(PROMPTS[1], max_new_tokens=4, do_sample=False, dart_head=head)  # DART's dispatchers installed
    before = plain_logits(model)
    real = getattr(owner, attribute)
    real_transposed, grouped = matmul.transposed_linear, target_module.grouped_sdpa_attention
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.generate(PROMPTS[0], max_new_tokens=24, do_sample=False, dart_head=head)
    monkeypatch.setattr(owner, attribute, real)
    assert matmul._PRODUCT.get() is None and target_module._LAST_GROUPED_MASK.get() is None
    used = []
    monkeypatch.setattr(matmul, "transposed_linear", lambda *a: used.append(1) or real_transposed(*a))
    monkeypatch.setattr(target_module, "grouped_sdpa_attention", lambda *a, **k: used.append(2) or grouped(*a, **k))
    assert all(torch.equal(a, b) for a, b in zip(plain_logits(model), before)) and not used
    assert model.dart_stats is not None or name == "prefill"  # the interrupted call's own statistics
    # and the model still decodes: DART and plain agree
    assert torch.equal(model.generate(PROMPTS[0], max_new_tokens=8, do_sample=False, dart_head=head),
                       model.generate(PROMPTS[0], max_new_tokens=8, do_sample=False, dart_head=False))


def test_nothing_is_swapped_in_or_out_per_call():
    # the dispatchers are installed once; a call only sets its own context
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    model.generate(PROMPTS[0], max_new_tokens=4, do_sample=False, dart_head=head)
    forwards = {id(m): m.__dict__.get("forward") for m in model.modules() if type(m) is nn.Linear}
    attention = model.config._attn_implementation
    model.generate(PROMPTS[0], max_new_tokens=8, do_sample=False, dart_head=head)
    assert {id(m): m.__dict__.get("forward") for m in model.modules() if type(m) is nn.Linear} == forwards
    assert model.config._attn_implementation == attention == "sdpa"
