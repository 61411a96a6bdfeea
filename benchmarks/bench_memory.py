"""Peak memory of a generate() call, plain vs DART, by prompt length (one fresh process per measurement).

    python benchmarks/bench_memory.py --json benchmarks/results/memory.json

SmolLM2-135M-Instruct and the shipped head on the CPU, a prompt of `--prompt-tokens` tokens (GSM8K text), greedy,
`--new-tokens` new tokens. Each (length, method) runs in its own process: the peak resident set size after loading
(model, head) and the peak over the call, from `resource.getrusage`; the call's growth is their difference.
"""

from __future__ import annotations

import argparse
import json
import sys

from dart_bench import read_prompt_rows, script_parser, write_results
from dart_bench.memory import peak_rss_mib, run_child


def peak_mib() -> float:
    return peak_rss_mib()["ru_maxrss_mib"]


def measure(length: int, method: str, new_tokens: int) -> dict:
    """In this process: load, build the prompt, one call -> peaks in MiB."""
    import torch

    import dart_hf

    model, tokenizer, head = dart_hf.load_default()
    text = "\n\n".join(row["question"] for row in read_prompt_rows("gsm8k"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"the text gives {ids.shape[1]} tokens, fewer than {length}")
    loaded = peak_mib()
    kwargs = {"dart_head": head} if method == "dart" else {}
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       **kwargs)
    call = peak_mib()
    return {"prompt_tokens": length, "method": method, "loaded_mib": loaded, "peak_mib": call,
            "call_mib": call - loaded}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--prompt-tokens", default="1000,8180")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--one", nargs=2, metavar=("LENGTH", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1], args.new_tokens)))
        return 0
    rows = []
    print("prompt tokens  method  after loading MiB  peak MiB  the call's growth MiB")
    for length in (int(x) for x in args.prompt_tokens.split(",")):
        for method in ("plain", "dart"):
            row = run_child(__file__, "--one", str(length), method, "--new-tokens", str(args.new_tokens))
            rows.append(row)
            print(f"{length:13d} {method:>7s} {row['loaded_mib']:17.0f} {row['peak_mib']:9.0f} {row['call_mib']:22.0f}")
    if args.json:
        write_results(args.json, {"new_tokens": args.new_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
