"""What a step's sampled token means for its request: the stop rules, and the `RequestOutput` handed to callers.

Stop rules, in order: a structured output's grammar that allows nothing more (even before `min_tokens`: nothing
else could follow); then, once `min_tokens` tokens are out (min_tokens holds off the others): an EOS token
(unless `ignore_eos`), a stop token id, a stop string (seen by the detokenizer), `max_tokens`, `max_model_len`.
"""

from __future__ import annotations

from kiln.engine.output.detokenizer import IncrementalDetokenizer
from kiln.engine.request import Request, RequestOutput

# (finish reason, stop reason: the token or string that stopped it, or None)
Finish = tuple[str, int | str | None]


def stop_after(
    req: Request, token: int, detok: IncrementalDetokenizer, eos_token_ids: tuple[int, ...], max_model_len: int
) -> Finish | None:
    """How `req` finishes now that `token` is its latest output token (already appended), or None to go on."""
    p = req.params
    held_off = len(req.output_token_ids) < p.min_tokens
    # as vLLM: the text of the token that stops the request is not output (EOS as `</s>` when special tokens
    # are kept), unless include_stop_str_in_output; its id stays in token_ids
    stop_token = not held_off and ((not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids)
    detok.update(check_stops=not held_off, drop_last=stop_token and not p.include_stop_str_in_output)
    if req.grammar is not None and req.grammar.is_complete:
        return "stop", None
    if held_off:
        return None
    if not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in p.stop_token_ids:
        return "stop", token
    if detok.stop_hit is not None:
        return "stop", detok.stop_hit
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length", None
    return None


def request_output(req: Request, detok: IncrementalDetokenizer, num_new: int) -> RequestOutput:
    """The caller's view of `req` after a step (`num_new` tokens added by it)."""
    finished = req.is_finished
    delta = detok.take_delta(finished)
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        text=detok.visible_text(finished),
        token_ids=list(req.output_token_ids),
        finished=finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        delta=delta,
        num_new_tokens=num_new,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        # NOTE: shared, not copied (a long prompt's list each step would cost): an output exists once a token is
        # sampled, when every prompt position is scored, and the list never changes after that
        prompt_logprobs=req.prompt_logprobs,
        embedding=req.embedding,
        error=req.error,
        error_param=req.error_param,
        num_cached_tokens=req.num_cached_tokens or 0,
        lora_name=req.lora.lora_name if req.lora is not None else None,
        metrics=req.metrics,
    )
