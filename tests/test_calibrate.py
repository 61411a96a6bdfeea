"""The tree size chosen for this machine: the acceptance rule (exact per step), the shipped acceptance curve, the
latency model, the choice, the first-call measurement and its cache, the fallback to plain, and `load_default`."""

import json
import sys

import pytest
import torch

import dart_hf
from dart_core import (AcceptanceCurve, DartHead, DartInputError, NGramModel, TreeConfig, build_draft_tree,
                       topk_draft_tokens)
from dart_core.tree import score_ranks
from dart_hf import DartFallbackWarning
from dart_hf.calibration import (MachineCost, TreeChoice, cached_machine_cost, choose, choose_tree_size, interpolate,
                                 machine_cost, measure_acceptance, monotone, tree_choice)
from dart_hf.default import DEFAULT_HEAD_DIR, default_head_dtype, load_default
from hf_models import oracle_head, random_head, tiny_target

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
    model = dart_hf.enable(tiny_target())
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


@pytest.mark.parametrize("kind", ["random", "replay3", "replay5"])
def test_tau_of_smaller_trees_is_exact_per_step(kind):
    """The claim: from every state of a greedy R_max=60 run, a real run with remain_total=R accepts exactly the
    leading accepted nodes of rank < R. Each state is rebuilt by decoding from the prefix before its root."""
    model = dart_hf.enable(tiny_target())
    new_tokens = 24
    plain = model.generate(PROMPT, max_new_tokens=new_tokens + 12, do_sample=False)
    head = random_head(model) if kind == "random" else oracle_head(model, plain[0], wrong_every=int(kind[-1]))
    config = TreeConfig(remain_total=60)
    out = model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, dart_head=head, dart_tree_config=config)
    assert torch.equal(out, plain[:, : out.shape[1]])
    stats = model.dart_stats
    sizes = (1, 2, 4, 8, 16, 30)
    if kind == "replay5":
        assert any(r and r[-1] >= 16 for r in stats.accepted_ranks)  # some accepted nodes rank deep in the tree
    length = PROMPT.shape[1] + 1  # the prefill emits the first root
    for step, ranks in enumerate(stats.accepted_ranks):
        prefix = out[:, : length - 1]  # decoding from here re-emits the root, then verifies step `step`'s tree
        for r in sizes + (60,):  # (3 new tokens: a call's last token is decided by the root alone)
            model.generate(prefix, max_new_tokens=3, do_sample=False, dart_head=head,
                           dart_tree_config=TreeConfig(remain_total=r))
            assert model.dart_stats.accepted_lengths[0] == stats.accepted_within(r)[step], (step, r)
            if r == 60:
                assert model.dart_stats.accepted_ranks[0] == ranks  # the state was rebuilt faithfully
        length += stats.accepted_lengths[step] + 1
    # over a whole run tau_at(R) is exact when a tree of R nodes keeps every step's acceptance (same trajectory)
    same = [r for r in sizes if stats.accepted_within(r) == stats.accepted_lengths]
    assert same
    for r in same:
        again = model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, dart_head=head,
                               dart_tree_config=TreeConfig(remain_total=r))
        assert torch.equal(again, out) and model.dart_stats.tau == stats.tau_at(r)


# ---- latency model and choice ----------------------------------------------------------------------------------

def test_interpolation_and_monotone_latency():
    points = {1: 1.0, 4: 4.0, 8: 6.0}
    assert interpolate(points, 1) == 1.0 and interpolate(points, 2) == 2.0 and interpolate(points, 6) == 5.0
    assert interpolate(points, 12) == 8.0  # extrapolated from the last two points
    assert monotone({1: 1.0, 2: 3.0, 4: 2.0, 8: 5.0}) == {1: 1.0, 2: 2.5, 4: 2.5, 8: 5.0}
    assert monotone(points) == points


def test_choice_is_argmax_of_tokens_per_second():
    tau = {1: 1.6, 4: 2.2, 16: 2.8, 60: 3.0}
    cpu = {1: 0.080, 2: 0.130, 8: 0.150, 16: 0.160, 32: 0.200, 64: 0.300}  # seconds per verify forward
    best, rows = choose_tree_size(tau, cpu, fixed_s=0.02, plain_s=0.080)
    rate = {row["remain_total"]: row["tokens_per_s"] for row in rows}
    assert rate[4] == pytest.approx(2.2 / (0.02 + interpolate(cpu, 5)))
    assert best == max(rate, key=rate.get) == 16
    assert rows[2]["speedup"] == pytest.approx(rate[16] * 0.080)
    gpu = {k: 0.010 for k in (1, 2, 4, 8, 16, 32, 64)}  # flat: the biggest tree wins
    assert choose_tree_size(tau, gpu, fixed_s=0.002, plain_s=0.010)[0] == 60
    assert choose_tree_size({1: 2.0, 4: 2.0}, gpu, 0.0, 0.01)[0] == 1  # ties: the smaller tree


# ---- the first-call choice: shipped acceptance, measured machine cost, cache ----------------------------------------

SMALL_CURVE = dict(max_new_tokens=20, candidates=(1, 2, 4, 8, 16), progress=False)
SMALL_COST = dict(context_length=32, repeats=1, progress=False)


def _cost(verify_ms: dict, plain_ms: float, fixed_ms: float = 3.0) -> MachineCost:
    return MachineCost(verify_ms=verify_ms, plain_ms=plain_ms, head_ms=fixed_ms, tree_ms=0.0, rest_ms=0.0,
                       context_length=256, seconds=1.0)


def test_a_given_latency_curve_picks_the_expected_tree_size():
    curve = AcceptanceCurve(tau={1: 1.4, 3: 1.7, 8: 2.0, 16: 2.2, 60: 2.4}, steps=10, new_tokens=20, prompts=1)
    base = TreeConfig(beam_width=9)
    # a CPU where a 4-token forward costs about one token's: a few nodes win
    cpu = choose(curve, _cost({1: 70, 2: 55, 4: 70, 8: 100, 16: 110, 32: 170, 61: 230}, plain_ms=77), base)
    assert cpu.remain_total == 3 and cpu.pays and cpu.tree_config == TreeConfig(beam_width=9, remain_total=3)
    assert cpu.expected_speedup == pytest.approx(1.7 / (3 + 70) * 77)
    # a GPU-like flat curve: the biggest tree
    assert choose(curve, _cost({k: 10.0 for k in (1, 2, 4, 8, 16, 32, 64)}, plain_ms=10, fixed_ms=1), base
                  ).remain_total == 60
    # a machine where every tree forward costs twice a plain step: nothing pays
    slow = choose(curve, _cost({1: 150, 2: 160, 4: 170, 8: 200, 16: 240, 32: 300, 61: 400}, plain_ms=77), base)
    assert not slow.pays and slow.expected_speedup < 1 and "expected 0." in slow.summary()
    assert "<- chosen" in slow.format_table()


def test_acceptance_curve_ships_in_the_head_directory(tmp_path):
    model = dart_hf.enable(tiny_target())
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


def test_first_call_measures_the_machine_once_and_caches_it_by_dtype_and_threads(cache_root, monkeypatch, capsys):
    model = dart_hf.enable(tiny_target())
    head = random_head(model)
    head.acceptance = AcceptanceCurve(tau={1: 1.5, 4: 1.9, 16: 2.2}, steps=5, new_tokens=9, prompts=1)
    measured = []
    real = calibrate_module.measure_machine_cost

    def counted(*args, **kwargs):
        measured.append(torch.get_num_threads())
        return real(*args, **{**kwargs, **SMALL_COST})

    monkeypatch.setattr(calibrate_module, "measure_machine_cost", counted)
    choice = tree_choice(model, head)
    assert measured == [1] and "measuring what a verify step costs" in capsys.readouterr().err
    assert choice.remain_total in (1, 4, 16) and tree_choice(model, head) is choice  # memo
    files = list((cache_root / "machine").glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["identity"]["threads"] == 1 and saved["identity"]["device"].startswith("cpu:")
    assert MachineCost.from_dict(saved) == cached_machine_cost(model, head)
    calibrate_module._CHOICES.clear()
    assert tree_choice(model, head).remain_total == choice.remain_total and measured == [1]  # from the disk cache
    torch.set_num_threads(2)  # another thread count is another machine setting
    try:
        tree_choice(model, head)
    finally:
        torch.set_num_threads(1)
    assert measured == [1, 2]
    model.to(torch.bfloat16)  # and so is another dtype
    try:
        assert cached_machine_cost(model, head) is None
    finally:
        model.to(torch.float32)
    assert random_head(model, seed=5).acceptance is None and tree_choice(model, random_head(model, seed=5)) is None


def test_a_machine_where_no_tree_pays_decodes_plain_with_one_warning(cache_root, monkeypatch):
    model = dart_hf.enable(tiny_target())
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=3)
    head.acceptance = AcceptanceCurve(tau={1: 1.5, 4: 1.9}, steps=5, new_tokens=9, prompts=1)
    slow = _cost({1: 150.0, 2: 160.0, 4: 170.0, 8: 400.0}, plain_ms=77.0)
    monkeypatch.setattr(calibrate_module, "machine_cost", lambda model, head: slow)
    attached = dart_hf.enable(tiny_target(), head)
    with pytest.warns(DartFallbackWarning, match=r"no tree beats plain decoding on this machine: .*expected 0\.\d+x"):
        out = attached.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, plain) and attached.dart_stats is None
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, dart_head=head)  # asked for: DART, best tree
    assert torch.equal(out, plain) and model.dart_stats.tree_nodes - 1 == 1  # tau 1.9 at 4 nodes costs more


def test_calibrate_measures_both_parts_and_returns_the_choice(cache_root):
    model = dart_hf.enable(tiny_target())
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=3)
    head.tree_config = TreeConfig(beam_width=12, ngram_weight=0.3, remain_total=40)
    choice = dart_hf.calibrate(model, None, head, [PROMPT], max_new_tokens=20, candidates=(1, 2, 4, 8, 16),
                               context_length=32, repeats=1, progress=False)
    assert isinstance(choice, TreeChoice) and choice.remain_total in (1, 2, 4, 8, 16, 60)
    assert (choice.tree_config.beam_width, choice.tree_config.ngram_weight) == (12, 0.3)  # the head's settings
    assert head.acceptance is not None and sorted(choice.cost.verify_ms) == [1, 2, 4, 8, 16, 32, 61]
    best, rows = choose_tree_size(head.acceptance.tau, {k: v / 1e3 for k, v in choice.cost.verify_ms.items()},
                                  choice.cost.fixed_ms / 1e3, choice.cost.plain_ms / 1e3)
    assert best == choice.remain_total
    for mine, theirs in zip(rows, choice.rows, strict=True):
        assert mine == pytest.approx(theirs)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        measure_acceptance(model, None, head, ["hello"], **SMALL_CURVE)


# ---- load_default -----------------------------------------------------------------------------------------------

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
    assert head.fc.weight.dtype == default_head_dtype(torch.float32, torch.device("cpu"))
    _, _, fp32 = load_default(tmp_path / "head", head_dtype=torch.float32)
    assert fp32.fc.weight.dtype == torch.float32
    bf16_model, _, bf16 = load_default(tmp_path / "head", target_dtype=torch.bfloat16)
    assert next(bf16_model.parameters()).dtype == torch.bfloat16 and bf16.fc.weight.dtype == torch.bfloat16


def test_default_head_dtype(monkeypatch):
    cpu = torch.device("cpu")
    for capability, want in (("AVX2", torch.bfloat16), ("AVX512", torch.bfloat16), ("DEFAULT", torch.float32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert default_head_dtype(torch.float32, cpu) == want
        assert default_head_dtype(torch.float16, cpu) == torch.float16  # only beside a float32 target
        assert default_head_dtype(torch.float32, torch.device("cuda")) == torch.float32  # the CPU only


@pytest.mark.parametrize("content", ["null", "[]", "17", '{"version": 4}', "{not json", "verify_ms", "plain_ms"])
def test_a_bad_cache_entry_is_ignored_with_a_warning_naming_the_file_and_measuring_replaces_it(cache_root, content):
    model = dart_hf.enable(tiny_target())
    head = random_head(model)
    machine_cost(model, head, **SMALL_COST)
    path = calibrate_module.cost_path(calibrate_module.identity(model, head))
    if content in ("verify_ms", "plain_ms"):  # a valid entry with one field broken
        raw = json.loads(path.read_text())
        raw[content] = {"verify_ms": [1, 2], "plain_ms": -3.0}[content]
        content = json.dumps(raw)
    path.write_text(content)
    with pytest.warns(UserWarning, match=f"ignoring the machine-cost cache {path}"):
        assert cached_machine_cost(model, head) is None
    with pytest.warns(UserWarning, match="ignoring the machine-cost cache"):
        assert isinstance(machine_cost(model, head, **SMALL_COST), MachineCost)
    assert cached_machine_cost(model, head) is not None  # measuring again replaced the entry
