"""Test-wide settings: one torch thread (on 2-core machines tiny-model tests run several times faster;
`DART_SPEC_TEST_THREADS=2` runs the suite at 2), an empty dart-spec cache of the session's own (what DART measures or
learns on this machine never comes from outside the run); the tiny training run shared by the trainer tests; and how
`pytest -n` (pytest-xdist, `--dist loadgroup`) shares the tests among its workers (`pytest_collection_modifyitems`)."""

import os

import pytest
import torch

from dart_train.data import write_shard
from helpers.hf_models import tiny_target


# the modules that share the session's SGLang servers (tests/sglang/conftest.py) run on one worker, one after another
SHARED_SERVERS = ("test_sglang_server.py", "test_sglang_tp.py")


def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` a module's tests run on one worker in their order (as without workers), and the
    modules that share the session's SGLang servers run on one worker together."""
    for item in items:
        group = "sglang-servers" if item.path.name in SHARED_SERVERS else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True, scope="session")
def session_cache(tmp_path_factory):
    """`DART_SPEC_CACHE` for the whole session: a new empty directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DART_SPEC_CACHE", str(tmp_path_factory.mktemp("dart-spec-cache")))
        yield


TEST_THREADS = int(os.environ.get("DART_SPEC_TEST_THREADS", "1"))  # the suite's verdict must not depend on it


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny target saved as a model directory and shards of its own greedy continuations of random prompts."""
    root = tmp_path_factory.mktemp("train")
    target = tiny_target(seed=3)
    target.save_pretrained(root / "target")
    _word_tokenizer().save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 96, (48, 6), generator=g)
    with torch.no_grad():
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=34, do_sample=False)
    data = root / "data"
    data.mkdir()
    sequences = [row.tolist() for row in out]
    write_shard(data / "shard-00000.npz", sequences[:24], [6] * 24)
    write_shard(data / "shard-00001.npz", sequences[24:], [6] * 24)
    return root, target


def _word_tokenizer():
    """A 96-word tokenizer (ids fit the tiny target) with a one-line chat template, for the distill/text commands."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<eos>"] + [f"w{i}" for i in range(90)] + ["hello", "world", "user"]
    model = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}user {{ m['content'] }} {% endfor %}"
    return tok
