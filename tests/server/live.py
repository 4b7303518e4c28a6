"""A live `python -m kiln.launch` server for tests: start it, wait for `Ready:`, read its metrics, stop it."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def cli_flags(**options: object) -> list[str]:
    """`kiln serve` flags from keyword options: `max_model_len=256` -> ["--max-model-len", "256"]."""
    return [item for name, value in options.items() for item in ("--" + name.replace("_", "-"), str(value))]


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[str]
    api_key: str | None = None
    log: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        key = api_key or self.api_key or "none"
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics as `name{labels}` -> value (the text must parse with prometheus_client)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def graph_mode(self) -> str | None:
        """The graph mode the server logged as ready (`Graph mode ready in 12.3 s (full_and_piecewise)`)."""
        for line in self.log:
            if found := re.search(r"Graph mode ready in [\d.]+ s \((\w+)\)", line):
                return found.group(1)
        return None

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until no request is in flight and no KV block is in use; return the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["kiln_kv_cache_used_blocks"] == 0 and m["kiln_num_requests_unfinished"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m['kiln_kv_cache_used_blocks']} blocks used")
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(
    args: list[str],
    api_key: str | None = None,
    while_loading: Callable[[], object] | None = None,
    command: tuple[str, ...] = ("-m", "kiln.launch"),
) -> Iterator[LiveServer]:
    """`python -m kiln.launch --port P ARGS` (or `python COMMAND --port P ARGS`), yielded once it logs `Ready:`;
    SIGTERM (then kill) at the end."""
    port = free_port()
    cmd = [sys.executable, *command, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    live = LiveServer(f"http://127.0.0.1:{port}", proc, api_key)
    ready = threading.Event()

    def read_log() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            live.log.append(line.rstrip("\n"))
            if "Ready: " in line:
                ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        if while_loading is not None:
            while_loading()  # NOTE: e.g. load an offline reference while the server loads
        deadline = time.monotonic() + 240
        while not ready.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("server did not start:\n" + "\n".join(live.log[-30:]))
        yield live
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
