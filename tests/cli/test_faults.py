"""Bad input and faults, as a careless or a hostile user would cause them: every case ends in a clear error (one line,
exit status 2 from the CLI) before any work, and never in lost work, code execution, a silent wrong result or a
hang. Each test names the fault it keeps from coming back."""

from __future__ import annotations

import json
import os
import random
import stat

import numpy as np
import pytest
import torch

import dart_hf
from dart_cli.main import main
from dart_core import DartHead, DartInputError, TreeConfig, build_draft_tree
from dart_train.data import read_shard, read_shards, write_shard
from dart_train.trainer import load_trainer_state
from helpers.hf_models import random_head, tiny_target


def one_line_error(argv, capsys, message) -> None:
    capsys.readouterr()  # what earlier calls printed
    rc = main([str(a) for a in argv])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "%|" not in line]  # no progress bars
    assert rc == 2 and len(err) == 1 and message in err[0], (rc, err)


def train_args(root, out, *more):
    return ["train", "--target", root / "target", "--data", root / "data", "--out", out, "--steps", "2",
            "--batch-size", "2", "--seq-len", "24", "--draft-length", "2", "--draft-vocab-size", "64", "--anchors",
            "4", "--tau-prompts", "0", "--no-progress", "--threads", "1", *more]


# ---- lost work ------------------------------------------------------------------------------------------------------
def test_train_refuses_an_existing_run_without_resume_or_force(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(root, out)]) == 0
    head_before = (out / "head" / "model.safetensors").read_bytes()
    one_line_error(train_args(root, out), capsys, "already holds a training run")
    assert (out / "head" / "model.safetensors").read_bytes() == head_before  # nothing replaced
    one_line_error(train_args(root, out, "--resume", "--force"), capsys, "give one")
    assert main([str(a) for a in train_args(root, out, "--force")]) == 0  # asked for: a fresh run, fresh logs
    steps = [json.loads(line)["step"] for line in (out / "train.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps))


def test_ngram_build_never_overwrites_one_of_its_inputs(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "shard-00000.npz"
    shard.write_bytes((root / "data" / "shard-00000.npz").read_bytes())
    before = shard.read_bytes()
    one_line_error(["ngram", "build", "--data", data, "--out", shard, "--force"], capsys, "overlaps the source")
    one_line_error(["ngram", "build", "--data", data, "--out", data / "ngram.safetensors", "--force"], capsys,
                   "overlaps the source")
    assert shard.read_bytes() == before and sorted(p.name for p in data.iterdir()) == ["shard-00000.npz"]


# every command with its inputs: (argv template, the input that a hostile destination names)
PROTECTED_INPUTS = [
    (["convert", "official", "{head}", "{dst}", "--target", "{target}"], "target"),
    (["convert", "official", "{head}", "{dst}"], "head"),
    (["convert", "sglang", "{head}", "{dst}", "--target", "{target}", "--num-target-layers", "4"], "target"),
    (["convert", "eagle3", "{head}", "{dst}", "--draft-length", "2"], "head"),
    (["convert", "trie", "{prompts}", "{dst}"], "prompts"),
    (["distill", "--target", "{target}", "--prompts", "{prompts}", "--out", "{dst}"], "prompts"),
    (["distill", "--target", "{target}", "--prompts", "{prompts}", "--out", "{dst}"], "target"),
    (["train", "--target", "{target}", "--data", "{data}", "--out", "{dst}"], "target"),
    (["train", "--target", "{target}", "--data", "{data}", "--out", "{dst}", "--init-from", "{head}"], "head"),
    (["ngram", "build", "--data", "{data}", "--out", "{dst}"], "data"),
    (["bench", "--data", "{data}", "--out", "{dst}", "--no-calibrate"], "data"),
    (["bench", "--head", "{head}", "--out", "{dst}", "--no-calibrate"], "head"),
]


@pytest.mark.parametrize("inside", [False, True], ids=["is", "inside"])
@pytest.mark.parametrize("argv,victim", PROTECTED_INPUTS, ids=lambda v: "-".join(v[:2]) if isinstance(v, list) else v)
def test_no_command_writes_over_or_into_a_path_it_reads(tmp_path, capsys, argv, victim, inside):
    """`convert official SRC T --target T --force` once replaced the target's weights with the head: every path any
    command reads is kept from being its destination, or holding it, by one rule before the command runs."""
    from helpers.official_heads import write_official_head, write_target

    paths = {"head": tmp_path / "head", "target": tmp_path / "target", "data": tmp_path / "data",
             "prompts": tmp_path / "prompts.jsonl"}
    write_official_head(paths["head"])
    write_target(paths["target"])
    (paths["target"] / "model.safetensors").write_bytes(b"the user's target weights")
    paths["data"].mkdir()
    (paths["data"] / "shard-00000.npz").write_bytes(b"the user's data")
    paths["prompts"].write_text('{"prompt": "hi"}\n')
    before = _tree(tmp_path)
    dst = paths[victim] / "out" if inside and paths[victim].is_dir() else paths[victim]
    force = ["--force"] if argv[0] in ("convert", "ngram", "train") else []  # the commands that replace with it
    one_line_error([a.format(dst=dst, **paths) for a in argv] + force, capsys, "overlaps the source")
    assert _tree(tmp_path) == before


def _tree(path) -> dict:
    """Every file under `path` with its bytes."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def _kept(path):
    """A user's directory named like an old copy: it must come through every run untouched."""
    path.mkdir(parents=True)
    (path / "mine.txt").write_text("the user's own file")
    return path


def test_a_converter_never_deletes_a_source_or_sibling_named_like_its_old_copy(tmp_path, capsys):
    from helpers.official_heads import write_official_head, write_target

    src = tmp_path / "d" / "x.old"  # the source is named DST.old
    write_official_head(src)
    before = _tree(src)
    assert main(["convert", "official", str(src), str(tmp_path / "d" / "x")]) == 0
    assert _tree(src) == before
    assert main(["convert", "official", str(src), str(tmp_path / "d" / "x"), "--force"]) == 0  # a real swap
    assert _tree(src) == before
    official = tmp_path / "official"
    write_official_head(official)
    sibling = _kept(tmp_path / "out.old")  # an unrelated directory the user kept
    for _ in range(2):  # the second run replaces `out`
        assert main(["convert", "official", str(official), str(tmp_path / "out"), "--force", "--target",
                     str(write_target(tmp_path / "t"))]) == 0
    assert _tree(sibling) == {"mine.txt": b"the user's own file"}
    ours = tmp_path / "s" / "y.old"
    assert main(["convert", "official", str(official), str(ours), "--target", str(tmp_path / "t")]) == 0
    before = _tree(ours)
    for _ in range(2):
        assert main(["convert", "sglang", str(ours), str(tmp_path / "s" / "y"), "--force"]) == 0
    assert _tree(ours) == before
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x", "x.old"]


def test_train_distill_and_ngram_build_never_delete_a_sibling_named_like_their_old_copy(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    out = tmp_path / "run"
    siblings = [_kept(out / "head.old"), _kept(out / "checkpoint-latest.old"), _kept(tmp_path / "run.old")]
    for more in ((), ("--force",)):
        assert main([str(a) for a in train_args(root, out, *more)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello w{i}"}) + "\n" for i in range(2)))
    siblings.append(_kept(tmp_path / "distilled.old"))
    assert main(["distill", "--target", str(root / "target"), "--out", str(tmp_path / "distilled"), "--prompts",
                 str(prompts), "--max-new-tokens", "2"]) == 0
    siblings.append(_kept(tmp_path / "ng.safetensors.old"))
    for more in ((), ("--force",)):
        assert main(["ngram", "build", "--data", str(root / "data"), "--out", str(tmp_path / "ng.safetensors"),
                     *more]) == 0
    capsys.readouterr()
    for sibling in siblings:
        assert _tree(sibling) == {"mine.txt": b"the user's own file"}, sibling


def test_an_interrupted_swap_leaves_one_complete_copy_that_resume_finds(tiny_run, tmp_path, monkeypatch):
    from dart_core import io
    from dart_train import trainer

    root, _ = tiny_run
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(root, out)]) == 0
    saved = _tree(out / "checkpoint-latest")
    real_replace = os.replace

    def crash_on_the_second_rename(src, dst):
        if os.path.basename(str(src)).startswith(".tmp"):
            raise KeyboardInterrupt  # the process dies between the two renames
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", crash_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        with io.staged_directory(out / "checkpoint-latest", force=True) as tmp:
            (trainer.Path(tmp) / "new").write_text("new")
    monkeypatch.undo()
    assert (out / "checkpoint-latest").is_dir()  # put back by the failing swap
    # the same crash with nobody left to put it back: only the set-aside copy remains
    aside = io.make_temp_dir(out, ".old-checkpoint-latest-")
    real_replace(out / "checkpoint-latest", os.path.join(aside, "checkpoint-latest"))
    assert trainer.find_checkpoint(out) == trainer.Path(aside) / "checkpoint-latest"
    assert _tree(trainer.find_checkpoint(out)) == saved
    assert os.path.relpath(aside, out) in trainer.run_files(out)


# ---- no code execution from files -------------------------------------------------------------------------------------
class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_never_runs_code_from_a_crafted_checkpoint(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(root, out, "--stop-at", "1")]) == 0
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = marker
    state = out / "checkpoint-latest" / "trainer_state.pt"
    torch.save({"step": 1, "evil": payload}, state)
    one_line_error(train_args(root, out, "--resume"), capsys, "not a readable trainer state")
    assert not marker.exists()
    state.write_bytes(random.Random(0).randbytes(300))  # corrupt
    one_line_error(train_args(root, out, "--resume"), capsys, "not a readable trainer state")


def corruptions(good: bytes, seeds: int):
    """(kind, bytes): for each seed, random bytes, a truncation and a copy with a few bytes overwritten."""
    for seed in range(seeds):
        rng = random.Random(seed)
        flipped = bytearray(good)
        for _ in range(5):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        yield "random", rng.randbytes(rng.randrange(1, 2 * len(good)))
        yield "truncated", good[:rng.randrange(len(good))]
        yield "overwritten", bytes(flipped)


def test_any_corrupt_trainer_state_is_a_clear_error(tmp_path):
    # garbage once reached the weights-only unpickler's IndexError/KeyError, a traceback instead of one line
    good = tmp_path / "good.pt"
    torch.save({"step": 3, "optimizer": {"state": {0: {"exp_avg": torch.randn(8)}}}, "scheduler": {"last_epoch": 3},
                "rng": {"torch": torch.get_rng_state()}, "config": {"lr": 1e-3}}, good)
    bad = tmp_path / "bad.pt"
    for kind, data in corruptions(good.read_bytes(), seeds=300):
        bad.write_bytes(data)
        try:
            state = load_trainer_state(bad)
        except DartInputError as err:
            assert str(bad) in str(err) and "\n" not in str(err)
        else:  # a byte inside tensor data changes a value, which no reader can see
            assert kind == "overwritten" and state["step"] == 3


def test_any_corrupt_shard_is_a_clear_error(tmp_path):
    # a damaged .npy header once reached numpy's tokenizer error, a traceback instead of one line
    good = tmp_path / "good.npz"
    write_shard(good, [np.arange(40) % 7, np.arange(25) % 5], [3, 4])
    bad = tmp_path / "bad.npz"
    for _, data in corruptions(good.read_bytes(), seeds=300):
        bad.write_bytes(data)
        with pytest.raises(DartInputError, match="bad.npz"):
            read_shard(bad)


def test_a_head_config_cannot_point_at_files_outside_its_directory(tmp_path):
    target = tiny_target()
    head = random_head(target)
    head.save_pretrained(tmp_path / "head")
    secret = tmp_path / "elsewhere.safetensors"
    secret.write_bytes(b"x")
    for name in ("../elsewhere.safetensors", str(secret), "/etc/passwd"):
        config = json.loads((tmp_path / "head" / "config.json").read_text())
        config["dart_ngram_file"] = name
        (tmp_path / "head" / "config.json").write_text(json.dumps(config))
        with pytest.raises(DartInputError, match="outside the head directory"):
            DartHead.from_pretrained(tmp_path / "head")


# ---- one line instead of a traceback ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage,message", [
    (lambda b: random.Random(0).randbytes(len(b)), "not a readable data shard"),
    (lambda b: b[: len(b) // 2], "not a readable data shard"),
    (lambda b: b"", "not a readable data shard"),
])
def test_corrupt_shards_are_one_line(tiny_run, tmp_path, capsys, damage, message):
    root, _ = tiny_run
    data = tmp_path / "data"
    data.mkdir()
    good = (root / "data" / "shard-00000.npz").read_bytes()
    (data / "shard-00000.npz").write_bytes(damage(good))
    one_line_error(["ngram", "build", "--data", data, "--out", tmp_path / "n.safetensors"], capsys, message)


def test_internal_errors_keep_their_traceback(monkeypatch, capsys):
    """Only bad input (DartInputError, UsageError among them) and the file system's answers (OSError) are one line: a
    ValueError or IndexError from inside the code is a bug, and its traceback is what a bug report needs."""
    import dart_cli.demo

    def fails(error):
        def verify(*args, **kwargs):
            raise error
        return verify

    for error in (ValueError("shapes [2, 3] and [3, 2] do not broadcast"), IndexError("index 7 is out of bounds"),
                  TypeError("unsupported operand")):
        monkeypatch.setattr(dart_cli.demo, "verify_greedy", fails(error))
        with pytest.raises(type(error), match=str(error).split()[0]):
            main(["demo", "--core", "--batch-size", "1"])
        assert "error:" not in capsys.readouterr().err
    # the same place raising bad input or a file-system error: one line, exit status 2
    for error, message in ((DartInputError("TreeConfig.topk must be a positive integer"), "topk must be"),
                           (PermissionError(13, "Permission denied", "/out"), "Permission denied: /out")):
        monkeypatch.setattr(dart_cli.demo, "verify_greedy", fails(error))
        one_line_error(["demo", "--core", "--batch-size", "1"], capsys, message)


def test_a_directory_where_a_shard_should_be_is_one_line(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "shard-00000.npz").mkdir(parents=True)
    one_line_error(["ngram", "build", "--data", data, "--out", tmp_path / "n.safetensors"], capsys, "not a file")


def test_a_bad_target_dtype_is_refused(tiny_run, tmp_path, capsys):
    from dart_train.trainer import TrainConfig

    root, _ = tiny_run
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in train_args(root, tmp_path / "o", "--target-dtype", "int8")])
    assert exit_.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(DartInputError, match="target_dtype must be one of float32, float16, bfloat16"):
        TrainConfig(data=[str(root / "data")], out=str(tmp_path / "o"), target_dtype="int8").validate()


@pytest.mark.parametrize("device,message", [("bogus", "is not one of auto, cpu, cuda"),
                                            ("cuda:0", "no CUDA device")])
def test_bad_devices_are_one_line(tiny_run, tmp_path, capsys, device, message):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    root, _ = tiny_run
    one_line_error(train_args(root, tmp_path / "o", "--device", device), capsys, message)
    one_line_error(["distill", "--target", root / "target", "--out", tmp_path / "d", "--text", __file__,
                    "--device", device], capsys, message)


def test_an_unwritable_output_is_one_line(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_error(["ngram", "build", "--data", root / "data", "--out", blocker / "n.safetensors"], capsys,
                   "is not a directory")


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 0, "hidden_size must be a positive integer"),
    ("hidden_size", "576", "hidden_size must be a positive integer"),
    ("draft_length", True, "draft_length must be a positive integer"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
    ("vocab_size", 10**12, "does not fit token ids in int32"),
    ("vocab_size", 2**30, "parameters"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a finite number > 0"),
    ("max_position_embeddings", 0, "max_position_embeddings must be a positive integer"),
    ("target_layer_ids", [2, True, 5], "target_layer_ids must name 3 layers"),
])
def test_bad_head_configs_are_refused_by_name(tmp_path, field, value, message):
    target = tiny_target()
    random_head(target).save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config.pop("head_dim")  # derived from hidden_size / num_attention_heads: those are checked first
    config[field] = value
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DartInputError, match=message):
        DartHead.from_pretrained(tmp_path / "head")


def test_token_ids_outside_the_vocabulary_are_refused_by_the_head():
    head = random_head(tiny_target())
    head.set_input_embeddings(torch.nn.Embedding(96, 32))
    aux = torch.randn(1, 3, 96)
    for bad in (96, -1):
        with pytest.raises(ValueError, match=f"token id {bad}, outside the vocabulary 0..95"):
            head(aux, torch.tensor([[1, bad, 2]]))


def test_token_ids_outside_the_vocabulary_are_refused_before_decoding():
    target = dart_hf.enable(tiny_target(), False)
    head = random_head(target)
    for bad in (96, -1):
        ids = torch.tensor([[1, 2, bad]])
        with pytest.raises(ValueError, match=f"token id {bad}, outside the target vocabulary 0..95"):
            target.generate(ids, attention_mask=torch.ones_like(ids), dart_head=head, max_new_tokens=4,
                            do_sample=False)


# ---- no silent wrong results ----------------------------------------------------------------------------------------
def _raw_shard(path, tokens, offsets, prompts):
    np.savez(path, tokens=np.asarray(tokens, np.int32), offsets=np.asarray(offsets, np.int64),
             prompt_lengths=np.asarray(prompts, np.int32))


@pytest.mark.parametrize("offsets,prompts,message", [
    ([0, 4, 2, 6], [1, 1, 1], "offsets decrease"),
    ([0, 3, 9], [1, 1], "do not match the token array"),
    ([0, 3, 6], [1, 5], "prompt length outside its sequence"),
])
def test_inconsistent_shards_are_refused(tmp_path, offsets, prompts, message):
    _raw_shard(tmp_path / "shard-00000.npz", range(6), offsets, prompts)
    with pytest.raises(DartInputError, match=message):
        list(read_shards(tmp_path))


def test_shards_keep_the_usual_file_permissions(tmp_path):
    write_shard(tmp_path / "shard-00000.npz", [[1, 2, 3]], [1])
    mode = stat.S_IMODE((tmp_path / "shard-00000.npz").stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


@pytest.mark.parametrize("probs", [float("nan"), -0.1, float("inf")])
def test_bad_draft_probabilities_build_no_tree(probs):
    tokens = torch.tensor([[5, 6], [7, 8]])
    p = torch.tensor([[0.6, 0.4], [0.5, probs]])
    with pytest.raises(ValueError, match="topk_probs must be probabilities"):
        build_draft_tree(tokens, p, [1], None, TreeConfig(topk=2, remain_total=3))


@pytest.mark.parametrize("settings,message", [
    ({"ngram_weight": float("nan")}, "ngram_weight must be a finite number"),
    ({"level_weight_exponent": float("inf")}, "level_weight_exponent"),
    ({"logit_weight_decay": 0.0}, "logit_weight_decay must be a finite number > 0"),
    ({"topk": True}, "topk must be a positive integer"),
    ({"eos_token_id": -1}, "eos_token_id must be an integer >= 0"),
    ({"remain_total": 100000}, "remain_total 100000 is above the supported 1024"),
])
def test_bad_tree_settings_are_refused(settings, message):
    with pytest.raises(DartInputError, match=message):
        TreeConfig(**settings)


def test_integer_weights_where_floats_belong_and_float_d2t_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target()
    random_head(target, draft_vocab=48).save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / "model.safetensors"
    state = load_file(str(weights))
    for key, tensor in (("d2t", state["d2t"].float()), ("fc.weight", state["fc.weight"].long())):
        save_file({**state, key: tensor}, str(weights))
        with pytest.raises(DartInputError, match=f"{key} is torch"):
            DartHead.from_pretrained(tmp_path / "head")


def test_demo_refuses_an_empty_prompt_and_an_oversized_tree(capsys):
    one_line_error(["demo", "--prompt", "  "], capsys, "--prompt is empty")
    one_line_error(["demo", "--remain-total", "100000"], capsys, "above the supported 1024")


def test_distill_into_a_directory_of_other_prompts_is_refused(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    prompts = tmp_path / "p.jsonl"
    out = tmp_path / "d"
    common = ["distill", "--target", root / "target", "--out", out, "--prompts", prompts, "--field", "q",
              "--batch-size", "2", "--max-new-tokens", "3"]
    prompts.write_text("".join(json.dumps({"q": f"hello w{i}"}) + "\n" for i in range(3)))
    assert main([str(a) for a in common]) == 0
    assert "wrote 2 new shard(s)" in capsys.readouterr().out
    assert main([str(a) for a in common]) == 0  # the same job: resumes, nothing to do
    assert "wrote 0 new shard(s)" in capsys.readouterr().out
    prompts.write_text("".join(json.dumps({"q": f"world w{i}"}) + "\n" for i in range(3)))
    one_line_error(common, capsys, "holds shards of another distillation (different prompts_sha256)")


# ---- unbounded work -------------------------------------------------------------------------------------------------
def test_an_impossible_ngram_order_fails_before_training(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    one_line_error(train_args(root, tmp_path / "o", "--ngram", "--ngram-order", "100"), capsys, "key space")
    assert not (tmp_path / "o" / "checkpoint-latest").exists()


def test_bench_refuses_a_file_as_report_directory_before_running(tmp_path, capsys):
    report = tmp_path / "report"
    report.write_text("x")
    one_line_error(["bench", "--out", report, "--no-charts"], capsys, "is a file")


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    from dart_core import io

    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "f").write_text("old")
    real_replace = os.replace

    def failing(src, dst):
        if os.path.basename(str(src)).startswith(".tmp"):  # the new directory's rename fails
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", failing)
    with pytest.raises(OSError):
        with io.staged_directory(dest, force=True) as tmp:
            (tmp_path / tmp / "f").write_text("new")
    assert (dest / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- plain generate()'s behaviour where DART used to raise ------------------------------------------------------
def test_a_float_attention_mask_is_taken_as_plain_generate_takes_it():
    model = dart_hf.enable(tiny_target(), False)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0], [1.0] * 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, dart_head=random_head(model), **kwargs), model.generate(ids, **kwargs))


def test_stop_strings_in_the_models_generation_config_with_a_tokenizer():
    from helpers.hf_models import char_tokenizer

    model = dart_hf.enable(tiny_target(), False)
    tokenizer = char_tokenizer()
    prompt = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])
    free = model.generate(prompt, max_new_tokens=16, do_sample=False)
    model.generation_config.stop_strings = [tokenizer.decode(free[0, 10:12])]
    plain = model.generate(prompt, max_new_tokens=16, do_sample=False, tokenizer=tokenizer)
    assert plain.shape[1] < free.shape[1]
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, tokenizer=tokenizer, dart_head=random_head(model))
    assert torch.equal(out, plain)


def test_inputs_embeds_are_named_as_unsupported():
    model = dart_hf.enable(tiny_target(), False)
    embeds = model.get_input_embeddings()(torch.tensor([[5, 17, 33]]))
    with pytest.raises(DartInputError, match="inputs_embeds is not supported"):
        model.generate(inputs_embeds=embeds, max_new_tokens=4, dart_head=random_head(model))


def test_demo_refuses_a_prompt_that_is_not_utf8_and_a_seed_beyond_64_bits(capsys):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    one_line_error(["demo", "--prompt", bad], capsys, "not valid UTF-8")
    one_line_error(["demo", "--core", "--seed", str(2 ** 70)], capsys, "--seed must be in")
