"""Shared setup of the SGLang tests: SGLang 0.5.23 on this CPU-only machine (docs/DESIGN.md §4) and the tiny models."""

from __future__ import annotations

import json
import os
import sys

import pytest

CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu")


def import_sglang():
    """Skip (with the install command) when SGLang is missing; put the test-only torchvision stub on the path."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's Triton kernels run in Triton's interpreter on CPU
    if CPU_DIR not in sys.path:
        sys.path.insert(0, CPU_DIR)
    return pytest.importorskip("sglang", reason="SGLang is not installed: see .ci/run for the CPU install")


def write_models(root, draft_length: int = 4, tree: dict | None = None, seed: int = 1) -> tuple[str, str]:
    """A tiny 8-layer Llama target with a word tokenizer, and a random DART head converted for SGLang.
    Returns (target_dir, head_dir)."""
    from conftest import _word_tokenizer
    from dart_sglang.head_format import convert_sglang
    from hf_models import random_head, tiny_target

    target_dir, raw_dir, head_dir = (os.path.join(root, n) for n in ("target", "head", "head-sglang"))
    target = tiny_target(layers=8)
    target.config.eos_token_id = 2
    target.save_pretrained(target_dir)
    _word_tokenizer().save_pretrained(target_dir)
    head = random_head(target, draft_length=draft_length, seed=seed)
    head.set_input_embeddings(target.get_input_embeddings())
    head.save_pretrained(raw_dir)
    convert_sglang(raw_dir, head_dir, target=target_dir, force=True, progress=False)
    if tree:
        set_tree(head_dir, **tree)
    return target_dir, head_dir


def set_tree(head_dir: str, **settings) -> None:
    file = os.path.join(head_dir, "config.json")
    with open(file) as fh:
        config = json.load(fh)
    config["dart_config"].update(settings)
    with open(file, "w") as fh:
        json.dump(config, fh, indent=1)


class Server:
    """An SGLang server on this CPU (docs/DESIGN.md §4 recipe), in its own process group; `url` once it answers."""

    FLAGS = ["--device", "cpu", "--attention-backend", "triton", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--disable-overlap-schedule", "--dtype", "float32",
             "--mem-fraction-static", "0.05", "--max-total-tokens", "4096", "--random-seed", "0"]

    def __init__(self, target: str, head: str | None, log_file: str, env: dict | None = None,
                 startup_timeout: float = 400):
        import socket
        import subprocess
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_file = log_file
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", target, "--port", str(port),
                *self.FLAGS]
        if head is not None:
            args += ["--speculative-algorithm", "DART", "--speculative-draft-model-path", head]
        full_env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([CPU_DIR, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self._log = open(log_file, "w")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                        start_new_session=True)
        deadline = time.time() + startup_timeout
        while True:
            if self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"SGLang server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"SGLang server did not answer within {startup_timeout} s:\n{self.log_tail()}")
            time.sleep(2)

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_file, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def close(self) -> None:
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except Exception:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
