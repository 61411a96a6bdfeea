"""The SGLang worker's one head pass per round (dart_sglang.batching): the packing and padding functions against
per-request loops (pure torch, no SGLang), and a CPU SGLang server whose batched passes over requests of different
lengths give every request the logits `dart_core.DartHead` gives it alone (slow)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dart_core import head_math
from dart_sglang.batching import (accepted_rows, gather_padded, last_rows, packed_positions, packed_slots, padded_slots,
                                  segment_offsets, shift_within)


def random_round(seed: int, max_batch: int = 5, max_rows: int = 7):
    """counts [B] >= 1 (ragged), starts [B] (rows each request already had)."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, max_batch + 1, (), generator=g))
    counts = torch.randint(1, max_rows + 1, (b,), generator=g)
    starts = torch.randint(0, 12, (b,), generator=g)
    return g, counts, starts


# ---- packing ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_packing_matches_a_per_request_loop(seed):
    g, counts, starts = random_round(seed)
    b, n = counts.shape[0], int(counts.sum())
    offsets, positions, last = [], [], []
    for i in range(b):
        offsets += list(range(int(counts[i])))
        positions += [int(starts[i]) + j for j in range(int(counts[i]))]
        last.append(len(offsets) - 1)
    assert segment_offsets(counts).tolist() == offsets
    assert segment_offsets(counts, n).tolist() == offsets
    assert packed_positions(starts, counts).tolist() == positions
    assert last_rows(counts).tolist() == last

    # the verify output: blocks of q rows per request, the accepted path first
    q = 8
    rows = accepted_rows(counts, q)
    assert rows.tolist() == [i * q + j for i in range(b) for j in range(int(counts[i]))]

    # prefill: each request's ids shifted left by one inside its own rows, its tail token last
    ids = torch.randint(0, 90, (n,), generator=g)
    tails = torch.randint(90, 96, (b,), generator=g)
    expected, start = [], 0
    for i in range(b):
        seg = ids[start: start + int(counts[i])].tolist()
        expected += seg[1:] + [int(tails[i])]
        start += int(counts[i])
    assert shift_within(ids, counts, tails).tolist() == expected

    # token slots: row pool_indices[b] of req_to_token at each packed position
    req_to_token = torch.randperm(40 * 32, generator=g).reshape(40, 32).to(torch.int32)
    pool_indices = torch.randperm(40, generator=g)[:b]
    slots = packed_slots(req_to_token, pool_indices, packed_positions(starts, counts), counts)
    expected = [int(req_to_token[pool_indices[i], p]) for i in range(b)
                for p in range(int(starts[i]), int(starts[i] + counts[i]))]
    assert slots.dtype == torch.long and slots.tolist() == expected


def round_rows(lengths: torch.Tensor, span: int, num_mask_rows: int) -> tuple[head_math.Rows, head_math.Rows]:
    """The rows of a round's query blocks as `LlamaForCausalLMDart.draft_logits` lays them out: (queries: each
    request's last real row and its mask rows, keys: the S cached columns, then the queries)."""
    queries, cached = head_math.step_rows(lengths - 1, torch.ones_like(lengths), span, 1, num_mask_rows)
    return queries, head_math.Rows.cat(cached, queries)


def test_block_positions_and_visibility():
    queries, keys = round_rows(torch.tensor([3, 1]), span=3, num_mask_rows=2)
    assert queries.positions().tolist() == [[2, 3, 4], [0, 1, 2]]
    see = head_math.visibility(queries, keys).int().tolist()
    # columns: 3 cached real rows (padded; the last real row's own column is read as the new row instead), the last
    # real row, then mask rows 1..2
    assert see[0] == [[1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]]
    assert see[1] == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]  # never the padding columns


@pytest.mark.parametrize("seed", range(6))
def test_padded_gather_matches_a_per_request_loop(seed):
    g, counts, starts = random_round(seed)
    b = counts.shape[0]
    lengths = starts + counts
    pool_size, kv, hd = 400, 2, 4
    req_to_token = torch.randperm(pool_size, generator=g)[: 16 * 24].reshape(16, 24)
    pool_indices = torch.randperm(16, generator=g)[:b]
    buffer = torch.randn(pool_size, kv, hd, generator=g)
    used = torch.cat([req_to_token[pool_indices[i], : int(lengths[i])] for i in range(b)])
    unused = torch.ones(pool_size, dtype=torch.bool)
    unused[used] = False
    buffer[unused] = float("nan")  # whatever sits at other slots must not reach the result

    slots, valid = padded_slots(req_to_token, pool_indices, lengths)
    past = gather_padded(buffer, slots, valid)
    span = int(lengths.max())
    assert slots.shape == valid.shape == (b, span) and past.shape == (b, span, kv, hd)
    assert not torch.isnan(past).any()
    for i in range(b):
        length = int(lengths[i])
        assert valid[i].tolist() == [True] * length + [False] * (span - length)
        assert torch.equal(past[i, :length], buffer[req_to_token[pool_indices[i], :length]])
        assert not past[i, length:].any()


# ---- the attention of a round's query blocks -----------------------------------------------------------------------


def one_request_attention(q, mask_k, mask_v, past_k, past_v, scale):
    """The per-request attention the worker ran before batching (LlamaForCausalLMDart.draft_logits then): q [D+1,
    heads, hd], mask_k/v [D, kv, hd], past_k/v [S, kv, hd] -> [D+1, heads*hd]."""
    d, heads, hd = mask_k.shape[0], q.shape[1], q.shape[2]
    s = past_k.shape[0]
    keys = torch.cat((past_k, mask_k), dim=0)
    values = torch.cat((past_v, mask_v), dim=0)
    see = torch.arange(s + d)[None, :] <= (s - 1 + torch.arange(d + 1))[:, None]
    groups = heads // past_k.shape[1]
    keys = keys.repeat_interleave(groups, dim=1).transpose(0, 1)
    values = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=see[None], scale=scale)
    return out.transpose(0, 1).reshape(d + 1, heads * hd)


def block_attention(q, mask_k, mask_v, past_k, past_v, lengths, scale):
    """The round's attention as `LlamaForCausalLMDart.draft_logits` runs it (`dart_core.head_math`): q [B, D+1,
    heads, hd], mask_k/v [B, D, kv, hd], past_k/v [B, S, kv, hd] (each request's rows 0..lengths-1, padded) ->
    [B, D+1, heads*hd]."""
    b, span = past_k.shape[:2]
    last = lengths - 1
    new_k = torch.cat((past_k[torch.arange(b), last][:, None], mask_k), dim=1)  # the last real row is a new row
    new_v = torch.cat((past_v[torch.arange(b), last][:, None], mask_v), dim=1)
    queries, keys = round_rows(lengths, span, mask_k.shape[1])
    k = torch.cat((past_k, new_k), dim=1).transpose(1, 2)
    v = torch.cat((past_v, new_v), dim=1).transpose(1, 2)
    return head_math.attention(q.transpose(1, 2), k, v, head_math.visibility(queries, keys), scale)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_attention_equals_one_request_at_a_time(seed, dtype):
    g, counts, starts = random_round(seed, max_rows=9)
    lengths = starts + counts
    b, span, d, heads, kv, hd = counts.shape[0], int(lengths.max()), 3, 4, 2, 8
    q = torch.randn(b, d + 1, heads, hd, generator=g, dtype=dtype)
    mask_k, mask_v = (torch.randn(b, d, kv, hd, generator=g, dtype=dtype) for _ in range(2))
    past_k, past_v = (torch.randn(b, span, kv, hd, generator=g, dtype=dtype) for _ in range(2))
    valid = torch.arange(span)[None, :] < lengths[:, None]
    past_k, past_v = past_k * valid[..., None, None], past_v * valid[..., None, None]  # as gather_padded pads
    out = block_attention(q, mask_k, mask_v, past_k, past_v, lengths, 0.3)
    assert out.shape == (b, d + 1, heads * hd)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    for i in range(b):
        length = int(lengths[i])
        alone = one_request_attention(q[i], mask_k[i], mask_v[i], past_k[i, :length], past_v[i, :length], 0.3)
        torch.testing.assert_close(out[i], alone, atol=tol, rtol=tol)


def test_block_attention_keeps_requests_apart():
    """Changing one request's keys, values or padding changes no other request's output."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 7, 4])
    b, span, d, heads, kv, hd = 3, 7, 2, 2, 1, 4
    q = torch.randn(b, d + 1, heads, hd, generator=g)
    mask_k, mask_v = (torch.randn(b, d, kv, hd, generator=g) for _ in range(2))
    past_k, past_v = (torch.randn(b, span, kv, hd, generator=g) for _ in range(2))
    out = block_attention(q, mask_k, mask_v, past_k, past_v, lengths, 0.5)
    k2, v2, mk2 = past_k.clone(), past_v.clone(), mask_k.clone()
    k2[1], v2[1], mk2[1] = 5.0, -3.0, 7.0  # request 1: everything
    k2[0, 2:], v2[0, 2:] = 9.0, 9.0  # request 0: its padding only
    out2 = block_attention(q, mk2, mask_v, k2, v2, lengths, 0.5)
    assert torch.equal(out2[0], out[0]) and torch.equal(out2[2], out[2])
    assert not torch.allclose(out2[1], out[1])


# ---- a CPU SGLang server: batched passes against DartHead, request by request (slow) -------------------------------

# different lengths, so the round's keys are padded and the prefill packs segments of different sizes
BATCH_PROMPTS = [[30, 31], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [70, 71, 72, 73, 74, 75]]
NEW_TOKENS = 12


def hf_greedy(model, ids, new_tokens):
    from helpers.sglang_env import EOS

    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_one_head_pass_per_round_over_requests_of_different_lengths(tmp_path):
    from helpers.sglang_env import Server, import_sglang, write_models

    import_sglang()
    from transformers import AutoModelForCausalLM

    target, head = write_models(tmp_path, draft_length=3, tree={"topk": 4, "beam_width": 4, "remain_total": 8},
                                seed=5)
    log = tmp_path / "head-logits.jsonl"
    server = Server(target, head, str(tmp_path / "dart.log"), env={"DART_TEST_LOGITS_LOG": str(log)})
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    try:
        alone = []
        for ids in BATCH_PROMPTS:
            status, body = server.post("/generate", {"input_ids": ids, "sampling_params": params})
            assert status == 200, body
            alone.append(body["output_ids"])
        alone_lines = len(log.read_text().splitlines())
        # one request carrying all prompts: the scheduler prefills and decodes them as one batch
        status, body = server.post("/generate", {"input_ids": BATCH_PROMPTS, "sampling_params": params})
        assert status == 200, body
        together = [b["output_ids"] for b in body]
    finally:
        server.close()
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert alone == [hf_greedy(hf, ids, NEW_TOKENS) for ids in BATCH_PROMPTS]
    assert together == alone

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # every request of every pass: the logits (and so the candidates) DartHead computes from its own rows alone
    assert max(c["max_abs_diff"] for c in lines) < 1e-4
    assert all(c["same_argmax"] for c in lines)
    # one head forward per round (one packed row write, one attention pass), whatever the batch size
    assert {(c["head_passes"], c["row_writes"]) for c in lines} == {(1, 1)}
    batched = lines[alone_lines:]
    assert any(c["kind"] == "prefill" and c["batch"] == len(BATCH_PROMPTS) for c in batched), batched
    decode_batches = [c["batch"] for c in batched if c["kind"] == "decode"]
    assert max(decode_batches) == len(BATCH_PROMPTS), batched
    # the passes over all three requests saw different lengths side by side (keys padded, rows packed raggedly)
    rounds = {}
    for c in batched:
        rounds.setdefault(c["round"], []).append(c)
    full = [r for r in rounds.values() if len(r) == len(BATCH_PROMPTS)]
    assert full and all(len({c["rows"] for c in r}) > 1 for r in full)


# ---- the worker in this process: SGLang's draft model class on a fake KV pool (needs SGLang, no server) ------------


class FakeKVPool:
    """The two calls the worker makes on SGLang's draft KV pool; unwritten slots hold NaN."""

    def __init__(self, size: int, kv_heads: int, head_dim: int):
        self.k = torch.full((size, kv_heads, head_dim), float("nan"))
        self.v = torch.full((size, kv_heads, head_dim), float("nan"))

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc], self.v[loc] = k, v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


@pytest.fixture(scope="module")
def sglang_head(tmp_path_factory):
    """(LlamaForCausalLMDart loaded from a converted random head, the same head as dart_core.DartHead, settings)."""
    import os
    import socket

    from helpers.sglang_env import import_sglang, write_models

    import_sglang()  # puts tests/helpers/sglang_cpu on sys.path
    import dart_cpu_test_patches
    from safetensors.torch import load_file
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import LlamaConfig

    from dart_core import DartHead
    from dart_sglang.settings import DartServeSettings

    dart_cpu_test_patches.apply()  # SGLang's CPU RoPE path, as the test servers use
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = dict(os.environ)
    try:
        init_single_process_dist(master_port=port)  # SGLang's layers need world-size-1 model-parallel groups
    finally:  # its MASTER_PORT, RANK, ... must not reach the servers other tests start
        os.environ.clear()
        os.environ.update(environ)
    from dart_sglang.models.llama_dart import LlamaForCausalLMDart

    root = tmp_path_factory.mktemp("sglang-head")
    target_dir, head_dir = write_models(root, draft_length=3, tree={"topk": 4, "beam_width": 4, "remain_total": 8},
                                        seed=7)
    model = LlamaForCausalLMDart(LlamaConfig.from_pretrained(head_dir)).eval()
    model.load_weights(iter(load_file(f"{head_dir}/model.safetensors").items()))
    reference = DartHead.from_pretrained(root / "head", load_ngram=False).float().eval()
    embed = load_file(f"{target_dir}/model.safetensors")["model.embed_tokens.weight"]
    with torch.no_grad():  # SGLang shares the target's table with the draft model (padded to 64 rows)
        model.model.embed_tokens.weight[: embed.shape[0]] = embed
    reference.set_input_embeddings(torch.nn.Embedding.from_pretrained(embed))
    return model, reference, DartServeSettings.from_draft_dir(head_dir)


def make_worker(sglang_head, pool_size=1024, requests=8, capacity=64, seed=0):
    from types import SimpleNamespace

    from dart_sglang.worker import DartDraftWorker

    model, _, settings = sglang_head
    attn = model.layer.self_attn
    worker = DartDraftWorker.__new__(DartDraftWorker)  # no server: only what the head pass touches
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pool_size - 1, generator=g)[: requests * capacity] + 1  # requests' slots interleave
    worker.__dict__.update(
        device=torch.device("cpu"), settings=settings, sampling_ok=True, hot_token_id=model.hot_token_id,
        draft_runner=SimpleNamespace(model=model, token_to_kv_pool=FakeKVPool(pool_size, attn.num_kv_heads,
                                                                              attn.head_dim)),
        req_to_token_pool=SimpleNamespace(req_to_token=slots.reshape(requests, capacity).to(torch.int32)))
    return worker


def count_forwards(model):
    """Count the model's packed row passes and query-block passes (instance attributes shadow the methods)."""
    counts = {"real_rows": 0, "draft_logits": 0}

    def counted(name):
        method = getattr(type(model), name)

        def call(*args, **kwargs):
            counts[name] += 1
            return method(model, *args, **kwargs)

        return call

    for name in counts:
        setattr(model, name, counted(name))
    return counts


def prefill_round(worker, items):
    """One prefill batch: items = [(pool index, prefix length, aux [T, 3*Ht], shifted ids [T])] -> candidates."""
    from types import SimpleNamespace

    pools = torch.tensor([pool for pool, *_ in items])
    counts = torch.tensor([len(ids) for *_, ids in items])
    positions = torch.cat([torch.arange(prefix, prefix + len(ids)) for _, prefix, _, ids in items])
    input_ids = torch.cat([torch.cat((torch.tensor([-1]), ids[:-1])) for *_, ids in items])  # row 0's own token:
    # never read (the head embeds the NEXT token), so -1 would fail loudly if it were
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False), chunked_req_next_prompt_token=None, chunked_req=None,
        reqs=[SimpleNamespace(sampling_params=SimpleNamespace(top_k=1)) for _ in items],
        prefix_lens=[prefix for _, prefix, *_ in items], extend_lens=counts.tolist(), req_pool_indices=pools,
        input_ids=input_ids.to(torch.int32),
        out_cache_loc=worker.req_to_token_pool.req_to_token[pools.repeat_interleave(counts), positions].long())
    aux = torch.cat([a for _, _, a, _ in items])
    tails = torch.stack([ids[-1] for *_, ids in items])
    out = worker._draft_extend_for_prefill(batch, aux, tails)
    return out.topk_index, out.topk_p


def decode_round(worker, items, q, g):
    """One verify's accepted rows: items = [(pool index, length after them, aux [A, 3*Ht], next ids [A])]; each
    request's Q-row block holds its A accepted rows first, then rows of noise the head must not read."""
    from types import SimpleNamespace

    blocks, ids = [], []
    for _, _, aux, nxt in items:
        a = len(nxt)
        blocks.append(torch.cat((aux, torch.randn(q - a, aux.shape[1], generator=g) * 100)))
        ids.append(torch.cat((nxt, torch.randint(0, 96, (q - a,), generator=g))))
    b = len(items)
    result = SimpleNamespace(
        logits_output=SimpleNamespace(hidden_states=torch.cat(blocks)), next_token_ids=torch.cat(ids),
        accept_lens=torch.tensor([len(nxt) for *_, nxt in items], dtype=torch.int32),
        new_seq_lens=torch.tensor([length for _, length, *_ in items]),
        next_draft_input=SimpleNamespace(bonus_tokens=torch.zeros(b, dtype=torch.long)))
    worker._draft_extend_for_decode(SimpleNamespace(req_pool_indices=torch.tensor([p for p, *_ in items])), result)
    return result.next_draft_input.topk_index, result.next_draft_input.topk_p


def request_script(prompt_lens, accepts, aux_size, seed=3):
    """Per request, its rounds' new rows: [(kind, aux [T, 3*Ht], shifted ids [T])]. Request 0's prompt comes in
    two chunks (its second prefill has a cached prefix); accepts[r][b] rows of request b in decode round r."""
    g = torch.Generator().manual_seed(seed)
    script = []
    for b, n in enumerate(prompt_lens):
        rows = lambda t: (torch.randn(t, aux_size, generator=g), torch.randint(0, 96, (t,), generator=g))  # noqa
        rounds = [("prefill", *rows(2)), ("prefill", *rows(n - 2))] if b == 0 else [("prefill", *rows(n))]
        rounds += [("decode", *rows(accept[b])) for accept in accepts]
        script.append(rounds)
    return script


def serve_script(sglang_head, script, together: bool):
    """Run the script on a fresh worker: each round's requests in one batch (`together`) or one at a time.
    Returns per request its candidates [(ids [L, K], probs [L, K])] and [(batch size, row passes, block passes)]."""
    model, _, settings = sglang_head
    worker = make_worker(sglang_head)
    counts = count_forwards(model)
    g = torch.Generator().manual_seed(11)
    lengths = [0] * len(script)
    step = [0] * len(script)
    out = [[] for _ in script]
    passes = []
    everyone = list(range(len(script)))
    # request 0's first chunk alone, then the prefills (request 0's second chunk among them), then the decodes
    schedule = [[0], everyone] + [everyone] * (len(script[0]) - 2)
    try:
        for requests in schedule:
            for group in [requests] if together else [[b] for b in requests]:
                items = []
                for b in group:
                    kind, aux, ids = script[b][step[b]]
                    start = lengths[b]
                    lengths[b] += len(ids)
                    step[b] += 1
                    # a prefill batch gives each request's cached prefix, a verify its length after the new rows
                    items.append((2 * b + 1, start if kind == "prefill" else lengths[b], aux, ids))
                before = dict(counts)
                if kind == "prefill":
                    ids, probs = prefill_round(worker, items)
                else:
                    ids, probs = decode_round(worker, items, settings.num_draft_tokens, g)
                passes.append((len(group), counts["real_rows"] - before["real_rows"],
                               counts["draft_logits"] - before["draft_logits"]))
                for j, b in enumerate(group):
                    out[b].append((ids[j], probs[j]))
        assert step == [len(rounds) for rounds in script]
    finally:
        for name in counts:
            delattr(model, name)
    return out, passes


PROMPT_LENS = [5, 13, 1, 8]
ACCEPTS = [[1, 3, 4, 2], [4, 1, 1, 3], [2, 2, 4, 1]]  # per decode round, rows accepted per request (Q >= 4)


def test_worker_batches_equal_requests_served_alone_and_dart_core(sglang_head):
    from dart_core.tree import topk_draft_tokens

    model, reference, settings = sglang_head
    script = request_script(PROMPT_LENS, ACCEPTS, model.model.fc.in_features)
    together, passes = serve_script(sglang_head, script, together=True)
    alone, alone_passes = serve_script(sglang_head, script, together=False)
    # one packed row pass and one query-block pass per round, whatever the batch size
    assert {p[1:] for p in passes + alone_passes} == {(1, 1)}
    assert max(p[0] for p in passes) == len(PROMPT_LENS) and {p[0] for p in alone_passes} == {1}
    for b, rounds in enumerate(script):
        cache = reference.new_cache(1)
        assert len(together[b]) == len(alone[b]) == len(rounds)
        for (ids, probs), (ids_alone, probs_alone), (_, aux, next_ids) in zip(together[b], alone[b], rounds):
            # the same candidates as the request served alone, and as dart_core.DartHead on its own rows
            assert torch.equal(ids, ids_alone)
            torch.testing.assert_close(probs, probs_alone, atol=1e-6, rtol=1e-5)
            with torch.no_grad():
                logits = reference(aux[None], next_ids[None], cache=cache)[0, : settings.head_levels]
            ref_ids, ref_probs = topk_draft_tokens(logits, settings.tree.topk, reference.d2t)
            assert torch.equal(ids, ref_ids)
            torch.testing.assert_close(probs, ref_probs, atol=1e-5, rtol=1e-4)
