"""SGLang tensor parallelism with DART on this CPU: `--tp-size 2` (two ranks, one core each) serves the plain
TP=2 and TP=1 servers' greedy output (the TP=1 one shared with the server tests, tests/sglang/conftest.py), accepts
drafts, and every rank's head computes `dart_core.DartHead`'s logits and the same trees. Marked slow (a TP=2 start
takes about two minutes here)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.sglang_env import Server, import_sglang, start_together

import_sglang()

pytestmark = pytest.mark.slow

PROMPT_IDS = [[5, 6, 7, 8, 9, 10], [12, 40, 41, 3], [70, 71, 72, 73, 74, 75, 76, 77], [30, 31]]
NEW_TOKENS = 12
TP2 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (SGLang asserts ranks <= NUMA nodes otherwise)


def generate(server, ids, **sampling):
    status, body = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **sampling}})
    assert status == 200, body
    return body


def serve_all(server):
    """Greedy outputs of every prompt, one at a time, then four at once, and a completion through the `openai`
    client."""
    sequential = [generate(server, ids)["output_ids"] for ids in PROMPT_IDS]
    with ThreadPoolExecutor(len(PROMPT_IDS)) as pool:
        concurrent = list(pool.map(lambda ids: generate(server, ids)["output_ids"], PROMPT_IDS))
    text = server.openai().completions.create(model="default", prompt="hello w1 w2", max_tokens=NEW_TOKENS,
                                              temperature=0).choices[0].text
    return sequential, concurrent, text


@pytest.fixture(scope="module")
def setup(models, accepting):
    """(root, target, a head whose drafts are accepted: acceptance shows under TP too), shared with the server tests."""
    root, target, _ = models
    return root, target, accepting[0]


def test_tp2_serves_the_plain_servers_output_with_drafts_accepted_and_ranks_agreeing(setup, plain_server):
    root, target, head = setup
    logits_log = root / "tp-head-logits.jsonl"
    want = serve_all(plain_server)
    plain2, dart = start_together(
        lambda: Server(target, None, str(root / "plain-tp2.log"), env=TP2, extra=("--tp-size", "2")),
        lambda: Server(target, head, str(root / "dart-tp2.log"), extra=("--tp-size", "2"),
                       env={**TP2, "DART_TEST_LOGITS_LOG": str(logits_log), "DART_CHECK_TP_TREES": "1"}))
    try:
        want2 = serve_all(plain2)
        got = serve_all(dart)
        accepted = generate(dart, PROMPT_IDS[0], max_new_tokens=24)["meta_info"]["spec_accept_length"]
    finally:
        plain2.close()
        dart.close()
    assert want2 == want  # the plain server gives the same output at TP=2 as at TP=1
    assert got == want  # DART at TP=2: the same tokens, one at a time and four at once
    assert got[1] == got[0] and all(len(o) == NEW_TOKENS for o in got[0])
    assert accepted > 1.5
    checks = [json.loads(line) for line in logits_log.read_text().splitlines()]
    assert {c["rank"] for c in checks} == {0, 1}  # both ranks' head logits were checked
    assert max(c["max_abs_diff"] for c in checks) < 1e-4
    assert "different draft trees" not in (root / "dart-tp2.log").read_text()


def test_two_data_parallel_replicas(setup, plain_server):
    root, target, head = setup
    server = Server(target, head, str(root / "dart-dp2.log"), env=TP2, extra=("--dp-size", "2"))
    try:
        sequential, concurrent, _ = serve_all(server)
    finally:
        server.close()
    want = [generate(plain_server, ids)["output_ids"] for ids in PROMPT_IDS]
    assert sequential == want and concurrent == want
