"""Start ``hf-paged-attn serve`` in a child process and stop it (tests, the benchmark, the example).

    with ServerProcess(DEMO_MODEL, ["--served-model-name", "demo"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

READY = re.compile(r"ready: (http://\S+)")


class ServerProcess:
    """``python -m hf_paged_attn.serve MODEL --port 0 ARGS`` on 127.0.0.1; ``url`` once ready.

    Every wait is bounded; ``stop`` sends SIGTERM (a drained shutdown) and kills the process if it
    has not exited in time. The server's log lines are kept in ``log``. Another server (``command``)
    that prints no ready line is ready when ``url`` + ``/health`` answers 200.
    """

    def __init__(self, model: str | Path, args: list[str] | None = None, env: dict[str, str] | None = None,
                 start_timeout: float = 120.0, command: list[str] | None = None, url: str = "") -> None:
        self.command = command or [sys.executable, "-m", "hf_paged_attn.serve", str(model), "--port", "0"]
        self.command += list(args or [])
        # Idle OpenMP threads that spin steal the cores of a shared machine (see hf_paged_attn._env).
        self.env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.url = ""
        self._health_url = url
        self.log: list[str] = []
        self.process: subprocess.Popen | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not self.url:
            if time.monotonic() > deadline:
                self.stop(5)
                log = "".join(self.log[-20:])
                raise TimeoutError(f"server not ready in {self.start_timeout:.0f} s:\n{log}")
            try:
                line = self._lines.get(timeout=0.25)
            except queue.Empty:
                line = ""
            if line is None:
                raise RuntimeError(f"server exited with {self.process.wait(5)}:\n" + "".join(self.log[-20:]))
            match = READY.search(line)
            if match:
                self.url = match.group(1)
            elif self._health_url and self._healthy():
                self.url = self._health_url
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self._health_url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout`` s (then SIGKILL); returns the exit status."""
        if self.process is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
