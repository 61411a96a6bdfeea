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
    # sglang.srt, not sglang: with tests/ on sys.path, the tests' own folder tests/sglang imports as a namespace
    # package "sglang" where SGLang is not installed
    return pytest.importorskip("sglang.srt", reason="SGLang is not installed: see .ci/run for the CPU install")


EOS = 1  # the tiny target's EOS id (`hf_models.char_tokenizer`'s "<eos>")
TREE = {"topk": 4, "beam_width": 4, "remain_total": 8}  # the random head's tree (`write_models`)
ACCEPT_PROMPT, ACCEPT_TOKENS = [5, 6, 7, 8, 9, 10], 24  # the continuation an `accepting_head` drafts


def write_models(root, draft_length: int = 4, tree: dict | None = None, seed: int = 1) -> tuple[str, str]:
    """A tiny 8-layer Llama target with a character-level tokenizer (which JSON grammars can spell), and a random
    DART head converted for SGLang. Returns (target_dir, head_dir)."""
    from dart_sglang.head_format import convert_sglang
    from helpers.hf_models import char_tokenizer, random_head, tiny_target

    target_dir, raw_dir, head_dir = (os.path.join(root, n) for n in ("target", "head", "head-sglang"))
    target = tiny_target(layers=8)
    target.config.eos_token_id = EOS
    target.generation_config.eos_token_id = EOS
    target.save_pretrained(target_dir)
    char_tokenizer().save_pretrained(target_dir)
    head = random_head(target, draft_length=draft_length, seed=seed)
    head.set_input_embeddings(target.get_input_embeddings())
    head.save_pretrained(raw_dir)
    convert_sglang(raw_dir, head_dir, target=target_dir, force=True, progress=False)
    if tree:
        set_tree(head_dir, **tree)
    return target_dir, head_dir


def accepting_head(target_dir: str, hf_target, reference: list[int], out_dir) -> str:
    """A DART head for SGLang whose 2-token draft vocabulary is the two most frequent tokens of `reference` (a
    greedy continuation of the target): every level drafts both, so drafts get accepted. Returns its directory."""
    from collections import Counter

    import torch

    from dart_sglang.head_format import convert_sglang
    from helpers.hf_models import random_head

    common = [t for t, _ in Counter(reference).most_common(2)]
    assert sum(reference.count(t) for t in common) >= len(reference) // 2, reference
    head = random_head(hf_target, draft_length=3, draft_vocab=2)
    with torch.no_grad():
        head.d2t.copy_(torch.tensor([common[0], common[1] - 1]))
        head.t2d.zero_()
        head.t2d[common] = True
    head.set_input_embeddings(hf_target.get_input_embeddings())
    raw, converted = os.path.join(out_dir, "crafted"), os.path.join(out_dir, "crafted-sglang")
    head.save_pretrained(raw)
    convert_sglang(raw, converted, target=target_dir, progress=False)
    set_tree(converted, topk=2, beam_width=4, remain_total=14)
    return converted


def set_tree(head_dir: str, **settings) -> None:
    file = os.path.join(head_dir, "config.json")
    with open(file) as fh:
        config = json.load(fh)
    config["dart_config"].update(settings)
    with open(file, "w") as fh:
        json.dump(config, fh, indent=1)


PORT_TAKEN = "address already in use"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An SGLang server on this CPU (docs/DESIGN.md §4 recipe), in its own process group; `url` once it answers.
    A start that loses the race for its port (another process binds it first) is retried on another port."""

    FLAGS = ["--device", "cpu", "--attention-backend", "triton", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--disable-overlap-schedule", "--dtype", "float32",
             "--mem-fraction-static", "0.05", "--max-total-tokens", "4096", "--random-seed", "0",
             "--sleep-on-idle"]  # an idle scheduler waits on its sockets instead of spinning a core

    def __init__(self, target: str, head: str | None, log_file: str, env: dict | None = None,
                 startup_timeout: float = 400, extra: tuple = (), attempts: int = 3):
        import subprocess

        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", target, *self.FLAGS, *extra]
        if head is not None:
            args += ["--speculative-algorithm", "DART", "--speculative-draft-model-path", head]
        full_env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([CPU_DIR, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self.log_file = log_file
        for attempt in range(attempts):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._log = open(log_file, "w")
            self.process = subprocess.Popen([*args, "--port", str(port)], stdout=self._log,
                                            stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
            if self._wait_until_ready(startup_timeout):
                return
            self.close()  # another process took the port between our probe and SGLang's bind: another one
        raise RuntimeError(f"SGLang server lost the race for a free port {attempts} times:\n{self.log_tail()}")

    def _wait_until_ready(self, startup_timeout: float) -> bool:
        """True once the server answers /health; False when its port was taken (it would hang); raises with the
        log tail when it exits or does not answer in time."""
        import time
        import urllib.request

        deadline = time.time() + startup_timeout
        while True:
            if PORT_TAKEN in self.log_tail(200).lower():
                return False
            if self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"SGLang server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"SGLang server did not answer within {startup_timeout} s:\n{self.log_tail()}")
            time.sleep(2)

    def openai(self):
        """The `openai` client on this server's OpenAI-compatible endpoints, as users' code makes it."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

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
        if not self._log.closed:
            self._log.close()


def start_together(*starts) -> list:
    """The servers the callables `starts` start, started at once (a start is mostly one busy thread: side by side
    they take about the time of one per core); if one fails, the others are closed and the error raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        started, error = [], None
        for future in futures:
            try:
                started.append(future.result())
            except Exception as err:  # noqa: BLE001 -- every other server is closed before it is raised
                error = error or err
    if error is not None:
        for server in started:
            server.close()
        raise error
    return started
