"""`kiln loadtest`: a dynamic-batch serving load test, like real traffic: random prompt and output lengths,
optional Poisson arrivals, a cap on requests in flight. Reports throughput and TTFT / TPOT / end-to-end latency
percentiles; optionally writes JSON and a plot of the percentiles over time.

Bounded by design: at most MAX_REQUESTS requests, a wall-clock `timeout`, and loopback URLs only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from kiln.errors import ConfigError, KilnError

MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 1024
PERCENTILES = (50, 90, 99)
# Common English words that are one token (with their leading space) in most BPE vocabularies, so a prompt of
# N words is close to N tokens; the report uses the server's own token counts.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "it",
    "an", "were", "are", "which", "this", "be", "or", "have", "had", "one", "not", "but", "first", "new", "time",
    "all", "two", "who", "their", "been", "has", "more", "after", "would", "into", "when", "there", "other", "her",
    "its", "only", "she", "also", "some", "years", "many", "may", "over", "most", "about", "out", "they", "then",
    "these", "can", "city", "during", "such", "up", "world", "used", "him", "made", "three", "where", "than",
    "state", "part", "well", "between", "both", "known", "under", "later", "while", "year", "found", "group",
    "being", "school", "film", "before", "number", "each", "same", "early", "name", "including", "life", "second",
    "area", "game", "high", "since", "people", "water", "music", "team", "long",
)
# fmt: on


@dataclass(frozen=True)
class LoadTestConfig:
    url: str
    concurrency: int
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    model: str | None = None
    api_key: str | None = None
    request_rate: float | None = None
    timeout: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_loopback_url(self.url)
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ConfigError(f"--num-requests must be in [1, {MAX_REQUESTS}], got {self.num_requests}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ConfigError(f"--concurrency must be in [1, {MAX_CONCURRENCY}], got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ConfigError(f"--request-rate must be > 0 requests/s, got {self.request_rate}")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class RequestRecord:
    """One request's outcome; times are seconds, `start` relative to the start of the test."""

    index: int
    start: float
    target_input_len: int
    target_output_len: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None


@dataclass
class LoadTestResult:
    config: LoadTestConfig
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """'A:B' (or 'A') -> (A, B) with 1 <= A <= B."""
    low, _, high = text.partition(":")
    try:
        a, b = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"{flag} expects A:B (two token counts, e.g. 32:256), got {text!r}") from None
    if not 1 <= a <= b:
        raise ConfigError(f"{flag} expects 1 <= A <= B, got {text!r}")
    return a, b


def check_loopback_url(url: str) -> None:
    """Refuse anything but http(s) to 127.0.0.0/8, ::1 or localhost: a load test must not hit someone else."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    host = parsed.hostname
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback:
        raise ConfigError(
            f"refusing to load-test {host!r}: kiln loadtest only targets loopback addresses (127.0.0.1, ::1, localhost)"
        )


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


async def run_loadtest(cfg: LoadTestConfig) -> LoadTestResult:
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    base = cfg.url.rstrip("/")
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(cfg.timeout)) as client:
        model = cfg.model or await _first_model(client, base)
        records: list[RequestRecord] = []
        in_flight = asyncio.Semaphore(cfg.concurrency)
        tasks: list[asyncio.Task[None]] = []
        t0 = time.monotonic()
        deadline = t0 + cfg.timeout

        async def send_all() -> None:
            for i in range(cfg.num_requests):
                if cfg.request_rate is not None:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
                await in_flight.acquire()
                lengths = rng.randint(*cfg.input_len), rng.randint(*cfg.output_len)
                record = RequestRecord(i, time.monotonic() - t0, *lengths)
                records.append(record)
                prompt = make_prompt(rng, record.target_input_len)
                tasks.append(asyncio.create_task(_one_request(client, base, model, prompt, record, t0, in_flight)))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(send_all(), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for record in records:
                if not record.ok and record.error is None:
                    record.error = f"unfinished after --timeout {cfg.timeout:g} s"
        return LoadTestResult(cfg, time.monotonic() - t0, records)


async def _first_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        response = await client.get(f"{base}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise KilnError(f"cannot list models at {base}/v1/models ({exc}); is the server up? pass --model") from None


async def _one_request(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    prompt: str,
    record: RequestRecord,
    t0: float,
    in_flight: asyncio.Semaphore,
) -> None:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": record.target_output_len,
        "ignore_eos": True,  # vLLM/kiln extension: fixed output lengths make runs comparable
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = t0 + record.start
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message')}"
                    return
                if event.get("choices") and record.ttft is None:
                    record.ttft = time.monotonic() - start
                if event.get("usage"):
                    record.prompt_tokens = event["usage"]["prompt_tokens"]
                    record.output_tokens = event["usage"]["completion_tokens"]
        record.e2e = time.monotonic() - start
        if record.ttft is not None and record.output_tokens > 1:
            record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        in_flight.release()


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200]
