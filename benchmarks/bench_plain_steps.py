"""What a step of the roots alone costs inside DART's loop against a step of plain generate(): the steps an attached
call takes to measure plain decoding and to finish a regime where DART does not pay; and what a call costs that runs as
plain generate() because its regime's verdict is plain (the fallback: plain generate() with the kernels
`dart_hf.enable.fallback_kernels` gives it: at batch 2 or more, the few-row product of DART's own plain steps).

    python benchmarks/bench_plain_steps.py --json benchmarks/results/plain_steps.json
    python benchmarks/bench_plain_steps.py --batch-sizes 1 --rounds 2 --new-tokens 8          # a quick check

SmolLM2-135M-Instruct float32 and the shipped head, greedy, held-out chat prompts (`dart_bench/data/
fresh_prompts.jsonl`, left-padded), `min_new_tokens` = `max_new_tokens` (generate() adds its min-length logits
processor, as a user's length settings do). For each batch size, plain `generate()` and a DART call whose step policy
decides a plain step every time (transformers' `generate` with `custom_generate=dart_decoding` and
`dart_step_policy`) and the fallback alternate `--rounds` times after one warm-up each; a ratio is
plain's median wall time over the other's (1.00x: a plain step in DART's loop, or the fallback, costs what plain's
does). DART's
per-step phases (median ms over the rounds, `DartStats`): the target forward and the acceptance (logits processors
and the chosen token).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from transformers import GenerationMixin

import dart_hf
from dart_bench import DATA_DIR, chat_batch, environment, interleave, prompts_from_file, script_parser, write_results
from dart_core.step_policy import PLAIN
from dart_hf.enable import fallback_kernels
from dart_hf.loop import dart_decoding


class PlainSteps:
    """A step policy that verifies the roots alone at every step."""

    max_tree_size = 1

    def begin(self, sampled: bool) -> None:
        pass

    def decide(self, batch_size: int, context_length: int):
        return PLAIN

    def observe(self, decision, step) -> None:
        pass


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default()
    tokenizer.padding_side = "left"
    texts = prompts_from_file(DATA_DIR / "fresh_prompts.jsonl", 16)
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        batch = chat_batch(tokenizer, texts[:batch_size])
        outputs, phases = {}, {"target": [], "accept": []}

        def plain():
            return model.generate(**batch, **settings)

        def dart():
            out = GenerationMixin.generate(model, **batch, **settings, custom_generate=dart_decoding, dart_head=head,
                                           dart_step_policy=PlainSteps(), return_dict_in_generate=True)
            stats = out.dart_stats
            phases["target"].append(stats.target_time / stats.forwards * 1e3)
            phases["accept"].append(stats.accept_time / stats.forwards * 1e3)
            return out.sequences

        def fallback():
            with fallback_kernels(model, batch_size):
                return model.generate(**batch, **settings)

        def keep(key, result, seconds, round_):
            outputs[key] = result.tolist()

        clock = interleave({"plain": plain, "dart": dart, "fallback": fallback}, args.rounds, warmup=1, after=keep)
        plain_s, dart_s, fallback_s = (statistics.median(clock.seconds[k]) for k in ("plain", "dart", "fallback"))
        row = {"batch_size": batch_size, "plain_s": plain_s, "dart_plain_steps_s": dart_s, "ratio": plain_s / dart_s,
               "fallback_s": fallback_s, "fallback_ratio": plain_s / fallback_s,
               "target_ms": statistics.median(phases["target"]), "accept_ms": statistics.median(phases["accept"]),
               "identical": outputs["plain"] == outputs["dart"] == outputs["fallback"]}
        rows.append(row)
        print(f"batch {batch_size}: plain {plain_s:.3f} s, DART's plain steps {dart_s:.3f} s, {row['ratio']:.3f}x "
              f"(target {row['target_ms']:.1f} ms, acceptance {row['accept_ms']:.2f} ms a step), the fallback "
              f"{fallback_s:.3f} s, {row['fallback_ratio']:.3f}x, identical {row['identical']}", flush=True)
    if args.json:
        write_results(args.json, {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
                                  "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows})
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
