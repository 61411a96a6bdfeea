"""Prompts without a dataset: the target writes user turns itself (`dart-spec prompts`).

The target's chat template is rendered with an empty user message and cut where the message's text would begin, so
the model continues as the user; it samples the turn until the template's end-of-turn token (the token that follows
a message's text) or the EOS. Turns that did not end inside `max_new_tokens`, that are short, repetitive, hold a
special token or text that does not decode, or repeat an earlier turn (case and spacing ignored) are dropped; the
rest are appended to a JSONL file as {"prompt": text}, which `dart-spec distill --prompts FILE` answers.

Resumable and append-only: batch i is drawn with seed + i, and after each batch a state file beside the output
(`FILE.state.json`, written atomically) records the batches done, the output's length in bytes, the counts kept
and dropped per reason, and the settings. Before a batch's lines are appended the state records them as pending, so
a resumed run knows its own half-written batch: bytes past the recorded length that are the start of the pending
batch are cut (the batch is drawn again, so the run ends with exactly the file an uninterrupted run writes); any
other bytes there (lines added by hand) make the run refuse, naming the file and the offset, and nothing is changed.
A resumed run never rewrites or removes what it did not write. The output's recorded part and the state are checked
first (one JSON object with a string "prompt" per line, UTF-8, as many lines as the state's turns; the state's
fields of their types): a damaged file is one error naming it, with nothing changed. A state of other settings is
refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from dart_core.errors import DartInputError
from dart_core.io import atomic_write

SENTINEL = "\u2063DART-USER-TURN\u2063"  # text no template alters; marks where a user message's content goes
STATE_SUFFIX = ".state.json"


def user_turn_prompt(tokenizer) -> tuple[list[int], list[int]]:
    """(the token ids that make the target write a user turn, the token ids that end it).

    The template rendered with one user message is cut where the message's content begins (for SmolLM2:
    `<|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n`). The end of the turn is the first token of what the
    template puts after the content (SmolLM2: `<|im_end|>`) when that is a single special token, plus the EOS."""
    if not getattr(tokenizer, "chat_template", None):
        raise DartInputError("the target's tokenizer has no chat template: a user turn has no place to start")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=False,
                                             tokenize=False)
    empty = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False,
                                          tokenize=False)
    if rendered.count(SENTINEL) != 1:
        raise DartInputError("the chat template does not place a user message's text verbatim")
    prefix, suffix = rendered.split(SENTINEL)
    if prefix + suffix != empty:
        raise DartInputError("the chat template renders an empty user message differently from a filled one")
    prompt = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if not prompt:
        raise DartInputError("the chat template puts nothing before a user message")
    stops = []
    suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix.strip() else []
    special = set(tokenizer.all_special_ids)
    if suffix_ids and suffix_ids[0] in special:
        stops.append(int(suffix_ids[0]))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(int(tokenizer.eos_token_id))
    if not stops:
        raise DartInputError("neither the chat template nor the tokenizer has a token that ends a user turn")
    return [int(t) for t in prompt], stops


def normalise(text: str) -> str:
    """The key two turns are duplicates under: case-folded, runs of whitespace one space, outer punctuation off."""
    return " ".join(text.casefold().split()).strip(" .!?,;:\"'")


def turn_problem(text: str, min_chars: int, max_chars: int) -> Optional[str]:
    """Why a decoded turn is dropped (a reason name), or None to keep it."""
    words = text.split()
    if len(text) < min_chars or len(words) < 3:
        return "short"
    if len(text) > max_chars:
        return "long"
    if "\ufffd" in text or any(ord(c) < 32 and c not in "\n\t" for c in text):
        return "undecodable"
    if len(words) >= 12 and len({w.casefold() for w in words}) < 0.4 * len(words):
        return "repetitive"
    if re.search(r"(.{8,}?)\1\1", text):  # a span of 8+ characters three times in a row
        return "repetitive"
    return None


def _settings(count: int, batch_size: int, max_new_tokens: int, temperature: float, top_p: float, seed: int,
              min_chars: int, max_chars: int, prompt_ids: list[int], stops: list[int]) -> dict:
    return {"count": count, "batch_size": batch_size, "max_new_tokens": max_new_tokens, "temperature": temperature,
            "top_p": top_p, "seed": seed, "min_chars": min_chars, "max_chars": max_chars,
            "prompt_ids": prompt_ids, "stop_ids": stops}


def _read_state(file: Path) -> Optional[dict]:
    """The prompt writer's state in `file` (None when there is none), its fields checked: DartInputError naming the
    file for anything else."""
    if not file.is_file():
        return None
    fix = "remove it and the prompts beside it to start over, or write into a new file"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not {"settings", "batches", "bytes", "kept", "dropped"} <= set(state):
            raise ValueError("not a prompt writer's state")
    except (OSError, ValueError) as err:
        raise DartInputError(f"{file}: unreadable ({err}); {fix}") from None

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    wrong = None
    if not isinstance(state["settings"], dict):
        wrong = "settings"
    else:
        wrong = next((k for k in ("batches", "bytes", "kept") if not count(state[k])), None)
    if wrong is None and not (isinstance(state["dropped"], dict)
                              and all(isinstance(k, str) and count(v) for k, v in state["dropped"].items())):
        wrong = "dropped"
    if wrong is None and state.get("pending") is not None and not isinstance(state["pending"], str):
        wrong = "pending"
    if wrong is not None:
        kind = {"settings": "an object", "dropped": "an object of counts", "pending": "text or null"}.get(
            wrong, "a count (an integer >= 0)")
        shown = json.dumps(state[wrong])
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise DartInputError(f"{file}: damaged: \"{wrong}\" is {shown}, not {kind}; {fix}")
    return state


def _recorded_turns(out: Path, length: int, kept: int, state_file: Path) -> list[str]:
    """The turns in the first `length` bytes of `out` (the part its state records), checked line by line; the file
    is only read."""
    with open(out, "rb") as fh:
        data = fh.read(length)
    if data and not data.endswith(b"\n"):
        raise DartInputError(f"{out}: the {length} bytes its state ({state_file.name}) records do not end at the end "
                             "of a line: the file was edited; this run changed nothing (restore it, or write into a "
                             "new file)")
    turns = []
    for number, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DartInputError(f"{out}:{number}: not UTF-8 text (byte {err.start} of the line); the file was edited: "
                                 "this run changed nothing (fix the line, or write into a new file)") from None
        except json.JSONDecodeError as err:
            raise DartInputError(f"{out}:{number}: not valid JSON ({err.msg}); the file was edited: this run "
                                 "changed nothing (fix the line, or write into a new file)") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise DartInputError(f"{out}:{number}: not a JSON object with a string \"prompt\"; the file was edited: "
                                 "this run changed nothing (fix the line, or write into a new file)")
        turns.append(record["prompt"])
    if len(turns) != kept:
        raise DartInputError(f"{out}: its first {length} bytes hold {len(turns)} turns where its state "
                             f"({state_file.name}) records {kept}: the file was edited; this run changed nothing "
                             "(restore it, or write into a new file)")
    return turns


def _unrecorded_bytes(out: Path, state: dict, state_file: Path) -> int:
    """How many bytes past the recorded length `out` holds that a batch of this writer left half-written (to cut);
    DartInputError naming the file and the offset when bytes there are anything else (nothing is changed)."""
    size, length = out.stat().st_size, state["bytes"]
    if size < length:
        raise DartInputError(f"{out} is shorter than its state ({state_file.name}) records ({length} bytes): the file "
                             "was edited; this run changed nothing (restore it, or write into a new file)")
    if size == length:
        return 0
    pending = (state.get("pending") or "").encode("utf-8")
    tail = b""
    if size - length <= len(pending):
        with open(out, "rb") as fh:
            fh.seek(length)
            tail = fh.read(size - length)
    if not tail or not pending.startswith(tail):
        raise DartInputError(f"{out}: {size - length} bytes from offset {length} on were not written by this prompt "
                             f"writer (its state {state_file.name} ends the file there); this run changed nothing: "
                             f"move those lines into another file (or cut the file at byte {length}) and run again, "
                             "or write into a new file")
    return size - length


@torch.no_grad()
def write_user_turns(model, tokenizer, out_file: str | os.PathLike, count: int, batch_size: int = 32,
                     max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 0.95, seed: int = 0,
                     min_chars: int = 16, max_chars: int = 1500, max_batches: Optional[int] = None,
                     progress: bool = True) -> dict:
    """Sample user turns from `model` until `out_file` holds at least `count` distinct ones (whole batches: a larger
    count later continues the same stream, so the file is what one run to that count writes), or until `max_batches`
    batches ran (default 20x the batches `count` needs if all were kept); returns the state (kept, dropped per
    reason, batches)."""
    for name, value in (("count", count), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens),
                        ("min_chars", min_chars), ("max_chars", max_chars)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DartInputError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DartInputError(f"{name} must be a finite number, got {value!r}")
    if temperature <= 0 or not 0 < top_p <= 1:
        raise DartInputError("temperature must be > 0 and top-p in (0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise DartInputError(f"seed must be an integer in 0..2**64-1, got {seed!r}")
    out = Path(out_file)
    state_file = out.with_name(out.name + STATE_SUFFIX)
    prompt_ids, stops = user_turn_prompt(tokenizer)
    settings = _settings(count, batch_size, max_new_tokens, temperature, top_p, seed, min_chars, max_chars,
                         prompt_ids, stops)
    # every check reads only; the files change after all of them passed
    state = _read_state(state_file)
    half_written = 0
    if state is None:
        if out.exists() and out.stat().st_size:
            raise DartInputError(f"{out} exists without a prompt writer's state ({state_file.name}); "
                                 "write into a new file")
        state = {"settings": settings, "batches": 0, "bytes": 0, "kept": 0, "dropped": {}}
        turns = []
    else:
        saved = dict(state["settings"])
        if {k: v for k, v in saved.items() if k != "count"} != {k: v for k, v in settings.items() if k != "count"}:
            changed = [k for k in settings if k != "count" and saved.get(k) != settings[k]]
            raise DartInputError(f"{out} was written with other settings (different {', '.join(changed)}); "
                                 "write into a new file")
        if not out.exists():
            if state["bytes"] or state["kept"]:
                raise DartInputError(f"{out} is missing, but its state ({state_file.name}) records "
                                     f"{state['bytes']} bytes of turns: restore it, or write into a new file")
            turns = []
        else:
            half_written = _unrecorded_bytes(out, state, state_file)
            turns = _recorded_turns(out, state["bytes"], state["kept"], state_file)
        state["settings"]["count"] = count  # a larger count continues the same stream of batches
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab"):
        pass
    if half_written:
        os.truncate(out, state["bytes"])  # this writer's own half-written batch: it is drawn again
    state["pending"] = None
    seen = {normalise(turn) for turn in turns}
    if max_batches is None:
        max_batches = 20 * -(-count // batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[-1]
    special = set(tokenizer.all_special_ids)
    ids = torch.tensor([prompt_ids] * batch_size, device=model.device)
    bar = tqdm(total=count, initial=min(state["kept"], count), desc="prompts", unit="turn", disable=not progress)
    while state["kept"] < count and state["batches"] < max_batches:
        index = state["batches"]
        torch.manual_seed((seed + index) % 2**64)
        result = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                eos_token_id=stops, pad_token_id=pad).cpu()
        lines = []
        for row in result[:, len(prompt_ids):].tolist():
            reason, text = _turn(row, stops, special, tokenizer, min_chars, max_chars)
            if reason is None:
                key = normalise(text)
                if key in seen:
                    reason = "duplicate"
                else:
                    seen.add(key)
                    lines.append(json.dumps({"prompt": text}, ensure_ascii=False) + "\n")
            if reason is not None:
                state["dropped"][reason] = state["dropped"].get(reason, 0) + 1
        text = "".join(lines)
        data = text.encode("utf-8")
        if data:  # recorded before it is appended: a resumed run knows these bytes as its own
            state["pending"] = text
            _write_state(state_file, state)
            with open(out, "ab") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        state["bytes"] += len(data)
        state["kept"] += len(lines)
        state["batches"] = index + 1
        state["pending"] = None
        _write_state(state_file, state)
        bar.update(len(lines))
        bar.set_postfix(batches=state["batches"], dropped=sum(state["dropped"].values()))
    bar.close()
    return state


def _write_state(file: Path, state: dict) -> None:
    with atomic_write(str(file), "w") as fh:
        json.dump(state, fh, indent=1)


def _turn(row: list[int], stops: list[int], special: set, tokenizer, min_chars: int,
          max_chars: int) -> tuple[Optional[str], str]:
    end = next((i for i, t in enumerate(row) if t in stops), None)
    if end is None:
        return "unfinished", ""
    body = row[:end]
    if any(t in special for t in body):
        return "special", ""
    text = tokenizer.decode(body, skip_special_tokens=False).strip()
    return turn_problem(text, min_chars, max_chars), text
