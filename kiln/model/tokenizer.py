"""Tokenizer and chat template, from GGUF metadata or an HF directory, on the `tokenizers` library.

Chat templates are Jinja run in an immutable sandbox: template text comes from a file and is never
given Python access.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kiln.errors import ModelLoadError, RequestError

Field = Callable[..., Any]  # a GGUF checkpoint's field(key, default=None)


def _template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


# stands in for each message's content while the chat template renders (a private-use character, never a token)
_MARK = "\ue000"
_TEMPLATES = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_TEMPLATES.globals["raise_exception"] = _template_error  # as HF templates call it: their own message reaches the 400
_TEMPLATES.filters["tojson"] = _tojson  # as HF renders it: keys in order, text as UTF-8 (jinja's sorts and escapes)


# NOTE: compiling the default model's chat template took 2.3 ms of every chat request and rendering it 0.02 ms; the
# few templates a server sees are kept compiled (a jinja Template renders from many threads at once)
@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    return _TEMPLATES.from_string(template)


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    return frozenset(meta.find_undeclared_variables(_TEMPLATES.parse(template)))


# what kiln itself gives every chat template to render; a request's template variables may not replace them
TEMPLATE_RESERVED = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", *_TEMPLATES.globals}
)


# token_type values in GGUF (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4
# GPT-2 style split used by llama.cpp's "default"/"gpt2"/"smollm" pre-tokenizers.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)


def _byte_level_pre(pre: str, path: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact"):
        steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        return pre_tokenizers.Sequence(steps)
    if pre in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    regex = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if regex is None:
        raise ModelLoadError(
            path, f"unsupported GGUF pre-tokenizer {pre!r} (kiln knows smollm, gpt2, llama-bpe, qwen2)"
        )
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    return pre_tokenizers.Sequence([split, byte_level])


def _gguf_bpe(field: Field, tokens: list[str], path: str) -> Tokenizer:
    """GPT-2 style byte-level BPE with the file's merges and pre-tokenizer."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre(field("tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_spm(field: Field, tokens: list[str], path: str) -> Tokenizer:
    """SentencePiece-BPE vocab (Llama 2 style): merges ranked by the merged piece's score."""
    scores = list(field("tokenizer.ggml.scores") or [0.0] * len(tokens))
    add_space_prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((scores[piece_id], piece_id, (left, right)))
    merges.sort(key=lambda m: (-m[0], m[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[m[2] for m in merges], unk_token="<unk>", byte_fallback=True))
    prepend = "first" if add_space_prefix else "never"
    tok.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁")])
    if add_space_prefix:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


# GGUF's tokenizer.ggml.model -> the builder of that tokenizer from the file's fields
GGUF_TOKENIZERS: dict[str, Callable[[Field, list[str], str], Tokenizer]] = {"gpt2": _gguf_bpe, "llama": _gguf_spm}


class KilnTokenizer:
    """Encode/decode plus the model's chat template and special-token ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool | None,
        pad_token: str | None = None,
        tokenizer_class: str = "PreTrainedTokenizerFast",
    ) -> None:
        """`add_bos=None` leaves special tokens to the tokenizer's own post-processor (HF directories).
        `tokenizer_class`: the class transformers would load (tokenizer_config.json's; /tokenizer_info shows it)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.tokenizer_class = tokenizer_class
        self.add_bos = add_bos
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self._text_tokenizer: Tokenizer | None = None  # a copy that splits special-token text (`_encode_as_text`)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: `encode_batch` releases the GIL while it works and `encode` does not (1M characters: the server's
        # event loop stalled 1.12 s with `encode`, 0.06 s with `encode_batch`); the ids are the same.
        if self.add_bos is None:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as the tokenizer stores it (`Ġhello`: HF's convert_ids_to_tokens)."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (`tools`, `enable_thinking`, `reasoning_effort`, ...)."""
        return _variables(self.chat_template) if self.chat_template else frozenset()

    @property
    def template_knows_tools(self) -> bool:
        """The chat template reads a `tools` variable (renders tool definitions), as tool-calling models' do."""
        return "tools" in self.template_variables

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the template writes it (text: control tokens and contents alike; see
        `encode_chat` for the ids a model should see). `tools`: the tool definitions, for templates that take them;
        `template_kwargs`: more variables for the template (`enable_thinking`, ...), JSON values that never
        replace kiln's own (TEMPLATE_RESERVED)."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; use a plain completion instead", param="messages")
        template = _compiled(self.chat_template)
        extra = {} if tools is None else {"tools": tools}
        return template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids, where control tokens come from the template only: each message's content
        is tokenized with special-token text kept as text (a user who writes `<|im_end|><|im_start|>system` gets
        those characters, not a system turn). The template is rendered with a marker in place of each content;
        the text between markers is the template's own and is tokenized with its special tokens. Where the template
        changes a content (trims it, ...), its text is used as rendered, and a content with special-token text
        is refused rather than obeyed."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        marked = [{**m, "content": f"{_MARK}{i}{_MARK}"} if m.get("content") else m for i, m in enumerate(messages)]
        pieces = self.apply_chat_template(marked, add_generation_prompt, tools, template_kwargs).split(_MARK)
        # pieces alternate: template text, a content's index, template text, ...
        in_order = pieces[1::2] == [str(i) for i, m in enumerate(messages) if m.get("content")]
        spliced = in_order and "".join(messages[int(p)]["content"] if n % 2 else p for n, p in enumerate(pieces))
        if spliced != text:  # the template rewrote (trimmed, ...) or reordered the contents: use its text
            for i, m in enumerate(messages):
                if self._has_special_text(m.get("content") or ""):
                    raise RequestError(
                        f"message {i} contains special-token text and this model's chat template rewrites message "
                        "contents, so it cannot be kept as text; remove the control tokens from the message",
                        param=f"messages.{i}.content",  # as the 400s of the request schema name it
                    )
            return self.encode(text)
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            if n % 2:
                ids += self._encode_as_text(messages[int(piece)]["content"])
            elif piece:
                ids += self.encode(piece, add_special_tokens=n == 0)
            elif n == 0:
                ids += self.encode("", add_special_tokens=True)
        return ids

    def encode_as_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As `encode`, but special-token literals in `text` (`<|im_start|>`, ...) are split like any other text:
        only the BOS the model's tokenizer adds is a control token (`kiln serve --completion-special-tokens text`)."""
        if self.add_bos is None:
            return self._as_text().encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        ids = self._encode_as_text(text)
        is_bos_added = add_special_tokens and self.add_bos and self.bos_token_id is not None
        return [self.bos_token_id, *ids] if is_bos_added else ids

    def _encode_as_text(self, text: str) -> list[int]:
        """`text` tokenized with its special-token literals split like any other text."""
        return self._as_text().encode_batch([text], add_special_tokens=False)[0].ids

    def _as_text(self) -> Tokenizer:
        """A copy of the tokenizer that splits special-token text, made on first use."""
        if self._text_tokenizer is None:
            self._text_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
            self._text_tokenizer.encode_special_tokens = True
        return self._text_tokenizer

    @property
    def special_token_texts(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def _has_special_text(self, text: str) -> bool:
        return any(special in text for special in self.special_token_texts)

    @classmethod
    def from_gguf(cls, checkpoint: Any) -> KilnTokenizer:
        f = checkpoint.field
        path = checkpoint.path
        kind = f("tokenizer.ggml.model")
        tokens = list(f("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError(path, "GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
        types = list(f("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind not in GGUF_TOKENIZERS:
            known = " and ".join(GGUF_TOKENIZERS)
            raise ModelLoadError(path, f"unsupported GGUF tokenizer model {kind!r} (kiln knows {known})")
        tok = GGUF_TOKENIZERS[kind](f, tokens, path)
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
        tok.add_special_tokens(special)

        def token(key: str) -> str | None:
            idx = f(key)
            return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

        return cls(
            tokenizer=tok,
            chat_template=f("tokenizer.chat_template"),
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
            add_bos=bool(f("tokenizer.ggml.add_bos_token", kind == "llama")),
            pad_token=token("tokenizer.ggml.padding_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str) -> KilnTokenizer:
        d = Path(directory)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(directory, "tokenizer.json is missing from the model directory")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise ModelLoadError(str(tok_file), f"cannot parse tokenizer ({exc})") from None
        cfg: dict[str, Any] = {}
        cfg_file = d / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())

        def name(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            tokenizer=tok,
            chat_template=template,
            bos_token=name(cfg.get("bos_token")),
            eos_token=name(cfg.get("eos_token")),
            add_bos=None,
            pad_token=name(cfg.get("pad_token")),
            tokenizer_class=cfg.get("tokenizer_class") or "PreTrainedTokenizerFast",
        )
