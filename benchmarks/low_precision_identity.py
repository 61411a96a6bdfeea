"""Where greedy outputs of speculative decoding leave plain greedy decoding in reduced precision, DART and a control.

    python benchmarks/low_precision_identity.py --dtype bfloat16 --prompts 3 --json benchmarks/results/low_precision.json

SmolLM2 with the shipped head cast to `--dtype`, greedy, the first `--prompts` MT-Bench first turns (chat template),
`--max-new-tokens` (64). For each prompt: the first new token at which DART's output differs from plain
`generate()`, and the same for transformers' own prompt-lookup decoding (`prompt_lookup_num_tokens=3`), the control:
both verify several tokens in one target forward, whose reduced-precision arithmetic rounds differently from a
one-token forward, so near-tied greedy choices can flip. In float32 both are expected to stay identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

import dart_hf
from dart_bench import DATA_DIR, load_prompt_sets
from results_io import write_results



def first_difference(out: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> Optional[int]:
    """Index (among the new tokens) of the first token where `out` [1, L] and `reference` differ, or None."""
    n = min(out.shape[1], reference.shape[1])
    differ = (out[0, :n] != reference[0, :n]).nonzero()
    if len(differ):
        return int(differ[0]) - prompt_len
    return None if out.shape[1] == reference.shape[1] else n - prompt_len


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer, head = dart_hf.load_default()
    model.to(dtype)
    head.to(dtype)
    texts = load_prompt_sets(DATA_DIR, args.prompts, ["mt_bench"])["mt_bench"]
    rows = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
        plain = model.generate(ids, **kwargs)
        dart = model.generate(ids, dart_head=head, **kwargs)
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, **kwargs)
        rows.append({"dart_first_difference": first_difference(dart, plain, ids.shape[1]),
                     "prompt_lookup_first_difference": first_difference(lookup, plain, ids.shape[1])})
        print(f"DART differs from plain at new token {rows[-1]['dart_first_difference']}, prompt lookup at "
              f"{rows[-1]['prompt_lookup_first_difference']} (None: identical)", flush=True)
    if args.json:
        write_results(args.json, {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
