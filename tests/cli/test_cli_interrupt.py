"""Ctrl-C gets one answer from `dart-spec` whenever it comes: "dart-spec COMMAND: interrupted" and exit status 130,
no traceback; while the commands' modules import (torch: seconds) as later. The interrupt is delivered
deterministically: a `sitecustomize` on PYTHONPATH sends the process SIGINT when a given module is first imported."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "dart-spec"
HOOK = """
import os, signal, sys

class _InterruptAt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _InterruptAt())
"""


def default_sigint() -> None:
    """In the child, before exec: SIGINT's default disposition, as a shell starts a command. An ignored SIGINT stays
    ignored across exec, and a test worker may have been left ignoring it by a library another test ran in it
    (SGLang's tracing sets SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(tmp_path, argv, module, entry="script"):
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "INTERRUPT_AT": module}
    command = [str(SCRIPT)] if entry == "script" else [sys.executable, "-m", "dart_cli.main"]
    return subprocess.run(command + argv, capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=default_sigint)


COMMANDS = [["demo", "--core"], ["bench"], ["calibrate", "HEAD"], ["convert", "sglang", "A", "B"], ["prompts"],
            ["distill"], ["train"], ["ngram"], ["serve"], ["--help"]]


@pytest.mark.skipif(not SCRIPT.exists(), reason="the dart-spec script is not installed")
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_a_ctrl_c_while_the_command_imports_is_answered_as_a_later_one(tmp_path, argv):
    proc = run(tmp_path, argv, "torch")
    command = "" if argv[0].startswith("-") else f" {argv[0]}"
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1:]) == (130, [f"dart-spec{command}: interrupted"])
    assert "Traceback" not in proc.stderr


def test_python_m_answers_alike_while_importing(tmp_path):
    proc = run(tmp_path, ["demo", "--core"], "torch", entry="module")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "dart-spec demo: interrupted"


def test_a_ctrl_c_once_running_gets_the_same_answer(monkeypatch, capsys):
    import dart_cli.demo
    from dart_cli.main import main

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dart_cli.demo, "core_demo", interrupted)
    assert main(["demo", "--core"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dart-spec demo: interrupted"


def test_importing_the_module_keeps_python_s_own_answer(tmp_path):
    """Imported by other code (not run as dart-spec), an interrupt during its imports stays a KeyboardInterrupt."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "INTERRUPT_AT": "torch"}
    code = "import dart_cli.main"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=default_sigint)
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr
