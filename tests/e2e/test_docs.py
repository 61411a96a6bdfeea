"""The front door stays true: every relative link and every project file named in README.md, docs/ and the shipped
head's model card exists, and the README keeps its shape (the two set-up commands first, at most 150 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "dart_hf" / "assets" / "smollm2-135m-dart" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# a project path in backticks: relative, with a folder, ending in a file type (or a nested folder's slash)
NAMED = re.compile(r"`((?:[\w.-]+/)+[\w.-]*\.(?:py|md|json|sh|txt|toml|cfg|jsonl)|(?:[\w.-]+/){2,})`")
OUTSIDE = ("runs/", "data/", "OUT/", "out/", "path/", "ckpt/", "models/", "head-", "dart-qwen3")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_named_files_exist(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            missing.append(f"link {target}")
    for name in NAMED.findall(text):
        if name.startswith(OUTSIDE) or "*" in name:
            continue
        if not ((ROOT / name).exists() or (doc.parent / name).exists()):
            missing.append(f"file {name}")
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150
    first_code = lines.index("```bash")
    assert first_code <= 3 and lines[first_code + 3] == "```"  # the two set-up commands come first
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", "\n".join(lines))  # dated figures live in BENCHMARKS.md
