"""Tree budget calibration: the acceptance profile rule (exact per step), the latency model, the choice, the cache,
and `load_default`."""

import json
import sys

import pytest
import torch

import dart_hf
from dart_core import NGramModel, TreeConfig, build_draft_tree, topk_draft_tokens
from dart_core.tree import score_ranks
from dart_hf.calibration import (Calibration, cached_calibration, calibration_dir, choose_tree_size, interpolate,
                               monotone, run_calibration, tuned_tree_config)
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


# ---- calibration end to end (tiny target), cache ---------------------------------------------------------------

SMALL = dict(max_new_tokens=20, context_length=32, repeats=1, candidates=(1, 2, 4, 8, 16), progress=False)


def test_calibrate_caches_and_tuned_tree_config_reuses(cache_root, monkeypatch):
    model = dart_hf.enable(tiny_target())
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=3)
    head.tree_config = TreeConfig(beam_width=12, ngram_weight=0.3, remain_total=40)
    tree = dart_hf.calibrate(model, None, head, [PROMPT], **SMALL)
    assert isinstance(tree, TreeConfig) and tree.remain_total in (1, 2, 4, 8, 16, 60)
    assert (tree.beam_width, tree.ngram_weight) == (12, 0.3)  # the other settings are the head's
    files = list(calibration_dir().glob("*.json"))
    assert len(files) == 1 and files[0].parent == cache_root / "calibration"
    saved = json.loads(files[0].read_text())
    assert saved["identity"]["threads"] == 1 and saved["identity"]["device"].startswith("cpu:")
    assert saved["remain_total"] == tree.remain_total and len(saved["rows"]) == 6
    result = cached_calibration(model, head)
    assert result.to_tree_config() == tree and "<- chosen" in result.format_table()
    assert Calibration.from_dict(json.loads(json.dumps(result.to_dict()))) == result

    def no_run(*args, **kwargs):
        raise AssertionError("calibrated again")

    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "run_calibration", no_run)
        assert tuned_tree_config(model, None, head, [PROMPT]) == tree  # from the cache
    # the cached choice is the same whatever remain_total the head carries now
    head.tree_config = tree
    assert cached_calibration(model, head) == result
    torch.set_num_threads(2)  # another thread count is another machine setting
    assert cached_calibration(model, head) is None
    torch.set_num_threads(1)
    other = random_head(model, seed=5)
    other.tree_config = head.tree_config
    assert cached_calibration(model, other) is None  # another head
    assert tuned_tree_config(model, None, head, [PROMPT], refresh=True, **SMALL).beam_width == 12


def test_calibration_rows_follow_the_rule():
    model = dart_hf.enable(tiny_target())
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False)
    head = oracle_head(model, plain[0], wrong_every=4)
    result = run_calibration(model, None, head, [PROMPT], **SMALL)
    assert sorted(result.verify_ms) == [1, 2, 4, 8, 16, 32, 61]
    fixed = (result.head_ms + result.tree_ms + result.rest_ms) / 1e3
    best, rows = choose_tree_size({row["remain_total"]: row["tau"] for row in result.rows},
                                  {k: v / 1e3 for k, v in result.verify_ms.items()}, fixed, result.plain_ms / 1e3)
    assert best == result.remain_total
    for mine, theirs in zip(rows, result.rows):
        assert mine == pytest.approx(theirs)
    assert result.rows[-1]["remain_total"] == 60 and result.rows[0]["tau"] >= 1.0
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        run_calibration(model, None, head, ["hello"], **SMALL)


# ---- load_default -----------------------------------------------------------------------------------------------

def test_load_default_names_the_missing_head_directory(tmp_path):
    assert DEFAULT_HEAD_DIR.parts[-3:] == ("dart_hf", "assets", "smollm2-135m-dart")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_default(tmp_path / "missing")


def test_load_default_uses_a_cached_calibration(tmp_path, cache_root, monkeypatch):
    monkeypatch.setattr("dart_hf.smollm2.load_smollm2", lambda attn_implementation="sdpa": (tiny_target(), None))
    saved = random_head(tiny_target(), seed=3)
    saved.tree_config = TreeConfig(remain_total=33, beam_width=9)
    saved.save_pretrained(tmp_path / "head", dtype=torch.float16)
    model, tokenizer, head = load_default(tmp_path / "head")
    assert head.tree_config == saved.tree_config and head.get_input_embeddings() is model.get_input_embeddings()
    assert head.fc.weight.dtype == default_head_dtype(torch.float32, torch.device("cpu"))
    tree = dart_hf.calibrate(model, tokenizer, head, [PROMPT], **SMALL)
    assert tree.beam_width == 9
    _, _, again = load_default(tmp_path / "head")
    assert again.tree_config == tree
    _, _, plain = load_default(tmp_path / "head", use_calibration=False)
    assert plain.tree_config == saved.tree_config
    _, _, fp32 = load_default(tmp_path / "head", head_dtype=torch.float32)
    assert fp32.fc.weight.dtype == torch.float32


def test_default_head_dtype(monkeypatch):
    cpu = torch.device("cpu")
    for capability, want in (("AVX2", torch.bfloat16), ("AVX512", torch.bfloat16), ("DEFAULT", torch.float32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert default_head_dtype(torch.float32, cpu) == want
        assert default_head_dtype(torch.float16, cpu) == torch.float16  # only beside a float32 target
        assert default_head_dtype(torch.float32, torch.device("cuda")) == torch.float32  # the CPU only


@pytest.mark.parametrize("content", ["null", "[]", "17", '{"version": 3}', "{not json",
                                     "verify_ms", "tree_config", "remain_total"])
def test_a_bad_cache_entry_is_ignored_with_a_warning_naming_the_file_and_recalibration_replaces_it(
        cache_root, content):
    model = dart_hf.enable(tiny_target())
    head = random_head(model)
    dart_hf.calibrate(model, None, head, [PROMPT], **SMALL)
    path = calibrate_module.calibration_path(model, head)
    if content in ("verify_ms", "tree_config", "remain_total"):  # a valid entry with one field broken
        raw = json.loads(path.read_text())
        raw[content] = {"verify_ms": [1, 2], "tree_config": "big", "remain_total": 10 ** 9}[content]
        content = json.dumps(raw)
    path.write_text(content)
    with pytest.warns(UserWarning, match=f"ignoring the calibration cache {path}"):
        assert cached_calibration(model, head) is None
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        assert isinstance(tuned_tree_config(model, None, head, [PROMPT], **SMALL), TreeConfig)
    assert cached_calibration(model, head) is not None  # calibrating again replaced the entry
