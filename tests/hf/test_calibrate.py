"""What DART's speed decisions start from (`dart_hf.calibration`): the acceptance rule (exact per step), the shipped
acceptance curve, the latency curve, the first-call machine cost and its cache (never failing a call, never taking an
implausible value), the head's dtype by measurement, and `load_default`."""

import dataclasses
import json
import sys

import pytest
import torch

import dart_hf
from dart_core import (AcceptanceCurve, DartHead, DartInputError, NGramModel, TreeConfig, build_draft_tree,
                       topk_draft_tokens)
from dart_core.tree import score_ranks
from dart_hf import DartCacheWarning
from dart_core.cost import MachineCost, interpolate, monotone
from dart_hf.calibration import cached_machine_cost, machine_cost, measure_acceptance, measure_machine_cost
from dart_hf.controller import controller_for
from dart_hf.default import DEFAULT_HEAD_DIR, default_head_dtype, load_default
from helpers.hf_models import oracle_head, random_head, tiny_target

calibrate_module = sys.modules["dart_hf.calibration"]
PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---- the acceptance rule ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_tree_of_r_nodes_is_the_best_r_by_score_rank(seed):
    """build_draft_tree(remain_total=R) keeps exactly the nodes of the R_max tree with score_ranks < R, and ranks
    increase from parent to child, also with many tied scores (integer logits) and with the n-gram prior."""
    gen = torch.Generator().manual_seed(seed)
    vocab, levels = 64, 5
    logits = torch.randint(0, 4, (levels, vocab), generator=gen).float()  # heavy ties
    if seed % 2:
        logits = logits + torch.randn(levels, vocab, generator=gen)  # no ties
    ngram = NGramModel.build([torch.randint(0, 16, (3000,), generator=gen)], order=3, vocab_size=vocab)
    tokens, probs = topk_draft_tokens(logits, 8)
    context = torch.tensor([3, 7, 1])
    base = TreeConfig(topk=8, beam_width=6, remain_total=60, eos_token_id=5 if seed == 2 else None)
    big = build_draft_tree(tokens, probs, context, ngram, base)
    ranks = score_ranks(big.scores)
    assert sorted(ranks.tolist()) == list(range(big.num_nodes - 1))
    for node in range(1, big.num_nodes):
        parent = int(big.parents[node])
        if parent > 0:
            assert ranks[node - 1] > ranks[parent - 1]
    paths = big.paths()
    for r in (1, 2, 3, 7, 16, 31, 59, 60):
        small = build_draft_tree(tokens, probs, context, ngram, TreeConfig(**{**base.to_dict(), "remain_total": r}))
        assert set(small.paths()) == {p for p, rank in zip(paths, ranks.tolist()) if rank < r}
        assert small.num_nodes == min(r, big.num_nodes - 1) + 1


def test_decoding_records_accepted_ranks():
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=5)
    out = model.generate(PROMPT, max_new_tokens=32, do_sample=False, dart_head=head,
                         dart_tree_config=TreeConfig(remain_total=60))
    assert torch.equal(out, plain[:, : out.shape[1]])
    stats = model.dart_stats
    assert [len(r) for r in stats.accepted_ranks] == stats.accepted_lengths
    assert all(r == sorted(set(r)) for r in stats.accepted_ranks)  # ranks increase along the accepted path
    assert stats.tau_at(60) == stats.tau and stats.accepted_within(60) == stats.accepted_lengths
    curve = [stats.tau_at(r) for r in range(1, 61)]
    assert curve == sorted(curve) and curve[0] < curve[-1]
    assert "accepted_ranks" in stats.as_dict()


@pytest.mark.parametrize("context_draft", [False, True])
@pytest.mark.parametrize("kind", ["random", "replay3", "replay5"])
def test_tau_of_smaller_trees_is_exact_per_step(kind, context_draft):
    """The claim: from every state of a greedy R_max=60 run, a real run with remain_total=R accepts exactly the
    leading accepted nodes of rank < R. Each state is rebuilt by decoding from the prefix before its root."""
    model = dart_hf.enable(tiny_target(), False, store=False)  # each state rebuilt from its prefix alone
    new_tokens = 24
    plain = model.generate(PROMPT, max_new_tokens=new_tokens + 12, do_sample=False)
    head = random_head(model) if kind == "random" else oracle_head(model, plain[0], wrong_every=int(kind[-1]))
    config = TreeConfig(remain_total=60, context_draft=context_draft)
    out = model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, dart_head=head, dart_tree_config=config)
    assert torch.equal(out, plain[:, : out.shape[1]])
    stats = model.dart_stats
    sizes = (1, 2, 4, 8, 16, 30)
    if kind == "replay5" and not context_draft:
        assert any(r and r[-1] >= 16 for r in stats.accepted_ranks)  # some accepted nodes rank deep in the tree
    length = PROMPT.shape[1] + 1  # the prefill emits the first root
    for step, ranks in enumerate(stats.accepted_ranks):
        prefix = out[:, : length - 1]  # decoding from here re-emits the root, then verifies step `step`'s tree
        for r in sizes + (60,):  # (3 new tokens: a call's last token is decided by the root alone)
            model.generate(prefix, max_new_tokens=3, do_sample=False, dart_head=head,
                           dart_tree_config=dataclasses.replace(config, remain_total=r))
            assert model.dart_stats.accepted_lengths[0] == stats.accepted_within(r)[step], (step, r)
            if r == 60:
                assert model.dart_stats.accepted_ranks[0] == ranks  # the state was rebuilt faithfully
        length += stats.accepted_lengths[step] + 1
    # over a whole run tau_at(R) is exact when a tree of R nodes keeps every step's acceptance (same trajectory)
    same = [r for r in sizes if stats.accepted_within(r) == stats.accepted_lengths]
    assert same
    for r in same:
        again = model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, dart_head=head,
                               dart_tree_config=dataclasses.replace(config, remain_total=r))
        assert torch.equal(again, out) and model.dart_stats.tau == stats.tau_at(r)


# ---- the latency curve ----------------------------------------------------------------------------------------

def test_interpolation_and_monotone_latency():
    points = {1: 1.0, 4: 4.0, 8: 6.0}
    assert interpolate(points, 1) == 1.0 and interpolate(points, 2) == 2.0 and interpolate(points, 6) == 5.0
    assert interpolate(points, 12) == 8.0  # extrapolated from the last two points
    assert monotone({1: 1.0, 2: 3.0, 4: 2.0, 8: 5.0}) == {1: 1.0, 2: 2.5, 4: 2.5, 8: 5.0}
    assert monotone(points) == points
    cost = MachineCost(verify_ms={1: 1.0, 2: 3.0, 4: 2.0, 8: 5.0}, plain_ms=1.0, head_ms=0.0, tree_ms=0.0,
                       rest_ms=0.0, context_length=8, seconds=0.0)
    assert cost.verify_at(3) == 2.5 and cost.verify_at(16) == pytest.approx(2.5 + 2.5 / 4 * 12)


# ---- the acceptance curve ----------------------------------------------------------------------------------------

SMALL_CURVE = dict(max_new_tokens=20, candidates=(1, 2, 4, 8, 16), progress=False)
SMALL_COST = dict(context_length=32, repeats=1, progress=False)


def test_acceptance_curve_ships_in_the_head_directory(tmp_path):
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=3)
    curve = measure_acceptance(model, None, head, [PROMPT], **SMALL_CURVE)
    assert sorted(curve.tau) == [1, 2, 4, 8, 16, 60] and curve.tau[1] >= 1.0 and curve.steps >= 1
    assert list(curve.tau.values()) == sorted(curve.tau.values())
    saved = random_head(model)
    saved.acceptance = curve
    saved.save_pretrained(tmp_path / "head")
    again = DartHead.from_pretrained(tmp_path / "head")
    assert again.acceptance.tau == pytest.approx(curve.tau, abs=1e-4) and again.acceptance.steps == curve.steps
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    raw["dart_acceptance"]["tau"]["2"] = 0.5  # below 1: no run accepts less than its bonus token
    (tmp_path / "head" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DartInputError, match="config.json: dart_acceptance: .*tau finite and >= 1"):
        DartHead.from_pretrained(tmp_path / "head")


def test_the_acceptance_curve_is_not_measured_on_the_demo_prompt():
    from dart_bench import DEMO_PROMPT
    from dart_hf.calibration import DEFAULT_PROMPTS
    assert DEMO_PROMPT not in DEFAULT_PROMPTS  # the demo's tree size would be fitted to the text it is timed on


# ---- the first-call machine cost and its cache ------------------------------------------------------------------

def test_the_machine_cost_is_measured_only_when_asked_cached_by_dtype_and_threads(cache_root, monkeypatch, capsys):
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    head.acceptance = AcceptanceCurve(tau={1: 1.5, 4: 1.9, 16: 2.2}, steps=5, new_tokens=9, prompts=1)
    measured = []
    real = calibrate_module.measure_machine_cost

    def counted(*args, **kwargs):
        measured.append(torch.get_num_threads())
        return real(*args, **{**kwargs, **SMALL_COST})

    monkeypatch.setattr(calibrate_module, "measure_machine_cost", counted)
    threads = torch.get_num_threads()
    controller = controller_for(model, head)  # what a call makes: it never measures
    assert measured == [] and controller.cost is None and controller_for(model, head) is controller
    attached = dart_hf.enable(tiny_target(), head)
    attached.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert measured == [] and "measuring" not in capsys.readouterr().err
    cost = machine_cost(model, head)  # asked for (`dart-spec calibrate`, `dart_hf.calibrate`)
    assert measured == [threads] and "measuring what a verify step costs" in capsys.readouterr().err
    files = [f for f in (cache_root / "machine").glob("*.json") if not f.name.endswith("learned.json")]
    saved = json.loads(files[0].read_text())
    assert len(files) == 1 and saved["identity"]["threads"] == threads
    assert saved["identity"]["device"].startswith("cpu:")
    assert MachineCost.from_dict(saved) == cached_machine_cost(model, head) == cost == machine_cost(model, head)
    sys.modules["dart_hf.controller"]._CONTROLLERS.clear()
    assert controller_for(model, head).cost == cost and measured == [threads]  # a new controller: from the cache
    torch.set_num_threads(threads + 1)  # another thread count is another machine setting
    try:
        assert controller_for(model, head).cost is None
        machine_cost(model, head)
    finally:
        torch.set_num_threads(threads)
    assert measured == [threads, threads + 1]
    model.to(torch.bfloat16)  # and so is another dtype
    try:
        assert cached_machine_cost(model, head) is None
    finally:
        model.to(torch.float32)


def test_the_timing_run_decodes_its_full_length_whatever_the_eos(cache_root):
    """A target whose first greedy token on the timing run's random ids is its EOS (as Gemma-3 and Qwen2.5 do) still
    gets a full timing run: the head, search and rest times are measured, never 0 from a run without steps."""
    model = dart_hf.enable(tiny_target(), False)
    prompt = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    first = int(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                               do_sample=False)[0, -1])
    model.generation_config.eos_token_id = first
    model.generation_config.pad_token_id = 0
    cost = measure_machine_cost(model, random_head(model), **SMALL_COST)
    assert cost.head_ms > 0 and cost.tree_ms > 0 and cost.plain_ms > 0


def test_a_timing_run_without_enough_steps_is_an_error_never_a_cached_zero(cache_root, monkeypatch):
    from dart_hf.loop import DartStats

    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    monkeypatch.setattr(calibrate_module, "acceptance_run", lambda *args, **kwargs: DartStats())
    with pytest.raises(DartInputError, match="the timing run made 0 verify steps"):
        machine_cost(model, head, **SMALL_COST)
    assert not list(cache_root.glob("machine/*.json"))
    # calls then learn the step costs from their own steps, exactly
    attached = dart_hf.enable(tiny_target(), head)
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    with warnings_as_errors(DartCacheWarning):
        assert torch.equal(attached.generate(PROMPT, max_new_tokens=8, do_sample=False), plain)


GOOD_COST = dict(verify_ms={"1": 5.0, "2": 6.0}, plain_ms=5.0, head_ms=1.0, tree_ms=1.0, rest_ms=0.5,
                 context_length=256, seconds=1.0, identity={}, created="", version=4)
BAD_COSTS = {  # what a cache file may hold; each must be ignored with a warning, never reach the choice
    "null": None, "list": [], "number": 17, "old version": {"version": 3}, "no fields": {"version": 4},
    "all zero": dict(GOOD_COST, verify_ms={"1": 0.0, "2": 0.0}, plain_ms=0.0, head_ms=0.0, tree_ms=0.0, rest_ms=0.0),
    "plain zero": dict(GOOD_COST, plain_ms=0.0), "plain string": dict(GOOD_COST, plain_ms="5"),
    "plain bool": dict(GOOD_COST, plain_ms=True), "plain negative": dict(GOOD_COST, plain_ms=-3.0),
    "plain null": dict(GOOD_COST, plain_ms=None), "plain list": dict(GOOD_COST, plain_ms=[5]),
    "verify zero": dict(GOOD_COST, verify_ms={"1": 0.0}), "verify negative": dict(GOOD_COST, verify_ms={"1": -1}),
    "verify string": dict(GOOD_COST, verify_ms={"1": "5"}), "verify list": dict(GOOD_COST, verify_ms=[1, 2]),
    "verify empty": dict(GOOD_COST, verify_ms={}), "verify key 0": dict(GOOD_COST, verify_ms={"0": 5.0}),
    "verify key text": dict(GOOD_COST, verify_ms={"one": 5.0}), "head negative": dict(GOOD_COST, head_ms=-1.0),
    "head string": dict(GOOD_COST, head_ms="1"), "tree bool": dict(GOOD_COST, tree_ms=False),
    "rest nan": dict(GOOD_COST, rest_ms=float("nan")), "rest inf": dict(GOOD_COST, rest_ms=float("inf")),
    "context zero": dict(GOOD_COST, context_length=0), "context float": dict(GOOD_COST, context_length=2.5),
    "seconds string": dict(GOOD_COST, seconds="1"), "identity list": dict(GOOD_COST, identity=[]),
}


def test_a_valid_cost_entry_reads_back():
    assert MachineCost.from_dict(GOOD_COST).verify_ms == {1: 5.0, 2: 6.0}


@pytest.mark.parametrize("name", sorted(BAD_COSTS))
def test_an_implausible_cost_entry_is_refused_by_name(name):
    with pytest.raises(DartInputError):
        MachineCost.from_dict(BAD_COSTS[name])


@pytest.mark.parametrize("name", ["null", "all zero", "plain string", "verify zero", "rest nan", "not json"])
def test_a_bad_cache_entry_is_ignored_with_a_warning_and_calibrate_replaces_it(cache_root, name):
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model)
    head.acceptance = AcceptanceCurve(tau={1: 1.5, 4: 1.9}, steps=5, new_tokens=9, prompts=1)
    path = calibrate_module.cost_path(calibrate_module.identity(model, head))
    path.parent.mkdir(parents=True)
    raw = dict(BAD_COSTS.get(name, {}), identity=calibrate_module.identity(model, head)) \
        if isinstance(BAD_COSTS.get(name), dict) else BAD_COSTS.get(name)
    path.write_text("{not json" if name == "not json" else json.dumps(raw))
    with pytest.warns(DartCacheWarning, match=f"ignoring the machine-cost cache {path}"):
        assert cached_machine_cost(model, head) is None
    attached = dart_hf.enable(tiny_target(), head)
    plain = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    with pytest.warns(DartCacheWarning, match="ignoring the machine-cost cache"):
        assert torch.equal(attached.generate(PROMPT, max_new_tokens=6, do_sample=False), plain)
    with pytest.warns(DartCacheWarning, match="ignoring the machine-cost cache"):
        machine_cost(model, head, **SMALL_COST)
    assert cached_machine_cost(model, head) is not None  # measuring again replaced the entry


def _unwritable(kind: str, root):
    """A DART_SPEC_CACHE under which nothing can be written, of the kind a read-only home or a mistake gives."""
    if kind == "under a file":
        (root / "file").write_text("x")
        return root / "file" / "cache"
    if kind == "proc":
        return "/proc/dart-spec-cache"
    if kind == "directory where the file belongs":  # every cost file name is a directory already
        return root / "dirs"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["under a file", "proc", "directory where the file belongs"])
def test_a_cache_that_cannot_be_written_never_fails_generate(tmp_path, monkeypatch, kind):
    """One DartCacheWarning, a measurement kept in memory for the process (a new controller takes it from there),
    output exactly plain's, for attached heads and dart_head= alike."""
    root = _unwritable(kind, tmp_path)
    monkeypatch.setenv("DART_SPEC_CACHE", str(root))
    model = dart_hf.enable(tiny_target(), False)
    head = random_head(model, seed=7)
    head.acceptance = AcceptanceCurve(tau={1: 1.5, 4: 1.9}, steps=5, new_tokens=9, prompts=1)
    if kind == "directory where the file belongs":
        path = calibrate_module.cost_path(calibrate_module.identity(model, head))
        path.mkdir(parents=True)
        path.with_suffix(".learned.json").mkdir()
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    attached = dart_hf.enable(tiny_target(), head)
    measured = []
    real = calibrate_module.measure_machine_cost
    monkeypatch.setattr(calibrate_module, "measure_machine_cost",
                        lambda *a, **k: measured.append(1) or real(*a, **{**k, **SMALL_COST}))
    # the few-row kernels' choices, decided over several calls, have a cache of their own (tests/hf/test_kernel_cache.py)
    monkeypatch.setattr(calibrate_module, "kernel_choices_path", lambda: tmp_path / "kernels" / "choices.json")
    calibrate_module._WARNED_PATHS.clear()
    with pytest.warns(DartCacheWarning, match="cannot (write|read) its cache"):
        machine_cost(model, head, **SMALL_COST)
        assert torch.equal(attached.generate(PROMPT, max_new_tokens=8, do_sample=False), plain)
    sys.modules["dart_hf.controller"]._CONTROLLERS.clear()  # a new controller reads the cost from memory
    with warnings_as_errors(DartCacheWarning):
        for _ in range(3):
            assert torch.equal(attached.generate(PROMPT, max_new_tokens=8, do_sample=False), plain)
            assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False, dart_head=head), plain)
        sys.modules["dart_hf.controller"]._save_all()  # what exit does: no error, no second warning
    assert measured == [1] and controller_for(attached, head).cost is not None


def warnings_as_errors(category):
    import warnings

    class _Errors(warnings.catch_warnings):
        def __enter__(self):
            out = super().__enter__()
            warnings.simplefilter("error", category)
            return out

    return _Errors()


# ---- load_default and the head's dtype ---------------------------------------------------------------------------

def test_load_default_names_the_missing_head_directory(tmp_path):
    assert DEFAULT_HEAD_DIR.parts[-3:] == ("dart_hf", "assets", "smollm2-135m-dart")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_default(tmp_path / "missing")


def test_load_default_loads_the_head_beside_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr("dart_hf.smollm2.load_smollm2", lambda attn_implementation="sdpa": (tiny_target(), None))
    saved = random_head(tiny_target(), seed=3)
    saved.tree_config = TreeConfig(remain_total=33, beam_width=9)
    saved.save_pretrained(tmp_path / "head", dtype=torch.float16)
    model, tokenizer, head = load_default(tmp_path / "head")
    assert head.tree_config == saved.tree_config and head.get_input_embeddings() is model.get_input_embeddings()
    assert head.fc.weight.dtype == default_head_dtype(head, torch.float32, torch.device("cpu"))
    _, _, fp32 = load_default(tmp_path / "head", head_dtype=torch.float32)
    assert fp32.fc.weight.dtype == torch.float32
    bf16_model, _, bf16 = load_default(tmp_path / "head", target_dtype=torch.bfloat16)
    assert next(bf16_model.parameters()).dtype == torch.bfloat16 and bf16.fc.weight.dtype == torch.bfloat16


def test_the_head_dtype_is_the_measured_faster_one(monkeypatch):
    """Beside a float32 target on the CPU the head takes whichever dtype its products run faster in here (a
    measurement, whatever the CPU's capability string says); bfloat16 only when clearly faster."""
    from dart_runtime import matmul

    head = random_head(tiny_target())
    cpu = torch.device("cpu")
    for capability in ("AVX2", "AVX512", "DEFAULT"):  # no capability list decides
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        for bf16_share, want in ((0.5, torch.bfloat16), (0.95, torch.float32), (2.0, torch.float32)):
            matmul._DTYPES.clear()
            fake = {torch.float32: 1.0, torch.bfloat16: bf16_share}

            def interleaved(runs, rounds, fake=fake):
                return {key: [fake[key[0]]] * rounds for key in runs}

            monkeypatch.setattr(matmul, "interleaved_seconds", interleaved)
            assert default_head_dtype(head, torch.float32, cpu) == want, (capability, bf16_share)
    assert default_head_dtype(head, torch.float16, cpu) == torch.float16  # only beside a float32 target
    assert default_head_dtype(head, torch.float32, torch.device("cuda")) == torch.float32  # the CPU only


def test_fastest_dtype_measures_real_products():
    from dart_runtime.matmul import fastest_dtype

    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    assert fastest_dtype(weights, 4, (torch.float32, torch.bfloat16)) in (torch.float32, torch.bfloat16)
    assert fastest_dtype(weights, 4, (torch.float32,)) == torch.float32


def test_a_heads_identity_follows_its_weights_dtype_and_shape_from_a_sample_of_each_tensor(monkeypatch):
    from dart_hf.calibration import _tensor_digest

    monkeypatch.setattr(calibrate_module, "DIGEST_ELEMENTS", 16)
    gen = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(40, 8, generator=gen), "b": torch.randn(5, generator=gen)}
    digest = _tensor_digest(weights)
    assert _tensor_digest({k: v.clone() for k, v in weights.items()}) == digest
    changed = [{**weights, "a": weights["a"] * 1.01}, {**weights, "b": weights["b"] + 1},
               {**weights, "a": weights["a"].to(torch.float64)}, {**weights, "a": weights["a"].reshape(8, 40)},
               {"c": weights["a"], "b": weights["b"]}]
    assert len({_tensor_digest(w) for w in changed} | {digest}) == len(changed) + 1
    sampled = weights["a"].clone().reshape(-1)
    sampled[0] += 1  # a sampled element (the first): seen
    assert _tensor_digest({**weights, "a": sampled.reshape(40, 8)}) != digest
