"""`dart-spec bench` (dart_bench): the method grid on a tiny target, the summary formulas, the prompt sets, the
report files, bad input; and the GPU projection script on CPU with small shapes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dart_hf
from dart_bench import (DATA_DIR, BenchConfig, load_prompt_sets, markdown_table, read_prompt_rows, run_bench,
                        summarize, write_report)
from dart_cli.main import main
from dart_core import Eagle3Head
from dart_core.errors import DartInputError
from helpers.hf_models import random_head, tiny_target

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def tiny_bench():
    model = dart_hf.enable(tiny_target(seed=6), False)
    dart = random_head(model, draft_length=3).eval()
    eagle = Eagle3Head.from_dart_head(random_head(model, draft_length=3, seed=2)).eval()
    sets = {"a": [[1, 2, 3, 4, 5]], "b": [[7, 8, 9], [10, 11, 12, 13]]}
    config = BenchConfig(temperatures=(0.0, 1.0), repeats=2, max_new_tokens=10)
    return run_bench(model, None, {"dart": dart, "eagle3": eagle}, sets, config, progress=False)


def test_every_method_runs_on_every_prompt_and_greedy_outputs_match(tiny_bench):
    runs = tiny_bench["runs"]
    assert len(runs) == 2 * 2 * 3 * 5  # temperatures x repeats x prompts x methods
    assert {r["method"] for r in runs} == {"plain", "prompt_lookup", "dart_tree", "dart_chain", "eagle3"}
    assert all(r["new_tokens"] == 10 and r["forwards"] >= 2 for r in runs)
    greedy = [r for r in runs if r["temperature"] == 0]
    assert all(r["identical"] for r in greedy)
    assert all("identical" not in r for r in runs if r["temperature"] == 1)
    drafted = [r for r in runs if r["method"] in ("dart_tree", "dart_chain", "eagle3")]
    assert all(r["draft_s"] > 0 and r["tree_s"] > 0 for r in drafted)
    assert all(r["draft_s"] == 0 for r in runs if r["method"] in ("plain", "prompt_lookup"))


def test_summary_rows_and_report(tiny_bench, tmp_path):
    summary = tiny_bench["summary"]
    assert len(summary) == 2 * 3 * 5  # temperatures x (a, b, all) x methods
    for row in summary:
        if row["method"] == "plain":
            assert row["speedup"]["median"] == 1.0 and row["tau"] == pytest.approx(1.0)
        assert row["tau"] >= 1.0 and row["verify_ms_per_step"] > 0
    assert [r["temperature"] for r in tiny_bench["dart_vs_eagle3"]] == [0.0, 1.0]
    paths = write_report(tiny_bench, tmp_path)
    assert [p.name for p in paths] == ["results.json", "table.md", "speedup.png", "breakdown.png"]
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == json.loads(json.dumps(summary))
    assert all(p.stat().st_size > 1000 for p in paths[2:])
    table = (tmp_path / "table.md").read_text()
    assert table.count("| all | eagle3 |") == 2 and "**temperature 1**" in table


def _record(method, repeat, new_tokens, seconds, forwards, **kw):
    base = dict(temperature=0.0, set="s", prompt=0, method=method, repeat=repeat, new_tokens=new_tokens,
                seconds=seconds, forwards=forwards, prefill_s=0.1, target_s=0.0, draft_s=0.0, tree_s=0.0)
    base.update(kw)
    return base


def test_summary_formulas_hand_case():
    records = [_record("plain", 0, 9, 1.0, 9, target_s=0.8), _record("plain", 1, 9, 2.0, 9, target_s=1.6),
               # 9 tokens in 3 verify steps (+ prefill): tau (9-1)/3; time 0.5 s then 0.5 s
               _record("dart_tree", 0, 9, 0.5, 4, target_s=0.3, draft_s=0.03, tree_s=0.015),
               _record("dart_tree", 1, 9, 0.5, 4, target_s=0.3, draft_s=0.03, tree_s=0.015)]
    rows = {(r["set"], r["method"]): r for r in summarize(records)}
    dart = rows[("s", "dart_tree")]
    assert dart["tau"] == pytest.approx(8 / 3)
    assert dart["speedup"] == {"median": pytest.approx(3.0), "min": pytest.approx(2.0), "max": pytest.approx(4.0)}
    assert dart["tokens_per_s"]["median"] == pytest.approx(18.0)
    assert dart["draft_ms_per_step"] == pytest.approx(10.0) and dart["tree_ms_per_step"] == pytest.approx(5.0)
    assert dart["verify_ms_per_step"] == pytest.approx(100.0)
    # other = wall - prefill - draft - tree - verify = (0.5 - 0.1 - 0.03 - 0.015 - 0.3) per call, 3 steps per call
    assert dart["other_ms_per_step"] == pytest.approx(1e3 * 0.055 / 3)
    assert rows[("all", "dart_tree")]["tau"] == dart["tau"]
    assert "identical" not in dart and "| s | dart_tree |" in markdown_table(summarize(records))


def test_the_shipped_prompt_sets_and_their_licences():
    sets = load_prompt_sets(DATA_DIR, 5)
    assert [len(v) for v in sets.values()] == [5, 5, 5]
    assert sets["mt_bench"][0].startswith("Compose an engaging travel blog post")
    assert sets["humaneval"][0].startswith("from typing import List")
    assert all(isinstance(q, str) and q for q in sets["gsm8k"])
    sizes = {name: len(read_prompt_rows(name)) for name in ("mt_bench_questions", "humaneval", "gsm8k")}
    assert sizes == {"mt_bench_questions": 80, "humaneval": 40, "gsm8k": 100}
    assert all(read_prompt_rows("gsm8k")[i]["answer"] for i in range(3))  # the harness benchmarks' solved shots
    listed = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    for name in ("LICENSE.gsm8k", "LICENSE.humaneval", "Apache-2.0"):
        assert name in listed and (not name.startswith("LICENSE") or (DATA_DIR / name).is_file())
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_sets(DATA_DIR, 1, ["nope"])


def test_prompt_counts_outside_a_set_are_errors_not_shorter_lists():
    assert load_prompt_sets(DATA_DIR, 0) == {"mt_bench": [], "humaneval": [], "gsm8k": []}
    assert len(load_prompt_sets(DATA_DIR, 40, ["humaneval"])["humaneval"]) == 40  # the whole set
    with pytest.raises(DartInputError, match="41 humaneval prompts asked for.*holds 40"):
        load_prompt_sets(DATA_DIR, 41, ["humaneval"])
    with pytest.raises(DartInputError, match=">= 0, got -1"):
        load_prompt_sets(DATA_DIR, -1, ["mt_bench"])


def test_no_file_of_the_project_names_the_data_beside_the_checkout():
    """A user's clone has nothing beside it: no tracked file may point at the data folder beside this checkout."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    beside = "shared"  # spelled apart so that this file does not name it either
    pattern = re.compile(("\\.\\./" + beside + "|" + beside + "/data|parent / \"" + beside + "\"").encode())
    named = [f for f in listed.decode().split("\0") if f and (REPO / f).is_file()
             and pattern.search((REPO / f).read_bytes())]
    assert named == []


def test_bench_config_and_cli_refuse_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="no drafter given for eagle3"):
        BenchConfig().validate({"dart": object()})
    assert main(["bench", "--out", str(tmp_path), "--methods", "plain", "eagle3"]) == 2
    assert "needs --eagle3 DIR" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path), "--eagle3", str(tmp_path / "missing")]) == 2
    assert "EAGLE3-style drafter not found" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path), "--data", str(tmp_path / "nothing"), "--no-calibrate",
                 "--methods", "plain"]) == 2
    assert "prompt file not found" in capsys.readouterr().err


def test_gpu_projection_script_runs_on_cpu_with_small_shapes(tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import project_gpu
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "projection.json"
    assert project_gpu.main(["--arch", "tiny", "--device", "cpu", "--context", "32", "--repeats", "1",
                             "--sizes", "1", "4", "--tau", "4:2.0", "8:2.5", "--batch-sizes", "1", "2",
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["verify_ms"]) == {"1", "4", "5", "9"}
    rows = result["projection_tree_on_cpu"]
    assert [r["nodes"] for r in rows] == [4, 8]
    for r in rows:  # the projection formula
        step = result["head_ms"] + result["tree_cpu_b1_ms"] + result["verify_ms"][str(r["nodes"] + 1)]
        assert r["step_ms"] == pytest.approx(step)
        assert r["speedup"] == pytest.approx(r["tau"] * result["plain_ms"] / step)
    assert "| nodes | tau |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="NODES:TAU"):
        project_gpu.parse_tau(["60"])


def test_calibrated_tree_keeps_the_fastest_search(monkeypatch):
    import importlib

    from dart_core import AcceptanceCurve, TreeConfig
    from dart_bench import calibrated_tree

    tau = {(1, 3): 1.2, (4, 3): 1.9, (10, 7): 1.1}  # (topk, max_depth) -> tau at every size: the speedup follows
    measured = []
    cal = importlib.import_module("dart_hf.calibration")  # the module (the package attribute is the function)

    def acceptance(model, tok, head, progress=None):
        measured.append((head.tree_config.topk, head.tree_config.max_depth))
        t = tau[measured[-1]]
        return AcceptanceCurve(tau={1: t, 5: t}, steps=3, new_tokens=6, prompts=1)

    cost = cal.MachineCost(verify_ms={1: 10.0, 8: 10.0}, plain_ms=10.0, head_ms=0.0, tree_ms=0.0, rest_ms=0.0,
                           context_length=8, seconds=0.1)
    monkeypatch.setattr(cal, "measure_acceptance", acceptance)
    monkeypatch.setattr(cal, "machine_cost", lambda model, head, refresh=False, progress=None: cost)
    model = tiny_target()
    drafter = Eagle3Head.from_dart_head(random_head(model))
    searches = [{"topk": t, "max_depth": d} for t, d in tau]
    tree, rows = calibrated_tree(model, None, drafter, searches)
    assert tree == TreeConfig(topk=4, max_depth=3, remain_total=1, context_draft=False) == drafter.tree_config  # ties: the smaller tree
    assert [r["expected_speedup"] for r in rows] == pytest.approx([1.2, 1.9, 1.1]) and measured == list(tau)


def test_atomic_writes_give_files_the_usual_permissions(tmp_path):
    import os

    import torch

    from dart_core.io import atomic_write, save_safetensors_atomic

    old = os.umask(0o022)
    try:
        with atomic_write(str(tmp_path / "out.txt"), "w") as fh:
            fh.write("x")
        save_safetensors_atomic({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    finally:
        os.umask(old)
    for name in ("out.txt", "w.safetensors"):  # mkstemp alone would leave 0600
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
