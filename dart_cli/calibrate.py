"""`dart-spec calibrate`: measure a head's acceptance curve on its target and ship it in the head's config.json."""

from __future__ import annotations

import argparse
import json
import os

from dart_cli.errors import UsageError
from dart_cli.numbers import checked, integer
from dart_cli.threads import set_threads


def add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="measure a head's acceptance curve tau(R) and store it in its config.json",
        description="Decode the prompts greedily with a 60-node tree, record which draft nodes the target accepts, "
                    "and store tau(R) for the candidate tree sizes under \"dart_acceptance\" in HEAD/config.json "
                    "(atomically; the weights are untouched). Every DART call then picks its tree size from this "
                    "curve and the cost of a verify step on the machine it runs on (measured at first use).")
    p.add_argument("head", metavar="HEAD", help="DART head directory (written in place: its config.json)")
    p.add_argument("--target", default="smollm2", help="'smollm2' (default) or a local transformers model directory")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="prompts, one JSON object per line with a \"prompt\" string (default: built-in chat prompts)")
    p.add_argument("--max-nodes", type=integer(1), default=60, help="the largest tree measured (default 60)")
    p.add_argument("--max-new-tokens", type=integer(1), default=128, help="tokens per prompt (default 128)")
    p.add_argument("--threads", type=integer(1), metavar="N", help="torch CPU threads")
    p.set_defaults(run=checked(p, _run_calibrate), reads=("target", "prompts"))


def _run_calibrate(args: argparse.Namespace) -> int:
    from dart_core import DartHead
    from dart_core.config import ACCEPTANCE_KEY, CONFIG_NAME
    from dart_core.io import atomic_write, check_rewritable, read_json_object
    from dart_cli.train import read_prompts
    from dart_hf import enable
    from dart_hf.calibration import DEFAULT_PROMPTS, measure_acceptance
    from dart_hf.default import default_head_dtype
    from dart_train.trainer import load_target

    if args.max_nodes < 1 or args.max_new_tokens < 1:
        raise UsageError("--max-nodes and --max-new-tokens must be >= 1")
    config_file = os.path.join(args.head, CONFIG_NAME)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"DART head directory not found: no {CONFIG_NAME} in {args.head}")
    check_rewritable(config_file)  # before the measurement: a link is never replaced by a copy
    set_threads(args.threads)
    prompts = read_prompts(args.prompts, "prompt") if args.prompts else list(DEFAULT_PROMPTS)
    model, tokenizer = load_target(args.target, "cpu", with_tokenizer=True)
    param = next(model.parameters())
    head = DartHead.from_pretrained(args.head, device=param.device)
    head.to(dtype=default_head_dtype(head, param.dtype, param.device))
    head.set_input_embeddings(model.get_input_embeddings())
    curve = measure_acceptance(enable(model, False), tokenizer, head.eval(), prompts, max_nodes=args.max_nodes,
                               max_new_tokens=args.max_new_tokens, progress=True)
    check_rewritable(config_file)
    config = read_json_object(config_file)
    config[ACCEPTANCE_KEY] = curve.to_dict()
    with atomic_write(config_file, "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    print(f"tau(R) over {curve.steps} verify steps of {curve.prompts} prompts: "
          + ", ".join(f"{r}: {t:.2f}" for r, t in curve.tau.items()))
    print(f"wrote {ACCEPTANCE_KEY} into {config_file}")
    return 0
