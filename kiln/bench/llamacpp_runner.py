"""The llama.cpp anchor: llama-cpp-python's bindings of llama.cpp, on the same GGUF file, prompts and thread count
as kiln, greedy (argmax of the logits), EOS ignored, exactly `output_len` tokens per request.

Batch size 1 runs one request at a time (mode "sequential"). Above 1 it uses llama.cpp's own batched decoding
(mode "batched"): one context of `batch_size` sequences (`n_seq_max`), each `llama_decode` carrying the prompts
of newly admitted requests and one token of every running one; a finished request's sequence is cleared and
takes the next prompt, the closed loop kiln runs. `Llama`, the high-level class, has no batched generate: run one
request after another it gives llama.cpp its batch-1 throughput at every batch size (the bs=1 row of the report).
The batched decode beats that from batch size 8 on (measured on a 2-core VM: decode steps of 8 and 32 sequences give
1.7x and 1.9x the tokens/s of one; with 128-token prompts and 64 output tokens, 1.3x the output tok/s; at 2 they
match), so it is the one reported above batch size 1.

llama-cpp-python is optional (`make llamacpp` builds it with scripts/install_llamacpp.sh's CMAKE_ARGS).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
from tqdm import tqdm

from kiln.bench.metrics import RunResult
from kiln.errors import ConfigError, KilnError, ModelLoadError

INSTALL_HINT = "run `make llamacpp` (builds it into .venv with scripts/install_llamacpp.sh, ~7 min on 2 cores)"


def import_llama_cpp() -> ModuleType:
    try:
        import llama_cpp
    except ImportError as exc:
        raise KilnError(
            f"--compare llama.cpp needs llama-cpp-python, which is not importable ({exc}): {INSTALL_HINT}"
        ) from exc
    return llama_cpp


def check_llamacpp(model_path: str) -> None:
    """Raise a KilnError unless llama_cpp imports and `model_path` is a .gguf file."""
    import_llama_cpp()
    if not (os.path.isfile(model_path) and model_path.endswith(".gguf")):
        raise ConfigError(
            f"--compare llama.cpp runs llama.cpp on the file kiln loaded, and llama.cpp needs a .gguf file; "
            f"kiln loaded {model_path} (pass --model path/to/model.gguf)"
        )


def run_llamacpp(
    model_path: str, batches: dict[int, list[list[int]]], output_len: int, num_threads: int
) -> list[RunResult]:
    """One RunResult per batch size in `batches` (batch size -> its prompts), each after a warm-up request."""
    results = []
    with _LlamaCppModel(model_path) as model:
        for batch_size, prompts in batches.items():
            seq_len = len(prompts[0]) + output_len
            with model.context(batch_size, seq_len, batch_size * len(prompts[0]), num_threads) as ctx:
                _closed_loop(ctx=ctx, prompts=prompts[:1], output_len=2, batch_size=1, desc=None)
                results.append(_run(ctx, prompts, output_len, batch_size))
    return results


def _run(ctx: _Context, prompts: list[list[int]], output_len: int, batch_size: int) -> RunResult:
    mode = "sequential" if batch_size == 1 else "batched"
    prefill_s, _ = _closed_loop(
        ctx=ctx, prompts=prompts, output_len=1, batch_size=batch_size, desc=f"llama.cpp {mode} bs={batch_size} prefill"
    )
    wall_s, requests = _closed_loop(
        ctx=ctx, prompts=prompts, output_len=output_len, batch_size=batch_size, desc=f"llama.cpp {mode} bs={batch_size}"
    )
    done = [(r.arrival_time, r.first_token_time, r.finished_time, r.token_ids) for r in requests]
    return RunResult.closed_loop(
        system="llama.cpp",
        mode=mode,
        batch_size=batch_size,
        prompts=prompts,
        output_len=output_len,
        wall_s=wall_s,
        prefill_s=prefill_s,
        requests=done,
    )


@dataclass
class _Request:
    index: int
    prompt: list[int]
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float = 0.0
    finished_time: float = 0.0


def _closed_loop(
    ctx: _Context, prompts: list[list[int]], output_len: int, batch_size: int, desc: str | None
) -> tuple[float, list[_Request]]:
    """At most `batch_size` requests in flight, sequence i of the context serving slot i; each step decodes the
    prompts of the requests admitted into free slots plus the last token of every running request."""
    ctx.clear()
    slots: list[_Request | None] = [None] * batch_size
    done: list[_Request] = []
    num_admitted = 0
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=desc is None)
    start = time.monotonic()
    while len(done) < len(prompts):
        feeds: list[tuple[int, list[int], int]] = []  # (sequence, tokens to decode, position of the first)
        for seq, req in enumerate(slots):
            if req is None and num_admitted < len(prompts):
                req = slots[seq] = _Request(num_admitted, prompts[num_admitted], time.monotonic())
                num_admitted += 1
                feeds.append((seq, req.prompt, 0))
            elif req is not None:
                feeds.append((seq, req.token_ids[-1:], len(req.prompt) + len(req.token_ids) - 1))
        next_tokens = ctx.decode(feeds)
        now = time.monotonic()
        for (seq, _, _), token in zip(feeds, next_tokens, strict=True):
            req = slots[seq]
            assert req is not None
            req.token_ids.append(token)
            req.first_token_time = req.first_token_time or now
            if len(req.token_ids) == output_len:
                req.finished_time = now
                done.append(req)
                slots[seq] = None
                ctx.free_sequence(seq)
                bar.update(1)
    wall_s = time.monotonic() - start
    bar.close()
    return wall_s, sorted(done, key=lambda r: r.index)


class _LlamaCppModel(contextlib.AbstractContextManager["_LlamaCppModel"]):
    """A GGUF file loaded by llama.cpp (CPU, memory-mapped), with llama.cpp's own log quiet (verbose=False)."""

    def __init__(self, path: str) -> None:
        self.lib = import_llama_cpp()
        # NOTE: llama-cpp-python prints llama.cpp's log through this logger; Llama(verbose=False) sets the same.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib.llama_backend_init()
        self.model = self.lib.llama_model_load_from_file(path.encode(), self.lib.llama_model_default_params())
        if not self.model:
            raise ModelLoadError(path, "llama.cpp could not load this GGUF file")
        self.vocab_size = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))

    def context(self, num_seqs: int, seq_len: int, max_batch_tokens: int, num_threads: int) -> _Context:
        return _Context(
            model=self, num_seqs=num_seqs, seq_len=seq_len, max_batch_tokens=max_batch_tokens, num_threads=num_threads
        )

    def __exit__(self, *exc: object) -> None:
        self.lib.llama_model_free(self.model)


class _Context(contextlib.AbstractContextManager["_Context"]):
    """A llama.cpp context of `num_seqs` sequences of up to `seq_len` tokens, and a batch of `max_batch_tokens`."""

    def __init__(
        self, model: _LlamaCppModel, num_seqs: int, seq_len: int, max_batch_tokens: int, num_threads: int
    ) -> None:
        self.lib = lib = model.lib
        if num_seqs > lib.llama_max_parallel_sequences():
            raise ConfigError(f"llama.cpp runs at most {lib.llama_max_parallel_sequences()} sequences, not {num_seqs}")
        params = lib.llama_context_default_params()
        # NOTE: n_seq_max sequences split n_ctx among them, each share rounded up to llama.cpp's 256-token step.
        params.n_ctx = num_seqs * -(-seq_len // 256) * 256
        params.n_seq_max = num_seqs
        params.n_batch = max_batch_tokens
        params.n_threads = params.n_threads_batch = num_threads
        self.ctx = lib.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise KilnError(f"llama.cpp could not create a context of {num_seqs} x {seq_len} tokens")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(max_batch_tokens, 0, 1)
        self.vocab_size = model.vocab_size

    def decode(self, feeds: list[tuple[int, list[int], int]]) -> list[int]:
        """Decode (sequence, tokens, first position) feeds in one `llama_decode`; the greedy next token of each."""
        batch, i = self.batch, 0
        for seq, tokens, pos in feeds:
            for j, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos + j, 1, seq
                batch.logits[i] = j == len(tokens) - 1
                i += 1
        batch.n_tokens = i
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise KilnError(f"llama.cpp's llama_decode returned {status} on a batch of {i} tokens")
        last_rows = np.cumsum([len(tokens) for _, tokens, _ in feeds]) - 1
        return [int(self._logits(int(row)).argmax()) for row in last_rows]

    def _logits(self, row: int) -> np.ndarray:
        """A view of the logits of batch row `row` (valid until the next decode)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), (self.vocab_size,))

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def free_sequence(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def __exit__(self, *exc: object) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
