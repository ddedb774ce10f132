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
from typing import Mapping, Sequence

SERVE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes",
               str(64 << 20), "--max-num-seqs", "8", "--max-logprobs", "5", "--seed", "0",
               "--uvicorn-log-level", "warning"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`vllm serve MODEL` with the tokensampler plugin on; `url` once `/health` answers.

    flags: more `vllm serve` flags, after `SERVE_FLAGS` (a flag given twice takes the later value);
    plugins: more general plugins to load with `VLLM_PLUGINS` (with or without tokensampler's);
    env: more environment variables of the server process;
    test_defaults: the suite's small engine (`SERVE_FLAGS`, one OMP thread, an in-process engine
      core); a benchmark passes False and its own flags, to serve as a user would."""

    def __init__(self, model: Path, name: str, *, max_model_len: int, log: Path, plugin: bool = True,
                 timeout: float = 300.0, flags: Sequence[str] = (), plugins: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, test_defaults: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        suite = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"} if test_defaults else {}
        environ = {**os.environ, **suite, "HF_HUB_OFFLINE": "1", **(env or {})}
        environ.pop("VLLM_PLUGINS", None)
        names = (["tokensampler"] if plugin else []) + list(plugins)
        if names:
            environ["VLLM_PLUGINS"] = ",".join(names)
        vllm = Path(sys.executable).with_name("vllm")
        command = [str(vllm), "serve", str(model), "--served-model-name", name, "--max-model-len", str(max_model_len),
                   "--host", "127.0.0.1", "--port", str(self.port), *(SERVE_FLAGS if test_defaults else ()), *flags]
        self.log = log
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True, env=environ)
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

    def alive(self) -> bool:
        """Whether the server process runs and `/health` answers 200."""
        if self.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as reply:
                return reply.status == 200
        except OSError:
            return False

    def rss(self, field: str = "VmRSS") -> dict[str, int]:
        """The resident memory (bytes) of each process of the server's group, by `name pid` (from
        /proc): the API server, and the engine core vLLM starts beside it. `field`: the line of
        /proc/PID/status read (`VmRSS` all resident pages, `RssAnon` the anonymous ones only:
        what the heap holds, without the shared libraries' code paged in on first use)."""
        out: dict[str, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
                fields = text[text.rindex(")") + 2:].split()
                if int(fields[2]) != self.process.pid:  # the process group (the server's session)
                    continue
                status = (stat.parent / "status").read_text().splitlines()
            except (OSError, ValueError):
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            rss = next((int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:")), 0)
            out[f"{name} {stat.parent.name}"] = rss
        return out

    def rss_bytes(self) -> int:
        """The resident memory of every process of the server's group together."""
        return sum(self.rss().values())

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
