"""Project DART's speedup for a target architecture from measured latencies and a stated tau.

    python benchmarks/project_gpu.py --arch qwen3-8b --tau 60:3.0 --json benchmarks/results/projection_qwen3_8b.json
    python benchmarks/project_gpu.py --arch tiny --device cpu --context 64 --repeats 2      # the CPU smoke test

The target is built from the architecture's shapes with random weights (bf16 on CUDA, fp32 on CPU; no download):
weights do not change latency. Measured, each the median of `--repeats` after a warm-up:

- t_verify(k): one target forward over k new tokens with a tree mask and tapped hidden states on a cache of
  `--context` tokens (`dart_hf.calibration.measure_latency`, the tree loop's forward), and t_plain, a plain 1-token step;
- t_head: one DART head forward (random weights, `--draft-length` mask rows, `--draft-vocab` outputs) over
  round(tau) new rows on a head cache of `--context` rows;
- t_tree: `dart_core.build_draft_trees` (topk 25, beam 20, the largest stated node count) with a 3-gram of 200k
  random tokens, on the CPU for B=1 and on the device for each `--batch-sizes` (per tree).

Projection per stated (R, tau): step = t_head + t_tree + t_verify(R+1) and speedup = tau * t_plain / step, once with
the tree search on the CPU (B=1) and once on the device (B=1). Tau comes from the user (`--tau R:TAU`, repeatable),
e.g. a head's measured acceptance: this script measures costs, not acceptance.
"""

from __future__ import annotations

import sys

import torch

from dart_bench import median_seconds, script_parser, write_results
from dart_core import DartConfig, DartHead, NGramModel, TreeConfig, build_draft_trees, topk_draft_tokens

PRESETS = {
    # Qwen3-8B (config.json of Qwen/Qwen3-8B)
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0),
    # Qwen3-4B
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0),
    # small shapes for testing the script on a CPU
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=10000.0),
}


def parse_tau(entries: list[str]) -> list[tuple[int, float]]:
    """["60:3.0", ...] -> [(60, 3.0), ...] (draft nodes R >= 1, tau >= 1)."""
    out = []
    for entry in entries:
        try:
            r, tau = entry.split(":")
            pair = (int(r), float(tau))
        except ValueError:
            raise ValueError(f"--tau takes NODES:TAU (e.g. 60:3.0), got {entry!r}") from None
        if pair[0] < 1 or pair[1] < 1:
            raise ValueError(f"--tau {entry}: nodes must be >= 1 and tau >= 1")
        out.append(pair)
    return out


def build_target(arch: dict, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**arch, max_position_embeddings=40960, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def build_head(model, draft_length: int, draft_vocab: int) -> DartHead:
    cfg = model.config
    head = DartHead(DartConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                               num_attention_heads=cfg.num_attention_heads,
                               num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               vocab_size=cfg.vocab_size, draft_vocab_size=min(draft_vocab, cfg.vocab_size),
                               draft_length=draft_length, rope_theta=cfg.rope_parameters["rope_theta"]
                               if getattr(cfg, "rope_parameters", None) else 10000.0,
                               num_target_layers=cfg.num_hidden_layers))
    param = next(model.parameters())
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.02)
    head.to(device=param.device, dtype=param.dtype).eval()
    head.set_input_embeddings(model.get_input_embeddings())
    return head


@torch.no_grad()
def head_latency(head: DartHead, context: int, rows: int, repeats: int) -> float:
    device = head.fc.weight.device
    hidden3 = 3 * head.config.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = head.new_cache(1, capacity=context + rows)
    aux = torch.randn(1, context, hidden3, generator=gen).to(device, head.fc.weight.dtype)
    ids = torch.randint(0, head.config.vocab_size, (1, context), generator=gen).to(device)
    head(aux, ids, cache=cache)
    new_aux, new_ids = aux[:, :rows], ids[:, :rows]
    full = cache.lengths.clone()

    def step():
        head(new_aux, new_ids, cache=cache)
        cache.lengths = full.clone()  # forget the rows just added

    return median_seconds(step, repeats, warmup=1, sync=device)


def tree_latency(vocab: int, levels: int, draft_vocab: int, nodes: int, batch: int, device: torch.device,
                 repeats: int) -> float:
    """Seconds per call of `build_draft_trees` for `batch` trees of `nodes` draft nodes on `device`."""
    gen = torch.Generator().manual_seed(1)
    corpus = torch.randint(0, vocab, (200_000,), generator=gen)
    corpus[::3] = corpus[::3] % 512  # some repeated contexts
    ngram = NGramModel.build([corpus], order=3, vocab_size=vocab).to(device)
    cfg = TreeConfig(remain_total=nodes)
    logits = torch.randn(batch, levels, draft_vocab, generator=gen) * 3
    tokens, probs = topk_draft_tokens(logits.to(device), cfg.topk)
    contexts = corpus[: 2 * batch].view(batch, 2).to(device)
    return median_seconds(lambda: build_draft_trees(tokens, probs, contexts, ngram, cfg), repeats, warmup=1,
                          sync=device)


def project(latency: dict[int, float], plain_s: float, head_s: float, tree_s: float,
            taus: list[tuple[int, float]]) -> list[dict]:
    """Projected speedup per stated (nodes, tau): tau * t_plain / (t_head + t_tree + t_verify(nodes + 1))."""
    rows = []
    for nodes, tau in taus:
        step = head_s + tree_s + latency[nodes + 1]
        rows.append({"nodes": nodes, "tau": tau, "verify_ms": latency[nodes + 1] * 1e3, "step_ms": step * 1e3,
                     "speedup": tau * plain_s / step})
    return rows


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--arch", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--context", type=int, default=1024, help="tokens in the KV cache (default 1024)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128],
                        help="verify forward sizes k to time (default 1..128)")
    parser.add_argument("--tau", nargs="+", default=["60:3.0"], metavar="NODES:TAU",
                        help="stated acceptance: tokens per step tau of a tree of NODES draft nodes (default 60:3.0)")
    parser.add_argument("--draft-length", type=int, default=8, help="head mask rows D (default 8)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="head output vocabulary (default 32000)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32],
                        help="trees per batched search on the device (default 1 8 32; 1 is always timed)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    taus = parse_tau(args.tau)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)

    model = build_target(PRESETS[args.arch], device, dtype)
    head = build_head(model, args.draft_length, args.draft_vocab)
    taps = head.config.layer_ids_for(model.config.num_hidden_layers)
    from dart_hf.calibration import measure_latency

    sizes = sorted(set(args.sizes) | {nodes + 1 for nodes, _ in taus})
    latency, plain_s = measure_latency(model, sizes, taps, args.context, args.repeats, progress=False)
    rows_per_step = max(1, round(max(tau for _, tau in taus)))
    head_s = head_latency(head, args.context, rows_per_step, args.repeats)
    nodes = max(n for n, _ in taus)
    shape = (head.config.vocab_size, head.config.draft_length + 1, head.config.draft_vocab_size, nodes)
    tree_cpu_s = tree_latency(*shape, 1, torch.device("cpu"), args.repeats)
    tree_device = {b: tree_latency(*shape, b, device, args.repeats) for b in sorted(set(args.batch_sizes) | {1})}

    results = {"arch": args.arch, "shapes": PRESETS[args.arch], "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(dtype).replace("torch.", ""), "context": args.context, "repeats": args.repeats,
               "torch": torch.__version__, "verify_ms": {k: v * 1e3 for k, v in latency.items()},
               "plain_ms": plain_s * 1e3, "head_ms": head_s * 1e3, "head_rows": rows_per_step,
               "draft_length": args.draft_length, "draft_vocab": head.config.draft_vocab_size,
               "tree_nodes": nodes, "tree_cpu_b1_ms": tree_cpu_s * 1e3,
               "tree_device_ms": {b: s * 1e3 for b, s in tree_device.items()},
               "tree_device_ms_per_tree": {b: s * 1e3 / b for b, s in tree_device.items()},
               "projection_tree_on_cpu": project(latency, plain_s, head_s, tree_cpu_s, taus),
               "projection_tree_on_device": project(latency, plain_s, head_s, tree_device[1], taus)}
    print(markdown(results))
    if args.json:
        write_results(args.json, results)
    return 0


def markdown(results: dict) -> str:
    lines = [f"{results['arch']} on {results['device_name']} ({results['dtype']}), context {results['context']}",
             "", "| k (tokens verified) | " + " | ".join(str(k) for k in results["verify_ms"]) + " |",
             "|---|" + "---:|" * len(results["verify_ms"]),
             "| verify ms | " + " | ".join(f"{v:.2f}" for v in results["verify_ms"].values()) + " |", "",
             f"plain 1-token step {results['plain_ms']:.2f} ms; head forward ({results['head_rows']} rows, "
             f"D={results['draft_length']}) {results['head_ms']:.2f} ms; tree search ({results['tree_nodes']} nodes) "
             f"CPU B=1 {results['tree_cpu_b1_ms']:.2f} ms, device "
             + ", ".join(f"B={b} {ms:.2f} ms ({results['tree_device_ms_per_tree'][b]:.3f}/tree)"
                         for b, ms in results["tree_device_ms"].items()), "",
             "| nodes | tau | verify ms | step ms (tree on CPU) | speedup (tree on CPU) | speedup (tree on device) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for cpu_row, dev_row in zip(results["projection_tree_on_cpu"], results["projection_tree_on_device"]):
        lines.append(f"| {cpu_row['nodes']} | {cpu_row['tau']:.2f} | {cpu_row['verify_ms']:.2f} | "
                     f"{cpu_row['step_ms']:.2f} | {cpu_row['speedup']:.2f}x | {dev_row['speedup']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
