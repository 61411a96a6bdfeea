"""The training commands lose nothing and measure honestly (issue 57): `dart-spec prompts` never removes or rewrites
what it did not write and answers damaged files in one line; the held-out split is by content, so data given twice
never leaks held-out sequences into training; `--data-weights` repeats data without copies; every numeric option is
checked as the command line is parsed. Each test names the fault it keeps from coming back."""

from __future__ import annotations

import json
import shutil
import tracemalloc

import numpy as np
import pytest

from dart_cli.main import main
from dart_core import DartInputError
from dart_train.data import read_shards, write_shard
from dart_train.trainer import TrainConfig, Trainer, heldout_mask
from helpers.hf_models import turn_writer
from helpers.train_configs import tiny_train_config


def one_line(argv, capsys, *words) -> str:
    """Run `dart-spec argv`: exit status 2 and one line on stderr holding every one of `words`; returns the line."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "%|" not in line]  # no progress bars
    assert rc == 2 and len(err) == 1 and all(w in err[0] for w in words), (rc, err)
    return err[0]


# ---- `dart-spec prompts`: nothing a user wrote is lost ---------------------------------------------------------------
@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    """A tiny target directory whose word tokenizer ends a user message with the special token <eot>, made likely,
    so sampled user turns end; and the argv of `dart-spec prompts` with it (without --out and --count)."""
    target, tok = turn_writer()
    root = tmp_path_factory.mktemp("writer")
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return ["prompts", "--target", str(root / "target"), "--batch-size", "8", "--max-new-tokens", "16",
            "--min-chars", "8", "--threads", "1", "--device", "cpu"]


def _written(writer, out, count, capsys):
    """`dart-spec prompts` to `count` turns into `out`; (the output's bytes, the state file's bytes)."""
    assert main([*writer, "--out", str(out), "--count", str(count)]) in (0, 1)
    capsys.readouterr()
    return out.read_bytes(), out.with_name(out.name + ".state.json").read_bytes()


def test_lines_added_after_the_last_batch_are_kept_and_the_run_refuses(writer, tmp_path, capsys):
    # the fault: a resumed run cut the file back to its state's length, deleting the user's lines, with exit 0
    out = tmp_path / "turns.jsonl"
    text, state = _written(writer, out, 5, capsys)
    added = text + '{"prompt": "a line I wrote myself and want to keep"}\n'.encode()
    out.write_bytes(added)
    line = one_line([*writer, "--out", out, "--count", 12], capsys, str(out), f"offset {len(text)}")
    assert "not written by" in line
    assert out.read_bytes() == added and out.with_name(out.name + ".state.json").read_bytes() == state
    one_line([*writer, "--out", out, "--count", 5], capsys, f"offset {len(text)}")  # nothing to draw: still refused
    assert out.read_bytes() == added


def _same_length(payload: bytes, line: bytes) -> bytes:
    """`payload` padded with spaces to the length of `line` (newline included): the file keeps its length."""
    assert len(payload) < len(line)
    return payload + b" " * (len(line) - 1 - len(payload)) + b"\n"


@pytest.mark.parametrize("payload,words", [
    (b"not json at all", ["turns.jsonl:2:", "not valid JSON"]),
    (b'{"other": "no prompt key"}', ["turns.jsonl:2:", "string \"prompt\""]),
    (b'{"prompt": 12}', ["turns.jsonl:2:", "string \"prompt\""]),
    (b'{"prompt": "caf\xe9 latte"}', ["turns.jsonl:2:", "not UTF-8"]),
])
def test_a_line_edited_inside_the_recorded_bytes_is_one_error_and_nothing_changes(writer, tmp_path, capsys, payload,
                                                                                  words):
    # the fault: an edited line (not JSON, no "prompt", not UTF-8) ended in a traceback
    out = tmp_path / "turns.jsonl"
    text, state = _written(writer, out, 5, capsys)
    lines = text.splitlines(keepends=True)
    lines[1] = _same_length(payload, lines[1])
    edited = b"".join(lines)
    out.write_bytes(edited)
    one_line([*writer, "--out", out, "--count", 12], capsys, *words)
    assert out.read_bytes() == edited and out.with_name(out.name + ".state.json").read_bytes() == state


@pytest.mark.parametrize("field,value", [("bytes", "120"), ("kept", "5"), ("dropped", [1]), ("batches", True),
                                         ("settings", [])])
def test_a_state_field_of_the_wrong_type_is_one_error_and_nothing_changes(writer, tmp_path, capsys, field, value):
    # the fault: "bytes" or "kept" a string, "dropped" a list ended in a traceback
    out = tmp_path / "turns.jsonl"
    text, _ = _written(writer, out, 5, capsys)
    state_file = out.with_name(out.name + ".state.json")
    state = json.loads(state_file.read_text())
    state[field] = value
    state_file.write_text(json.dumps(state))
    damaged = state_file.read_bytes()
    one_line([*writer, "--out", out, "--count", 12], capsys, str(state_file), f'"{field}"')
    assert out.read_bytes() == text and state_file.read_bytes() == damaged


def test_a_state_whose_turns_disagree_with_the_file_is_one_error(writer, tmp_path, capsys):
    out = tmp_path / "turns.jsonl"
    text, _ = _written(writer, out, 5, capsys)
    first, second, *rest = text.splitlines(keepends=True)
    joined = first[:-2] + b", " + second[1:]  # two turns made one line of the same length: a JSON object still
    merged = b"".join([joined[:-1] + b" " * (len(first) + len(second) - len(joined)) + b"\n", *rest])
    assert len(merged) == len(text)
    out.write_bytes(merged)
    one_line([*writer, "--out", out, "--count", 12], capsys, str(out), "turns where its state")
    assert out.read_bytes() == merged


def test_a_missing_output_beside_its_state_is_refused_without_creating_it(writer, tmp_path, capsys):
    # the fault: the run created an empty output before it refused
    out = tmp_path / "turns.jsonl"
    _written(writer, out, 5, capsys)
    out.unlink()
    one_line([*writer, "--out", out, "--count", 12], capsys, "is missing")
    assert not out.exists()


# ---- the held-out split: by content ---------------------------------------------------------------------------------
def test_the_same_data_directory_twice_is_refused(tiny_run, tmp_path, capsys):
    # the fault: `--data A A` (or `A A/`) was accepted and the held-out loss measured on training sequences
    root, _ = tiny_run
    data = str(root / "data")
    for twice in ([data, data], [data, data + "/"], [data, str(root / "." / "data")]):
        with pytest.raises(DartInputError, match="twice"):
            tiny_train_config(root, tmp_path / "o", data=twice).validate()
        one_line(["train", "--target", root / "target", "--out", tmp_path / "o", "--data", *twice], capsys,
                 "twice", str((root / "data").resolve()))
    assert not (tmp_path / "o").exists()


def test_copies_of_a_sequence_are_never_split_between_held_out_and_training(tiny_run, tmp_path):
    # the fault: the split hashed each sequence's index in the concatenation, so a copy of a held-out sequence
    # (the same directory copied, an answer distilled twice) was trained on
    root, target = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(root / "data", copy)
    trainer = Trainer(tiny_train_config(root, tmp_path / "o", data=[str(root / "data"), str(copy)],
                                        heldout_fraction=0.2),
                      model=target)
    held = {tuple(t.tolist()) for t, _ in trainer.heldout_sequences}
    trained = {tuple(t.tolist()) for t, _ in trainer.train_sequences}
    assert held and trained and not held & trained
    alone = Trainer(tiny_train_config(root, tmp_path / "a", heldout_fraction=0.2), model=target)
    assert held == {tuple(t.tolist()) for t, _ in alone.heldout_sequences}  # the copy changes nothing held out
    tokens = [t for t, _ in read_shards(root / "data")]
    mask = heldout_mask(tokens + tokens[::-1], 0.2)  # order and place do not matter, content does
    assert np.array_equal(mask[: len(tokens)], mask[len(tokens):][::-1])


# ---- `--data-weights`: repeats without copies -----------------------------------------------------------------------
def _traced_peak(build) -> int:
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_data_weight_makes_no_copies_and_memory_does_not_grow_with_it(tiny_run, tmp_path):
    # the fault: the weight materialised that many copies of every window in one list (1e9: killed for memory)
    root, target = tiny_run
    second = tmp_path / "second"
    second.mkdir()
    write_shard(second / "shard-00000.npz", [t[::-1] for t, _ in read_shards(root / "data")][:16], [0] * 16)
    data = [str(root / "data"), str(second)]
    trainers = {}

    def build(weights):
        def run():
            out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
            trainer = Trainer(tiny_train_config(root, out, data=data, data_weights=weights), model=target)
            trainer.samples_for(0), trainer.samples_for(12345)
            trainers[weights[0]] = trainer
        return run

    build([1, 1])()  # first-use allocations (imports, caches) outside the measurement
    light, heavy = _traced_peak(build([1, 1])), _traced_peak(build([1000, 1]))
    print(f"traced peak: weights 1 1 {light / 2**20:.2f} MiB, 1000 1 {heavy / 2**20:.2f} MiB")
    assert len(trainers[1000].train_windows) == len(trainers[1].train_windows)
    assert heavy < light + 2**20, (heavy, light)  # measured: 0.13 and 0.15 MiB; with copies 0.13 and 22 MiB
    first, n = int(trainers[1].order.window_start[1]), len(trainers[1].train_windows)  # the first directory's
    assert trainers[1000]._batches_per_epoch == (1000 * first + (n - first)) // 4


def test_a_data_weight_past_the_bound_is_refused(tiny_run, tmp_path, capsys):
    # the fault: `--data-weights 1000000000 1` was accepted (and the process killed for memory 86 s later)
    root, _ = tiny_run
    (tmp_path / "second").mkdir()
    data = [str(root / "data"), str(tmp_path / "second")]
    with pytest.raises(DartInputError, match="at most 10000"):
        tiny_train_config(root, tmp_path / "o", data=data, data_weights=[10**9, 1]).validate()
    one_line(["train", "--target", root / "target", "--out", tmp_path / "o", "--data", *data, "--data-weights",
              str(10**9), "1"], capsys, "--data-weights must be an integer in 1..10000, got 1000000000")


def test_the_weighted_order_repeats_each_window_its_weight_times_per_epoch():
    from dart_train.trainer import Permutation, WeightedOrder

    lengths = np.arange(3, 3 + 10)
    order = WeightedOrder(lengths, [(0, 4, 5), (4, 6, 1)], per=2, seed=7)  # 4 windows x5 + 6 windows x1 = 26
    assert order.batches == 13
    epoch = np.concatenate([order.batch(s) for s in range(13)])
    assert np.bincount(epoch, minlength=10).tolist() == [5] * 4 + [1] * 6
    again = np.concatenate([order.batch(s) for s in range(13, 26)])
    assert sorted(again.tolist()) == sorted(epoch.tolist()) and again.tolist() != epoch.tolist()  # a new shuffle
    for n in (1, 2, 3, 17, 1000, 4097):
        assert sorted(Permutation(n, n)(np.arange(n)).tolist()) == list(range(n))


# ---- numbers: checked as the command line is parsed ----------------------------------------------------------------
@pytest.mark.parametrize("more,words", [
    (["--seed", str(2**64)], ["--seed must be an integer in 0..2**64-1"]),
    (["--seed", "-1"], ["--seed must be an integer >= 0, got -1"]),
    (["--steps", "abc"], ["--steps must be", "'abc'"]),
    (["--anchors", "1e3"], ["--anchors must be", "'1e3'"]),
])
def test_train_numbers_are_refused_in_one_line_before_any_work(tiny_run, tmp_path, capsys, more, words):
    # the fault: a seed past 64 bits ended in a traceback; a word where a number goes ended in argparse's usage text
    root, _ = tiny_run
    one_line(["train", "--target", root / "target", "--data", root / "data", "--out", tmp_path / "o", *more], capsys,
             *words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("more,words", [
    (["--temperature", "nan"], ["--temperature must be a finite number", "'nan'"]),
    (["--temperature", "1e-300"], ["--temperature must be a finite number >= 1e-06"]),
    (["--seed", str(2**64)], ["--seed must be an integer in 0..2**64-1"]),
    (["--seed", "-3"], ["--seed must be an integer >= 0"]),
    (["--min-chars", "20", "--max-chars", "10"], ["--max-chars 10 is below --min-chars 20"]),
])
def test_prompts_numbers_are_refused_in_one_line_before_any_work(writer, tmp_path, capsys, more, words):
    # the fault: `prompts --temperature nan` and a seed past 64 bits ended in tracebacks after the model loaded
    one_line([*writer, "--out", tmp_path / "p.jsonl", "--count", "3", *more], capsys, *words)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("more,words", [
    (["--temperature", "nan"], ["--temperature must be a finite number"]),
    (["--sample-seed", str(2**64)], ["--sample-seed must be an integer in 0..2**64-1"]),
    (["--seed", str(2**64)], ["--seed must be an integer in 0..2**64-1"]),
])
def test_distill_numbers_are_refused_in_one_line_before_any_work(writer, tmp_path, capsys, more, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\n')
    one_line(["distill", "--target", writer[2], "--out", tmp_path / "d", "--prompts", prompts, "--max-new-tokens",
              "2", *more], capsys, *words)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("argv,words", [
    (["convert", "eagle3", "{tmp}/src", "{tmp}/dst", "--draft-length", "2", "--seed", str(2**64)],
     ["dart-spec convert: error: --seed must be an integer in 0..2**64-1"]),
    (["convert", "widen", "{tmp}/src", "{tmp}/dst", "--intermediate-size", "48", "--seed", "-1"],
     ["--seed must be an integer >= 0"]),
    (["bench", "--out", "{tmp}/b", "--temperatures", "0", "nan"], ["--temperatures must be a finite number >= 0"]),
    (["bench", "--out", "{tmp}/b", "--seed", str(2**64)], ["--seed must be an integer in 0..9223372036854775807"]),
    (["calibrate", "{tmp}/head", "--max-new-tokens", "many"], ["--max-new-tokens must be an integer", "'many'"]),
])
def test_numbers_of_the_other_commands_are_refused_in_one_line(tmp_path, capsys, argv, words):
    one_line([a.format(tmp=tmp_path) for a in argv], capsys, *words)
    assert not list(tmp_path.iterdir())


def test_the_library_checks_the_same_numbers(writer, tmp_path):
    from dart_train.data import check_sampling
    from dart_train.user_turns import write_user_turns

    with pytest.raises(DartInputError, match="temperature must be a finite number"):
        write_user_turns(None, None, tmp_path / "p.jsonl", count=3, temperature=float("nan"))
    with pytest.raises(DartInputError, match="seed must be an integer in 0..2\\*\\*64-1"):
        write_user_turns(None, None, tmp_path / "p.jsonl", count=3, seed=2**64)
    with pytest.raises(DartInputError, match="sampling temperature must be a finite number"):
        check_sampling({"temperature": float("nan"), "top_p": 1.0, "seed": 0})
    with pytest.raises(DartInputError, match="seed must be in 0..2\\*\\*64-1"):
        TrainConfig(data=[str(tmp_path)], out=str(tmp_path / "o"), seed=2**64).validate()
    assert not list(tmp_path.iterdir())


def test_any_seed_in_range_trains(tiny_run, tmp_path):
    # the fault: seeds the trainer derives (seed * 1_000_003 + ...) overflowed torch's 64 bits past seed ~4e9
    root, target = tiny_run
    trainer = Trainer(tiny_train_config(root, tmp_path / "o", seed=2**64 - 1, steps=1), model=target)
    assert trainer.run()["step"] == 1
