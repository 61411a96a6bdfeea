"""dart_sglang without a server: settings, the EAGLE tree encoding through SGLang's own Triton kernels (run by
TRITON_INTERPRET=1 on CPU), the algorithm registry and server-argument resolution."""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers.sglang_env import EOS, import_sglang, set_tree, write_models

import_sglang()

from dart_core import NGramModel, TreeConfig, build_draft_trees  # noqa: E402
from dart_core.context import ContextDrafter  # noqa: E402
from dart_core.verify import verify_greedy  # noqa: E402
from dart_core.tree import tree_node_count  # noqa: E402
from dart_sglang.settings import DartServeSettings, eagle_topk  # noqa: E402
from dart_sglang.tree_abi import encode_eagle_trees  # noqa: E402
from dart_sglang.worker import draft_contexts, recent_tokens  # noqa: E402

TREES = [  # (TreeConfig kwargs, draft_length)
    (dict(topk=4, beam_width=3, remain_total=12), 3),
    (dict(topk=2, beam_width=8, remain_total=30), 5),  # more internal nodes than topk * (levels - 1) would allow
    (dict(topk=6, beam_width=6, remain_total=60), 6),
    (dict(topk=1, beam_width=1, remain_total=8), 4),  # a chain
    (dict(topk=5, beam_width=4, remain_total=9, max_depth=2), 6),
    (dict(topk=3, beam_width=2, remain_total=200), 2),  # pool smaller than remain_total
    # context paths (docs/DESIGN.md §2.6): deeper than the head's levels, more children than topk
    (dict(topk=3, beam_width=3, remain_total=16, context_draft=True, context_depth=8, context_min_match=1), 3),
]
KERNEL_TREES = TREES[:4] + TREES[-1:]


def random_trees(cfg: TreeConfig, draft_length: int, batch: int, seed: int, vocab: int = 50, ngram=None):
    g = torch.Generator().manual_seed(seed)
    levels = DartServeSettings.for_tree(cfg, draft_length).head_levels
    tokens = torch.randint(0, vocab, (batch, levels, cfg.topk), generator=g)
    probs = torch.softmax(torch.randn(batch, levels, cfg.topk, generator=g) * 2, dim=-1)
    rows = torch.randint(0, 4, (batch, 40), generator=g)  # few distinct tokens: context matches everywhere
    proposals = ContextDrafter(list(rows), cfg).propose() if cfg.context_draft else None
    return build_draft_trees(tokens, probs, rows[:, -2:], ngram, cfg, context=proposals)


# ---- settings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,draft_length", TREES)
def test_sizes_match_the_search(kwargs, draft_length):
    cfg = TreeConfig(**kwargs)
    s = DartServeSettings.for_tree(cfg, draft_length)
    trees = random_trees(cfg, draft_length, batch=2, seed=3)
    assert trees.num_nodes == s.num_draft_tokens == tree_node_count(cfg, s.head_levels, cfg.topk)
    assert int(trees.depths.max()) <= s.num_levels == cfg.tree_depth(draft_length + 1)
    assert s.head_levels == min(draft_length + 1, cfg.max_depth or 99, cfg.remain_total)
    assert s.server_args() == {"speculative_num_steps": s.num_levels, "speculative_eagle_topk": s.topk,
                               "speculative_num_draft_tokens": s.num_draft_tokens}


def test_eagle_topk_rule():
    cfg = TreeConfig(topk=2, beam_width=8, remain_total=30)
    # 31 nodes over 6 levels: up to 29 internal non-root nodes need ceil(29 / 5) = 6 rows per level
    assert eagle_topk(cfg, 6, 31) == 6
    assert eagle_topk(TreeConfig(topk=25, context_draft=False), 7, 61) == 25
    assert eagle_topk(TreeConfig(topk=25), 7, 61) == 29  # each followed context occurrence may add a child


def test_settings_from_a_converted_directory(tmp_path):
    _, head_dir = write_models(tmp_path, draft_length=3, tree={"topk": 4, "beam_width": 4, "remain_total": 8,
                                                               "context_draft": False})
    s = DartServeSettings.from_draft_dir(head_dir)
    assert (s.draft_length, s.num_levels, s.topk, s.num_draft_tokens) == (3, 4, 4, 9)
    assert s.tree.eos_token_id == EOS and s.ngram_path is None

    config = json.loads((tmp_path / "head-sglang" / "config.json").read_text())
    config["dart_config"]["ngram_file"] = "missing.safetensors"
    (tmp_path / "head-sglang" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        DartServeSettings.from_draft_dir(head_dir)
    with pytest.raises(ValueError, match="convert the head first"):
        DartServeSettings.from_draft_dir(tmp_path / "head")  # our own format, not converted
    set_tree(head_dir, beam_width=0)
    with pytest.raises(ValueError, match="beam_width"):
        DartServeSettings.from_draft_dir(head_dir)
    with pytest.raises(FileNotFoundError, match="config.json"):
        DartServeSettings.from_draft_dir(tmp_path)


def test_draft_contexts():
    from types import SimpleNamespace

    assert draft_contexts([[1, 2, 3, 4], [7]], [4, 7], 2).tolist() == [[3, 4], [-1, 7]]
    assert draft_contexts([[1, 2]], [3], 2).tolist() == [[-1, 3]]  # not ending with the root: the root alone
    req = SimpleNamespace(origin_input_ids=[1, 2, 3], output_ids=[4])
    assert recent_tokens(req, 3) == [2, 3, 4] and recent_tokens(req, 1) == [4]
    assert recent_tokens(SimpleNamespace(origin_input_ids=[1, 2], output_ids=[5, 6, 7]), 2) == [6, 7]


def test_chain_trees_are_no_deeper_than_their_nodes():
    s = DartServeSettings.for_tree(TreeConfig(topk=1, beam_width=1, remain_total=3), 6)
    assert (s.num_draft_tokens, s.num_levels) == (4, 3)


# ---- the EAGLE tree encoding, checked by SGLang's kernels --------------------------------------------------------


def decode_like_the_kernel(parent_list, selected, topk):
    """Independent reading of the ABI (one row): node i's parent from its selected index."""
    parents = [-1]
    for i, sel in enumerate(selected, start=1):
        row = sel // topk
        parents.append(0 if row == 0 else selected.index(parent_list[row]) + 1)
    return parents


@pytest.mark.parametrize("kwargs,draft_length", TREES)
def test_encoding_round_trips(kwargs, draft_length):
    cfg = TreeConfig(**kwargs)
    s = DartServeSettings.for_tree(cfg, draft_length)
    trees = random_trees(cfg, draft_length, batch=3, seed=5)
    parent_list, selected, tokens = encode_eagle_trees(trees, s.topk, s.num_levels)
    assert parent_list.shape == (3, s.topk * (s.num_levels - 1) + 1)
    assert torch.equal(tokens, trees.tokens[:, 1:])
    for b in range(3):
        sel = selected[b].tolist()
        assert len(set(sel)) == len(sel)
        assert decode_like_the_kernel(parent_list[b].tolist(), sel, s.topk) == trees.parents[b].tolist()


def test_encoding_rejects_trees_that_do_not_fit():
    cfg = TreeConfig(topk=4, beam_width=4, remain_total=12, context_draft=False)
    trees = random_trees(cfg, 3, batch=1, seed=0)
    with pytest.raises(ValueError, match="more than topk=2 children"):
        encode_eagle_trees(trees, 2, 4)
    with pytest.raises(ValueError, match="levels deep"):
        encode_eagle_trees(trees, 4, 1)


def sglang_tree(trees, s, seq_lens, mode):
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient

    parent_list, selected, tokens = encode_eagle_trees(trees, s.topk, s.num_levels)
    spec_tree._is_xpu = True  # the Triton kernels (as on XPU); test-only, this process only
    try:
        return build_tree_kernel_efficient(trees.tokens[:, 0], parent_list, selected, tokens, seq_lens,
                                           int(seq_lens.sum()), s.topk, s.num_levels, s.num_draft_tokens, mode)
    finally:
        spec_tree._is_xpu = False


@pytest.mark.parametrize("kwargs,draft_length", KERNEL_TREES)
def test_sglang_tree_build_reproduces_dart_trees(kwargs, draft_length):
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    cfg = TreeConfig(**kwargs)
    s = DartServeSettings.for_tree(cfg, draft_length)
    trees = random_trees(cfg, draft_length, batch=3, seed=11)
    b, n = 3, s.num_draft_tokens
    seq_lens = torch.tensor([5, 9, 17])
    mask, positions, _, next_token, next_sibling, tokens = sglang_tree(trees, s, seq_lens, TreeMaskMode.QLEN_ONLY)
    assert torch.equal(positions.view(b, n), seq_lens[:, None] + trees.depths)
    assert torch.equal(mask.view(b, n, n), trees.ancestor_mask())
    assert torch.equal(tokens.view(b, n), trees.tokens)
    for row in range(b):  # first child / next sibling links, in node order
        parents = trees.parents[row].tolist()
        kids = {p: [i for i in range(1, n) if parents[i] == p] for p in range(n)}
        assert next_token[row].tolist() == [kids[p][0] if kids[p] else -1 for p in range(n)]
        sib = [-1] * n
        for group in kids.values():
            for a, c in zip(group, group[1:]):
                sib[a] = c
        assert next_sibling[row].tolist() == sib
    full, *_ = sglang_tree(trees, s, seq_lens, TreeMaskMode.FULL_MASK)
    start = 0
    for row in range(b):  # FULL_MASK: each tree row sees the whole prefix, then its ancestors
        length = int(seq_lens[row])
        block = full[start: start + n * (length + n)].view(n, length + n)
        assert bool(block[:, :length].all()) and torch.equal(block[:, length:], trees.ancestor_mask()[row])
        start += n * (length + n)


@pytest.mark.parametrize("kwargs,draft_length", KERNEL_TREES)
def test_sglang_greedy_verify_agrees_with_dart_core(kwargs, draft_length):
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, verify_tree_greedy_triton

    cfg = TreeConfig(**kwargs)
    s = DartServeSettings.for_tree(cfg, draft_length)
    vocab, b, n = 50, 4, s.num_draft_tokens
    trees = random_trees(cfg, draft_length, batch=b, seed=13, vocab=vocab)
    rng = random.Random(7)
    # the target's argmax at each node: often the token of one of its children, so paths get accepted
    predict = torch.randint(0, vocab, (b, n))
    for row in range(b):
        parents = trees.parents[row].tolist()
        for node in range(n):
            kids = [i for i in range(1, n) if parents[i] == node]
            if kids and rng.random() < 0.8:
                predict[row, node] = trees.tokens[row, rng.choice(kids)]
    logits = torch.nn.functional.one_hot(predict, vocab).float()
    expected = verify_greedy(trees, logits)

    _, _, retrieve_index, next_token, next_sibling, candidates = sglang_tree(trees, s, torch.tensor([4] * b),
                                                                             TreeMaskMode.QLEN_ONLY)
    accept_index = torch.full((b, s.num_levels + 1), -1, dtype=torch.long)
    accept_num = torch.zeros(b, dtype=torch.long)
    predicts = torch.zeros(b * n, dtype=torch.long)
    verify_tree_greedy_triton(predicts, accept_index, accept_num, candidates.view(b, n), retrieve_index,
                              next_token, next_sibling, predict)
    assert accept_num.tolist() == expected.accept_length.tolist()
    assert sum(expected.accept_length.tolist()) > 0  # the check saw accepted drafts
    for row in range(b):
        path = [i - row * n for i in accept_index[row].tolist() if i >= 0]
        assert path == [x for x in expected.accepted_nodes[row].tolist() if x >= 0]
        assert int(predicts[row * n + path[-1]]) == int(expected.bonus_token[row])


def test_trees_with_the_ngram_prior_encode(tmp_path):
    ngram = NGramModel.build([[random.Random(i).randrange(50) for _ in range(200)] for i in range(4)], order=3,
                             vocab_size=50)
    cfg = TreeConfig(topk=5, beam_width=5, remain_total=20)
    trees = random_trees(cfg, 4, batch=2, seed=2, ngram=ngram)
    s = DartServeSettings.for_tree(cfg, 4)
    parent_list, selected, _ = encode_eagle_trees(trees, s.topk, s.num_levels)
    for b in range(2):
        assert decode_like_the_kernel(parent_list[b].tolist(), selected[b].tolist(), s.topk) == \
            trees.parents[b].tolist()


# ---- registry and server arguments ------------------------------------------------------------------------------


def test_registry_and_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    import dart_sglang
    from dart_sglang.spec import DartSpecAlgo

    dart_sglang.register()
    dart_sglang.register()  # idempotent
    algo = SpeculativeAlgorithm.from_string("dart")
    assert isinstance(algo, DartSpecAlgo) and algo.is_eagle() and algo.is_eagle3() and algo.need_topk()
    _assert_custom_spec_algo_conforms(DartSpecAlgo)
    # every method the scheduler may call on a builtin algorithm exists on ours
    for name, value in vars(SpeculativeAlgorithm).items():
        if callable(value) and not name.startswith("_"):
            assert callable(getattr(algo, name)), name
    from sglang.srt.models.registry import ModelRegistry

    assert ModelRegistry.is_arch_supported("LlamaForCausalLMDart")


def _args(target, head, *extra):
    return ["--model-path", target, "--speculative-algorithm", "DART", "--speculative-draft-model-path", head,
            "--device", "cpu", "--disable-overlap-schedule", *extra]


def test_server_args_come_from_the_head(tmp_path):
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    import dart_sglang

    dart_sglang.register()
    target, head = write_models(tmp_path, draft_length=3, tree={"topk": 4, "beam_width": 4, "remain_total": 8,
                                                                "context_draft": False})
    def resolve(*args):
        server_args = prepare_server_args(list(args))
        server_args.resolve_once()
        return resolved_view(server_args)

    view = resolve(*_args(target, head))
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (4, 4, 9)
    with pytest.raises(ValueError, match="speculative-num-steps 3 but the head's trees need 4"):
        resolve(*_args(target, head, "--speculative-num-steps", "3"))
    with pytest.raises(ValueError, match="accept-threshold"):
        resolve(*_args(target, head, "--speculative-accept-threshold-single", "0.5"))
    assert resolve(*_args(target, head, "--tp-size", "2")).tp_size == 2  # served (tests/sglang/test_sglang_tp.py)
    with pytest.raises(ValueError, match="pp-size"):
        resolve(*_args(target, head, "--pp-size", "2"))
    with pytest.raises(ValueError, match="enable-custom-logit-processor"):
        resolve(*_args(target, head, "--enable-custom-logit-processor"))
    with pytest.raises(ValueError, match="page-size"):
        resolve(*_args(target, head, "--page-size", "4"))
    with pytest.raises(ValueError, match="rejection-sampling"):
        resolve(*_args(target, head, "--speculative-use-rejection-sampling"))
    from helpers.hf_models import tiny_target

    other = tmp_path / "other-target"  # hidden size 48 instead of 32
    tiny_target(layers=8, hidden=48).save_pretrained(other)
    with pytest.raises(ValueError, match="does not fit the target .*hidden_size 48"):
        resolve(*_args(str(other), head))
    set_tree(head, topk=200)
    with pytest.raises(ValueError, match="draft vocabulary has 96 tokens"):
        resolve(*_args(target, head))
    set_tree(head, topk=4)
    config = json.loads((tmp_path / "head-sglang" / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle3"]  # an EAGLE3 head
    (tmp_path / "head-sglang" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="convert the head first"):
        resolve(*_args(target, head))


def test_fits_target_accepts_a_head_that_carries_its_own_embedding(tmp_path):
    """A head narrower or wider than the target runs when its checkpoint has its own token embedding table."""
    from helpers.hf_models import tiny_target

    from dart_core import DartConfig, DartHead
    from dart_sglang.spec import check_fits_target

    target = tmp_path / "target"  # hidden size 32
    tiny_target(layers=8).save_pretrained(target)
    head = DartHead(DartConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=96, draft_vocab_size=96, draft_length=3, target_hidden_size=32,
                               num_target_layers=8))
    head.save_pretrained(tmp_path / "no-embedding")
    with pytest.raises(ValueError, match="no embed_tokens.weight"):
        check_fits_target(str(tmp_path / "no-embedding"), str(target))
    head.set_input_embeddings(torch.nn.Embedding(96, 48), save_with_head=True)
    head.save_pretrained(tmp_path / "own-embedding")
    check_fits_target(str(tmp_path / "own-embedding"), str(target))


def test_serve_launcher(tmp_path, capsys):
    from dart_cli.main import main

    target, head = write_models(tmp_path, draft_length=3)
    assert main(["serve", "--model-path", target, "--head", head, "--port", "30001", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DART"
    assert cmd[cmd.index("--speculative-draft-model-path") + 1] == head
    assert "--disable-overlap-schedule" in cmd and cmd[-2:] == ["--port", "30001"]
    assert main(["serve", "--model-path", target, "--head", str(tmp_path / "head"), "--dry-run"]) == 2
    assert "convert the head first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--no-such-flag"])


def test_kv_sizing_hooks(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.mem_cache.allocation_sizing as sizing
    import sglang.srt.runtime_context as rc

    from dart_sglang.spec import decode_alloc_len, req_to_token_headroom, reserved_tokens

    monkeypatch.setattr(rc, "max_speculative_num_draft_tokens", lambda: 61)
    monkeypatch.setattr(sizing, "get_alloc_reserve_per_decode", lambda: 122)
    eagle = lambda: 175  # noqa: E731  max(steps * topk, tokens) with topk 25, 7 steps
    monkeypatch.setattr(rc, "get_spec", lambda: SimpleNamespace(speculative_algorithm="DART",
                                                                 speculative_num_steps=7))
    assert decode_alloc_len(eagle) == 61
    assert req_to_token_headroom(lambda: 65) == 126
    assert reserved_tokens(eagle) == 7  # the tree's depth, not EAGLE's 175
    monkeypatch.setattr(rc, "get_spec", lambda: SimpleNamespace(speculative_algorithm="EAGLE3"))
    assert decode_alloc_len(eagle) == 175 and req_to_token_headroom(lambda: 65) == 65
    assert reserved_tokens(eagle) == 175


def test_the_dart_worker_sets_every_attribute_eagles_constructor_sets():
    import ast
    import inspect
    import textwrap

    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from dart_sglang.worker import DartWorker

    def assigned(init) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        out = set()
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.add(t.attr)
        return out

    eagle, dart = assigned(EAGLEWorkerV2.__init__), assigned(DartWorker.__init__)
    assert eagle and not eagle - dart, f"SGLang's EAGLEWorkerV2.__init__ sets {sorted(eagle - dart)}, DartWorker not"
