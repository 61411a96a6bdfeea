"""Converters: official DART dirs, the official .trie n-gram, SGLang dirs and EAGLE3 heads.

Fixtures are written in the official layouts (the .trie byte for byte by `write_official_trie`, pinned by a hand
check); converted outputs are compared with straight re-derivations (head logits, dict-based n-gram counts and
back-off probabilities, docs/DESIGN.md §2.4).
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dart_cli.main import main
from dart_converters import (
    TrieFormatError,
    convert_eagle3,
    convert_official,
    convert_trie,
    init_mask_rep,
    read_official_trie,
    write_official_trie,
)
from dart_core import DartConfig, DartHead, NGramModel, TreeConfig
from dart_sglang.head_format import convert_sglang, read_sglang_dir
from helpers.official_heads import TARGET_LAYERS, TINY, random_state, write_official_head, write_target


# =====================================================================================================================
# fixtures
# =====================================================================================================================


def random_corpus(seed: int, vocab: int, n_seqs: int = 12, max_len: int = 60) -> list[list[int]]:
    """Random sequences with repeated fragments (so longer n-grams recur and the back-off has work to do)."""
    rnd = random.Random(seed)
    motifs = [[rnd.randrange(vocab) for _ in range(rnd.randint(2, 6))] for _ in range(4)]
    seqs = []
    for _ in range(n_seqs):
        seq, length = [], rnd.randint(0, max_len)
        while len(seq) < length:
            seq += rnd.choice(motifs) if rnd.random() < 0.5 else [rnd.randrange(vocab)]
        seqs.append(seq)
    return seqs


def dict_counts(seqs, order) -> Counter:
    """count(w) = number of windows seq[i:i+order] that begin with w (root = ())."""
    counts = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            window = tuple(seq[i:i + order])
            for n in range(len(window) + 1):
                counts[window[:n]] += 1
    return counts


def dict_probability(counts, order, context, tokens) -> list[float]:
    """q(t | context) by the back-off rule of docs/DESIGN.md §2.4, straight from the dict."""
    out, matched = [0.0] * len(tokens), [False] * len(tokens)
    for n in range(min(order - 1, len(context)), 0, -1):
        node = tuple(context[-n:])
        if node not in counts:
            continue
        for j, t in enumerate(tokens):
            child = counts.get(node + (t,), 0)
            if not matched[j] and child:
                out[j] = float(np.float32(child) / np.float32(counts[node]))
                matched[j] = True
    return out


def head_logits(path, embedding, aux, ids):
    head = DartHead.from_pretrained(path)
    head.float()
    head.set_input_embeddings(embedding)
    with torch.no_grad():
        return head(aux, ids)


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(123)
    embedding = torch.nn.Embedding(TINY["vocab_size"], TINY["hidden_size"])
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=gen))
    aux = torch.randn(2, 5, 3 * TINY["target_hidden_size"], generator=gen)
    ids = torch.randint(0, TINY["vocab_size"], (2, 5), generator=gen)
    return embedding, aux, ids


# =====================================================================================================================
# the official .trie format
# =====================================================================================================================


def test_writer_bytes_by_hand(tmp_path):
    """Corpus [1, 2, 1], order 2: windows [1,2], [2,1], [1] -> root 3, (1) 2, (2) 1, (1,2) 1, (2,1) 1."""
    path = tmp_path / "hand.trie"
    info = write_official_trie(path, [[1, 2, 1]], order=2, node_order="bfs", shuffle_children=False)
    node, child = struct.Struct("<iQiQ").pack, struct.Struct("<iQ").pack
    expected = (struct.pack("<QQ", 2, 5)
                + node(0, 0, 3, 2) + child(1, 1) + child(2, 2)  # root: token 0, parent 0 (as the reference writes)
                + node(1, 0, 2, 1) + child(2, 3)  # node 1 = (1)
                + node(2, 0, 1, 1) + child(1, 4)  # node 2 = (2)
                + node(2, 1, 1, 0)  # node 3 = (1, 2)
                + node(1, 2, 1, 0))  # node 4 = (2, 1)
    assert path.read_bytes() == expected
    assert len(expected) == 16 + 5 * 24 + 4 * 12 == info["bytes"]
    model, stats = read_official_trie(path, progress=False)
    assert [model.count(g) for g in [(), (1,), (2,), (1, 2), (2, 1), (1, 1)]] == [3, 2, 1, 1, 1, 0]
    assert model.probability([1], [2, 1]) == [0.5, 0.0]
    assert stats["nodes"] == 5 and stats["passes"] == 1 and stats["vocab_bound"] == 3


def test_writer_layouts_are_nontrivial(tmp_path):
    """Shuffled child lists, non-BFS ids and children stored before their parents really occur in the fixtures."""
    seqs = random_corpus(0, 30)
    info = {}
    for layout in ("bfs", "dfs", "random", "children-first"):
        path = tmp_path / f"{layout}.trie"
        write_official_trie(path, seqs, order=3, node_order=layout, seed=1)
        raw = path.read_bytes()
        off, child_before_parent, unsorted_lists = 16, 0, 0
        for i in range(struct.unpack_from("<QQ", raw)[1]):
            tok, parent, freq, nch = struct.unpack_from("<iQiQ", raw, off)
            off += 24
            kids = [struct.unpack_from("<iQ", raw, off + 12 * j) for j in range(nch)]
            off += 12 * nch
            child_before_parent += i > 0 and parent > i
            unsorted_lists += [t for t, _ in kids] != sorted(t for t, _ in kids)
        assert off == len(raw)
        info[layout] = (child_before_parent, unsorted_lists)
    assert info["bfs"][0] == 0 and info["dfs"][0] == 0 and info["bfs"][1] > 0
    assert info["random"][0] > 0 and info["children-first"][0] > 0


@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("layout", ["bfs", "dfs", "random", "children-first"])
def test_trie_conversion_matches_dict_rederivation(tmp_path, order, layout):
    seed = order * 10 + ["bfs", "dfs", "random", "children-first"].index(layout)
    vocab = 25
    seqs = random_corpus(seed, vocab)
    src, dst = tmp_path / "in.trie", tmp_path / "out" / "ngram.safetensors"
    write_official_trie(src, seqs, order=order, node_order=layout, seed=seed)
    # small chunks: records straddle chunk boundaries and children-first layouts need several passes
    stats = convert_trie(src, dst, progress=False, chunk_bytes=4096)
    model = NGramModel.load(dst)
    counts = dict_counts(seqs, order)
    assert model.num_nodes == len(counts) == stats["nodes"]
    assert all(model.count(g) == c for g, c in counts.items())
    rnd = random.Random(seed)
    grams = [g for g in counts if g]
    for _ in range(150):
        if rnd.random() < 0.7:  # a context that occurs, possibly followed by random junk
            context = list(rnd.choice(grams)) + [rnd.randrange(vocab + 3) for _ in range(rnd.randint(0, 1))]
        else:
            context = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 4))]
        tokens = [rnd.randrange(vocab + 2) for _ in range(6)]
        assert model.probability(context, tokens) == dict_probability(counts, order, context, tokens)
    if layout == "children-first" and order == 3:  # depth-3 records come before their parents' keys are known
        assert stats["passes"] >= 2
    assert stats["output_bytes"] <= 12 * stats["nodes"] + 512 and stats["input_bytes"] == os.path.getsize(src)


def test_trie_vocab_size_and_root_handling(tmp_path):
    seqs = random_corpus(5, 12)
    src = tmp_path / "in.trie"
    write_official_trie(src, seqs, order=3, seed=2, root_token=77, root_parent=123)  # any root token/parent accepted
    model, _ = read_official_trie(src, vocab_size=50, progress=False)
    ref = NGramModel.build(seqs, order=3, vocab_size=50)
    assert model.vocab_bound == 50 and torch.equal(model.keys, ref.keys) and torch.equal(model.counts, ref.counts)
    with pytest.raises(TrieFormatError, match=r"byte offset \d+ has token id 11 outside 0\.\.9 \(vocab size\)"):
        read_official_trie(src, vocab_size=10, progress=False)
    # a negative root freq (the reference's `reduce` leaves one) is replaced by the sum of the unigram counts
    raw = bytearray(src.read_bytes())
    struct.pack_into("<i", raw, 16 + 12, -5)
    src.write_bytes(bytes(raw))
    model, stats = read_official_trie(src, progress=False)
    assert stats["root_count_replaced"] and stats["root_freq_in_file"] == -5
    assert model.num_tokens == sum(len(s) for s in seqs) == stats["root_count"]


def test_records_larger_than_a_chunk_and_count_checks_across_chunks(tmp_path):
    """A root record bigger than the read buffer grows it; count runs split across check chunks still add up."""
    from dart_converters.trie import _check_counts

    seqs = [list(range(600)) * 2]  # the root has 600 children: a 7 KB record, read with 4 KB chunks
    src = tmp_path / "wide.trie"
    write_official_trie(src, seqs, order=2, node_order="random", seed=3)
    model, _ = read_official_trie(src, progress=False, chunk_bytes=4096)
    ref = NGramModel.build(seqs, order=2)
    assert torch.equal(model.keys, ref.keys) and torch.equal(model.counts, ref.counts)
    keys, counts = ref.keys.numpy().copy(), ref.counts.numpy().copy()
    base = ref.vocab_bound + 1
    assert _check_counts(keys, counts, base, 2, "x", chunk=7) == 1200
    counts[-1] = 5  # (599, 0) now exceeds its parent (599) with count 2
    with pytest.raises(TrieFormatError, match=r"n-gram \(599,\) has count 2 but its continuations' counts sum to 5"):
        _check_counts(keys, counts, base, 2, "x", chunk=7)


def _canonical(tmp_path, seqs=([1, 2, 1, 3, 2, 1],), order=3):
    """A small canonical trie and its node offsets (node i -> byte offset of its record)."""
    path = tmp_path / "c.trie"
    write_official_trie(path, list(seqs), order=order, node_order="bfs", shuffle_children=False)
    raw = bytearray(path.read_bytes())
    offsets, off = [], 16
    for _ in range(struct.unpack_from("<QQ", raw)[1]):
        offsets.append(off)
        off += 24 + 12 * struct.unpack_from("<Q", raw, off + 16)[0]
    return path, raw, offsets


@pytest.mark.parametrize("cut", ["mid-header", "mid-node", "mid-child-list", "last-byte"])
def test_truncated_trie_names_offset_and_leaves_no_output(tmp_path, cut):
    path, raw, offsets = _canonical(tmp_path)
    at = {"mid-header": 10, "mid-node": offsets[2] + 9, "mid-child-list": offsets[1] + 24 + 5,
          "last-byte": len(raw) - 1}[cut]
    path.write_bytes(bytes(raw[:at]))
    dst = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="truncated") as err:
        convert_trie(path, dst, progress=False)
    assert f"byte offset {at}" in str(err.value) or (cut == "mid-header" and "byte offset 0" in str(err.value))
    assert not dst.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


@pytest.mark.parametrize("cut", ["mid-node", "mid-child-list"])
def test_truncation_found_while_streaming(tmp_path, cut):
    """Without the upfront size check the streaming reader names the record it could not finish."""
    path, raw, offsets = _canonical(tmp_path)
    node = 2 if cut == "mid-node" else 1
    at = offsets[node] + (9 if cut == "mid-node" else 24 + 5)
    path.write_bytes(bytes(raw[:at]))
    part = "header" if cut == "mid-node" else "child list"
    with pytest.raises(TrieFormatError, match=rf"node {node} starts at byte offset {offsets[node]} .* ends at byte "
                                              rf"offset {at} \(inside its {part}"):
        read_official_trie(path, progress=False, strict_size=False)


def _patched(tmp_path, patch):
    path, raw, offsets = _canonical(tmp_path)
    patch(raw, offsets)
    path.write_bytes(bytes(raw))
    return path, offsets


def test_corrupt_tries_fail_naming_offsets(tmp_path):
    cases = []
    # header order 2 for an order-3 trie: depth-3 nodes exceed it
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, 0, 2), r"depth > order 2 .*wrong order"))
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, 0, 0), r"byte offset 0 gives n-gram order 0"))
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, 0, 1000), r"order 1000; expected 1\.\.62"))
    # root's first child entry: child id out of range
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, off[0] + 24 + 4, 99),
                  r"child entry at byte offset 40 \(in the list of node 0\) names child id 99 but the file has only 12 "
                  r"nodes"))
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, off[0] + 24 + 4, 0), r"names the root"))
    # node 1's parent out of range / negative freq / negative token
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, off[1] + 4, 1 << 40),
                  rf"node 1 at byte offset 76 has parent id {1 << 40} but the file has only 12 nodes"))
    cases.append((lambda raw, off: struct.pack_into("<i", raw, off[1] + 12, -3), r"negative freq -3"))
    cases.append((lambda raw, off: struct.pack_into("<i", raw, off[1], -4), r"token id -4"))
    # a child entry whose token disagrees with the child's own record
    cases.append((lambda raw, off: struct.pack_into("<i", raw, off[0] + 24, 3),
                  r"(child entry at byte offset 40 says node 1|node 1 at byte offset \d+ \(token 1).*disagree|does not "
                  r"match"))
    # a child whose freq exceeds its parent's
    cases.append((lambda raw, off: struct.pack_into("<i", raw, off[5] + 12, 1000), r"continuations' counts sum to"))
    # n_children larger than the whole node count
    cases.append((lambda raw, off: struct.pack_into("<Q", raw, off[1] + 16, 1 << 33),
                  r"node 1 at byte offset 76 claims \d+ children but the file has only 12 nodes"))
    for patch, message in cases:
        path, offsets = _patched(tmp_path, patch)
        with pytest.raises(TrieFormatError, match=message):
            read_official_trie(path, progress=False, strict_size=patch is not cases[-1][0])


def test_trailing_garbage_and_cycles(tmp_path):
    path, raw, _ = _canonical(tmp_path)
    path.write_bytes(bytes(raw) + b"\x00" * 7)
    with pytest.raises(TrieFormatError, match=rf"7 trailing byte\(s\) from byte offset {len(raw)}"):
        read_official_trie(path, progress=False)
    with pytest.raises(TrieFormatError, match=rf"7 trailing byte\(s\) after the last node .* byte offset {len(raw)}"):
        read_official_trie(path, progress=False, strict_size=False)
    # nodes 1 and 2 name each other as parent and child: consistent lists, but no path to the root
    node, child = struct.Struct("<iQiQ").pack, struct.Struct("<iQ").pack
    cyc = (struct.pack("<QQ", 3, 3) + node(0, 0, 2, 0) + node(5, 2, 1, 1) + child(6, 2)
           + node(6, 1, 1, 1) + child(5, 1))
    path.write_bytes(cyc)
    with pytest.raises(TrieFormatError, match=r"node 1 at byte offset 40 \(parent 2\): its parent chain never reaches "
                                              r"the root"):
        read_official_trie(path, progress=False)
    # two children of the root with the same token: two nodes for one n-gram
    dup = (struct.pack("<QQ", 2, 3) + node(0, 0, 2, 2) + child(4, 1) + child(4, 2)
           + node(4, 0, 1, 0) + node(4, 0, 1, 0))
    path.write_bytes(dup)
    with pytest.raises(TrieFormatError, match=r"two nodes stand for the same n-gram \(4,\)"):
        read_official_trie(path, progress=False)
    with pytest.raises(FileNotFoundError, match="n-gram trie not found"):
        read_official_trie(tmp_path / "missing.trie", progress=False)


def test_trie_destination_rules(tmp_path):
    src = tmp_path / "in.trie"
    write_official_trie(src, [[1, 2, 3, 1, 2]], order=3)
    dst = tmp_path / "ng.safetensors"
    dst.write_bytes(b"old")
    with pytest.raises(FileExistsError, match="already exists; use --force"):
        convert_trie(src, dst, progress=False)
    assert dst.read_bytes() == b"old"
    convert_trie(src, dst, force=True, progress=False)
    assert NGramModel.load(dst).count((1, 2)) == 2
    os.makedirs(tmp_path / "d")
    with pytest.raises(ValueError, match="is a directory"):
        convert_trie(src, tmp_path / "d", force=True, progress=False)
    with pytest.raises(ValueError, match="overlaps the source"):
        convert_trie(src, src, force=True, progress=False)


# =====================================================================================================================
# official DART head -> this project
# =====================================================================================================================


def test_convert_official_keeps_logits_and_records_everything(tmp_path, inputs):
    embedding, aux, ids = inputs
    src, dst = tmp_path / "official", tmp_path / "ours"
    write_official_head(src, seed=1)
    seqs = random_corpus(3, TINY["vocab_size"])
    write_official_trie(tmp_path / "full.trie", seqs, order=3, node_order="dfs", seed=4)
    target = write_target(tmp_path / "target", eos=[7, 9], gen_eos=None)
    summary = convert_official(src, dst, ngram=tmp_path / "full.trie", target=target, progress=False)
    assert any("several EOS ids [7, 9]" in n for n in summary["notes"])

    torch.testing.assert_close(head_logits(dst, embedding, aux, ids), head_logits(src, embedding, aux, ids),
                               rtol=0, atol=0)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["target_layer_ids"] == [2, 4, 5] and cfg["num_target_layers"] == TARGET_LAYERS
    assert cfg["dart_tree"]["eos_token_id"] == 7
    assert cfg["dart_tree"]["topk"] == 20  # the reference 25, cut to the 20 tokens of this head's draft vocabulary
    assert cfg["dart_ngram_file"] == "ngram.safetensors" and cfg["architectures"] == ["LlamaForCausalLMDart"]
    head = DartHead.from_pretrained(dst)
    assert head.tree_config.eos_token_id == 7 and head.config.target_layer_ids == [2, 4, 5]
    counts = dict_counts(seqs, 3)
    assert head.ngram.count((seqs[0][0],)) == counts[(seqs[0][0],)]
    assert head.ngram.probability(seqs[0][:2], list(range(10))) == dict_probability(counts, 3, seqs[0][:2],
                                                                                      list(range(10)))
    assert not [f for f in os.listdir(tmp_path) if f.startswith((".tmp", ".old"))]


def test_convert_official_dtype_eos_and_embedding(tmp_path, inputs):
    embedding, aux, ids = inputs
    src, dst = tmp_path / "official", tmp_path / "ours"
    embed = torch.randn(TINY["vocab_size"], TINY["hidden_size"])
    write_official_head(src, seed=2, extra={"embed_tokens.weight": embed}, dtype=torch.bfloat16)
    target = write_target(tmp_path / "t", eos=3, gen_eos=[11, 12], text_config=True)
    convert_official(src, dst, target=target, progress=False)  # default dtype: the source's
    with safe_open(str(dst / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("fc.weight").get_dtype() == "BF16"
        assert torch.equal(fh.get_tensor("embed_tokens.weight"), embed.to(torch.bfloat16))
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["dart_tree"]["eos_token_id"] == 11  # generation_config first
    torch.testing.assert_close(head_logits(dst, embedding, aux, ids), head_logits(src, embedding, aux, ids),
                               rtol=0, atol=0)
    convert_official(src, dst, dtype="float32", force=True, eos_token_id=5, progress=False)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["dart_tree"]["eos_token_id"] == 5
    assert cfg.get("target_layer_ids") is None  # no target: taps stay the defaults, resolved at load time
    assert load_file(str(dst / "model.safetensors"))["fc.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    "target_kwargs, message",
    [
        (dict(hidden=20), "target hidden_size 20 != head target_hidden_size 16"),
        (dict(hidden=20), "target hidden_size 20 != head hidden_size 16 (the head embeds tokens with the target's"),
        (dict(vocab=41), "target vocab_size 41 != head vocab_size 40"),
        (dict(layers=3), "target num_hidden_layers 3 is too few for the default taps [2, L//2, L-3] (need at least 4)"),
        (dict(vocab=30), "d2t maps draft ids to target ids"),
    ],
)
def test_convert_official_refuses_target_mismatch(tmp_path, target_kwargs, message):
    src, dst = tmp_path / "official", tmp_path / "ours"
    state = random_state(3)
    state["d2t"][0] = 39  # draft id 0 -> target id 39: outside a 30-token vocab
    write_official_head(src, state=state)
    target = write_target(tmp_path / "t", **target_kwargs)
    with pytest.raises(ValueError) as err:
        convert_official(src, dst, target=target, progress=False)
    assert message in str(err.value)
    if "d2t" in message:
        assert "..39, outside the target vocab 0..29" in str(err.value)
    assert not dst.exists()


def test_convert_official_taps_beyond_target_and_embedding_width(tmp_path):
    src, dst = tmp_path / "official", tmp_path / "ours"
    write_official_head(src, config_overrides={"target_layer_ids": [2, 5, 12]})
    with pytest.raises(ValueError, match=r"target num_hidden_layers 8 is too few for taps \[2, 5, 12\] \(need at "
                                         r"least 12\)"):
        convert_official(src, dst, target=write_target(tmp_path / "t"), progress=False)
    write_official_head(src, state=random_state(0, {**TINY, "target_hidden_size": 24}),
                        config_overrides={"target_hidden_size": 24})
    with pytest.raises(ValueError, match="target hidden_size 16 != head target_hidden_size 24"):
        convert_official(src, dst, target=write_target(tmp_path / "t"), progress=False)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (dict(drop=["midlayer.mask_rep"]), ValueError, "missing key 'midlayer.mask_rep'"),
        (dict(extra={"midlayer.bogus": torch.zeros(2)}), ValueError, "unknown key(s) ['midlayer.bogus']"),
        (dict(extra={"lm_head.weight": torch.zeros(21, 16)}), ValueError, "has shape [21, 16], expected [20, 16]"),
        (dict(config_overrides={"draft_length": None}), ValueError, "draft_length must be a positive integer"),
    ],
)
def test_convert_official_bad_checkpoints(tmp_path, mutate, error, message):
    src, dst = tmp_path / "official", tmp_path / "ours"
    write_official_head(src, **mutate)
    with pytest.raises(error) as err:
        convert_official(src, dst, progress=False)
    assert message in str(err.value) and not dst.exists()


def test_convert_official_missing_inputs_and_destination(tmp_path):
    src, dst = tmp_path / "official", tmp_path / "ours"
    with pytest.raises(FileNotFoundError, match="DART head directory not found"):
        convert_official(src, dst, progress=False)
    write_official_head(src)
    os.remove(src / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        convert_official(src, dst, progress=False)
    write_official_head(src)
    with pytest.raises(FileNotFoundError, match="n-gram trie not found"):
        convert_official(src, dst, ngram=tmp_path / "none.trie", progress=False)
    with pytest.raises(FileNotFoundError, match="target model directory not found"):
        convert_official(src, dst, target=tmp_path / "none", progress=False)
    os.makedirs(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_official(src, dst, target=tmp_path / "t", progress=False)
    assert not dst.exists()
    (tmp_path / "bad.trie").write_bytes(b"\x03" + b"\x00" * 12)
    with pytest.raises(TrieFormatError, match="truncated header"):
        convert_official(src, dst, ngram=tmp_path / "bad.trie", progress=False)
    assert not dst.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]
    os.makedirs(dst)
    (dst / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_official(src, dst, progress=False)
    assert (dst / "keep").exists()
    convert_official(src, dst, force=True, progress=False)
    assert not (dst / "keep").exists() and (dst / "model.safetensors").exists()
    with pytest.raises(ValueError, match="overlaps the source"):
        convert_official(src, src, force=True, progress=False)


# =====================================================================================================================
# SGLang directory
# =====================================================================================================================


def test_convert_sglang_from_our_dir(tmp_path, inputs):
    embedding, aux, ids = inputs
    src, ours, sgl = tmp_path / "official", tmp_path / "ours", tmp_path / "sglang"
    write_official_head(src, seed=4)
    write_official_trie(tmp_path / "a.trie", random_corpus(6, 40), order=3, node_order="random")
    convert_official(src, ours, ngram=tmp_path / "a.trie", target=write_target(tmp_path / "t", eos=7),
                     progress=False)
    raw = json.loads((ours / "config.json").read_text())
    # a tree topk of 25 is more than this head's 20 draft tokens: `serve` would refuse it, so convert does
    (ours / "config.json").write_text(json.dumps({**raw, "dart_tree": {**raw["dart_tree"], "topk": 25}}))
    with pytest.raises(ValueError, match=r"refused by dart-spec serve: .*sglang/config.json: the tree takes topk=25"):
        convert_sglang(ours, sgl, dtype="bfloat16")
    assert not sgl.exists()
    (ours / "config.json").write_text(json.dumps({**raw, "dart_tree": {**raw["dart_tree"], "topk": 16}}))
    convert_sglang(ours, sgl, dtype="bfloat16")
    cfg = json.loads((sgl / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMDart"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert cfg["target_layer_ids"] == [2, 4, 5] and cfg["torch_dtype"] == "bfloat16"
    assert (cfg["draft_length"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (3, 20, 16)
    assert cfg["dart_config"] == {"topk": 16, "beam_width": 20, "remain_total": 60, "ngram_weight": 0.5,
                                  "eos_token_id": 7, "level_weight_exponent": 0.7, "logit_weight_decay": 0.9,
                                  "max_depth": None, "context_draft": True, "context_depth": 16,
                                  "context_matches": 4, "context_min_match": 2, "context_max_match": 4,
                                  "ngram_file": "ngram.safetensors"}
    assert "dart_tree" not in cfg and "dart_ngram_file" not in cfg
    assert (sgl / "ngram.safetensors").read_bytes() == (ours / "ngram.safetensors").read_bytes()
    # the SGLang format's reader gives the settings back; the core loader reads the weights and only its own keys
    config, tree, ngram_path = read_sglang_dir(sgl)
    assert tree == TreeConfig(eos_token_id=7, topk=16) and ngram_path == str(sgl / "ngram.safetensors")
    assert NGramModel.load(ngram_path).num_nodes == DartHead.from_pretrained(ours).ngram.num_nodes
    loaded = DartHead.from_pretrained(sgl)
    assert loaded.config.target_layer_ids == config.target_layer_ids == [2, 4, 5]
    assert loaded.tree_config is None and loaded.ngram is None  # dart_config is SGLang's block, not the core's
    with safe_open(str(sgl / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("midlayer.mask_rep").get_dtype() == "BF16" and "d2t" in fh.keys()
    ref = DartHead.from_pretrained(src)
    assert torch.equal(loaded.d2t, ref.d2t) and torch.equal(loaded.t2d, ref.t2d)
    torch.testing.assert_close(loaded.fc.weight, ref.fc.weight.to(torch.bfloat16).float(), rtol=0, atol=0)
    # an SGLang directory converted again keeps its tree settings and n-gram
    convert_sglang(sgl, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["dart_config"] == cfg["dart_config"] and again["eagle_config"] == cfg["eagle_config"]
    assert (tmp_path / "again" / "ngram.safetensors").read_bytes() == (sgl / "ngram.safetensors").read_bytes()


def test_convert_sglang_needs_taps_for_official_dirs(tmp_path):
    src, sgl = tmp_path / "official", tmp_path / "sglang"
    write_official_head(src)
    with pytest.raises(ValueError, match="records no target layers .*--target TARGET_DIR or --num-target-layers L"):
        convert_sglang(src, sgl)
    assert not sgl.exists()
    convert_sglang(src, sgl, num_target_layers=32)
    cfg = json.loads((sgl / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]  # taps [2, 16, 29] - 1
    assert "ngram_file" not in cfg["dart_config"] and not (sgl / "ngram.safetensors").exists()
    assert cfg["dart_config"]["eos_token_id"] is None
    # n-gram given explicitly: an official trie is converted, checked against the head's vocab
    write_official_trie(tmp_path / "b.trie", [[1, 2, 3, 39, 1, 2]], order=3)
    convert_sglang(src, sgl, target=write_target(tmp_path / "t", eos=9), ngram=tmp_path / "b.trie", force=True)
    cfg = json.loads((sgl / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["dart_config"]["ngram_file"] == "ngram.safetensors" and cfg["dart_config"]["eos_token_id"] == 9
    assert NGramModel.load(sgl / "ngram.safetensors").count((1, 2)) == 2
    write_official_trie(tmp_path / "c.trie", [[1, 2, 45]], order=3)
    with pytest.raises(TrieFormatError, match="token id 45 outside 0..39"):
        convert_sglang(src, tmp_path / "s2", num_target_layers=8, ngram=tmp_path / "c.trie")
    with pytest.raises(ValueError, match="hidden_states index 0"):
        write_official_head(src, config_overrides={"target_layer_ids": [0, 4, 5]})
        convert_sglang(src, tmp_path / "s3")
    assert not (tmp_path / "s2").exists() and not (tmp_path / "s3").exists()


# =====================================================================================================================
# EAGLE3 -> DART
# =====================================================================================================================


def write_eagle3(path, seed=0, aux_ids=(1, 3, 4), drop=(), extra=None, arch="LlamaForCausalLMEagle3"):
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
           "torch_dtype": "float32", "tie_word_embeddings": False, **{k: v for k, v in TINY.items()
                                                                       if k != "draft_length"}}
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(cfg))
    state = random_state(seed)
    state.pop("midlayer.mask_rep")
    for k in drop:
        state.pop(k)
    state.update(extra or {})
    save_file(state, str(path / "model.safetensors"))
    return state


def test_convert_eagle3(tmp_path):
    src = tmp_path / "eagle3"
    state = write_eagle3(src)
    convert_eagle3(src, tmp_path / "d1", draft_length=4, seed=7)
    convert_eagle3(src, tmp_path / "d2", draft_length=4, seed=7)
    convert_eagle3(src, tmp_path / "d3", draft_length=4, seed=8)
    head = DartHead.from_pretrained(tmp_path / "d1")
    assert head.config.draft_length == 4 and head.config.target_layer_ids == [2, 4, 5]
    mask = head.midlayer.mask_rep.detach()
    assert mask.shape == (2 * TINY["hidden_size"],) and torch.equal(mask, init_mask_rep(TINY["hidden_size"], 7))
    assert torch.equal(DartHead.from_pretrained(tmp_path / "d2").midlayer.mask_rep, mask)
    assert not torch.equal(DartHead.from_pretrained(tmp_path / "d3").midlayer.mask_rep, mask)
    assert 0.5 < float(mask.std()) < 1.5  # standard normal like the reference's torch.randn(2H)
    out = head.state_dict()
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    cfg = json.loads((tmp_path / "d1" / "config.json").read_text())
    assert "eagle_config" not in cfg and cfg["architectures"] == ["DartHead"]
    # then on to SGLang: the aux ids come back unchanged
    convert_sglang(tmp_path / "d1", tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and cfg["draft_length"] == 4


# =====================================================================================================================
# a wider MLP (warm start of a capacity variant)
# =====================================================================================================================


def test_convert_widen_keeps_the_function_and_the_formats(tmp_path, inputs):
    from dart_converters import convert_widen

    embedding, aux, ids = inputs
    src, wide = tmp_path / "official", tmp_path / "wide"
    state = write_official_head(src, seed=5)
    summary = convert_widen(src, wide, intermediate_size=40, seed=3)
    assert (summary["from_intermediate_size"], summary["intermediate_size"]) == (24, 40)
    head = DartHead.from_pretrained(wide)
    assert head.config.intermediate_size == 40
    torch.testing.assert_close(head_logits(wide, embedding, aux, ids), head_logits(src, embedding, aux, ids),
                               rtol=0, atol=0)
    out = head.state_dict()
    for name in ("gate_proj", "up_proj"):
        w = out[f"midlayer.mlp.{name}.weight"]
        assert torch.equal(w[:24], state[f"midlayer.mlp.{name}.weight"]) and float(w[24:].abs().min()) > 0
        assert float(w[24:].abs().max()) <= TINY["hidden_size"] ** -0.5  # nn.Linear's init bound
    down = out["midlayer.mlp.down_proj.weight"]
    assert torch.equal(down[:, :24], state["midlayer.mlp.down_proj.weight"]) and not down[:, 24:].any()
    assert all(torch.equal(out[k], v) for k, v in state.items() if ".mlp." not in k)
    convert_widen(src, tmp_path / "again", intermediate_size=40, seed=3)
    assert torch.equal(DartHead.from_pretrained(tmp_path / "again").midlayer.mlp.up_proj.weight,
                       head.midlayer.mlp.up_proj.weight)  # seeded
    # the new units learn: a gradient reaches their down_proj columns at once
    head.float().set_input_embeddings(embedding)
    head(aux, ids).square().sum().backward()
    assert head.midlayer.mlp.down_proj.weight.grad[:, 24:].abs().sum() > 0
    # the widened directory is an ordinary head for the SGLang conversion
    convert_sglang(wide, tmp_path / "sglang", num_target_layers=TARGET_LAYERS)
    config, _, _ = read_sglang_dir(tmp_path / "sglang")
    assert config.intermediate_size == 40 and json.loads((tmp_path / "sglang" / "config.json").read_text())[
        "num_hidden_layers"] == 1
    with safe_open(str(tmp_path / "sglang" / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("midlayer.mlp.down_proj.weight").get_shape() == [TINY["hidden_size"], 40]
    with pytest.raises(ValueError, match="intermediate_size must be an integer >= the head's 24"):
        convert_widen(src, tmp_path / "narrow", intermediate_size=16)
    assert not (tmp_path / "narrow").exists()


def test_cli_convert_widen(tmp_path, capsys):
    src = tmp_path / "official"
    write_official_head(src, seed=6)
    assert main(["convert", "widen", str(src), str(tmp_path / "w"), "--intermediate-size", "48",
                 "--dtype", "float16"]) == 0
    assert "MLP 24 -> 48 units" in capsys.readouterr().out
    head = DartHead.from_pretrained(tmp_path / "w")
    assert head.config.intermediate_size == 48
    with safe_open(str(tmp_path / "w" / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("midlayer.mlp.up_proj.weight").get_dtype() == "F16"
    assert main(["convert", "widen", str(src), str(tmp_path / "w"), "--intermediate-size", "48"]) == 2  # exists
    assert "exists" in capsys.readouterr().err


def test_convert_eagle3_bad_input(tmp_path):
    src = tmp_path / "eagle3"
    write_eagle3(src, drop=["norm.weight"])
    with pytest.raises(ValueError, match="missing key 'norm.weight'"):
        convert_eagle3(src, tmp_path / "o", draft_length=3)
    write_eagle3(src, extra={"midlayer.mask_rep": torch.zeros(32)})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['midlayer.mask_rep'\]"):
        convert_eagle3(src, tmp_path / "o", draft_length=3)
    write_eagle3(src, arch="LlamaForCausalLM")
    with pytest.raises(ValueError, match="name no EAGLE3 model"):
        convert_eagle3(src, tmp_path / "o", draft_length=3)
    write_eagle3(src, aux_ids=None)
    with pytest.raises(ValueError, match="draft_length must be a positive integer"):
        convert_eagle3(src, tmp_path / "o", draft_length=0)
    convert_eagle3(src, tmp_path / "o", draft_length=2)
    assert DartHead.from_pretrained(tmp_path / "o").config.target_layer_ids is None
    with pytest.raises(FileExistsError):
        convert_eagle3(src, tmp_path / "o", draft_length=2)


# =====================================================================================================================
# command line
# =====================================================================================================================


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dart-spec convert: error: "), err
    return err[0]


def test_cli_trie_and_errors(tmp_path, capsys):
    src, dst = tmp_path / "in.trie", tmp_path / "ng.safetensors"
    seqs = random_corpus(9, 20)
    write_official_trie(src, seqs, order=3, node_order="random")
    assert main(["convert", "trie", str(src), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "bytes/node" in out and "M nodes/s" in out
    assert NGramModel.load(dst).count(()) == sum(len(s) for s in seqs)
    assert main(["convert", "trie", str(src), str(dst)]) == 2
    assert "already exists; use --force" in _one_line_error(capsys)
    assert main(["convert", "trie", str(src), str(dst), "--force", "--vocab-size", "100"]) == 0
    capsys.readouterr()
    src.write_bytes(src.read_bytes()[:-3])
    assert main(["convert", "trie", str(src), str(tmp_path / "x.safetensors")]) == 2
    assert "truncated" in _one_line_error(capsys) and not (tmp_path / "x.safetensors").exists()
    assert main(["convert", "trie", str(tmp_path / "nope.trie"), str(dst)]) == 2
    assert "not found" in _one_line_error(capsys)


def test_cli_official_sglang_eagle3(tmp_path, capsys):
    src = tmp_path / "official"
    write_official_head(src)
    target = write_target(tmp_path / "t", hidden=20)
    assert main(["convert", "official", str(src), str(tmp_path / "o"), "--target", str(target)]) == 2
    assert "target hidden_size 20 != head target_hidden_size 16" in _one_line_error(capsys)
    target = write_target(tmp_path / "t")
    write_official_trie(tmp_path / "a.trie", [[1, 2, 3, 1, 2]], order=3)
    assert main(["convert", "official", str(src), str(tmp_path / "o"), "--target", str(target), "--ngram",
                 str(tmp_path / "a.trie"), "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "taps [2, 4, 5]" in out and "n-gram: 10 nodes" in out
    assert main(["convert", "sglang", str(src), str(tmp_path / "s")]) == 2
    assert "records no target layers" in _one_line_error(capsys)
    assert main(["convert", "sglang", str(tmp_path / "o"), str(tmp_path / "s")]) == 0
    assert "eagle_aux_hidden_state_layer_ids [1, 3, 4]" in capsys.readouterr().out
    write_eagle3(tmp_path / "e")
    assert main(["convert", "eagle3", str(tmp_path / "e"), str(tmp_path / "d"), "--draft-length", "3"]) == 0
    assert "mask_rep seed 0" in capsys.readouterr().out
    assert main(["convert", "eagle3", str(tmp_path / "e"), str(tmp_path / "d"), "--draft-length", "3"]) == 2
    assert "already exists" in _one_line_error(capsys)
    with pytest.raises(SystemExit):
        main(["convert", "eagle3", str(tmp_path / "e"), str(tmp_path / "d2")])  # --draft-length is required
