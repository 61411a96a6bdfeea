"""`dart-spec serve`: an SGLang server with `--speculative-algorithm DART` (a thin launcher)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from dart_cli.errors import UsageError


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an SGLang server that decodes with a DART head",
                       description="Runs `python -m sglang.launch_server --model-path TARGET --speculative-algorithm "
                                   "DART --speculative-draft-model-path HEAD --disable-overlap-schedule ARGS...` "
                                   "after checking the head directory. Tree sizes come from the head's "
                                   "config.json (dart_config). Every other argument goes to SGLang unchanged.")
    p.add_argument("--model-path", required=True, metavar="TARGET", help="the target model (a local directory)")
    p.add_argument("--head", required=True, metavar="DIR",
                   help="a DART head converted for SGLang (`dart-spec convert sglang HEAD DIR --target TARGET`)")
    p.add_argument("--dry-run", action="store_true", help="print the SGLang command instead of running it")
    p.set_defaults(run=_run_serve, passthrough=True)


def serve_command(model_path: str, head: str, extra: list[str]) -> list[str]:
    """The SGLang command line `dart-spec serve` runs (checks the head directory first)."""
    from dart_sglang.settings import DartServeSettings

    DartServeSettings.from_draft_dir(head)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--speculative-algorithm", "DART", "--speculative-draft-model-path", head]
    if "--disable-overlap-schedule" not in extra:
        cmd.append("--disable-overlap-schedule")
    return cmd + extra


def _run_serve(args: argparse.Namespace) -> int:
    cmd = serve_command(args.model_path, args.head, args.extra)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    if importlib.util.find_spec("sglang") is None:
        raise UsageError("SGLang is not installed: pip install 'dart-spec[sglang]' (a CUDA machine)")
    os.execv(cmd[0], cmd)
