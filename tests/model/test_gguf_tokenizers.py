"""GGUF tokenizers from the file's fields (kiln.model.tokenizer.GGUF_TOKENIZERS): a SentencePiece (`llama`) vocab
splits on its merges ranked by score and decodes back to the text; an unknown kind is refused naming the known."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kiln.errors import ModelLoadError
from kiln.model.tokenizer import GGUF_TOKENIZERS, KilnTokenizer

# normal pieces, then <unk>, <s>, </s> (control)
PIECES = ["<unk>", "<s>", "</s>", "▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "ll", "▁He", "▁Hell", "▁Hello",
          "▁w", "or", "▁wor", "▁world", "ld"]  # fmt: skip


def checkpoint(kind: str) -> Any:
    fields = {
        "tokenizer.ggml.model": kind,
        "tokenizer.ggml.tokens": PIECES,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (len(PIECES) - 3),
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [float(len(p)) for p in PIECES[3:]],  # longer merges first
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return SimpleNamespace(path="tiny.gguf", field=lambda key, default=None: fields.get(key, default))


def test_a_sentencepiece_vocab_merges_by_score_and_decodes_back() -> None:
    tok = KilnTokenizer.from_gguf(checkpoint("llama"))
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and [PIECES[i] for i in ids[1:]] == ["▁Hello", "▁world"]  # BOS added, as llama's default
    assert tok.decode(ids) == "Hello world" and tok.eos_token_id == 2


def test_an_unknown_tokenizer_model_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'rwkv'") as refused:
        KilnTokenizer.from_gguf(checkpoint("rwkv"))
    assert all(kind in str(refused.value) for kind in GGUF_TOKENIZERS)
