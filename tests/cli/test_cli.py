"""The `dart-spec` command line: the demo runs offline; bad input ends with a one-line cause and exit status 2."""

import subprocess
import sys

import pytest
import torch

from dart_cli.demo import core_demo
from dart_cli.main import main


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_runs_and_accepts_the_agreeing_path(capsys):
    assert main(["demo", "--core", "--batch-size", "2"]) == 0
    assert "2 trees of 61 nodes" in capsys.readouterr().out


def test_demo_accepts_the_deepest_path_the_target_agrees_with():
    result = core_demo(seed=1, batch_size=3)
    trees, verify = result["trees"], result["verify"]
    for b in range(3):
        assert int(verify.accept_length[b]) == int(trees[b].depths.max())


def test_bad_option_is_one_line_and_exit_2(capsys):
    assert main(["demo", "--core", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dart-spec demo: error: --batch-size and --remain-total must be >= 1"]
    assert main(["demo", "--max-new-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dart-spec demo: error: --max-new-tokens, --repeats and --threads must be >= 1"]


def test_demo_without_the_head_is_one_line_naming_the_directory(tmp_path, monkeypatch, capsys):
    import dart_hf.default

    missing = tmp_path / "no-head"
    assert main(["demo", "--head", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dart-spec demo: error: ") and str(missing) in err[0]
    monkeypatch.setattr(dart_hf.default, "DEFAULT_HEAD_DIR", missing)  # the shipped head, when it is not there
    assert main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shipped DART head" in err[0] and str(missing) in err[0]


def smollm2_shaped_head(path):
    from dart_bench.replay import random_head, shipped_shape
    from dart_core import TreeConfig

    head = random_head(shipped_shape(576, 49152, 30, draft_length=4))
    head.tree_config = TreeConfig(remain_total=8, eos_token_id=2)
    head.save_pretrained(path, dtype=torch.float16)


@pytest.mark.slow
def test_real_demo_streams_times_and_checks_identity(tmp_path, monkeypatch, capsys):
    import dart_hf
    from dart_core import AcceptanceCurve

    smollm2_shaped_head(tmp_path / "head")
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path / "cache"))
    # a head without an acceptance curve: the controller learns one from the calls; what it decides depends on
    # this CPU, the output never does
    assert main(["demo", "--head", str(tmp_path / "head"), "--max-new-tokens", "6", "--repeats", "1",
                 "--threads", "1", "--prompt", "Name three colours."]) == 0
    out = capsys.readouterr().out
    assert "each step's tree chosen by what DART measures here" in out
    assert "plain generate():" in out and "DART:" in out and "speedup" in out
    assert "outputs identical (token for token)" in out
    # --calibrate measures the curve first (stubbed here: the real one takes a minute on this CPU)
    calls = []

    def fake_calibrate(model, tokenizer, head, progress=None):
        calls.append(progress)
        head.acceptance = AcceptanceCurve(tau={1: 1.4, 3: 1.8, 8: 1.9}, steps=9, new_tokens=20, prompts=1)

    monkeypatch.setattr(dart_hf, "calibrate", fake_calibrate)
    assert main(["demo", "--head", str(tmp_path / "head"), "--max-new-tokens", "4", "--repeats", "1",
                 "--threads", "1", "--calibrate"]) == 0
    assert calls == [True] and "outputs identical" in capsys.readouterr().out
    # a fixed tree, in bfloat16: the agreement with plain bfloat16 is reported, not required
    assert main(["demo", "--head", str(tmp_path / "head"), "--max-new-tokens", "6", "--repeats", "1",
                 "--threads", "1", "--dtype", "bfloat16", "--remain-total", "2"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (bfloat16" in out and "a fixed tree of 2 draft nodes" in out
    assert "DIFFER" not in out and ("identical (token for token)" in out or "equal for the first" in out)


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "dart_cli.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_ci_runs_the_readme_test_command_verbatim():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    setup = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(setup) == 2 and setup[0].endswith("dart-spec demo") and setup[1].endswith("-m pytest")
    assert (root / ".ci" / "run").read_text().strip().splitlines()[-1] == setup[1]
