"""What the SGLang server modules share, made once per session: the tiny target and its heads, the HF reference and
one plain server (an idle server waits on its sockets, `--sleep-on-idle`, so keeping it costs no core)."""

from __future__ import annotations

import pytest
import torch

from helpers.sglang_env import ACCEPT_PROMPT, ACCEPT_TOKENS, TREE, Server, accepting_head, write_models


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """(root, target directory, random head directory converted for SGLang)."""
    root = tmp_path_factory.mktemp("sglang")
    target, head = write_models(root, draft_length=4, tree=TREE)
    return root, target, head


@pytest.fixture(scope="session")
def hf_target(models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)


@pytest.fixture(scope="session")
def accepting(models, hf_target) -> tuple[str, list[int]]:
    """(a head directory whose drafts the target accepts on `ACCEPT_PROMPT`, the target's greedy continuation)."""
    root, target, _ = models
    reference = hf_target.generate(torch.tensor([ACCEPT_PROMPT]), max_new_tokens=ACCEPT_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ACCEPT_PROMPT):].tolist()
    return accepting_head(target, hf_target, reference, root), reference


@pytest.fixture(scope="session")
def plain_server(models):
    """The target served without speculation (TP=1), for the whole session."""
    root, target, _ = models
    server = Server(target, None, str(root / "plain.log"), extra=("--constrained-json-disable-any-whitespace",))
    yield server
    server.close()
