"""DartHead against a loop-based re-derivation of docs/DESIGN.md §2.2, official-checkpoint loading, cache and bad input."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from dart_bench.replay import random_head
from dart_core import DartConfig, DartHead, NGramModel, TreeConfig

TINY = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, vocab_size=40,
            draft_vocab_size=20, draft_length=3, target_hidden_size=12, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=512)


def tiny_head(seed=0, **overrides):
    """A head of the TINY shape (with `overrides`), random weights N(0, 0.3) and d2t, its own input embedding."""
    head = random_head(DartConfig(**{**TINY, **overrides}), std=0.3, seed=seed)
    head.set_input_embeddings(torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size))
    return head


def reference_logits(weights, cfg, aux, ids, emb):
    """Loop-based single-sequence forward written from docs/DESIGN.md §2.2, in float64. aux [T, 3Ht], ids [T] -> [D+1, Vd]."""
    w = {k: v.double() for k, v in weights.items()}
    h_size, d, hd = cfg["hidden_size"], cfg["draft_length"], cfg["hidden_size"] // cfg["num_attention_heads"]
    n_heads, n_kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]

    def rms(x, g):
        return g * (x / math.sqrt(float((x * x).mean()) + eps))

    t = aux.shape[0]
    rows, residual = [], []
    for i in range(t):
        s = w["fc.weight"] @ aux[i].double()
        e = emb[ids[i]].double()
        rows.append(torch.cat((rms(e, w["midlayer.input_layernorm.weight"]), rms(s, w["midlayer.hidden_norm.weight"]))))
        residual.append(s)
    for _ in range(d):
        rows.append(w["midlayer.mask_rep"])
        residual.append(w["midlayer.mask_rep"][:h_size])

    def rope(vec, pos):
        out = vec.clone()
        for j in range(hd // 2):
            angle = pos * cfg["rope_theta"] ** (-2.0 * j / hd)
            a, b = vec[j], vec[j + hd // 2]
            out[j] = a * math.cos(angle) - b * math.sin(angle)
            out[j + hd // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    qs, ks, vs = [], [], []
    for pos, x in enumerate(rows):
        q = (w["midlayer.self_attn.q_proj.weight"] @ x).view(n_heads, hd)
        k = (w["midlayer.self_attn.k_proj.weight"] @ x).view(n_kv, hd)
        v = (w["midlayer.self_attn.v_proj.weight"] @ x).view(n_kv, hd)
        qs.append([rope(q[h], pos) for h in range(n_heads)])
        ks.append([rope(k[h], pos) for h in range(n_kv)])
        vs.append([v[h] for h in range(n_kv)])
    outs = []
    for i in range(t - 1, t + d):  # only the rows that are kept
        heads = []
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            scores = torch.tensor([float(qs[i][h] @ ks[j][kv]) / math.sqrt(hd) for j in range(i + 1)])
            probs = torch.softmax(scores.double(), 0)
            heads.append(sum(probs[j] * vs[j][kv] for j in range(i + 1)))
        attn = w["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
        hid = residual[i] + attn
        normed = rms(hid, w["midlayer.post_attention_layernorm.weight"])
        gate = w["midlayer.mlp.gate_proj.weight"] @ normed
        up = w["midlayer.mlp.up_proj.weight"] @ normed
        hid = hid + w["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        outs.append(w["lm_head.weight"] @ rms(rms(hid, w["norm.weight"]), w["norm.weight"]))
    return torch.stack(outs)


def test_forward_matches_loop_reference():
    head = tiny_head(1)
    torch.manual_seed(2)
    aux = torch.randn(2, 5, 3 * TINY["target_hidden_size"])
    ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    out = head(aux, ids)
    assert out.shape == (2, TINY["draft_length"] + 1, TINY["draft_vocab_size"])
    emb = head.get_input_embeddings().weight.detach()
    weights = {k: v.detach() for k, v in head.state_dict().items()}
    for b in range(2):
        ref = reference_logits(weights, TINY, aux[b], ids[b], emb)
        torch.testing.assert_close(out[b].double(), ref, atol=2e-4, rtol=1e-4)


def test_single_final_norm_would_differ():
    """Guards the reference's double final norm: a single norm gives different logits for non-unit norm weights."""
    head = tiny_head(3)
    aux, ids = torch.randn(1, 4, 36), torch.randint(0, 40, (1, 4))
    out = head(aux, ids)
    with torch.no_grad():
        head.norm.weight.fill_(1.0)  # with unit weights norm(norm(x)) == norm(x) up to eps
        unit = head(aux, ids)
    assert not torch.allclose(out, unit, atol=1e-3)


def test_cache_incremental_equals_stateless_and_per_row_lengths():
    head = tiny_head(4)
    torch.manual_seed(5)
    aux, ids = torch.randn(2, 9, 36), torch.randint(0, 40, (2, 9))
    full = head(aux, ids)
    cache = head.new_cache(2, capacity=2)  # forces growth
    head(aux[:, :4], ids[:, :4], cache=cache)
    head(aux[:, 4:6], ids[:, 4:6], cache=cache)
    out = head(aux[:, 6:], ids[:, 6:], cache=cache)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [9, 9]

    # rows of different lengths in one batch: row 0 has 3+2 real rows, row 1 has 3+5
    cache = head.new_cache(2)
    head(aux[:, :3], ids[:, :3], cache=cache)
    out = head(aux[:, 3:8], ids[:, 3:8], cache=cache, lengths=torch.tensor([2, 5]))
    torch.testing.assert_close(out[0], head(aux[:1, :5], ids[:1, :5])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], head(aux[1:, :8], ids[1:, :8])[0], atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [5, 8]
    # the next step continues each row from its own length
    nxt = head(aux[:, 8:9], ids[:, 8:9], cache=cache)
    ref0 = head(torch.cat((aux[:1, :5], aux[:1, 8:9]), 1), torch.cat((ids[:1, :5], ids[:1, 8:9]), 1))
    torch.testing.assert_close(nxt[0], ref0[0], atol=1e-5, rtol=1e-5)


def test_draft_to_target():
    head = tiny_head(6)
    draft = torch.tensor([[0, 5, 19]])
    assert head.draft_to_target(draft).tolist() == [[0 + int(head.d2t[0]), 5 + int(head.d2t[5]),
                                                     19 + int(head.d2t[19])]]


def write_official_dir(path, head, extra_keys=None, drop=None, config_overrides=None):
    """An official-layout DART directory: Llama-style config.json + model.safetensors with official names."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMDart"], "model_type": "llama", "hidden_act": "silu",
           "num_hidden_layers": 1, "torch_dtype": "float32", "tie_word_embeddings": False, "rope_scaling": None,
           **{k: v for k, v in TINY.items()}}
    cfg.update(config_overrides or {})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    for k in drop or ():
        state.pop(k)
    state.update(extra_keys or {})
    save_file(state, os.path.join(path, "model.safetensors"))


def test_official_directory_loads_unchanged(tmp_path):
    head = tiny_head(7)
    write_official_dir(tmp_path, head)
    loaded = DartHead.from_pretrained(tmp_path)
    loaded.set_input_embeddings(head.get_input_embeddings())
    aux, ids = torch.randn(1, 6, 36), torch.randint(0, 40, (1, 6))
    torch.testing.assert_close(loaded(aux, ids), head(aux, ids))
    assert loaded.config.layer_ids_for(28) == [2, 14, 25]


def test_save_pretrained_roundtrip_with_tree_and_ngram(tmp_path):
    head = tiny_head(8)
    head.tree_config = TreeConfig(remain_total=30, eos_token_id=3)
    head.ngram = NGramModel.build([[1, 2, 3, 1, 2, 4]], order=3, vocab_size=40)
    head.config.target_layer_ids = [2, 5, 8]
    head.save_pretrained(tmp_path)
    loaded = DartHead.from_pretrained(tmp_path)
    assert loaded.tree_config == head.tree_config
    assert loaded.ngram.probability([1, 2], [3, 4]) == [0.5, 0.5]
    assert loaded.config.target_layer_ids == [2, 5, 8]
    loaded.set_input_embeddings(head.get_input_embeddings())
    aux, ids = torch.randn(1, 3, 36), torch.randint(0, 40, (1, 3))
    torch.testing.assert_close(loaded(aux, ids), head(aux, ids))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (dict(drop=["midlayer.mask_rep"]), "missing key 'midlayer.mask_rep' (expected shape [32])"),
        (dict(extra_keys={"midlayer.bogus": torch.zeros(2)}), "unknown key(s) ['midlayer.bogus']"),
        (dict(extra_keys={"fc.weight": torch.zeros(16, 30)}), "key 'fc.weight' has shape [16, 30], expected [16, 36]"),
        (dict(extra_keys={"d2t": torch.full((20,), 100, dtype=torch.long)}), "outside the target vocab"),
        (dict(config_overrides={"draft_length": None}), "draft_length must be a positive integer"),
        (dict(config_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), "not supported"),
    ],
)
def test_bad_checkpoints_fail_clearly(tmp_path, mutate, message):
    write_official_dir(tmp_path, tiny_head(9), **mutate)
    with pytest.raises(ValueError) as err:
        DartHead.from_pretrained(tmp_path)
    assert message in str(err.value)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        DartHead.from_pretrained(tmp_path / "nope")
    write_official_dir(tmp_path, tiny_head(10))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        DartHead.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        DartHead.from_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        DartHead.from_pretrained(tmp_path)


def test_bad_inputs_fail_clearly():
    head = tiny_head(11)
    with pytest.raises(ValueError, match=r"aux_hidden must be \[B, T, 36\]"):
        head(torch.randn(1, 3, 35), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="shifted_ids must be"):
        head(torch.randn(1, 3, 36), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        head(torch.randn(1, 3, 36), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="cache holds 2 rows"):
        head(torch.randn(1, 3, 36), torch.zeros(1, 3, dtype=torch.long), cache=head.new_cache(2))
    with pytest.raises(ValueError, match="target embedding width 8"):
        head.set_input_embeddings(torch.nn.Embedding(40, 8))
    with pytest.raises(ValueError, match="has 41 rows"):
        head.set_input_embeddings(torch.nn.Embedding(41, 16))
    bare = DartHead(DartConfig(**TINY))
    with pytest.raises(RuntimeError, match="set_input_embeddings"):
        bare(torch.randn(1, 3, 36), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="too shallow"):
        DartConfig(**TINY, num_target_layers=3)
    with pytest.raises(ValueError, match="only 10 layers"):
        DartConfig(**TINY, target_layer_ids=[2, 5, 12]).layer_ids_for(10)


def test_an_embedding_carried_by_the_checkpoint_is_saved_back(tmp_path):
    head = tiny_head(12)
    table = torch.randn(TINY["vocab_size"], TINY["hidden_size"])
    write_official_dir(tmp_path / "src", head, extra_keys={"embed_tokens.weight": table})
    loaded = DartHead.from_pretrained(tmp_path / "src")
    torch.testing.assert_close(loaded.get_input_embeddings().weight, table)
    loaded.save_pretrained(tmp_path / "dst")
    again = DartHead.from_pretrained(tmp_path / "dst")
    torch.testing.assert_close(again.get_input_embeddings().weight, table)
    # a shared target table is never written with the head
    again.set_input_embeddings(torch.nn.Embedding(TINY["vocab_size"], TINY["hidden_size"]))
    again.save_pretrained(tmp_path / "shared")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shared" / "model.safetensors"), "pt") as fh:
        assert "embed_tokens.weight" not in fh.keys()
