"""The step's third verb: apply what the runner sampled to the requests, and hand their outputs back.

`Updater` holds the requests the engine serves (with each one's incremental detokenizer) from admission to their
final output: it advances each scheduled sequence by the tokens its step computed, appends the sampled tokens
up to the first that stops the request (kiln.engine.output.outputs: the stop rules), moves structured outputs' grammars,
counts accepted speculative drafts, and fails or finishes requests with an output for their callers. It never
runs the model and never touches tensors.
"""

from __future__ import annotations

import logging
import time

from kiln.config import PoolingConfig
from kiln.engine.output.detokenizer import IncrementalDetokenizer
from kiln.engine.output.outputs import request_output, stop_after
from kiln.engine.request import Request, RequestOutput
from kiln.engine.running.pooling import embedding_of, record_pooled
from kiln.engine.running.prompt_logprobs import record_prompt_scores
from kiln.engine.running.step_sample import ModelRunnerOutput
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.engine.speculation.speculation import Speculator
from kiln.errors import INTERNAL_ERROR, RequestError
from kiln.model.tokenizer import KilnTokenizer

logger = logging.getLogger("kiln")


class Updater:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: KilnTokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        pooling: PoolingConfig | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`pooling`: whether embedding requests' vectors are normalized (kiln.engine.running.pooling);
        `speculator`: the step's proposer, which learns from each verification of its drafts."""
        self.scheduler = scheduler
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.normalize_embeddings = (pooling or PoolingConfig()).normalize
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def track(self, req: Request) -> None:
        """Serve `req` from now on (it is queued in the scheduler by the caller)."""
        self.requests[req.request_id] = req
        self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in sched.scheduled:
            if (req := s.request).is_finished:
                continue  # aborted while its step was in flight (kiln.engine.loop.pipelined)
            drafts = s.spec_token_ids
            self.scheduler.advance(req, s.num_new_tokens - len(drafts))  # drafts count once accepted (below)
            if req.request_id in result.errors:
                outputs.append(self.fail(req.request_id, result.errors[req.request_id]))
                continue
            if (scores := result.prompt_logprobs.get(req.request_id)) is not None and req.prompt_logprobs is not None:
                record_prompt_scores(req.prompt_logprobs, scores)
            if req.params.embed:
                if (out := self._pool(req, result)) is not None:
                    outputs.append(out)
                continue
            tokens = result.sampled.get(req.request_id)
            if tokens is None:
                continue  # a prefill chunk that does not reach the end of the sequence yet
            if (out := self._emit(req, tokens, result.logprobs.get(req.request_id), now)) is not None:
                outputs.append(out)
            if drafts:
                if self.speculator is not None:
                    self.speculator.verified(req, len(drafts), len(tokens) - 1)
                self.scheduler.trim_rejected(req)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        if (req := self.requests.get(request_id)) is None:
            return None
        self._finish(req, "abort")
        return self.output(req, num_new=0)

    def fail(self, request_id: str, message: str, param: str | None = None) -> RequestOutput | None:
        """Finish a request with `finish_reason="error"` and `message` (written for the client) as its error;
        `param`: the request field that failed it (then the client's error, not the engine's)."""
        if (req := self.requests.get(request_id)) is None:
            return None
        req.error, req.error_param = message, param
        self._finish(req, "error")
        return self.output(req, num_new=0)

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)

    def output(self, req: Request, num_new: int) -> RequestOutput:
        """`req`'s output now, with its `num_new` latest tokens as new; a finished request is no longer served."""
        out = request_output(req, self.detokenizers[req.request_id], num_new)
        if out.finished:
            self.requests.pop(req.request_id, None)
            self.detokenizers.pop(req.request_id, None)
        return out

    def _pool(self, req: Request, result: ModelRunnerOutput) -> RequestOutput | None:
        """Add the rows `req`'s chunk pooled to its sum; once its whole prompt is computed, its embedding is its
        final output and it finishes (its blocks freed)."""
        if (chunk := result.pooled.get(req.request_id)) is not None:
            req.pooled = record_pooled(req.pooled, chunk)
        if req.num_computed_tokens < req.num_prompt_tokens:
            return None
        assert req.pooled is not None, "a computed prompt has pooled its rows"
        req.embedding = embedding_of(req.pooled, self.normalize_embeddings)
        self._finish(req, "stop", None)
        return self.output(req, num_new=0)

    def _emit(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None, now: float
    ) -> RequestOutput | None:
        """Append a step's tokens to `req` up to the first that stops it; each token after the first was a draft
        the step accepted, so its K/V is computed too."""
        forced, start = req.forced_output, len(req.output_token_ids)
        for i, token in enumerate(tokens):
            if i:
                self.scheduler.advance(req, 1)
            if forced is not None and len(req.output_token_ids) < len(forced):
                token = forced[len(req.output_token_ids)]
            req.output_token_ids.append(token)
            if req.grammar is not None:
                try:
                    req.grammar.advance(token)
                except RequestError as exc:  # the grammar failed on a token: this request alone fails
                    return self.fail(req.request_id, str(exc), exc.param or "structured_output")
            if logprobs:
                req.logprobs.append(logprobs[i])
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            try:
                detok = self.detokenizers[req.request_id]
                finish = stop_after(req, token, detok, self.eos_token_ids, self.max_model_len)
                if finish is not None:
                    self._finish(req, *finish)
                    break
            except Exception:  # detokenizing this request's tokens failed: only this request is affected
                logger.exception("request %s: finishing the step's update failed; failing the request", req.request_id)
                return self.fail(req.request_id, INTERNAL_ERROR)
        return self.output(req, num_new=len(req.output_token_ids) - start)
