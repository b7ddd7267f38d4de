"""Prefix caching for hybrid models: prompts that start like an earlier prompt skip that part of
the prefill.

An attention layer can resume from any prefix whose KV is kept, but a Mamba layer needs its state
*after* the prefix, and the state pool holds only the state after the last computed token. So a
prefix is cached as a pair: the KV pages of its tokens (shared by refcount, as forks share them)
and a copy of every Mamba layer's conv and SSM state taken right after its last token, in a
state-pool slot that the cache owns. Prefixes end on page boundaries (no partially filled page is
ever shared). A prefill chunk that ends at a caching point leaves its state there in the sequence's
slot, which is copied; one that runs past it has its Mamba layers leave a copy of the state at the
point in the cache's slot as they go (StepBatch.state_snapshots), so caching costs no extra step.

Entries are keyed by a hash chained over the prefix's pages (vLLM-style block hashes), verified
against the stored tokens on a hit, and evicted least recently used when their slots or pages are
needed. A request's `cache_salt` (vLLM's) starts the chain and is verified with the tokens: requests
of different salts never share a prefix, so one tenant cannot learn from another's hit timing what it
sent.
"""
from __future__ import annotations

from dataclasses import dataclass

from state_pool.util import cdiv


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]  # the prefix (a multiple of the page size long)
    slot: int  # state-pool slot: every Mamba layer's state after the prefix
    pages: list[int]  # KV pages of the prefix; the cache holds one reference to each
    last_used: int
    salt: str | None = None  # the cache_salt of the request it came from

    def holds(self, tokens: list[int], salt: str | None) -> bool:
        """Whether this entry is the prefix `tokens` (a whole number of pages) of a request salted `salt`."""
        return self.salt == salt and self.tokens == tuple(tokens)


class PrefixCache:
    def __init__(self, page_size: int, max_entries: int, interval: int = 0) -> None:
        if max_entries < 1:
            raise ValueError("the prefix cache needs at least one entry")
        if interval < 0:
            raise ValueError("the prefix cache interval must be >= 0 (0: only the end of each prompt)")
        self.page_size = page_size
        self.max_entries = max_entries
        # Besides its end, a prompt is cached every `interval` tokens (rounded up to whole pages), so
        # that prompts which share only a beginning (a system prompt) find it. 0: the end only.
        self.interval = cdiv(interval, page_size) * page_size if interval else 0
        self.entries: dict[int, CachedPrefix] = {}  # chained hash of the prefix -> entry
        self._clock = 0

    def __len__(self) -> int:
        return len(self.entries)

    def page_hashes(self, tokens: list[int], num_pages: int, salt: str | None = None) -> list[int]:
        """Hash of tokens[: (i + 1) * page_size] for i < num_pages, each chained on the previous one (the
        first on the salt)."""
        ps, h, out = self.page_size, (0 if salt is None else hash(("cache_salt", salt))), []
        for i in range(num_pages):
            h = hash((h, tuple(tokens[i * ps:(i + 1) * ps])))
            out.append(h)
        return out

    def caching_point(self, prompt: list[int]) -> int:
        """Where a prompt's prefix is cached: the last page boundary before its last token (that token
        is always computed, for its logits). 0: too short to cache."""
        return (len(prompt) - 1) // self.page_size * self.page_size

    def next_point(self, prompt: list[int], after: int) -> int:
        """The first caching point of `prompt` beyond `after` tokens (0: none): every `interval`
        tokens, and the caching point at its end."""
        end = self.caching_point(prompt)
        if self.interval:
            step = (after // self.interval + 1) * self.interval
            if step < end:
                return step
        return end if end > after else 0

    def _hashes(self, tokens: list[int], n: int, salt: str | None, hashes: list[int] | None) -> list[int]:
        """The first n page hashes of `tokens`: from `hashes` (page_hashes of a longer sequence starting with
        tokens, same salt) where given, else computed."""
        if hashes is None:
            return self.page_hashes(tokens, n, salt)
        if len(hashes) < n:
            raise ValueError(f"{len(hashes)} page hashes given for a prefix of {n} pages")
        return hashes[:n]

    def lookup(self, prompt: list[int], salt: str | None = None,
               hashes: list[int] | None = None) -> CachedPrefix | None:
        """The longest cached prefix of `prompt` (of a request salted `salt`) that leaves at least its last
        token to compute. `hashes`: the prompt's page_hashes, if the caller keeps them."""
        n = self.caching_point(prompt) // self.page_size
        for i, h in reversed(list(enumerate(self._hashes(prompt, n, salt, hashes)))):
            entry = self.entries.get(h)
            if entry is not None and entry.holds(prompt[:(i + 1) * self.page_size], salt):
                self._clock += 1
                entry.last_used = self._clock
                return entry
        return None

    def contains(self, tokens: list[int], salt: str | None = None, hashes: list[int] | None = None) -> bool:
        """Whether the whole pages of `tokens` are cached (`hashes`: as lookup's, of tokens or a longer sequence
        starting with them)."""
        n = len(tokens) // self.page_size
        if n == 0:
            return False
        entry = self.entries.get(self._hashes(tokens, n, salt, hashes)[-1])
        return entry is not None and entry.holds(tokens[:n * self.page_size], salt)

    def insert(self, tokens: list[int], slot: int, pages: list[int], salt: str | None = None,
               hashes: list[int] | None = None) -> CachedPrefix | None:
        """Cache `tokens` (a whole number of pages): the caller gives the entry its slot and one
        reference to each page, and has made room (is_full / pop_lru) beforehand. Returns the entry
        this one displaced (same key: a prefix whose hash collides, or these tokens again), whose
        slot and pages go back to the caller as pop_lru's do, so that nothing leaks; None if none.
        `hashes`: as lookup's."""
        if len(tokens) % self.page_size or len(pages) != len(tokens) // self.page_size:
            raise ValueError("a cached prefix covers whole pages")
        key = self._hashes(tokens, len(pages), salt, hashes)[-1]
        old = self.entries.pop(key, None)
        if self.is_full:
            raise RuntimeError("prefix cache full: pop an entry first")
        self._clock += 1
        self.entries[key] = CachedPrefix(tuple(tokens), slot, list(pages), self._clock, salt)
        return old

    @property
    def is_full(self) -> bool:
        return len(self.entries) >= self.max_entries

    def remove_prefixes_of(self, prompt: list[int], salt: str | None = None) -> list[CachedPrefix]:
        """Remove and return every cached prefix of `prompt` (their slots and pages go back to the
        caller): after a request failed, a prefix cached from its steps may hold its bad state."""
        n = len(prompt) // self.page_size
        out = []
        for i, h in enumerate(self.page_hashes(prompt, n, salt)):
            entry = self.entries.get(h)
            if entry is not None and entry.holds(prompt[:(i + 1) * self.page_size], salt):
                out.append(self.entries.pop(h))
        return out

    def pop_lru(self) -> CachedPrefix | None:
        """Remove and return the least recently used entry (its slot and pages go back to the caller)."""
        if not self.entries:
            return None
        key = min(self.entries, key=lambda k: self.entries[k].last_used)
        return self.entries.pop(key)
