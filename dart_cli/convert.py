"""`dart-spec convert {official,trie,sglang,eagle3,widen}`: checkpoint and n-gram conversions (see `dart_converters`; the
SGLang directory: `dart_sglang.head_format`)."""

from __future__ import annotations

import argparse
import sys

from dart_cli.numbers import checked, integer, seed
from dart_core.io import WEIGHT_DTYPES


def add_convert(sub) -> None:
    """Register the `convert` command group on the top-level subparsers."""
    p = sub.add_parser(
        "convert", help="convert official DART heads, .trie n-grams and EAGLE3 heads to this project's formats",
        description="Convert checkpoints and n-gram files. Outputs are built beside the destination and moved into "
                    "place at the end; an existing destination is refused unless --force.")
    kinds = p.add_subparsers(dest="convert_kind", metavar="KIND")
    kinds.required = True

    o = kinds.add_parser(
        "official", help="official DART head directory -> this project's head directory",
        description="Read an official DART head (config.json + model.safetensors), optionally check it against the "
                    "target model and convert the official n-gram trie, and write this project's head directory "
                    "(tree settings, taps, n-gram recorded in config.json).")
    o.add_argument("src", metavar="SRC", help="official DART head directory")
    o.add_argument("dst", metavar="DST", help="output directory")
    o.add_argument("--ngram", metavar="SRC.trie", help="official n-gram trie to convert into DST/ngram.safetensors")
    o.add_argument("--target", metavar="TARGET_DIR",
                   help="local HF target model directory (config.json): check hidden size, vocab, layers and d2t, "
                        "record the taps and take the EOS id")
    o.add_argument("--eos-token-id", type=integer(0), help="EOS id for the tree search (default: the target's)")
    _common(o)
    o.set_defaults(run=checked(o, _run_official), reads=("src", "ngram", "target"), writes="dst")

    t = kinds.add_parser(
        "trie", help="official .trie n-gram -> this project's n-gram file (streamed)",
        description="Stream an official DART .trie file into this project's compact n-gram file (sorted int64 keys "
                    "+ int32 counts, 12 bytes per node). Memory follows the output, not the input; the output is "
                    "written atomically. Corrupt or truncated input fails naming the byte offset.")
    t.add_argument("src", metavar="SRC.trie", help="official n-gram trie")
    t.add_argument("dst", metavar="DST", help="output file (e.g. ngram.safetensors)")
    t.add_argument("--vocab-size", type=integer(1), metavar="N",
                   help="token ids must lie below N (default: max token id + 1)")
    t.add_argument("--force", action="store_true", help="replace DST if it exists")
    t.set_defaults(run=checked(t, _run_trie), reads=("src",), writes="dst")

    s = kinds.add_parser(
        "sglang", help="DART head directory (ours or official) -> SGLang DART plugin directory",
        description="Write the directory SGLang's DART plugin loads: config.json with LlamaForCausalLMDart, the "
                    "EAGLE3 aux-layer ids (taps - 1) and a dart_config block with the tree settings and n-gram file, "
                    "plus model.safetensors (official weight names) and ngram.safetensors.")
    s.add_argument("src", metavar="SRC", help="DART head directory (this project's or official)")
    s.add_argument("dst", metavar="DST", help="output directory")
    s.add_argument("--target", metavar="TARGET_DIR", help="local HF target model directory: checks and taps")
    s.add_argument("--num-target-layers", type=integer(1), metavar="L",
                   help="target layer count for the default taps [2, L//2, L-3] when the head records none")
    s.add_argument("--ngram", metavar="FILE",
                   help="n-gram to ship: this project's .safetensors (copied) or an official .trie (converted); "
                        "default: the head directory's own")
    s.add_argument("--eos-token-id", type=integer(0),
                   help="EOS id for the tree search (default: the head's or target's)")
    _common(s)
    s.set_defaults(run=checked(s, _run_sglang), reads=("src", "target", "ngram"), writes="dst")

    e = kinds.add_parser(
        "eagle3", help="EAGLE3 head (SpecForge/SGLang layout) -> DART head for warm-start training",
        description="Keep every EAGLE3 weight and add DART's mask_rep [2H], drawn from a seeded standard normal "
                    "like the reference's initialisation. EAGLE3 aux-layer ids become taps (+1).")
    e.add_argument("src", metavar="SRC", help="EAGLE3 head directory (config.json + model.safetensors)")
    e.add_argument("dst", metavar="DST", help="output directory")
    e.add_argument("--draft-length", type=integer(1), required=True, metavar="D", help="DART draft length (mask rows)")
    e.add_argument("--seed", type=seed(), default=0, help="seed of the mask_rep initialisation, 0..2**64-1 (default 0)")
    _common(e)
    e.set_defaults(run=checked(e, _run_eagle3), reads=("src",), writes="dst")


    w = kinds.add_parser(
        "widen", help="a DART head -> the same head with a wider MLP (warm start of a wider head)",
        description="Copy a head with --intermediate-size MLP units: its own units first, each new one with "
                    "freshly drawn gate/up rows and a zero down_proj column, so the widened head computes exactly "
                    "what the source computes until it is trained (dart-spec train --init-from DST). The format "
                    "is unchanged (official weight names; `dart-spec convert sglang` takes it).")
    w.add_argument("src", metavar="SRC", help="DART head directory")
    w.add_argument("dst", metavar="DST", help="output directory")
    w.add_argument("--intermediate-size", type=integer(1), required=True, metavar="I",
                   help="MLP width of the result (at least the source's)")
    w.add_argument("--seed", type=seed(), default=0,
                   help="seed of the new units' gate/up rows, 0..2**64-1 (default 0)")
    _common(w)
    w.set_defaults(run=checked(w, _run_widen), reads=("src",), writes="dst")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=tuple(WEIGHT_DTYPES), help="weights dtype (default: the source's)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")


def _notes(summary: dict) -> None:
    for note in summary.get("notes") or ():
        print(f"dart-spec convert: note: {note}", file=sys.stderr)


def _ngram_line(stats: dict) -> str:
    return (f"n-gram: {stats['nodes']:,} nodes, order {stats['order']}, vocab bound {stats['vocab_bound']}, "
            f"{stats['bytes_per_node']:.1f} bytes/node ({stats['input_bytes_per_node']:.1f} in the .trie), "
            f"{stats['nodes_per_s'] / 1e6:.2f} M nodes/s")


def _run_official(args: argparse.Namespace) -> int:
    from dart_converters import convert_official

    summary = convert_official(args.src, args.dst, ngram=args.ngram, target=args.target, dtype=args.dtype,
                               force=args.force, eos_token_id=args.eos_token_id, progress=None)
    _notes(summary)
    print(f"wrote {summary['dst']} ({summary['dtype']}; taps {summary['target_layer_ids']}; "
          f"eos {summary['tree']['eos_token_id']})")
    if "ngram" in summary:
        print(_ngram_line(summary["ngram"]))
    return 0


def _run_trie(args: argparse.Namespace) -> int:
    from dart_converters import convert_trie

    stats = convert_trie(args.src, args.dst, vocab_size=args.vocab_size, force=args.force, progress=None)
    print(f"wrote {stats['output']}")
    print(_ngram_line(stats))
    if stats["root_count_replaced"]:
        print(f"dart-spec convert: note: root freq {stats['root_freq_in_file']} in the file is below the sum of its "
              f"children's; stored {stats['root_count']}", file=sys.stderr)
    return 0


def _run_sglang(args: argparse.Namespace) -> int:
    from dart_sglang.head_format import CONFIG_BLOCK, NGRAM_KEY, convert_sglang

    summary = convert_sglang(args.src, args.dst, target=args.target, num_target_layers=args.num_target_layers,
                             ngram=args.ngram, dtype=args.dtype, force=args.force, eos_token_id=args.eos_token_id,
                             progress=None)
    _notes(summary)
    cfg = summary["config"]
    print(f"wrote {summary['dst']} ({summary['dtype']}; eagle_aux_hidden_state_layer_ids "
          f"{cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']}; n-gram "
          f"{cfg[CONFIG_BLOCK].get(NGRAM_KEY, 'none')})")
    return 0


def _run_eagle3(args: argparse.Namespace) -> int:
    from dart_converters import convert_eagle3

    summary = convert_eagle3(args.src, args.dst, draft_length=args.draft_length, seed=args.seed, dtype=args.dtype,
                             force=args.force)
    print(f"wrote {summary['dst']} ({summary['dtype']}; draft_length {summary['draft_length']}; mask_rep seed "
          f"{summary['seed']}; taps {summary['target_layer_ids'] or 'default'})")
    return 0


def _run_widen(args: argparse.Namespace) -> int:
    from dart_converters import convert_widen

    summary = convert_widen(args.src, args.dst, intermediate_size=args.intermediate_size, seed=args.seed,
                            dtype=args.dtype, force=args.force)
    print(f"wrote {summary['dst']} ({summary['dtype']}; MLP {summary['from_intermediate_size']} -> "
          f"{summary['intermediate_size']} units, new units' seed {summary['seed']})")
    return 0
