"""End to end: real SGLang servers on this CPU with `--speculative-algorithm DART` (tiny random target with a
character-level tokenizer, tiny heads) against the same server without speculation and against HF greedy, through
/generate and the `openai` client. Marked slow (a few minutes: the session's plain server, tests/sglang/conftest.py, a
DART server for the module, and one more each for the accepting head and context paths)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.sglang_env import (ACCEPT_PROMPT, ACCEPT_TOKENS, EOS, TREE, Server, import_sglang, set_tree,
                                start_together)

import_sglang()

pytestmark = pytest.mark.slow

PROMPT_IDS = [[5, 6, 7, 8, 9, 10], [12, 40, 41, 3], [70, 71, 72, 73, 74, 75, 76, 77], [30, 31]]
TEXT_PROMPTS = ["hello world w3 w4", "user w10 w11 w12 w13 w14"]
NEW_TOKENS = 16
CONTEXT = 512  # the tiny target's max_position_embeddings


def hf_greedy(model, ids, new_tokens, stop_at_eos=True):
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=EOS if stop_at_eos else None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def generate(server, ids, ignore_eos=False, expect=200, **sampling):
    status, body = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": ignore_eos, **sampling}})
    assert status == expect, body
    return body


@pytest.fixture(scope="module")
def dart_servers(models, accepting):
    """The module's DART servers, started side by side: {"random": the random head's, "accepting": the accepting
    head's, "context": the random head's with context paths}."""
    import shutil

    root, target, head = models
    context_head = root / "context-head"
    shutil.copytree(head, context_head)
    set_tree(str(context_head), context_draft=True, context_min_match=1, context_depth=8)
    started = start_together(
        lambda: Server(target, head, str(root / "dart.log"), {"DART_TEST_LOGITS_LOG": str(root / "head-logits.jsonl")},
                       extra=("--constrained-json-disable-any-whitespace",)),
        lambda: Server(target, accepting[0], str(root / "accepting.log")),
        lambda: Server(target, str(context_head), str(root / "context.log")))
    yield dict(zip(("random", "accepting", "context"), started))
    for server in started:
        server.close()


@pytest.fixture(scope="module")
def servers(plain_server, dart_servers):
    """(plain, dart): the same target without and with DART (the random head)."""
    return plain_server, dart_servers["random"]


def both(servers, call):
    plain, dart = servers
    return call(plain), call(dart)


def test_dart_server_is_lossless_and_batches(models, servers, hf_target):
    root, _, _ = models
    plain, dart = servers
    want = [generate(plain, ids)["output_ids"] for ids in PROMPT_IDS]
    sequential = [generate(dart, ids)["output_ids"] for ids in PROMPT_IDS]
    with ThreadPoolExecutor(len(PROMPT_IDS)) as pool:
        concurrent = list(pool.map(lambda ids: generate(dart, ids)["output_ids"], PROMPT_IDS))
    # lossless: the same tokens as the server without speculation and as HF greedy
    assert sequential == want
    assert sequential == [hf_greedy(hf_target, ids, NEW_TOKENS) for ids in PROMPT_IDS]
    # continuous batching: 4 requests in flight give the sequential outputs
    assert concurrent == sequential
    # the served head computes what dart_core.DartHead computes on the same rows
    checks = [json.loads(line) for line in (root / "head-logits.jsonl").read_text().splitlines()]
    assert len(checks) >= len(PROMPT_IDS) * 3
    assert max(c["max_abs_diff"] for c in checks) < 1e-4
    assert max(c["rows"] for c in checks) > max(map(len, PROMPT_IDS))  # decode rounds were checked too


@pytest.mark.parametrize("penalties", [
    dict(frequency_penalty=1.0, presence_penalty=1.0),
    dict(repetition_penalty=1.5, min_new_tokens=12),
])
def test_penalties_give_the_plain_servers_output(servers, penalties):
    prompts = PROMPT_IDS[:2]
    plain, dart = both(servers, lambda s: [generate(s, ids, **penalties)["output_ids"] for ids in prompts])
    assert dart == plain
    unpenalised = generate(servers[0], prompts[0])["output_ids"]
    assert unpenalised != plain[0]  # control: the penalties change the output, so equality says something


def test_the_openai_client_gets_the_plain_servers_text(servers):
    def requests(server):
        client = server.openai()
        texts = [client.completions.create(model="default", prompt=p, max_tokens=NEW_TOKENS, temperature=0)
                 .choices[0].text for p in TEXT_PROMPTS]
        chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi w1"}],
                                              max_tokens=NEW_TOKENS, temperature=0).choices[0].message.content
        stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi w1"}],
                                                max_tokens=NEW_TOKENS, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        return texts, chat, streamed

    plain, dart = both(servers, requests)
    assert dart == plain and all(plain[0]) and plain[2] == plain[1]


def test_sampling_is_served_on_this_cpu(servers):
    # SGLang's default temperature is 1.0: a client that sends none samples
    _, dart = servers
    client = dart.openai()
    out = client.completions.create(model="default", prompt=TEXT_PROMPTS[0], max_tokens=NEW_TOKENS, n=2,
                                    temperature=0.8, top_p=0.9)
    assert len(out.choices) == 2 and out.usage.completion_tokens <= 2 * NEW_TOKENS
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi w1"}],
                                            max_tokens=NEW_TOKENS, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    body = generate(dart, PROMPT_IDS[0], ignore_eos=True, temperature=1.0, top_k=5, min_p=0.05)
    assert len(body["output_ids"]) == NEW_TOKENS and body["meta_info"]["finish_reason"]["type"] == "length"


def test_context_limits_are_the_plain_servers_up_to_the_tree_depth(servers):
    import openai

    from dart_core import TreeConfig
    from dart_sglang.settings import DartServeSettings

    plain, dart = servers
    reserve = DartServeSettings.for_tree(TreeConfig(**TREE), 4).num_levels  # positions a tree reaches past the end
    new = 8

    def prompt(length):
        return [3 + i % 80 for i in range(length)]  # token ids inside the vocabulary

    def request(server, length, expect):
        return generate(server, prompt(length), ignore_eos=True, max_new_tokens=new, expect=expect)

    edge = CONTEXT - new - reserve  # the longest prompt DART takes with `new` tokens
    assert request(dart, edge, 200)["output_ids"] == request(plain, edge, 200)["output_ids"]
    refused = request(dart, edge + 1, 400)
    assert "maximum context" in json.dumps(refused), refused
    request(plain, edge + 1, 200)  # the plain server still takes it: DART's limit is stricter by the tree depth
    request(plain, CONTEXT - new, 200)
    request(plain, CONTEXT - new + 1, 400)
    with pytest.raises(openai.BadRequestError):  # streamed: refused before any token, not mid-stream
        stream = dart.openai().completions.create(model="default", prompt=prompt(edge + 1), max_tokens=new,
                                                  temperature=0, stream=True)
        next(iter(stream))


def test_constrained_decoding_with_a_json_schema_and_a_regex(servers):
    import jsonschema

    # bounded: the servers run with --constrained-json-disable-any-whitespace, so a random model cannot ramble
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"enum": [1, 2, 3]}},
              "required": ["name", "n"], "additionalProperties": False}
    asks = [dict(json_schema=json.dumps(schema)), dict(regex=r"[a-z]{3}-[0-9]{2}")]

    def run(server):
        return [generate(server, PROMPT_IDS[0], max_new_tokens=48, **ask)["text"] for ask in asks]

    plain, dart = both(servers, run)
    assert dart == plain
    jsonschema.validate(json.loads(dart[0]), schema)
    assert len(dart[1]) == 6 and dart[1][3] == "-"


def test_a_head_that_drafts_right_gets_drafts_accepted(dart_servers, accepting):
    body = generate(dart_servers["accepting"], ACCEPT_PROMPT, ignore_eos=True, max_new_tokens=ACCEPT_TOKENS)
    assert body["output_ids"] == accepting[1]
    assert body["meta_info"]["spec_accept_length"] > 1.5, body["meta_info"]


def test_context_paths_are_served_losslessly(dart_servers, hf_target):
    prompts = [PROMPT_IDS[0] * 3, PROMPT_IDS[2] * 2]  # prompts that repeat themselves
    bodies = [generate(dart_servers["context"], p, ignore_eos=True, max_new_tokens=24) for p in prompts]
    for prompt, body in zip(prompts, bodies):
        assert body["output_ids"] == hf_greedy(hf_target, prompt, 24, stop_at_eos=False)
