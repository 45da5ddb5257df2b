"""Key/value caches the local sampler keeps between calls, so a turn prefills only its new tokens.

A multi-turn branch's next prompt is its previous prompt, the completion it sampled, the
template's closing tokens and the new messages (``agent_gym.render`` guarantees the prefix
extension). When a sampled row finishes, the sampler stores the keys and values it already
computed for ``prompt + completion[:-1]`` here; the branch's next call finds that entry as the
longest cached prefix of its prompt and prefills only the rest. The lookup is by token
content, not by caller identity, so concurrent branches (even ones sharing a prefix, like the
branches of one group) each get a correct prefix and never see each other's tokens.

Memory is bounded by ``max_bytes`` with least-recently-used eviction. Entries belong to one
sampling client, i.e. to one frozen copy of the weights: a new sampler on new weights starts
empty, so a stale key/value can never be reused after an update.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

# One (keys, values) pair per decoder layer, each [1, kv_heads, length, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CachedPrefix:
    """Keys and values of ``length`` tokens, per layer, and (for a scored prompt) each
    token's logprob given the ones before it (``logprobs[0]`` is NaN)."""

    tokens: np.ndarray
    layers: tuple[LayerKV, ...]
    logprobs: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.layers)

    def cropped(self, length: int) -> tuple[LayerKV, ...]:
        """The first ``length`` positions (views: callers must not write into them)."""
        return tuple((k[:, :, :length], v[:, :, :length]) for k, v in self.layers)


class PrefixCache:
    """A bounded LRU of token prefixes and their keys/values; thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._bytes = 0
        self._next_key = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def longest_prefix(self, tokens: list[int], limit: int) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest common prefix with ``tokens`` and its length (at most
        ``limit``). Any shared prefix is usable: keys at position i depend only on tokens[:i+1]."""
        query = np.asarray(tokens, dtype=np.int64)
        best: CachedPrefix | None = None
        best_len = 0
        best_key = -1
        with self._lock:
            for key, entry in self._entries.items():
                n = min(entry.length, query.shape[0], limit)
                if n <= best_len:
                    continue
                differ = np.flatnonzero(entry.tokens[:n] != query[:n])
                common = int(differ[0]) if differ.size else n
                if common > best_len:
                    best, best_len, best_key = entry, common, key
            if best is not None:
                self._entries.move_to_end(best_key)
        return best, best_len

    def put(
        self, tokens: list[int], layers: tuple[LayerKV, ...], logprobs: np.ndarray | None = None
    ) -> None:
        """Store a prefix (the tensors must be owned by the caller: not views of a batch).

        Entries that are prefixes of the new one are dropped: the new entry serves every
        lookup they could serve at least as well, so a branch keeps one entry, not one per turn.
        """
        if not tokens:
            return
        entry = CachedPrefix(np.asarray(tokens, dtype=np.int64), layers, logprobs)
        size = entry.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            dominated = [
                key for key, old in self._entries.items()
                if old.length <= entry.length
                and np.array_equal(old.tokens, entry.tokens[: old.length])
            ]
            for key in dominated:
                self._bytes -= self._entries.pop(key).nbytes
            self._entries[self._next_key] = entry
            self._next_key += 1
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
