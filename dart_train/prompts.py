"""Training prompts for self-distillation, from offline sources (never the benchmark prompts).

- math: the questions of gsm8k_train.jsonl;
- code: "write this function" requests derived from the Python standard library (function name, signature and the
  first line of its docstring);
- chat: general instructions built from task templates x topics.
Sources are interleaved round-robin after a seeded shuffle, so any prefix of the list mixes all three.
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
from pathlib import Path

from dart_core.errors import DartInputError

CHAT_TEMPLATES = [
    "Explain {t} to a curious teenager.",
    "Write a short, friendly email inviting a colleague to a talk about {t}.",
    "Give me five practical tips related to {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Summarize the history of {t} in one paragraph.",
    "Write a haiku and then a limerick about {t}.",
    "Compare {t} with a closely related idea and say when each is preferable.",
    "Draft a three-step plan for a beginner who wants to learn about {t}.",
    "Describe a common misconception about {t} and correct it.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "List the key terms someone should know about {t}, with one-line definitions.",
    "Write a persuasive paragraph arguing that everyone should understand {t}.",
]
CHAT_TOPICS = [
    "photosynthesis", "compound interest", "the water cycle", "machine learning", "black holes", "vaccines",
    "the Roman Empire", "climate change", "healthy sleep", "public speaking", "time management", "recycling",
    "the stock market", "electric cars", "the human heart", "volcanoes", "jazz music", "the printing press",
    "supply and demand", "renewable energy", "meditation", "the Internet", "chess openings", "honeybees",
    "budget travel", "job interviews", "composting", "the French Revolution", "quantum computing", "coral reefs",
    "learning a new language", "remote work", "the immune system", "democracy", "plate tectonics", "cooking rice",
    "marathon training", "cryptography", "the Moon landing", "minimalism",
]


def math_prompts(path: str | os.PathLike) -> list[str]:
    """The "question" of every JSON line of `path` (GSM8K's format)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(str(json.loads(line)["question"]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DartInputError(f"{path}:{number}: not a JSON object with a \"question\" ({err})") from None
    return out


def code_prompts(limit: int = 3000) -> list[str]:
    """'Write a Python function ...' requests from public stdlib functions with a docstring."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                summary = doc.strip().splitlines()[0].strip()
                args = ", ".join(a.arg for a in node.args.args)
                out.append(f"Write a Python function `{node.name}({args})`. {summary} "
                           f"Include a docstring and a short usage example.")
    return out[:limit]


def chat_prompts() -> list[str]:
    return [t.format(t=topic) for topic in CHAT_TOPICS for t in CHAT_TEMPLATES]


def mixed_prompts(gsm8k_path: str | os.PathLike, seed: int = 0) -> list[str]:
    """All three sources, each shuffled with `seed`, interleaved round-robin."""
    rng = random.Random(seed)
    sources = [math_prompts(gsm8k_path), code_prompts(), chat_prompts()]
    for s in sources:
        rng.shuffle(s)
    out = []
    for i in range(max(len(s) for s in sources)):
        out.extend(s[i] for s in sources if i < len(s))
    return out
