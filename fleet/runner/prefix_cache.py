"""Reuse the KV cache of tokens an earlier task already processed (a shared system prompt).

Entries are the KV caches of finished tasks (prompt and completion) and of system prompts,
stored the moment their prefill passes the end of the system turn, so a task that arrives
while another with the same system prompt is still running reuses it. mlx-lm's LRU trie finds
the nearest entry and hands out a copy, trimmed to the shared prefix; the batch generator
takes such a cache per sequence and prefills only the rest.

The bound is memory: `max_bytes` of KV caches per runner, least recently used entries evicted
first (`max_entries` only guards the trie). The worker's routing index (fleet/worker/routing.py)
models what this holds by prompt blocks; it cannot see this cache's evictions, so a routed
task whose entry was evicted pays one prefill, nothing else.
"""

from __future__ import annotations

from typing import Any, Literal

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

KVCache = list[Any]  # one cache object per layer
EntryKind = Literal["system", "assistant"]

# The engine serves one model, so every entry lives under the same trie key.
_MODEL_KEY = "model"


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._entries = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)

    def lookup(self, tokens: list[int]) -> tuple[KVCache | None, int]:
        """A private copy of the longest cached prefix of `tokens` and its length.

        At least the last token is always left out: the model must run on it to produce the
        logits of the first new token.
        """
        cache, rest = self._entries.fetch_nearest_cache(_MODEL_KEY, tokens)
        if cache is None:
            return None, 0
        if not rest:
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, len(tokens) - len(rest)

    def store(self, tokens: list[int], cache: KVCache, kind: EntryKind) -> None:
        if tokens:
            self._entries.insert_cache(_MODEL_KEY, list(tokens), cache, cache_type=kind)

    def __len__(self) -> int:
        return len(self._entries)
