"""Sweeps of the classes where DART could differ from plain generate() without saying so (issue #46, items 3-7):
every case ends correct (DART's output or masks are plain's, or the file is written as asked), as a clear refusal
(NotApplicable / one DartFallbackWarning / a one-line error naming the reason), or as a silent difference, which
must never happen.

    python benchmarks/exactness_sweep.py --json benchmarks/results/exactness_sweep.json
    python benchmarks/exactness_sweep.py --classes masks,processors        # some classes only

Classes:
  masks       every sliding-window architecture of transformers' causal LMs that builds tiny (`tests/helpers/hf_models.py`),
              sliding_window 1, 2, 3, 8, 64, layer_types as configured / all full / all sliding / alternating: the
              positions every attention layer sees in plain one-token steps against one DART verify forward over
              the same tokens (`tests/helpers/attention_views.py`), logits included. A config plain generate() cannot run
              counts as correct when DART refuses it too.
  generate    the issue's 11 architectures, the same windows, layer_types as configured / all full / alternating, a
              prompt and a left-padded batch of 2: greedy DART (a head drafting plain's continuation) against plain.
  processors  custom and transformers' logits processors, batch 1-4, an attached head and dart_head=.
  prefix_fn   prefix_allowed_tokens_fn with per-row bands, batch 1-4, three prompts each.
  links       `dart-spec calibrate` on a head whose config.json is a regular file, a relative / absolute / chained
              symbolic link, a hard link, inside a linked directory, a dangling link.
  interrupts  a real SIGINT to `dart-spec demo --core` after 0.02-8 s (imports take seconds here); a signal that
              lands in Python's own start-up, before the first line of dart-spec's code, is counted apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model helpers the tests use

import dart_hf
from dart_bench import script_parser, write_results
from dart_core import TreeConfig
from dart_core.errors import DartInputError

CORRECT, REFUSED, SILENT = "correct", "refused", "silent difference"
TREE = TreeConfig(remain_total=8)
F, S = "full_attention", "sliding_attention"
LAYER_TYPES = {"configured": None, "all full": [F] * 4, "all sliding": [S] * 4, "alternating": [S, F, S, F]}
WINDOWS = (1, 2, 3, 8, 64)
ISSUE_ARCHS = ("mistral", "ministral", "mixtral", "gemma2", "gemma3_text", "phi3", "qwen2", "qwen3", "cohere2",
               "starcoder2", "gpt_oss")


def quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def windowed_archs() -> list[str]:
    """The architectures (not refused, tiny-buildable) whose text config has a sliding_window."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from test_hf_architectures import NOT_BUILT, REFUSED

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in REFUSED or model_type in NOT_BUILT:
            continue
        try:
            config = transformers.AutoConfig.for_model(model_type).get_text_config(decoder=True)
        except Exception:
            continue
        if hasattr(config, "sliding_window"):
            out.append(model_type)
    return out


def overrides(window, kind):
    settings = {"sliding_window": window}
    if LAYER_TYPES[kind] is not None:
        settings["layer_types"] = LAYER_TYPES[kind]
    return settings


def sweep_masks(archs) -> list[dict]:
    from helpers.attention_views import dart_views, differences, padded_prompt, plain_views
    from helpers.hf_models import _tiny, tiny_causal_lm

    rows = []
    ids, mask = padded_prompt()
    new = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    for model_type in archs:
        for window in WINDOWS:
            for kind in LAYER_TYPES:
                case = {"arch": model_type, "window": window, "layer_types": kind}
                try:
                    model = tiny_causal_lm(model_type, **overrides(window, kind))
                    plain, plain_logits = plain_views(model, ids, mask, new)
                except AssertionError as err:  # the recorder saw no attention call it can read
                    case.update(outcome="not observed", note=str(err)[:160])
                    rows.append(case)
                    continue
                except Exception as err:  # plain cannot run it: DART must refuse it
                    try:
                        dart_hf.target.attention_layout(_tiny(model_type, 0, (), overrides(window, kind)))
                        case.update(outcome=SILENT, note=f"plain fails ({type(err).__name__}), DART does not refuse")
                    except DartInputError as refusal:
                        case.update(outcome=REFUSED, note=f"plain fails; {refusal}"[:160])
                    except Exception as other:
                        case.update(outcome=REFUSED, note=f"plain fails; so does building it ({other})"[:160])
                    rows.append(case)
                    continue
                try:
                    dart, dart_logits = dart_views(model, ids, mask, new)
                except DartInputError as refusal:
                    case.update(outcome=REFUSED, note=str(refusal)[:160])
                    rows.append(case)
                    continue
                except Exception as err:  # an error, not an answer: loud, but not a refusal by name
                    case.update(outcome="DART raises", note=f"{type(err).__name__}: {err}"[:160])
                    rows.append(case)
                    continue
                diff = differences(plain, dart)
                close = torch.allclose(dart_logits, plain_logits, atol=1e-4, rtol=1e-4)
                case.update(outcome=CORRECT if not diff and close else SILENT,
                            note="" if not diff and close else (diff[:1] or ["logits differ"])[0][:160])
                rows.append(case)
    return rows


def _generate_case(model, ids, mask):
    from helpers.hf_models import oracle_head

    kwargs = dict(max_new_tokens=12, do_sample=False)
    if mask is not None:
        kwargs.update(attention_mask=mask, pad_token_id=0)
    try:
        plain = model.generate(ids, **kwargs)
    except Exception as err:  # plain cannot run it: DART must refuse it (or fail as plain does)
        try:
            model.generate(ids, dart_head=oracle_head(model, ids[-1]), dart_tree_config=TREE, **kwargs)
        except dart_hf.NotApplicable as refusal:
            return REFUSED, f"plain fails ({type(err).__name__}); {refusal}"[:160]
        except Exception as also:
            return "plain fails, so does DART", f"{type(err).__name__} / {type(also).__name__}"
        return SILENT, f"plain fails ({type(err).__name__}), DART decodes"
    head = oracle_head(model, plain[-1], wrong_every=5)
    try:
        out = model.generate(ids, dart_head=head, dart_tree_config=TREE, **kwargs)
    except dart_hf.NotApplicable as refusal:
        return REFUSED, str(refusal)[:160]
    except Exception as err:  # an error, not an answer: loud, but not a refusal by name
        return "DART raises", f"{type(err).__name__}: {err}"[:160]
    return (CORRECT, "") if torch.equal(out, plain) else (SILENT, "output differs")


def sweep_generate() -> list[dict]:
    from helpers.attention_views import padded_prompt
    from helpers.hf_models import _tiny, tiny_causal_lm

    rows = []
    prompt = torch.tensor([[5, 17, 33, 2, 9, 40, 41, 7, 8]])
    ids, mask = padded_prompt(length=12, pad=4)
    for model_type in ISSUE_ARCHS:
        for window in WINDOWS:
            for kind in ("configured", "all full", "alternating"):
                try:
                    model = dart_hf.enable(tiny_causal_lm(model_type, **overrides(window, kind)))
                except Exception as err:  # plain cannot run it: DART must refuse it
                    try:
                        dart_hf.target.attention_layout(_tiny(model_type, 0, (), overrides(window, kind)))
                        outcome, note = SILENT, f"plain fails ({type(err).__name__}), DART does not refuse"
                    except DartInputError as refusal:
                        outcome, note = REFUSED, f"plain fails; {refusal}"[:160]
                    for batch in ("prompt", "padded batch of 2"):
                        rows.append({"arch": model_type, "window": window, "layer_types": kind, "batch": batch,
                                     "outcome": outcome, "note": note})
                    continue
                for batch, (x, m) in (("prompt", (prompt, None)), ("padded batch of 2", (ids, mask))):
                    outcome, note = _generate_case(model, x, m)
                    rows.append({"arch": model_type, "window": window, "layer_types": kind, "batch": batch,
                                 "outcome": outcome, "note": note})
    return rows


def sweep_processors() -> list[dict]:
    from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor
    from helpers.hf_models import oracle_head, tiny_target
    import test_processor_state as t

    cases = {
        "counting (custom, state)": (lambda: [t.BanArgmaxEveryOtherCall()], {}),
        "row rules (custom, no state)": (lambda: [t.BanByRow()], {}),
        "row rules, declared stateless": (lambda: [t.BanByRow()], {"dart_stateless_processors": True}),
        "a function, declared stateless": (lambda: [t.ban_odd], {"dart_stateless_processors": True}),
        "subclass of TemperatureLogitsWarper": (lambda: [t.SharperTemperature(0.7)], {}),
        "NoRepeatNGramLogitsProcessor passed in": (lambda: [NoRepeatNGramLogitsProcessor(3)], {}),
        "repetition_penalty (generate builds it)": (lambda: [], {"repetition_penalty": 1.3}),
    }
    rows = []
    for name, (make, extra) in cases.items():
        for batch in (1, 2, 3, 4):
            model, ids, kwargs = t.setting(batch)
            settings = {k: v for k, v in extra.items() if not k.startswith("dart_")}
            declared = {k: v for k, v in extra.items() if k.startswith("dart_")}
            plain = model.generate(ids, logits_processor=LogitsProcessorList(make()), **kwargs, **settings)
            head = oracle_head(model, plain[0], wrong_every=4)
            for mode in ("attached head", "dart_head="):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", dart_hf.DartFallbackWarning)
                    try:
                        if mode == "attached head":
                            attached = dart_hf.enable(tiny_target(), head, tree_config=TREE)
                            out = attached.generate(ids, logits_processor=LogitsProcessorList(make()), **kwargs,
                                                    **settings, **declared)
                            decoded = attached.dart_stats is not None and attached.dart_stats.forwards > 0
                        else:
                            out = model.generate(ids, logits_processor=LogitsProcessorList(make()), dart_head=head,
                                                 dart_tree_config=TREE, **kwargs, **settings, **declared)
                            decoded = True
                    except dart_hf.NotApplicable as refusal:
                        rows.append({"processor": name, "batch": batch, "mode": mode, "outcome": REFUSED,
                                     "note": str(refusal)[:120]})
                        continue
                fallbacks = [w for w in caught if issubclass(w.category, dart_hf.DartFallbackWarning)]
                if not torch.equal(out, plain):
                    outcome = SILENT if not fallbacks else "differs after a warning"
                elif fallbacks:
                    outcome = REFUSED
                else:
                    outcome = CORRECT
                rows.append({"processor": name, "batch": batch, "mode": mode, "outcome": outcome,
                             "note": str(fallbacks[0].message)[:120] if fallbacks else f"decoded with DART: {decoded}"})
    return rows


def sweep_prefix_fn() -> list[dict]:
    from helpers.hf_models import oracle_head
    import test_processor_state as t

    rows = []
    for batch in (1, 2, 3, 4):
        for seed in range(3):
            model, ids, kwargs = t.setting(batch)
            ids = ids.roll(seed, dims=1) if seed else ids
            kwargs["prefix_allowed_tokens_fn"] = lambda b, sent: list(range(10 * b + 2, 10 * b + 40))
            plain = model.generate(ids, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model.generate(ids, dart_head=oracle_head(model, plain[0], wrong_every=4), dart_tree_config=TREE,
                                     **kwargs)
            warned = [w for w in caught if issubclass(w.category, dart_hf.DartFallbackWarning)]
            same = torch.equal(out, plain)
            rows.append({"batch": batch, "seed": seed, "outcome": CORRECT if same and not warned else SILENT,
                         "note": f"DART forwards {model.dart_stats.forwards}"})
    return rows


def sweep_links() -> list[dict]:
    from dart_cli.main import main
    import dart_train.trainer
    import dart_hf.calibration
    from helpers.hf_models import char_tokenizer, random_head, tiny_target
    import test_cli_links as t

    real_load, real_measure = dart_train.trainer.load_target, dart_hf.calibration.measure_acceptance
    dart_train.trainer.load_target = lambda *a, **k: (tiny_target(), char_tokenizer())
    dart_hf.calibration.measure_acceptance = lambda *a, **k: t.CURVE
    rows = []
    try:
        for layout in ("regular file", "relative link", "absolute link", "chained links", "hard link",
                       "linked directory", "dangling link"):
            with tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                head = tmp / "head"
                random_head(tiny_target()).save_pretrained(head)
                given, target = head, head / "config.json"
                if layout in ("relative link", "absolute link", "chained links"):
                    snap, target = t.snapshot(tmp / "hub", relative=layout != "absolute link")
                    given = snap
                    if layout == "chained links":  # snapshot link -> another link -> the blob
                        os.symlink(target, tmp / "hop")
                        os.unlink(snap / "config.json")
                        os.symlink(tmp / "hop", snap / "config.json")
                elif layout == "hard link":
                    os.link(target, tmp / "other.json")
                elif layout == "linked directory":
                    given = tmp / "link"
                    os.symlink(head, given)
                elif layout == "dangling link":
                    os.replace(target, tmp / "moved.json")
                    os.symlink(tmp / "gone.json", target)
                before = target.read_text() if target.exists() else None
                was_link = os.path.islink(given / "config.json")
                err = tempfile.TemporaryFile(mode="w+")
                saved, sys.stderr = sys.stderr, err
                try:
                    status = main(["calibrate", str(given), "--target", "tiny"])
                finally:
                    sys.stderr = saved
                err.seek(0)
                message = err.read().strip()
                still_link = os.path.islink(given / "config.json")
                after = target.read_text() if target.exists() else None
                if status == 0:
                    wrote = "dart_acceptance" in json.loads((given / "config.json").read_text())
                    outcome = CORRECT if wrote and still_link == was_link else SILENT
                else:
                    outcome = REFUSED if still_link == was_link and after == before and message else SILENT
                rows.append({"layout": layout, "exit": status, "outcome": outcome, "note": message[:160]})
    finally:
        dart_train.trainer.load_target, dart_hf.calibration.measure_acceptance = real_load, real_measure
    return rows


def sweep_interrupts() -> list[dict]:
    script = Path(sys.executable).parent / "dart-spec"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dart_cli.main"]
    rows = []
    for delay in (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 3.0, 5.0, 8.0):
        proc = subprocess.Popen(command + ["demo", "--core", "--batch-size", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
        time.sleep(delay)
        sent = proc.poll() is None
        if sent:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        if not sent:
            outcome = "finished before the signal"
        elif proc.returncode == 130 and lines[-1:] == ["dart-spec demo: interrupted"] and "Traceback" not in err:
            outcome = CORRECT
        elif "dart_cli" + os.sep + "main.py" not in err:  # Python's own start-up and its finding the module
            outcome = "before dart-spec's code runs"
        else:
            outcome = SILENT
        rows.append({"delay_s": delay, "exit": proc.returncode, "outcome": outcome, "note": (lines or [""])[-1][:120]})
    return rows


def totals(rows: list[dict]) -> dict:
    out = {"cases": len(rows)}
    for row in rows:
        out[row["outcome"]] = out.get(row["outcome"], 0) + 1
    return out


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=1)
    parser.add_argument("--classes", default="masks,generate,processors,prefix_fn,links,interrupts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet()
    os.environ.setdefault("DART_SPEC_CACHE", tempfile.mkdtemp(prefix="dart-sweep-cache-"))
    runs = {"masks": lambda: sweep_masks(windowed_archs()), "generate": sweep_generate,
            "processors": sweep_processors, "prefix_fn": sweep_prefix_fn, "links": sweep_links,
            "interrupts": sweep_interrupts}
    results = {"classes": {}}
    for name in args.classes.split(","):
        start = time.perf_counter()
        rows = runs[name]()
        results["classes"][name] = {"totals": totals(rows), "seconds": round(time.perf_counter() - start, 1),
                                    "cases": rows}
        print(f"{name}: {totals(rows)}  ({time.perf_counter() - start:.0f} s)", flush=True)
        for row in rows:
            if row["outcome"] == SILENT:
                print("  SILENT:", row, flush=True)
    if args.json:
        write_results(args.json, results)
    silent = sum(c["totals"].get(SILENT, 0) for c in results["classes"].values())
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
