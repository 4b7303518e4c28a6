"""How much work one HTTP request may ask for, and the checks that refuse more before the work is done.

Each limit is a `kiln serve` flag whose default is one of the constants below (kiln/server/cli.py documents
them). The checks run before the work they bound: prompt size before tokenizing, prompts x n and stop strings
before any engine request exists. A refusal names the limit, its value, and the flag that raises it. (The body
size is checked even earlier, before parsing: kiln/server/middleware.py.)

This module imports nothing heavy: the CLI reads its defaults to build `kiln --help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import RequestError

MIB = 1 << 20
MAX_BODY_BYTES = 4 * MIB
BODY_TIMEOUT_S = 30.0  # a whole request body must arrive within this; a stalled upload is dropped after it
# per connection (kiln/server/connections.py): the request line and headers must arrive within HEADER_TIMEOUT_S and
# hold at most MAX_HEADER_BYTES (more: 400); an idle kept-alive connection closes after KEEP_ALIVE_TIMEOUT_S
HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 * 1024
KEEP_ALIVE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1000
SEND_BUFFER_BYTES = 256 * 1024  # a connection's kernel send buffer (token streams need far less)
# NOTE: a prompt longer than max_model_len tokens is refused anyway; text averages 3-5 characters a token, so
# 16 per token lets every prompt that could fit through while bounding the tokenizer's work (it holds the GIL:
# about 1 s per million characters during which no other client is served).
PROMPT_CHARS_PER_TOKEN = 16
# what a chat template adds around each message (`<|im_start|>user\n...<|im_end|>\n` is 24), counted against
# --max-prompt-chars with the message's own text
MESSAGE_MARKUP_CHARS = 32
MAX_SEQS_PER_REQUEST = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_QUEUE = 256
MAX_STREAM_BUFFER = 1024


class LimitExceeded(RequestError):
    """A request over one of the server's limits: the message names the limit, its value and its flag."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message, param=param)
        self.code = code


@dataclass(frozen=True)
class ServerLimits:
    """The per-request limits of one server (the body size is enforced by `BodySizeLimitMiddleware`)."""

    max_prompt_chars: int
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    max_seqs_per_request: int = MAX_SEQS_PER_REQUEST
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS

    @classmethod
    def for_model(cls, max_model_len: int, max_prompt_chars: int | None = None, **limits: float) -> ServerLimits:
        """Limits for a model of `max_model_len` tokens; no `max_prompt_chars`: PROMPT_CHARS_PER_TOKEN per token."""
        return cls(max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len, **limits)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise LimitExceeded(
                f"{param} has {num_chars} characters; this server accepts at most {self.max_prompt_chars} per "
                f"prompt (--max-prompt-chars={self.max_prompt_chars}); send a shorter prompt",
                param,
                "prompt_too_long",
            )

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        """Each (prompt, choice) is one engine request; one HTTP request may make `max_seqs_per_request`."""
        if num_prompts * n > self.max_seqs_per_request:
            raise LimitExceeded(
                f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} completions; this server makes at most "
                f"{self.max_seqs_per_request} per request (--max-seqs-per-request={self.max_seqs_per_request}); "
                "send fewer prompts or a smaller n, or split the request",
                "n",
                "too_many_completions",
            )

    def check_stop(self, stop: list[str]) -> None:
        """Every stop string is matched against every new token's text, so their number and length are bounded."""
        if len(stop) > self.max_stop_strings:
            raise LimitExceeded(
                f"stop has {len(stop)} strings; this server accepts at most {self.max_stop_strings} "
                f"(--max-stop-strings={self.max_stop_strings})",
                "stop",
                "too_many_stop_strings",
            )
        for i, text in enumerate(stop):
            if len(text) > self.max_stop_chars:
                raise LimitExceeded(
                    f"stop.{i} has {len(text)} characters; this server accepts stop strings of at most "
                    f"{self.max_stop_chars} (--max-stop-chars={self.max_stop_chars})",
                    f"stop.{i}",
                    "stop_string_too_long",
                )
