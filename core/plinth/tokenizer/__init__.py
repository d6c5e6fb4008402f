"""Tokenizers built from GGUF ``tokenizer.*`` metadata.

``Tokenizer.from_metadata(md)`` picks an implementation from
``tokenizer.ggml.model``: ``gpt2`` (BPE; the pre-tokenizer, and whether words
are byte-level or raw UTF-8, chosen by ``tokenizer.ggml.pre``: every value
llama.cpp knows, see ``SUPPORTED_PRE`` and ``pretok.py``) or ``llama``
(SentencePiece-style, score-driven bigram merging with byte fallback).
"""
from .core import (
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
    UnsupportedTokenizerError,
    SUPPORTED_MODELS,
    SUPPORTED_PRE,
)

__all__ = [
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedTokenizerError",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE",
]
