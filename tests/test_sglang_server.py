"""End to end: real SGLang servers on this CPU with `--speculative-algorithm DART` (tiny random target, tiny heads)
against the same server without speculation and against HF greedy. Marked slow (a few minutes)."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_env import Server, import_sglang, set_tree, write_models

import_sglang()

pytestmark = pytest.mark.slow

PROMPT_IDS = [[5, 6, 7, 8, 9, 10], [12, 40, 41, 3], [70, 71, 72, 73, 74, 75, 76, 77], [30, 31]]
TEXT_PROMPTS = ["hello world w3 w4", "user w10 w11 w12 w13 w14"]
NEW_TOKENS = 16
TREE = {"topk": 4, "beam_width": 4, "remain_total": 8}


def hf_greedy(model, ids, new_tokens, stop_at_eos=True):
    eos = 2 if stop_at_eos else None
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def generate(server, ids, ignore_eos=False, **sampling):
    status, body = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": ignore_eos, **sampling}})
    assert status == 200, body
    return body


def complete(server, prompt):
    status, body = server.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                    "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    target, head = write_models(root, draft_length=4, tree=TREE)
    return root, target, head


@pytest.fixture(scope="module")
def hf_target(models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)


@pytest.fixture(scope="module")
def plain_outputs(models):
    root, target, _ = models
    server = Server(target, None, str(root / "plain.log"))
    try:
        return {"ids": [generate(server, ids)["output_ids"] for ids in PROMPT_IDS],
                "text": [complete(server, p) for p in TEXT_PROMPTS]}
    finally:
        server.close()


def test_dart_server_is_lossless_and_batches(models, plain_outputs, hf_target):
    root, target, head = models
    logits_log = root / "head-logits.jsonl"
    server = Server(target, head, str(root / "dart.log"), env={"DART_TEST_LOGITS_LOG": str(logits_log)})
    try:
        sequential = [generate(server, ids)["output_ids"] for ids in PROMPT_IDS]
        texts = [complete(server, p) for p in TEXT_PROMPTS]
        with ThreadPoolExecutor(len(PROMPT_IDS)) as pool:
            concurrent = list(pool.map(lambda ids: generate(server, ids)["output_ids"], PROMPT_IDS))
        status, refused = server.post("/generate", {"input_ids": PROMPT_IDS[0], "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 4}})
        still_serving = generate(server, PROMPT_IDS[1])["output_ids"]
    finally:
        server.close()
    # lossless: the same tokens as the server without speculation and as HF greedy
    assert sequential == plain_outputs["ids"]
    assert sequential == [hf_greedy(hf_target, ids, NEW_TOKENS) for ids in PROMPT_IDS]
    assert texts == plain_outputs["text"] and all(texts)
    # continuous batching: 4 requests in flight give the sequential outputs
    assert concurrent == sequential
    # temperature > 0 cannot be verified losslessly here: a clear refusal, never silent greedy
    assert "tree-sampling" in json.dumps(refused), (status, refused)
    assert still_serving == sequential[1]
    # the served head computes what dart_core.DartHead computes on the same rows
    checks = [json.loads(line) for line in logits_log.read_text().splitlines()]
    assert len(checks) >= len(PROMPT_IDS) * 3
    assert max(c["max_abs_diff"] for c in checks) < 1e-4
    assert max(c["rows"] for c in checks) > max(map(len, PROMPT_IDS))  # decode rounds were checked too


def test_a_head_that_drafts_right_gets_drafts_accepted(models, hf_target, tmp_path):
    from dart_sglang.head_format import convert_sglang
    from hf_models import random_head

    _, target_dir, _ = models
    prompt = PROMPT_IDS[0]
    reference = hf_greedy(hf_target, prompt, 24, stop_at_eos=False)
    common = [t for t, _ in Counter(reference).most_common(2)]
    assert sum(reference.count(t) for t in common) >= len(reference) // 2, reference
    # a 2-token draft vocabulary of the target's two most frequent continuation tokens: every level drafts both
    head = random_head(hf_target, draft_length=3, draft_vocab=2)
    with torch.no_grad():
        head.d2t.copy_(torch.tensor([common[0], common[1] - 1]))
        head.t2d.zero_()
        head.t2d[common] = True
    head.set_input_embeddings(hf_target.get_input_embeddings())
    head.save_pretrained(tmp_path / "crafted")
    convert_sglang(tmp_path / "crafted", tmp_path / "crafted-sglang", target=target_dir, progress=False)
    set_tree(str(tmp_path / "crafted-sglang"), topk=2, beam_width=4, remain_total=14)
    server = Server(target_dir, str(tmp_path / "crafted-sglang"), str(tmp_path / "crafted.log"))
    try:
        body = generate(server, prompt, ignore_eos=True, max_new_tokens=24)
    finally:
        server.close()
    assert body["output_ids"] == reference
    assert body["meta_info"]["spec_accept_length"] > 1.5, body["meta_info"]
