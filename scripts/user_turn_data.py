#!/usr/bin/env python
"""Breadth data for a DART head without a dataset, in one resumable process: the target writes user turns
(`dart-spec prompts`), then answers them (`dart-spec distill --prompts`), chunk by chunk, so every finished chunk is
training data at once.

    python scripts/user_turn_data.py --out runs/data-turns --chunks 8 --chunk-size 512 --threads 1

Chunk k (1-based): the prompts file OUT/prompts.jsonl grows to k * CHUNK_SIZE turns (batch i of turns drawn with
--seed + i), lines (k-1)*CHUNK_SIZE+1 .. k*CHUNK_SIZE are copied to OUT/prompts-00k.jsonl, and the target answers
them greedily into OUT/greedy-00k/ (256 tokens at most). With --sample, every chunk's prompts are then answered
again by sampling (temperature 0.8, top-p 0.95, seed k) into OUT/sample-00k/, after all greedy chunks. Rerunning the
same command continues where it stopped (each step skips what is done; --chunks may grow). One process (one PID):
a SIGSTOP/SIGCONT pause is harmless.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dart_core.io import atomic_write  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompt-batch-size", type=int, default=32)
    p.add_argument("--prompt-max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="of the user turns (default 1.0)")
    p.add_argument("--top-p", type=float, default=0.95, help="of the user turns (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="of the user turns (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="answers per generate call and shard (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit (default 256)")
    p.add_argument("--sample", action="store_true", help="also sampled answers (after all greedy chunks)")
    p.add_argument("--threads", type=int)
    args = p.parse_args()

    import torch

    from dart_cli.train import read_prompts
    from dart_train.data import distill
    from dart_train.trainer import load_target
    from dart_train.user_turns import write_user_turns

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target, "cpu", with_tokenizer=True)
    parts = []
    for k in range(1, args.chunks + 1):
        state = write_user_turns(model, tokenizer, out / "prompts.jsonl", count=k * args.chunk_size,
                                 batch_size=args.prompt_batch_size, max_new_tokens=args.prompt_max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        if state["kept"] < k * args.chunk_size:
            print(f"only {state['kept']} turns after {state['batches']} batches; stopping", file=sys.stderr)
            return 1
        part = out / f"prompts-{k:03d}.jsonl"
        if not part.exists():
            with open(out / "prompts.jsonl", encoding="utf-8") as fh:
                lines = fh.readlines()[(k - 1) * args.chunk_size: k * args.chunk_size]
            with atomic_write(str(part), "w") as fh:
                fh.write("".join(lines))
        parts.append(part)
        prompts = read_prompts(str(part), "prompt")
        print(f"chunk {k}: {len(prompts)} prompts, greedy answers", file=sys.stderr)
        distill(model, tokenizer, prompts, out / f"greedy-{k:03d}", batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens)
    if args.sample:
        for k, part in enumerate(parts, 1):
            print(f"chunk {k}: sampled answers", file=sys.stderr)
            distill(model, tokenizer, read_prompts(str(part), "prompt"), out / f"sample-{k:03d}",
                    batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                    sampling={"temperature": 0.8, "top_p": 0.95, "seed": k})
    print(f"{args.chunks} chunk(s) of {args.chunk_size} prompts answered in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
