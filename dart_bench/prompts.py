"""Prompt sets and chat encoding: the one place the benchmarks, `dart-spec bench` and the demo read prompts and turn
them into token ids.

The shipped sets live in `dart_bench/data/` (see data/README.md): MT-Bench questions, HumanEval prompts and the
end of the GSM8K distillation order. Chat encoding goes through `dart_hf.calibration.encode_prompts` (the
chat template when the tokenizer has one), imported when called so that importing dart_bench stays free of
transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from dart_core.errors import DartInputError

PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k")
DATA_DIR = Path(__file__).resolve().parent / "data"  # the shipped prompt sets (see data/README.md)
# the prompt of `dart-spec demo` (and of benchmarks/bench_hf_overhead.py)
DEMO_PROMPT = "Explain in a few sentences how a hash table works and when it is a bad choice."
# prompt set -> (file in the data folder, the prompt text of one row)
_FIELDS = {"mt_bench": ("mt_bench_questions", lambda r: r["turns"][0]),
           "humaneval": ("humaneval", lambda r: r["prompt"]), "gsm8k": ("gsm8k", lambda r: r["question"])}


# ---- reading ------------------------------------------------------------------------------------------------------
def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) of each non-empty line of a JSON-lines file, read lazily."""
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    yield number, json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DartInputError(f"{path}: not a JSON-lines file ({err})") from None


def read_prompt_rows(name: str, data_dir: str | Path = DATA_DIR) -> list[dict]:
    """The rows of one prompt file of `data_dir` (default: the sets shipped in `dart_bench/data/`): `name` is
    mt_bench_questions, humaneval or gsm8k."""
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    return [row for _, row in _jsonl_rows(path)]


def load_prompt_sets(data_dir: str | Path, per_set: int, sets: Sequence[str] = PROMPT_SETS) -> dict[str, list[str]]:
    """The first `per_set` prompts of each set: MT-Bench first turns, HumanEval prompts, GSM8K questions (the shipped
    slice is the end of the distillation order). Raises DartInputError for a negative `per_set` or one above a set's
    size."""
    unknown = sorted(set(sets) - set(PROMPT_SETS))
    if unknown:
        raise DartInputError(f"unknown prompt set(s) {unknown}; known: {', '.join(PROMPT_SETS)}")
    if per_set < 0:
        raise DartInputError(f"prompts per set must be >= 0, got {per_set}")
    out = {}
    for name in sets:
        file, field = _FIELDS[name]
        rows = read_prompt_rows(file, data_dir)
        if per_set > len(rows):
            raise DartInputError(f"{per_set} {name} prompts asked for; {Path(data_dir) / file}.jsonl holds {len(rows)}")
        out[name] = [field(row) for row in rows[:per_set]]
    return out


def prompt_set(name: str, count: int, data_dir: str | Path = DATA_DIR) -> list[str]:
    """The first `count` prompts of one set (`load_prompt_sets` for a single set)."""
    return load_prompt_sets(data_dir, count, [name])[name]


def prompts_from_file(path: Path, count: int, missing_hint: str = "") -> list[str]:
    """The first `count` prompts of a JSON-lines file: MT-Bench rows (first of "turns"), "prompt" / "text" rows or
    plain JSON strings. Lines after the `count`-th are not read. `missing_hint` is appended to the not-found error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}{missing_hint}")
    prompts = []
    for number, row in _jsonl_rows(path):
        if isinstance(row, str):
            prompts.append(row)
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            prompts.append(str(row["turns"][0]))
        elif isinstance(row, dict) and isinstance(row.get("prompt", row.get("text")), str):
            prompts.append(row.get("prompt", row.get("text")))
        else:
            raise ValueError(f"{path}:{number}: expected a JSON string or an object with \"turns\", \"prompt\" "
                             "or \"text\"")
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"{path} holds {len(prompts)} prompts, fewer than the {count} asked for")
    return prompts


def gsm8k_few_shot(shots: Sequence[dict], question: dict) -> str:
    """A GSM8K harness prompt: solved `shots` ("Question: ...\\nAnswer: ..." each, a blank line after), then
    `question` ("Question: ...\\nAnswer:")."""
    prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in shots)
    return f"{prefix}Question: {question['question']}\nAnswer:"


# ---- encoding -----------------------------------------------------------------------------------------------------
def encode_prompts(tokenizer, prompts) -> list[torch.Tensor]:
    """Strings (chat template when the tokenizer has one) or token ids -> list of [1, n] LongTensors
    (`dart_hf.calibration.encode_prompts`)."""
    from dart_hf.calibration import encode_prompts as encode

    return encode(tokenizer, prompts)


def chat_ids(tokenizer, text: str, device: Optional[torch.device] = None) -> torch.Tensor:
    """One user turn, chat-templated with the generation prompt: [1, n] ids (on `device` when given)."""
    ids = encode_prompts(tokenizer, [text])[0]
    return ids if device is None else ids.to(device)


def chat_batch(tokenizer, texts: Sequence[str]) -> dict:
    """Chat-encoded (`encode_prompts`), padded batch (the tokenizer's padding side; left for decoder-only
    generation): input_ids / attention_mask [B, T]."""
    rows = [ids[0].tolist() for ids in encode_prompts(tokenizer, texts)]
    return dict(tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt"))
