"""dart_train: the multi-anchor training forward equals the inference forward, the loss, the draft vocabulary, the
trainer (loss goes down, resume is exact) and the `train` / `ngram build` / `distill` commands."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dart_core import head_math
from dart_cli.main import main
from dart_core import DartHead, NGramModel, TreeConfig
from dart_train.data import read_shards, write_shard
from dart_train.features import collate, target_features
from dart_train.loss import TrainingForward, anchor_range, choose_anchors, dart_loss, kl_and_agreement
from dart_train.trainer import TrainConfig, Trainer, heldout_mask, lr_factor, split_windows, train
from dart_train.vocab import build_draft_vocab, count_tokens, draft_vocab_buffers, select_draft_tokens
from helpers.hf_models import random_head, tiny_target, turn_writer
from helpers.train_configs import tiny_train_config

torch.set_num_threads(1)


# ---- the training forward -----------------------------------------------------------------------------------------
def _head_and_inputs(seed: int, draft_length: int, n: int = 13, batch: int = 2):
    target = tiny_target(seed=seed)
    head = random_head(target, draft_length=draft_length, draft_vocab=48, seed=seed + 1)
    head.set_input_embeddings(target.get_input_embeddings())
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, n, 3 * head.config.target_hidden_size, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (batch, n), generator=g)
    # first/last real row, a repeated anchor, anchors in any order
    anchors = torch.tensor([[0, 5, n - 1, 3], [7, 7, 2, n - 2]])[:batch]
    return head, aux, ids, anchors


def _max_error_vs_inference(head, aux, ids, anchors) -> float:
    """Largest |training output - inference output on the prefix| over all anchors and all D+1 positions."""
    with torch.no_grad():
        real, blocks = head.training_forward(aux, ids, anchors)
        err = 0.0
        for b in range(anchors.shape[0]):
            for a in range(anchors.shape[1]):
                p = int(anchors[b, a])
                reference = head(aux[b:b + 1, : p + 1], ids[b:b + 1, : p + 1])[0]  # [D+1, Vd]
                got = torch.cat((real[b, p:p + 1], blocks[b, a]))
                err = max(err, float((reference - got).abs().max()))
    return err


@pytest.mark.parametrize("seed,draft_length", [(0, 4), (1, 1), (2, 6)])
def test_training_forward_equals_inference_forward_per_anchor(seed, draft_length):
    head, aux, ids, anchors = _head_and_inputs(seed, draft_length)
    assert _max_error_vs_inference(head, aux, ids, anchors) < 1e-5


def _blocks_see_each_other(see, n):
    see[:, n:, n:] = True


def _blocks_see_later_real_rows(see, n):
    see[:, n:, :n] = True


def _real_rows_see_blocks(see, n):
    see[:, :n, n:] = True


@pytest.mark.parametrize("broken", [_blocks_see_each_other, _blocks_see_later_real_rows, _real_rows_see_blocks])
def test_a_leaky_training_mask_fails_the_equivalence_check(monkeypatch, broken):
    head, aux, ids, anchors = _head_and_inputs(0, 4)
    n = ids.shape[1]
    training_columns = n + anchors.shape[1] * 4  # the inference passes of the check are shorter
    visibility = head_math.visibility

    def leaky(queries, keys):
        see = visibility(queries, keys)
        if see.shape[-1] == training_columns:
            broken(see, n)
        return see

    monkeypatch.setattr(head_math, "visibility", leaky)
    assert _max_error_vs_inference(head, aux, ids, anchors) > 1e-2


def test_training_mask_hand_case():
    # N = 3 real rows, D = 2, anchors (1, 0): rows 0-2 real, 3-4 block of anchor 1, 5-6 block of anchor 0
    rows = head_math.training_rows(torch.tensor([[1, 0]]), 3, 2)
    see = head_math.visibility(rows, rows)[0].int().tolist()
    assert see == [[1, 0, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0, 0],
                   [1, 1, 0, 1, 0, 0, 0],
                   [1, 1, 0, 1, 1, 0, 0],
                   [1, 0, 0, 0, 0, 1, 0],
                   [1, 0, 0, 0, 0, 1, 1]]
    assert rows.positions().tolist() == [[0, 1, 2, 2, 3, 1, 2]]


# ---- loss, eligibility, anchors -----------------------------------------------------------------------------------
def test_kl_and_accuracy_hand_case():
    target = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    head = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    kl, agree = kl_and_agreement(target, head)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.0
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    assert agree.tolist() == [False]
    kl, agree = kl_and_agreement(target + 3.0, target)  # shift-invariant: identical distributions
    assert kl.item() == pytest.approx(0.0, abs=1e-6) and agree.tolist() == [True]


def test_loss_eligibility_and_weighting_hand_case():
    # one sequence of T = 6 tokens with a 3-token prompt; N = 5 real rows; D = 2; anchors 0 and 2
    vd, d, t = 3, 2, 6
    teacher = torch.zeros(1, t, vd)
    teacher[0, :, 0] = 5.0  # the teacher always prefers draft token 0
    real = torch.zeros(1, t - 1, vd)  # uniform head at k = 0 -> KL = KL(teacher || uniform), wrong argmax? tie -> 0
    blocks = torch.zeros(1, 2, d, vd)
    blocks[..., 1] = 5.0  # the blocks prefer token 1: wrong
    anchors, valid = torch.tensor([[0, 2]]), torch.tensor([[True, True]])
    out = dart_loss(real, blocks, teacher, anchors, valid, torch.tensor([t]), torch.tensor([3]), gamma=0.5)
    # k=0: real row p predicts x[p+2]; eligible when 3 <= p+2 < 6 -> p = 1, 2, 3
    # k=1: anchor p predicts x[p+3]: anchor 0 -> 3 (ok), anchor 2 -> 5 (ok)
    # k=2: x[p+4]: anchor 0 -> 4 (ok), anchor 2 -> 6 (past the end)
    assert out.count.tolist() == [3, 2, 1]
    p = torch.softmax(torch.tensor([5.0, 0.0, 0.0]), 0)
    kl_uniform = float((p * (p.log() - math.log(1 / 3))).sum())
    q = torch.log_softmax(torch.tensor([0.0, 5.0, 0.0]), 0)
    kl_wrong = float((p * (p.log() - q)).sum())
    assert out.kl == pytest.approx([kl_uniform, kl_wrong, kl_wrong], abs=1e-5)
    assert out.accuracy == [1.0, 0.0, 0.0]  # argmax of an all-zero row is token 0, as the teacher's
    assert out.loss.item() == pytest.approx(kl_uniform + 0.5 * kl_wrong + 0.25 * kl_wrong, abs=1e-5)
    # a prompt covering everything leaves nothing eligible and a zero loss
    none = dart_loss(real, blocks, teacher, anchors, valid, torch.tensor([t]), torch.tensor([t]), gamma=0.5)
    assert none.count.tolist() == [0, 0, 0] and none.loss.item() == 0.0
    # invalid anchors do not count
    half = dart_loss(real, blocks, teacher, anchors, torch.tensor([[True, False]]), torch.tensor([t]),
                     torch.tensor([3]), gamma=0.5)
    assert half.count.tolist() == [3, 1, 1]


def test_loss_uses_the_teacher_at_the_shifted_position():
    # output k of anchor p is scored against the teacher's row p+1+k: put a distinct argmax in every teacher row
    vd, t, d = 8, 8, 3
    teacher = torch.full((1, t, vd), -10.0)
    for pos in range(t):
        teacher[0, pos, pos] = 10.0
    real = torch.full((1, t - 1, vd), -10.0)
    for p in range(t - 1):
        real[0, p, p + 1] = 10.0
    blocks = torch.full((1, 1, d, vd), -10.0)
    anchor = 2
    for j in range(1, d + 1):
        blocks[0, 0, j - 1, anchor + 1 + j] = 10.0
    out = dart_loss(real, blocks, teacher, torch.tensor([[anchor]]), torch.tensor([[True]]), torch.tensor([t]),
                    torch.tensor([0]))
    assert out.accuracy == [1.0] * (d + 1)
    assert max(out.kl) < 1e-6


def test_choose_anchors_keeps_only_useful_positions():
    # T = 20, prompt 15, D = 2: an anchor p is useful when some k in 1..2 has 15 <= p+2+k < 20 -> p in 11..16
    assert anchor_range(20, 15, 2) == (11, 17)
    g = torch.Generator().manual_seed(0)
    anchors, valid = choose_anchors(torch.tensor([20, 5, 2]), torch.tensor([15, 0, 0]), 4, 2, g)
    assert valid[0].all() and set(anchors[0].tolist()) <= set(range(11, 17)) and len(set(anchors[0].tolist())) == 4
    assert anchors[1].tolist() == [0, 1, 0, 0] and valid[1].tolist() == [True, True, False, False]
    assert not valid[2].any()


# ---- draft vocabulary ---------------------------------------------------------------------------------------------
def test_draft_vocab_hand_case():
    sequences = [(np.array([9, 9, 5, 3, 3, 7]), 2), (np.array([7, 3, 1]), 0)]
    # response tokens: 5 3 3 7 | 7 3 1 -> counts 3:3, 7:2, 5:1, 1:1
    counts = count_tokens(sequences, 10)
    assert counts.tolist() == [0, 1, 0, 3, 0, 1, 0, 2, 0, 0]
    assert select_draft_tokens(counts, 3).tolist() == [1, 3, 7]  # 3, 7, then the tie 1/5 -> smaller id 1
    assert select_draft_tokens(counts, 6).tolist() == [0, 1, 2, 3, 5, 7]  # 4 seen + lowest unused 0, 2
    target_ids, d2t, t2d = build_draft_vocab(sequences, 10, 3)
    assert d2t.tolist() == [1, 2, 5] and (torch.arange(3) + d2t).tolist() == [1, 3, 7]
    assert t2d.nonzero().flatten().tolist() == [1, 3, 7]
    assert count_tokens(sequences, 10, responses_only=False)[9] == 2
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_tokens([(np.array([12]), 0)], 10)
    with pytest.raises(ValueError):
        draft_vocab_buffers(np.array([3, 2]), 10)


# ---- features, data split, schedule --------------------------------------------------------------------------------
def test_target_features_restricted_logits_and_taps():
    target = tiny_target()
    batch = collate([(np.array([1, 2, 3, 4, 5]), 2), (np.array([7, 8, 9]), 0)])
    assert batch.input_ids[1].tolist() == [7, 8, 9, 0, 0] and batch.attention_mask[1].tolist() == [1, 1, 1, 0, 0]
    ids = torch.tensor([0, 5, 17, 95])
    aux, logits = target_features(target, (2, 3, 3), batch.input_ids, batch.attention_mask, ids)
    with torch.no_grad():
        ref = target(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    assert torch.allclose(logits, ref.logits[..., ids], atol=1e-5)
    assert torch.equal(aux[..., :32], ref.hidden_states[2]) and torch.equal(aux[..., 64:], ref.hidden_states[3])


def test_split_windows_and_heldout_split():
    seq = np.arange(10)
    # windows of 4: [0..3] prompt 3, [4..7] prompt 0, [8, 9] too short
    windows = split_windows([(seq, 3)], 4)
    assert [(w.tolist(), p) for w, p in windows] == [([0, 1, 2, 3], 3), ([4, 5, 6, 7], 0)]
    assert split_windows([(seq, 9)], 4) == []  # nothing left to predict after the prompt in any window
    distinct = [np.array([i, i + 1]) for i in range(1000)]
    mask = heldout_mask(distinct, 0.02)
    assert 5 <= mask.sum() <= 40 and np.array_equal(mask, heldout_mask(distinct, 0.02))
    assert heldout_mask(distinct[:3], 0.02).sum() == 1 and heldout_mask(distinct[:3], 0.0).sum() == 0
    assert lr_factor(0, 4, 20) == 0.25 and lr_factor(3, 4, 20) == 1.0 and lr_factor(20, 4, 20) == pytest.approx(0)


# ---- the trainer ----------------------------------------------------------------------------------------------------
def test_training_loss_decreases(tiny_run, tmp_path):
    root, target = tiny_run
    cfg = tiny_train_config(root, tmp_path / "out", steps=60, lr=1e-2, warmup_steps=4, eval_every=30, tau_prompts=2,
                  tau_max_new_tokens=12)
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = 2
    try:
        summary = train(cfg, model=target)
    finally:
        target.generation_config.eos_token_id = eos
    losses = summary["losses"]
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    print(f"loss {first:.3f} -> {last:.3f}")
    assert last < 0.7 * first  # measured: 1.145 -> 0.583
    evals = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [30, 60]
    assert evals[-1]["loss"] < evals[0]["loss"] and len(evals[-1]["acc"]) == cfg.draft_length + 1
    assert evals[-1]["tau"] >= 1.0 and evals[-1]["tau_prompts"] == 2
    head = DartHead.from_pretrained(tmp_path / "out" / "head")
    assert head.config.target_layer_ids == [2, 3, 3] and head.config.draft_vocab_size == 64
    assert head.tree_config == TreeConfig(eos_token_id=2)  # the target's EOS travels with the head
    train_log = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert train_log[-1]["step"] == 60 and train_log[-1]["tokens_per_s"] > 0


def test_resume_reproduces_an_uninterrupted_run(tiny_run, tmp_path):
    root, target = tiny_run
    straight = Trainer(tiny_train_config(root, tmp_path / "a"), model=target)
    straight.run()
    first = Trainer(tiny_train_config(root, tmp_path / "b", stop_at=3), model=target)
    assert first.run()["step"] == 3
    assert not (tmp_path / "b" / "head").exists() and (tmp_path / "b" / "checkpoint-latest").is_dir()
    resumed = Trainer(tiny_train_config(root, tmp_path / "b", resume=True), model=target)
    assert resumed.start_step == 3
    resumed.run()
    logged = [json.loads(line)["step"] for line in (tmp_path / "b" / "train.jsonl").read_text().splitlines()]
    assert logged == [3, 6]
    a, b = straight.head.state_dict(), resumed.head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    with pytest.raises(ValueError, match="seq_len"):
        Trainer(tiny_train_config(root, tmp_path / "b", resume=True, seq_len=16), model=target)


@pytest.mark.parametrize("bf16_time,want", [(0.5, "bfloat16"), (0.95, "float32")])
def test_the_head_precision_is_measured_kept_on_resume_and_logged(tiny_run, tmp_path, monkeypatch, bf16_time, want):
    root, target = tiny_run
    clock = iter(range(10 ** 6))
    timings = {"float32": 1.0, "bfloat16": bf16_time}  # seconds per head step under each precision
    now = [0.0]

    def fake_clock():  # every head step takes its precision's time; everything else is instant
        return now[0] + next(clock) * 1e-9

    def forward(self, *args):
        now[0] += timings["bfloat16" if torch.is_autocast_enabled("cpu") else "float32"]
        return real_forward(self, *args)

    real_forward = TrainingForward.forward
    with monkeypatch.context() as patch:
        patch.setattr("dart_runtime.timing.now", fake_clock)  # the one clock
        patch.setattr(TrainingForward, "forward", forward)
        trainer = Trainer(tiny_train_config(root, tmp_path / "p", head_precision=None, stop_at=2), model=target)
    assert trainer.head_precision == want and (trainer.autocast is not None) == (want == "bfloat16")
    trainer.run()
    logged = [json.loads(line) for line in (tmp_path / "p" / "train.jsonl").read_text().splitlines()]
    assert logged[-1]["head_precision"] == want
    resumed = Trainer(tiny_train_config(root, tmp_path / "p", head_precision=None, resume=True), model=target)
    assert resumed.head_precision == want  # the checkpoint's, not measured again
    with pytest.raises(ValueError, match="head_precision must be"):
        tiny_train_config(root, tmp_path / "q", head_precision="int8").validate()


def test_every_finished_epoch_leaves_a_head_of_its_own(tiny_run, tmp_path):
    root, target = tiny_run
    per_epoch = Trainer(tiny_train_config(root, tmp_path / "probe"), model=target)._batches_per_epoch
    Trainer(tiny_train_config(root, tmp_path / "e", steps=2 * per_epoch + 1), model=target).run()
    epochs = sorted(p.name for p in (tmp_path / "e").glob("head-epoch-*"))
    assert epochs == ["head-epoch-1", "head-epoch-2"]
    assert DartHead.from_pretrained(tmp_path / "e" / epochs[-1]).config.draft_length == 3


# ---- command line -------------------------------------------------------------------------------------------------
def test_cli_train_writes_a_loadable_head_with_ngram(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    out = tmp_path / "cli"
    rc = main(["train", "--target", str(root / "target"), "--data", str(root / "data"), "--out", str(out),
               "--steps", "3", "--batch-size", "2", "--seq-len", "24", "--draft-length", "2",
               "--draft-vocab-size", "500", "--anchors", "4", "--tau-prompts", "1", "--tau-max-new-tokens", "6",
               "--save-dtype", "bfloat16", "--ngram", "--no-progress", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    assert "wrote" in capsys.readouterr().out
    head = DartHead.from_pretrained(out / "head")
    assert load_file(str(out / "head" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert head.config.draft_vocab_size == 96  # clamped to the target vocab
    assert head.ngram is not None and head.ngram.order == 3
    assert (out / "checkpoint-latest" / "trainer_state.pt").is_file()


def test_cli_ngram_build(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    dest = tmp_path / "ng.safetensors"
    assert main(["ngram", "build", "--data", str(root / "data"), "--out", str(dest), "--vocab-size", "96"]) == 0
    ngram = NGramModel.load(dest)
    sequences = [t for t, _ in read_shards(root / "data")]
    expected = NGramModel.build(sequences, order=3, vocab_size=96)
    assert torch.equal(ngram.keys, expected.keys) and torch.equal(ngram.counts, expected.counts)
    capsys.readouterr()
    assert main(["ngram", "build", "--data", str(root / "data"), "--out", str(dest)]) == 2  # exists, no --force
    assert "exists" in capsys.readouterr().err


def test_cli_distill_prompts_and_text(tiny_run, tmp_path, capsys):
    root, _ = tiny_run
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"hello w{i} world"}) + "\n" for i in range(5)))
    out = tmp_path / "distilled"
    assert main(["distill", "--target", str(root / "target"), "--out", str(out), "--prompts", str(prompts),
                 "--field", "question", "--limit", "3", "--batch-size", "2", "--max-new-tokens", "4"]) == 0
    rows = list(read_shards(out))
    assert len(rows) == 3
    assert sorted(p.name for p in out.iterdir()) == ["distill.json", "shard-00000.npz", "shard-00001.npz"]
    assert rows[0][0][: rows[0][1]].tolist() == [95, 93, 3, 94] and len(rows[0][0]) == rows[0][1] + 4
    # sampled answers: seeded per batch (a second run draws the same), recorded, never mixed with greedy shards
    base = ["distill", "--target", str(root / "target"), "--prompts", str(prompts), "--field", "question",
            "--limit", "3", "--batch-size", "2", "--max-new-tokens", "4", "--temperature", "1.5", "--top-p", "0.9"]
    for name in ("s1", "s2"):
        assert main(base + ["--out", str(tmp_path / name), "--sample-seed", "7"]) == 0
    sampled = [t.tolist() for t, _ in read_shards(tmp_path / "s1")]
    assert sampled == [t.tolist() for t, _ in read_shards(tmp_path / "s2")]
    assert sampled != [t.tolist() for t, _ in rows]  # a control: sampling at temperature 1.5 left greedy's answers
    recorded = json.loads((tmp_path / "s1" / "distill.json").read_text())
    assert recorded["sampling"] == {"temperature": 1.5, "top_p": 0.9, "seed": 7}
    capsys.readouterr()
    assert main(base + ["--out", str(out)]) == 2  # the greedy shards above are not continued with samples
    assert "sampling" in capsys.readouterr().err
    text = tmp_path / "corpus.txt"
    text.write_text("hello w1 w2 w3\nw4 world\n\n\nw7 w7 w7 w8\n")
    assert main(["distill", "--target", str(root / "target"), "--out", str(tmp_path / "text"), "--text",
                 str(text)]) == 0
    assert [(t.tolist(), p) for t, p in read_shards(tmp_path / "text")] == [
        ([93, 4, 5, 6, 7, 94], 0), ([10, 10, 10, 11], 0)]
    dest = tmp_path / "text.safetensors"
    assert main(["ngram", "build", "--text", str(text), "--target", str(root / "target"), "--out", str(dest)]) == 0
    ngram = NGramModel.load(dest)
    assert ngram.vocab_bound == 96 and ngram.probability([10, 10], [10, 11]) == pytest.approx([0.5, 0.5])
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["train", "--data", "{missing}", "--out", "{tmp}/o"], "data directory not found"),
    (["train", "--data", "{data}", "--out", "{tmp}/o", "--target", "{empty}"], "target not found"),
    (["train", "--data", "{data}", "--out", "{tmp}/o", "--steps", "0"], "steps must be a positive integer"),
    (["train", "--data", "{data}", "--out", "{tmp}/o", "--gamma", "1.5"], "gamma must be in"),
    (["train", "--data", "{empty}", "--out", "{tmp}/o", "--target", "{target}"], "no data shards"),
    (["ngram", "build", "--data", "{missing}", "--out", "{tmp}/n.safetensors"], "data directory not found"),
    (["ngram", "build", "--data", "{data}", "--out", "{tmp}/n.safetensors", "--vocab-size", "10"], ">= vocab_size"),
    (["ngram", "build", "--out", "{tmp}/n.safetensors"], "give --data"),
    (["distill", "--out", "{tmp}/d", "--prompts", "{tmp}/none.jsonl"], "prompts file not found"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tiny_run, tmp_path, capsys, argv, message):
    root, _ = tiny_run
    (tmp_path / "empty").mkdir()
    subs = {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path), "empty": str(tmp_path / "empty"),
            "data": str(root / "data"), "target": str(root / "target")}
    assert main([a.format(**subs) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_read_prompts(tmp_path):
    from dart_cli.train import read_prompts

    good = tmp_path / "p.jsonl"
    good.write_text('{"question": "a?"}\n\n{"question": "b?", "x": 1}\n')
    assert read_prompts(str(good), "question") == ["a?", "b?"]
    with pytest.raises(ValueError, match=r"p.jsonl:1: no string field 'prompt'"):
        read_prompts(str(good), "prompt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompts(str(bad), "prompt")


# ---- robustness: non-finite values, time budget, length buckets -------------------------------------------------------
@pytest.mark.parametrize("autocast", [False, True])
def test_non_finite_padding_rows_reach_neither_the_loss_nor_the_gradients(autocast):
    head, aux, ids, anchors = _head_and_inputs(0, 4, n=12)
    anchors = torch.tensor([[0, 3, 9], [1, 2, 5]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    real_rows = torch.tensor([12, 7])  # row 1: 7 real rows, then right padding
    teacher = torch.randn(2, 13, head.config.draft_vocab_size, generator=torch.Generator().manual_seed(1))
    seq_lengths, prompts = real_rows + 1, torch.tensor([0, 0])

    def loss_and_grads(aux):
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            real, blocks = TrainingForward(head)(aux, ids, anchors, real_rows)
        out = dart_loss(real, blocks, teacher, anchors, valid, seq_lengths, prompts)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None]

    clean_loss, clean_grads = loss_and_grads(aux)
    poisoned = aux.clone()
    poisoned[1, 7:] = float("inf")  # what a target could leave at padded positions
    poisoned[1, 9, 0] = float("nan")
    loss, grads = loss_and_grads(poisoned)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(loss, clean_loss) and all(torch.equal(a, b) for a, b in zip(grads, clean_grads))


def _poison_gradients_at(trainer, steps: set[int]):
    """Make the loss of the given steps (0-based) non-finite: the gradient then is too."""
    compute = trainer.compute
    calls = {"n": 0}

    def poisoned(batch, generator):
        out, t_target, t_head = compute(batch, generator)
        if trainer.head.training:
            if calls["n"] in steps:
                out.loss = out.loss * float("nan")
            calls["n"] += 1
        return out, t_target, t_head

    trainer.compute = poisoned


def test_a_non_finite_step_changes_neither_weights_nor_optimizer_state(tiny_run, tmp_path):
    root, target = tiny_run
    trainer = Trainer(tiny_train_config(root, tmp_path / "skip", steps=4, log_every=1), model=target)
    _poison_gradients_at(trainer, {2})
    trainer.train_step(0)
    trainer.train_step(1)
    weights = {k: v.clone() for k, v in trainer.head.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in trainer.optimizer.state_dict()["state"].items()}
    result = trainer.train_step(2)
    assert result["skipped"] and not math.isfinite(result["loss"])
    assert all(torch.equal(v, trainer.head.state_dict()[k]) for k, v in weights.items())
    assert all(torch.equal(m, trainer.optimizer.state_dict()["state"][i]["exp_avg"]) for i, m in moments.items())
    assert not trainer.train_step(3)["skipped"]
    assert all(torch.isfinite(p).all() for p in trainer.head.parameters())


def test_the_skip_count_is_logged_and_the_run_finishes(tiny_run, tmp_path):
    root, target = tiny_run
    trainer = Trainer(tiny_train_config(root, tmp_path / "log", steps=6, log_every=3), model=target)
    _poison_gradients_at(trainer, {1, 4})
    summary = trainer.run()
    assert summary["skipped_steps"] == 2 and "head" in summary
    logged = [json.loads(line) for line in (tmp_path / "log" / "train.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in logged] == [1, 1]
    assert all(torch.isfinite(p).all() for p in DartHead.from_pretrained(tmp_path / "log" / "head").parameters())


def test_consecutive_non_finite_steps_stop_with_a_clear_error(tiny_run, tmp_path):
    from dart_train.trainer import TrainingDiverged

    root, target = tiny_run
    trainer = Trainer(tiny_train_config(root, tmp_path / "nan", steps=10, max_skipped_steps=3), model=target)
    _poison_gradients_at(trainer, set(range(2, 10)))
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps \(up to step 5\).*lower --lr"):
        trainer.run()
    saved = DartHead.from_pretrained(tmp_path / "nan" / "checkpoint-latest", load_ngram=False)
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    assert not (tmp_path / "nan" / "head").exists()


def test_fit_steps():
    from dart_train.trainer import fit_steps

    # 100 s left, 1 s a step, evaluations of 10 s every 20 steps: (100 - 10) / (1 + 0.5) = 60 steps more
    assert fit_steps(100.0, 1.0, 10.0, 20, done=8) == 68
    assert fit_steps(1.0, 1.0, 10.0, 20, done=8) == 9  # always at least one more step


def test_time_budget_fits_the_schedule_and_ends_with_a_saved_head(tiny_run, tmp_path):
    root, target = tiny_run
    budget = 5.0
    cfg = tiny_train_config(root, tmp_path / "budget", steps=3, time_budget=budget, eval_every=200, log_every=50)
    t0 = time.perf_counter()
    summary = train(cfg, model=target)
    took = time.perf_counter() - t0
    log = [json.loads(line) for line in (tmp_path / "budget" / "train.jsonl").read_text().splitlines()]
    fitted = [r for r in log if "fitted_steps" in r]
    assert len(fitted) == 1 and fitted[0]["fitted_steps"] > 3  # --steps replaced by what fits
    assert summary["step"] >= 0.5 * fitted[0]["fitted_steps"]
    assert log[-1]["total_steps"] == summary["step"]  # the schedule ended at the last step
    assert "head" in summary and (tmp_path / "budget" / "head" / "model.safetensors").is_file()
    assert took < budget + 2.0, took
    with pytest.raises(ValueError, match="time_budget"):
        tiny_train_config(root, tmp_path / "x", time_budget=0).validate()


def test_a_budgeted_resume_keeps_the_checkpoint_schedule_until_it_fits_its_own(tiny_run, tmp_path):
    # the steps a resumed budget times before fitting once ran at the peak rate, even after a finished schedule
    root, target = tiny_run
    out = tmp_path / "run"
    train(tiny_train_config(root, out, steps=8, log_every=1), model=target)  # the cosine schedule ends at step 8
    train(tiny_train_config(root, out, steps=8, log_every=1, resume=True, time_budget=4.0), model=target)
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    fitted_at = next(r["step"] for r in log if "fitted_steps" in r)
    before_fit = [r["lr"] for r in log if 8 < r["step"] < fitted_at and "lr" in r]
    assert before_fit and all(lr == 0.0 for lr in before_fit), before_fit


def test_length_buckets_keep_padding_small_and_cover_each_window_once(tmp_path):
    lengths = torch.randint(3, 200, (320,), generator=torch.Generator().manual_seed(0)).tolist()
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "shard-00000.npz", [[i % 96 for i in range(n)] for n in lengths], [1] * len(lengths))
    target = tiny_target(seed=3)
    cfg = TrainConfig(target="unused", data=[str(data)], out=str(tmp_path / "o"), batch_size=8, seq_len=256,
                      heldout_fraction=0.0, draft_length=2, draft_vocab_size=32, intermediate_size=32,
                      progress=False)
    trainer = Trainer(cfg, model=target)
    epoch = np.concatenate([trainer.order.batch(step) for step in range(trainer._batches_per_epoch)])
    assert sorted(epoch.tolist()) == list(range(320))  # 40 batches of 8: each window once
    batches = [trainer.samples_for(step) for step in range(40)]
    padded = sum(8 * max(len(w) for w, _ in b) for b in batches)
    real = sum(lengths)
    assert padded < 1.1 * real  # unbucketed: about 1.8x
    again = Trainer(dataclasses.replace(cfg, out=str(tmp_path / "o2")), model=target)
    assert all([w.tolist() for w, _ in again.samples_for(s)] == [w.tolist() for w, _ in batches[s]] for s in (0, 17))


# ---- prompts written by the target (`dart-spec prompts`) -------------------------------------------------------------
def test_user_turn_prompt_is_the_template_cut_where_the_message_begins():
    from dart_core import DartInputError
    from dart_train.user_turns import user_turn_prompt
    from helpers.hf_models import char_tokenizer

    _, tok = turn_writer()
    assert user_turn_prompt(tok) == ([93, 95], [3, 2])  # "hello user", then <eot> (the template's) or <eos>
    chars = char_tokenizer()  # "user: TEXT\n": nothing special after the text, so the EOS alone ends the turn
    prompt, stops = user_turn_prompt(chars)
    assert chars.decode(prompt) == "user: " and stops == [chars.eos_token_id]
    chars.chat_template = None
    with pytest.raises(DartInputError, match="no chat template"):
        user_turn_prompt(chars)


def test_turn_filters_and_duplicate_key():
    from dart_train.user_turns import normalise, turn_problem

    assert normalise("  What IS   a list?\n") == normalise("what is a list") == "what is a list"
    assert turn_problem("Explain how a hash map works.", 16, 1500) is None
    assert turn_problem("Hi there", 16, 1500) == "short"
    assert turn_problem("a b c " * 400, 16, 1500) == "long"
    assert turn_problem("What does \ufffd mean in this file?", 16, 1500) == "undecodable"
    assert turn_problem("please help me " * 8, 16, 1500) == "repetitive"


def test_written_turns_are_distinct_resumable_and_refuse_other_settings(tmp_path, monkeypatch):
    import os

    from dart_core import DartInputError
    from dart_train.user_turns import normalise, write_user_turns

    target, tok = turn_writer()
    settings = dict(batch_size=8, max_new_tokens=16, min_chars=8, progress=False)
    whole = tmp_path / "whole.jsonl"
    state = write_user_turns(target, tok, whole, count=12, **settings)
    lines = whole.read_text().splitlines()
    turns = [json.loads(line)["prompt"] for line in lines]
    assert len(turns) == state["kept"] >= 12 and len({normalise(t) for t in turns}) == len(turns)
    assert not any("<eot>" in t or "<eos>" in t for t in turns)
    assert state["dropped"].get("unfinished", 0) > 0  # some turns ran past 16 tokens and were dropped
    # in two calls (a larger count continues the same stream), with a half-written batch between them
    part = tmp_path / "part.jsonl"
    write_user_turns(target, tok, part, count=5, **settings)
    fsync = os.fsync

    def dies_mid_write(fd):  # the next batch's lines reach the output part way, then the process ends
        if os.fstat(fd).st_ino == part.stat().st_ino:
            os.ftruncate(fd, os.fstat(fd).st_size - 9)
            raise KeyboardInterrupt
        fsync(fd)

    monkeypatch.setattr(os, "fsync", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        write_user_turns(target, tok, part, count=12, **settings)
    monkeypatch.setattr(os, "fsync", fsync)
    assert not part.read_bytes().endswith(b"\n")  # a half-written batch: its own, so the next run cuts it
    write_user_turns(target, tok, part, count=12, **settings)
    assert part.read_text() == whole.read_text()
    assert write_user_turns(target, tok, part, count=12, **settings)["batches"] == state["batches"]  # nothing to do
    with pytest.raises(DartInputError, match="temperature"):
        write_user_turns(target, tok, part, count=20, **{**settings, "temperature": 0.7})
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"prompt": "w1 w2 w3"}\n')
    with pytest.raises(DartInputError, match="without a prompt writer's state"):
        write_user_turns(target, tok, stray, count=2, **settings)


def test_cli_prompts_then_distill_them(tmp_path, capsys):
    target, tok = turn_writer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "turns.jsonl"
    argv = ["prompts", "--target", str(tmp_path / "target"), "--out", str(prompts), "--count", "6",
            "--batch-size", "8", "--max-new-tokens", "16", "--min-chars", "8"]
    assert main(argv) == 0
    assert " turns from " in capsys.readouterr().out and (tmp_path / "turns.jsonl.state.json").is_file()
    assert main(["distill", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "answers"), "--prompts",
                 str(prompts), "--batch-size", "4", "--max-new-tokens", "4"]) == 0
    assert len(list(read_shards(tmp_path / "answers"))) == len(prompts.read_text().splitlines()) >= 6
    assert main(argv[:-2] + ["--min-chars", "9"]) == 2  # other settings: refused, one line
    assert "min_chars" in capsys.readouterr().err


def test_data_weights_repeat_a_directory_in_each_epoch_and_keep_the_held_out_split(tiny_run, tmp_path):
    from collections import Counter

    from dart_core import DartInputError

    root, target = tiny_run
    second = tmp_path / "second"
    second.mkdir()
    reversed_ = [(t[::-1], 0) for t, _ in read_shards(root / "data")][:20]  # other content than the first directory
    write_shard(second / "shard-00000.npz", [t for t, _ in reversed_], [0] * len(reversed_))
    data = [str(root / "data"), str(second)]
    plain = Trainer(tiny_train_config(root, tmp_path / "a", data=data, heldout_fraction=0.1), model=target)
    heavy = Trainer(tiny_train_config(root, tmp_path / "b", data=data, data_weights=[1, 3], heldout_fraction=0.1),
                    model=target)
    # the windows are the same list (never copied); only the order repeats the second directory's
    assert [w.tolist() for w, _ in heavy.train_windows] == [w.tolist() for w, _ in plain.train_windows]
    assert [w.tolist() for w, _ in heavy.heldout_windows] == [w.tolist() for w, _ in plain.heldout_windows]
    sequences = [t for t, _ in read_shards(root / "data")] + [t for t, _ in reversed_]
    held = heldout_mask(sequences, 0.1)
    first = len(split_windows([(t, 6) for t, h in zip(sequences[:48], held[:48]) if not h], 32))
    n = len(heavy.train_windows)
    assert 0 < first < n
    counts = Counter(int(i) for step in range(heavy._batches_per_epoch) for i in heavy.order.batch(step))
    want = {i: 1 if i < first else 3 for i in range(n)}
    entries = first + 3 * (n - first)
    assert heavy._batches_per_epoch == entries // 4 and all(counts[i] <= want[i] for i in range(n))
    assert sum(want[i] - counts[i] for i in range(n)) == entries % 4  # the epoch's remainder, left out
    with pytest.raises(DartInputError, match="one weight per data directory"):
        tiny_train_config(root, tmp_path / "c", data=data, data_weights=[2]).validate()
    with pytest.raises(DartInputError, match="data_weights"):
        tiny_train_config(root, tmp_path / "c", data=data, data_weights=[1, 0]).validate()
