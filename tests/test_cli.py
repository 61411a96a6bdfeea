"""The `dart-spec` command line: the demo runs offline; bad input ends with a one-line cause and exit status 2."""

import subprocess
import sys

from dart_cli.demo import core_demo
from dart_cli.main import main


def test_demo_runs_and_accepts_the_agreeing_path(capsys):
    assert main(["demo", "--batch-size", "2"]) == 0
    assert "2 trees of 61 nodes" in capsys.readouterr().out


def test_demo_accepts_the_deepest_path_the_target_agrees_with():
    result = core_demo(seed=1, batch_size=3)
    trees, verify = result["trees"], result["verify"]
    for b in range(3):
        assert int(verify.accept_length[b]) == int(trees[b].depths.max())


def test_bad_option_is_one_line_and_exit_2(capsys):
    assert main(["demo", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dart-spec demo: error: --batch-size and --remain-total must be >= 1"]


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "dart_cli.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout
