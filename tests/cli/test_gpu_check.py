"""benchmarks/gpu_check.py on CPU with tiny settings (the real SmolLM2 and the shipped head): the JSON it writes."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def gpu_check():
    """The script as a module (benchmarks/ is not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))
    return gpu_check


@pytest.mark.slow
def test_gpu_check_tiny_cpu_run(tmp_path, gpu_check):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Name three colours and say why the sky is blue."]}) + "\n")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--dtypes", "float32", "--nodes", "4", "--prompts", "1",
                           "--max-new-tokens", "8", "--unsynced-prompts", "1", "--prompt-file", str(prompts),
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and result["identity"] is True
    assert result["environment"]["device"] == "cpu" and result["environment"]["torch"]
    assert result["settings"]["nodes"] == [4] and result["settings"]["max_new_tokens"] == 8
    entry = result["dtypes"]["float32"]
    assert entry["tree_config"]["remain_total"] > 0 and entry["skipped"] == []
    plain = entry["plain"]
    assert plain["new_tokens"] == 8 and plain["tokens_per_s"] > 0 and plain["step_ms"] > 0
    row = entry["trees"]["4"]
    assert row["remain_total"] == 4 and row["identical"] == row["prompts"] == 1 and row["identity"]
    assert row["new_tokens"] == 8 and row["tokens_per_s"] > 0 and row["steps"] >= 1 and row["tau"] >= 1
    assert row["step_ms"] > 0 and row["prefill_ms"] > 0
    assert row["overhead_ms_per_step"] == pytest.approx(row["step_ms"] - plain["step_ms"])
    assert row["overhead_goal_met"] is None  # the goal is a GPU one
    phases = row["phases_ms_per_step"]
    assert all(phases[f"{name}_ms"] > 0 for name in ("head", "tree", "target", "verify"))
    assert phases["verify_ms"] >= phases["target_ms"]
    assert row["unsynced"]["prompts"] == row["unsynced"]["identical"] == 1 and row["unsynced"]["step_ms"] > 0
    assert row["per_prompt"][0]["identical"] and row["per_prompt"][0]["first_mismatch"] is None


def test_gpu_check_reads_prompt_files(tmp_path, gpu_check):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["a", "b"]}\n\n"c"\n{"prompt": "d"}\n{"text": "e"}\n')
    assert gpu_check.first_prompts(path, 4) == ["a", "c", "d", "e"]
    with pytest.raises(ValueError, match="fewer than"):
        gpu_check.first_prompts(path, 5)
    with pytest.raises(FileNotFoundError, match="--prompt-file"):
        gpu_check.first_prompts(tmp_path / "missing.jsonl", 1)
