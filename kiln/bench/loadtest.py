"""`kiln loadtest`: a dynamic-batch serving load test, like real traffic: random prompt and output lengths,
optional Poisson arrivals, a cap on requests in flight, optionally one shared prefix (a system prompt) and
multi-turn chats (each turn resends the conversation so far with the answers). Reports throughput, TTFT / TPOT /
end-to-end latency percentiles and the prompt tokens the server found cached; optionally writes JSON and a plot
of the percentiles over time. The HTTP side of a request is kiln.bench.loadtest_client.

Bounded by design: at most MAX_REQUESTS requests, a wall-clock `timeout`, and loopback URLs only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from kiln.bench.loadtest_client import RequestRecord, first_model, request_body, send, speculation_counts
from kiln.errors import ConfigError

MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 1024
MAX_PREFIX_WORDS = 100_000
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
    shared_prefix_len: int = 0  # words of one prefix every request starts with (a chat's system message)
    turns: int = 1  # > 1: chats of this many turns (the last may be shorter), one request at a time each

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
        if not 0 <= self.shared_prefix_len <= MAX_PREFIX_WORDS:
            raise ConfigError(
                f"--shared-prefix-len must be in [0, {MAX_PREFIX_WORDS}] words, got {self.shared_prefix_len}"
            )
        if not 1 <= self.turns <= self.num_requests:
            raise ConfigError(f"--turns must be in [1, --num-requests {self.num_requests}], got {self.turns}")


@dataclass
class LoadTestResult:
    config: LoadTestConfig
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    # the server's speculative-decoding counts at the start and the end of the test (None: off, or not reported)
    speculation: tuple[dict[str, float], dict[str, float]] | None = None


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
    """Conversations of `cfg.turns` requests, at most `cfg.concurrency` at once (one request in flight each):
    with one turn, each is a completion of its own prompt, as real traffic of independent requests."""
    rng = random.Random(cfg.seed)
    prefix = make_prompt(rng, cfg.shared_prefix_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    base = cfg.url.rstrip("/")
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(cfg.timeout)) as client:
        model = cfg.model or await first_model(client, base)
        spec_before = await speculation_counts(client, base)
        records: list[RequestRecord] = []
        in_flight = asyncio.Semaphore(cfg.concurrency)
        tasks: list[asyncio.Task[None]] = []
        t0 = time.monotonic()

        async def conversation(c: int, num_turns: int) -> None:
            messages = [{"role": "system", "content": prefix}] if prefix else []
            own = random.Random(f"{cfg.seed}/{c}")  # its lengths and words, whatever order the conversations run in
            try:
                for turn in range(num_turns):
                    lengths = own.randint(*cfg.input_len), own.randint(*cfg.output_len)
                    record = RequestRecord(len(records), time.monotonic() - t0, *lengths, conversation=c, turn=turn)
                    records.append(record)
                    text = make_prompt(own, record.target_input_len)
                    if cfg.turns == 1:
                        await send(
                            client=client,
                            base=base,
                            body=request_body(model, record, f"{prefix} {text}".lstrip()),
                            record=record,
                            t0=t0,
                        )
                        continue
                    messages.append({"role": "user", "content": text})
                    answer = await send(
                        client=client, base=base, body=request_body(model, record, messages), record=record, t0=t0
                    )
                    if not record.ok:
                        return  # the conversation cannot go on without its answer
                    messages.append({"role": "assistant", "content": answer})
            finally:
                in_flight.release()

        async def send_all() -> None:
            for c, start in enumerate(range(0, cfg.num_requests, cfg.turns)):
                if cfg.request_rate is not None:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
                await in_flight.acquire()
                tasks.append(asyncio.create_task(conversation(c, min(cfg.turns, cfg.num_requests - start))))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(send_all(), timeout=max(t0 + cfg.timeout - time.monotonic(), 0.001))
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for record in records:
                if not record.ok and record.error is None:
                    record.error = f"unfinished after --timeout {cfg.timeout:g} s"
        duration = time.monotonic() - t0
        spec_after = await speculation_counts(client, base) if spec_before is not None else None
        spec = (spec_before, spec_after) if spec_before is not None and spec_after is not None else None
        return LoadTestResult(cfg, duration, records, spec)
