"""Incremental detokenization with stop strings, holding back text that may still become a stop string."""

from __future__ import annotations

from kiln.engine.request import Request
from kiln.model.tokenizer import KilnTokenizer

# tokens of prompt context re-decoded with each new token, so leading spaces and merges come out right
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: KilnTokenizer | None, request: Request) -> None:
        """`tokenizer=None` (a model without one, e.g. a debugger factory model): token ids only, no text."""
        self.tokenizer = tokenizer
        self.request = request
        self.skip_special = request.params.skip_special_tokens
        self.prefix_offset = max(request.num_prompt_tokens - _CONTEXT_TOKENS, 0)
        self.read_offset = request.num_prompt_tokens
        self.text = ""
        self.num_emitted_chars = 0
        self.stop_hit: str | None = None
        self.stops_from = 0  # text before this offset was produced before min_tokens: no stop string starts there

    def update(self, check_stops: bool = True, drop_last: bool = False) -> None:
        """Decode new output tokens into `self.text`; check stop strings in the new text (truncating at the
        first match) unless `check_stops` is False (before min_tokens: text produced then is never a stop).
        `drop_last`: the latest token stopped the request (EOS, a stop token id) and its text is not output."""
        ids = self.request.all_token_ids
        if drop_last:
            ids = ids[:-1]
        if self.tokenizer is None or self.stop_hit is not None or len(ids) <= self.read_offset:
            return
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tokenizer.decode(ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        start = max(len(self.text) - self._max_stop_len() + 1, 0)
        self.text += delta
        if check_stops:
            self._check_stop(max(start, self.stops_from))
        else:
            self.stops_from = len(self.text)

    def _max_stop_len(self) -> int:
        return max((len(s) for s in self.request.params.stop), default=0)

    def _check_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self.request.params.stop:
            pos = self.text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            pos, stop = best
            self.text = (
                self.text[: pos + len(stop)] if self.request.params.include_stop_str_in_output else self.text[:pos]
            )
            self.stop_hit = stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could be the start of a stop string."""
        if finished or self.stop_hit is not None:
            return self.text
        hold = self._max_stop_len() - 1
        return self.text[: max(len(self.text) - hold, 0)] if hold > 0 else self.text

    def take_delta(self, finished: bool) -> str:
        visible = self.visible_text(finished)
        delta = visible[self.num_emitted_chars :]
        self.num_emitted_chars = len(visible)
        return delta
