"""The `dart-spec` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import _signal  # the signal module's core, already loaded: `signal` itself takes milliseconds to import
import os
import sys

_WORDS = sys.argv[1:]  # the command line the interrupt message names (main's argv once it runs)


def _interrupted(argv: list[str]) -> int:
    """Ctrl-C's answer, whenever it comes: one line naming the command, exit status 130."""
    command = next((a for a in argv if not a.startswith("-")), None)
    sys.stderr.write(f"dart-spec{' ' + command if command else ''}: interrupted\n")
    sys.stderr.flush()
    return 130


def _importing(frame) -> bool:
    """Whether the interrupted frame runs inside an import (Python's import machinery is on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):
            return True
        frame = frame.f_back
    return False


def _on_interrupt(signum, frame) -> None:
    """SIGINT while dart-spec runs. Inside an import (torch and transformers take seconds; a library may swallow a
    KeyboardInterrupt there and leave a module half-initialised) the command ends at once with the answer of any
    later interrupt: nothing is written while modules import. Anywhere else: KeyboardInterrupt, as Python raises it,
    which `main` answers once the code it interrupts has cleaned up."""
    if _importing(frame):
        os._exit(_interrupted(_WORDS))
    raise KeyboardInterrupt


if __name__ == "__main__" or os.path.basename(sys.argv[0]).startswith("dart-spec"):  # run as the command
    _signal.signal(_signal.SIGINT, _on_interrupt)  # first, before the imports below (seconds)

import argparse
import contextlib
import signal
import threading
from typing import Callable, Optional

from dart_core.config import TreeConfig
from dart_core.errors import DartInputError
from dart_core.io import refuse_overlap

from dart_cli.bench import add_bench
from dart_cli.calibrate import add_calibrate
from dart_cli.convert import add_convert
from dart_cli.errors import UsageError
from dart_cli.threads import set_threads
from dart_cli.serve import add_serve
from dart_cli.train import add_distill, add_ngram, add_prompts, add_train


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="SmolLM2 with the shipped DART head: a streamed completion and the speedup",
                       description="Load SmolLM2-135M-Instruct and the shipped DART head (offline), stream a greedy "
                                   "DART completion of a prompt, then time plain generate() and DART on it and "
                                   "check that both outputs are identical. --core runs the core pipeline on an "
                                   "embedded random head instead (no model).")
    p.add_argument("--prompt", help="the user message (chat template applied; default: a built-in question)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per completion (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each method, after one warm-up (default 3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the target's dtype (default float32, where DART's output is plain's token for token; "
                        "bfloat16 uses the CPU's bfloat16 units, and the agreement with plain is reported)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the head's acceptance curve and this machine's cost again first (about a minute)")
    p.add_argument("--head", metavar="DIR", help="a DART head directory instead of the shipped one")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--remain-total", type=int, help="draft nodes per tree (default: chosen for this machine, else "
                                                    "the head's; --core: 60)")
    core = p.add_argument_group("--core (the core pipeline on an embedded random head, no model)")
    core.add_argument("--core", action="store_true", help="run the core demo instead")
    core.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    core.add_argument("--batch-size", type=int, default=4, help="trees drafted at once (default 4)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from dart_cli.demo import DEFAULT_PROMPT, core_demo, model_demo

    if args.batch_size < 1 or (args.remain_total is not None and args.remain_total < 1):
        raise UsageError("--batch-size and --remain-total must be >= 1")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty; give a question, or leave --prompt out for the built-in one")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise UsageError("--prompt is not valid UTF-8 text") from None
    if not 0 <= args.seed < 2 ** 64:
        raise UsageError(f"--seed must be in 0..2**64-1, got {args.seed}")
    if args.remain_total is not None:
        TreeConfig(remain_total=args.remain_total)  # its bounds, before the model loads
    if args.max_new_tokens < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        raise UsageError("--max-new-tokens, --repeats and --threads must be >= 1")
    set_threads(args.threads)
    if args.core:
        core_demo(seed=args.seed, batch_size=args.batch_size, remain_total=args.remain_total or 60)
        return 0
    result = model_demo(prompt=args.prompt or DEFAULT_PROMPT, max_new_tokens=args.max_new_tokens,
                        repeats=args.repeats, calibrate=args.calibrate, head_dir=args.head,
                        remain_total=args.remain_total, dtype=args.dtype)
    return 0 if result["identical"] or args.dtype != "float32" else 1


def _one_line(err: BaseException) -> str:
    """The error's message on one line (an OSError without one: its cause and file)."""
    if isinstance(err, OSError) and str(err).startswith("[Errno"):  # raised by the OS, not by this project
        text = f"{err.strerror}: {err.filename}" if err.filename else str(err.strerror)
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


COMMANDS: list[Callable] = [_add_demo, add_bench, add_calibrate, add_convert, add_prompts, add_distill, add_train,
                            add_ngram, add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dart-spec", description="Lossless speculative decoding with DART heads.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def read_paths(args: argparse.Namespace) -> list[str]:
    """Every path the parsed command reads (its parser's `reads` names the arguments; lists flattened)."""
    values = [getattr(args, name, None) for name in getattr(args, "reads", ())]
    return [v for value in values for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


@contextlib.contextmanager
def _interrupts_answered(words: list[str]):
    """Within the block (in the main thread) SIGINT is `_on_interrupt`, naming `words`; the handler before is put
    back after it."""
    global _WORDS
    _WORDS = words
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, _on_interrupt)
    try:
        yield
    finally:
        if before is not None:  # None: a handler not installed from Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


def main(argv: Optional[list[str]] = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    with _interrupts_answered(words):
        return _main(words)


def _main(words: list[str]) -> int:
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(words)
        if extra and not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra
        if getattr(args, "writes", None):  # one rule for every command: no input is its output or inside it
            refuse_overlap(getattr(args, args.writes), read_paths(args))
        return args.run(args)
    except (DartInputError, OSError) as err:
        # bad input (UsageError is one), or the file system's answer about a path (missing, full, read-only); any
        # other exception, a plain ValueError included, is a bug: its traceback is what a report needs
        print(f"dart-spec {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(words)


if __name__ == "__main__":
    sys.exit(main())
