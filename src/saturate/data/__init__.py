"""Corpus → token shards: find the files, tokenise once, cache by content, memory-map the result."""

from saturate.data.corpus import (
    DATA_SUFFIXES,
    JSONL_SUFFIX,
    TEXT_SUFFIXES,
    content_hash,
    default_corpus,
    iter_documents,
    resolve_paths,
)
from saturate.data.shards import TokenShard, open_shard, shard_dtype, write_shard
from saturate.data.token_cache import TokenCorpus, cache_root, prepare_corpus
from saturate.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, parse_tokenizer_spec

__all__ = [
    "DATA_SUFFIXES",
    "JSONL_SUFFIX",
    "TEXT_SUFFIXES",
    "BPETokenizer",
    "ByteTokenizer",
    "TokenCorpus",
    "TokenShard",
    "Tokenizer",
    "cache_root",
    "content_hash",
    "default_corpus",
    "iter_documents",
    "open_shard",
    "parse_tokenizer_spec",
    "prepare_corpus",
    "resolve_paths",
    "shard_dtype",
    "write_shard",
]
