"""`vllm serve` in a process group of its own, for tests that talk to it with the `openai` client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes",
               str(64 << 20), "--max-num-seqs", "8", "--max-logprobs", "5", "--seed", "0",
               "--uvicorn-log-level", "warning"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`vllm serve MODEL` with the tokensampler plugin on; `url` once `/health` answers."""

    def __init__(self, model: Path, name: str, *, max_model_len: int, log: Path, plugin: bool = True,
                 timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        env.pop("VLLM_PLUGINS", None)
        if plugin:
            env["VLLM_PLUGINS"] = "tokensampler"
        vllm = Path(sys.executable).with_name("vllm")
        command = [str(vllm), "serve", str(model), "--served-model-name", name, "--max-model-len", str(max_model_len),
                   "--host", "127.0.0.1", "--port", str(self.port), *SERVE_FLAGS]
        self.log = log
        self.process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer /health in {timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
