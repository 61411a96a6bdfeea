"""The `dart-spec` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from dart_cli.convert import add_convert


class UsageError(Exception):
    """Bad input from the command line; reported as one line and exit status 2."""


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run the DART core end to end on an embedded random head (offline)",
                       description="Draft a tree with an embedded random head and n-gram, verify it against a "
                                   "synthetic target, and print the tree and per-stage timings.")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--batch-size", type=int, default=4, help="trees drafted at once (default 4)")
    p.add_argument("--remain-total", type=int, default=60, help="draft nodes per tree (default 60)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from dart_cli.demo import core_demo

    if args.batch_size < 1 or args.remain_total < 1:
        raise UsageError("--batch-size and --remain-total must be >= 1")
    core_demo(seed=args.seed, batch_size=args.batch_size, remain_total=args.remain_total)
    return 0


COMMANDS: list[Callable] = [_add_demo, add_convert]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dart-spec", description="Lossless speculative decoding with DART heads.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"dart-spec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dart-spec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
