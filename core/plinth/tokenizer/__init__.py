"""Tokenizers built from GGUF ``tokenizer.*`` metadata.

``Tokenizer.from_metadata(md)`` picks an implementation from
``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE, pre-tokenizer chosen by
``tokenizer.ggml.pre``) or ``llama`` (SentencePiece-style, score-driven
bigram merging with byte fallback).
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
