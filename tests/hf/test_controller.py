"""The speed rule in the decoding loop, on a tiny model (`dart_hf.controller`, `dart_core.step_policy`): exact
whatever each step's decision, and an attached head that cannot pay finishes plain with one warning."""

import random
import sys
import time
import warnings

import pytest
import torch

import dart_hf
from dart_core.step_policy import PLAIN, FixedTree, TreeStep
from dart_hf import DartFallbackWarning
from helpers.hf_models import oracle_head, tiny_target

controller_module = sys.modules["dart_hf.controller"]


PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])


class RandomSizes:
    """A policy that decides a random tree size or a plain step (the loop's exactness must not depend on them)."""

    def __init__(self, seed: int, sizes=(0, 1, 2, 5, 9, 30)) -> None:
        self.rng, self.sizes, self.max_tree_size, self.seen = random.Random(seed), sizes, max(sizes), []

    def begin(self, sampled):
        pass

    def decide(self, batch_size, context_length):
        size = self.rng.choice(self.sizes)
        return TreeStep(size) if size else PLAIN

    def observe(self, decision, step):
        size = decision.nodes if isinstance(decision, TreeStep) else 0
        self.seen.append((size, step.batch_size, len(step.ranks)))


@pytest.mark.parametrize("seed", range(4))
def test_the_loop_is_exact_whatever_each_steps_tree(seed):
    from dart_hf.loop import dart_decoding

    model = tiny_target()  # not enabled: the loop as a custom_generate callable, with a policy of its own
    batch = torch.tensor([[5, 17, 33, 2, 9, 41, 12], [0, 0, 8, 3, 3, 60, 1], [0, 0, 0, 0, 7, 7, 70]])
    mask = (torch.arange(7)[None] >= torch.tensor([[0], [2], [4]])).long()
    plain = model.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    head = oracle_head(model, plain[0], wrong_every=3)
    policy = RandomSizes(seed)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         custom_generate=dart_decoding, dart_head=head, dart_step_policy=policy)
    assert torch.equal(out, plain)
    stats = dart_hf.last_stats(model)
    assert stats.tree_sizes == [s for s, _, _ in policy.seen] and 0 in stats.tree_sizes
    assert all(rows == n for _, rows, n in policy.seen)  # one ranks list per sequence of the step


def slow_drafts(head, seconds: float):
    """`head` whose drafting pass takes `seconds` longer (a head that cannot pay on any CPU)."""
    draft = head.draft

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return draft(*args, **kwargs)

    head.draft = slow
    return head


def test_an_attached_head_that_cannot_pay_finishes_plain_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    head = slow_drafts(oracle_head(model, plain[0], wrong_every=2), 0.05)  # 50 ms a draft, ~5 ms a plain step
    attached = dart_hf.enable(tiny_target(), head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [attached.generate(PROMPT, max_new_tokens=40, do_sample=False) for _ in range(4)]
        stats = attached.dart_stats
    assert all(torch.equal(out, plain) for out in outputs)
    fallbacks = [w for w in caught if issubclass(w.category, DartFallbackWarning)]
    message = str(fallbacks[0].message)
    assert len(fallbacks) == 1 and "calls here run plain" in message
    # the numbers of the estimates, or (their first call stopped by its loss budget before any) what the calls lost
    assert "does not beat plain decoding" in message or "lost time against plain decoding" in message
    assert fallbacks[0].filename == __file__  # it points at the caller's line
    regime = controller_module.existing_controller(attached, head, store=True).regimes[(1, 256)]
    assert regime.mode == "plain"
    assert stats is None or stats.plain_steps > 0  # the last call ran plain, or probed and finished plain
    # asked for by name, the head decodes with DART all the same (tree sizes still adapt)
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, dart_head=head)
    assert torch.equal(out, plain[:, :out.shape[1]]) and model.dart_stats.plain_steps == 0


def test_the_loop_reports_each_tree_steps_drafting_apart(tmp_path, monkeypatch):
    """A head whose drafting pass takes 30 ms longer: the controller learns a drafting time of at least that, within
    the steps' own times (which it predicts untimed trees from, `SpeedController.no_tree_point`)."""
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=32, do_sample=False)
    head = slow_drafts(oracle_head(model, plain[0], wrong_every=2), 0.03)
    out = model.generate(PROMPT, max_new_tokens=32, do_sample=False, dart_head=head)
    assert torch.equal(out, plain)
    regime = controller_module.existing_controller(model, head, store=True).regimes[(1, 256)]
    assert regime.drafting.weight > 0 and 0.03 <= regime.drafting.value < min(m.value for m in regime.timed().values())


@pytest.mark.parametrize("choices", ["undecided", "decided"])
def test_the_loop_reports_the_steps_that_ran_kernel_trials(choices, tmp_path, monkeypatch):
    """Where this process has not yet chosen the few-row product for the trees' row counts, the first tree steps run
    the trials (some products through the slower kernel) and are reported as one-off work; the control, every choice
    made, reports none."""
    import dart_hf.loop as loop_module
    import dart_runtime.matmul as matmul

    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))  # no kernel choices from earlier processes
    monkeypatch.setattr(matmul, "_CHOICES", {})
    monkeypatch.setattr(matmul, "_TRIALS", {})
    if choices == "decided":
        monkeypatch.setattr(matmul, "kernel_choice", lambda weight, rows: False)
    model = tiny_target()
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    outcomes = []
    verify = loop_module.verify_step

    def recorded(*args, **kwargs):
        outcomes.append(verify(*args, **kwargs))
        return outcomes[-1]

    monkeypatch.setattr(loop_module, "verify_step", recorded)
    out = model.generate(PROMPT, max_new_tokens=24, do_sample=False, custom_generate=loop_module.dart_decoding,
                         dart_head=oracle_head(model, plain[0]), dart_step_policy=FixedTree(3))
    assert torch.equal(out, plain)
    one_off = [o.one_off for o in outcomes if o.drafted]
    if choices == "undecided":
        assert one_off[0]
    else:
        assert one_off and not any(one_off)


def test_a_fresh_regimes_first_dart_steps_verify_small_trees(tmp_path, monkeypatch):
    """Small trees first: in a fresh cache, an attached head that fills its trees starts with the largest tree within
    `FIRST_ROWS` rows a sequence, and a larger tree comes only after a timed smaller one (the first step of a size is
    not timed) within `LADDER` times its rows."""
    from dart_core.speed import FIRST_ROWS, LADDER

    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    attached = dart_hf.enable(tiny_target(), oracle_head(model, plain[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DartFallbackWarning)  # the tiny model's steps may not pay on this CPU
        out = attached.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, plain)
    sizes = [s for s in attached.dart_stats.tree_sizes if s]
    assert sizes[:2] == [FIRST_ROWS - 1] * 2
    for i, size in enumerate(sizes):
        timed = [s for j, s in enumerate(sizes[:i]) if s in sizes[:j]]  # sizes with a step after their first
        reach = LADDER * (max(timed) + 1) - 1 if timed else FIRST_ROWS - 1
        assert size in sizes[:i] or size <= reach


def test_an_attached_call_that_runs_plain_takes_the_few_row_product_of_dart_plain_steps(tmp_path, monkeypatch):
    """A regime's plain verdict runs the call as plain generate(), its few-row layers (2 rows a step at batch 2)
    through the kernel choice DART's own plain steps take, so that falling back costs what the controller measured;
    a single sequence's call is the model's own (its steps are one-row products either way)."""
    import dart_runtime.matmul as matmul

    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    batch = torch.tensor([[5, 17, 33, 2, 9, 41, 12], [0, 0, 8, 3, 3, 60, 1]])
    kwargs = dict(attention_mask=(batch > 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(batch, **kwargs)
    head = oracle_head(model, plain[0], wrong_every=2)
    attached = dart_hf.enable(tiny_target(), head)
    rows = []
    choice = matmul.kernel_choice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DartFallbackWarning)  # the first call may find that DART does not pay here
        attached.generate(batch, **kwargs)  # makes the controller
        controller = controller_module.existing_controller(attached, head, store=True)
        controller.set_plain((2, 256), probing=False)
        monkeypatch.setattr(matmul, "kernel_choice", lambda weight, n: rows.append(n) or choice(weight, n))
        out = attached.generate(batch, **kwargs)
    assert attached.dart_stats is None and torch.equal(out, plain)  # plain generate(), plain's tokens
    assert 2 in rows
    rows.clear()
    model.generate(batch, **kwargs)  # plain generate() itself keeps the model's own product
    assert rows == []
    controller.regime(1, 7)
    controller.set_plain((1, 256), probing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DartFallbackWarning)
        one = attached.generate(batch[:1], **dict(kwargs, attention_mask=kwargs["attention_mask"][:1]))  # one-row steps
    assert attached.dart_stats is None and torch.equal(one, plain[:1]) and rows == []


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_single_sequences_plain_step_takes_the_models_own_kernels(batch_size):
    """DART's verify kernels (`tree_forwards`: the few-row product, grouped attention) serve the forwards over two or
    more rows; a batch-of-one plain step is one row, computed as plain generate() computes it, with no dispatch per
    layer."""
    import dart_runtime.matmul as matmul
    from dart_hf import target as target_module
    from dart_hf.loop import dart_decoding

    model = tiny_target()
    batch = torch.tensor([[5, 17, 33, 2, 9, 41, 12], [0, 0, 8, 3, 3, 60, 1]])[:batch_size]
    kwargs = dict(attention_mask=(batch > 0).long(), max_new_tokens=16, do_sample=False, pad_token_id=0)
    plain = model.generate(batch, **kwargs)
    policy = RandomSizes(0, sizes=(0, 0, 3))
    seen = []  # per target forward: (its rows, whether the verify kernels were on)
    layer = model.model.layers[0].mlp.down_proj
    layer.register_forward_pre_hook(lambda module, args: seen.append(
        (args[0].numel() // args[0].shape[-1], matmul._PRODUCT.get() is not None
         and target_module._LAST_GROUPED_MASK.get() is not None)))
    out = model.generate(batch, **kwargs, custom_generate=dart_decoding,
                         dart_head=oracle_head(model, plain[0], wrong_every=3), dart_step_policy=policy)
    assert torch.equal(out, plain)
    steps = seen[1:]  # after the prefill
    assert {rows for rows, _ in steps} >= {batch_size, 4 * batch_size}  # plain steps and tree steps ran
    assert all(on == (rows > 1) for rows, on in steps)
