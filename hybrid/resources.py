"""The one owner of Mamba state slots and KV pages: what each sequence holds, what forks share,
what cached prefixes keep, and when released resources may be reused.

A running sequence owns one state-pool slot and a list of KV pages; pages are refcounted, so a
fork's prompt pages and a cached prefix's pages are shared rather than copied. A release while a
launched step may still read or write the resources (async scheduling) is fenced: it is carried
out once that step is known to be finished (`step_synced`), so nobody reuses them early.
The scheduler decides who gets what; everything that touches the pools goes through here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attention.kv_cache import DUMMY_PAGE, PagedKVCache
from hybrid.batch import StepBatch
from hybrid.prefix_cache import PrefixCache
from state_pool.errors import StateCorruptionError
from state_pool.pool import PAD_SLOT_ID, MambaStatePool
from state_pool.sanitizer import ExpectedInputs, RowOwner, check_batch
from state_pool.util import cdiv

if TYPE_CHECKING:
    from hybrid.engine_config import EngineConfig
    from hybrid.request import ScheduledChunk, Sequence


def row_owners(chunks: list[ScheduledChunk], with_lengths: bool = False,
               state_tokens: dict[int, int] | None = None) -> list[RowOwner]:
    """Who each row of a step's batch belongs to (row i: chunk i), as the sanitizer names them;
    `with_lengths` (before the step is launched, while num_computed is the context it runs on):
    also the KV length each row must run to, its token count, the most tokens the sequence can run
    (known, sampled in flight, drafted) and, from `state_tokens` (ResourceManager.state_tokens), the
    tokens the state in its slot has absorbed."""
    def lengths(c: ScheduledChunk) -> tuple[int, ...]:
        if not with_lengths:
            return ()
        absorbed = -1 if state_tokens is None else state_tokens.get(c.seq.slot, -1)
        return (c.seq.num_computed + c.num_tokens, c.num_tokens, c.seq.num_tokens + c.seq.pending + len(c.draft),
                absorbed)

    return [RowOwner(c.seq.label, c.seq.slot if c.seq.slot is not None else PAD_SLOT_ID, list(c.seq.pages),
                     *lengths(c)) for c in chunks]


class ResourceManager:
    def __init__(self, state_pool: MambaStatePool, kv_cache: PagedKVCache, stats: dict[str, int],
                 config: EngineConfig) -> None:
        self.state_pool = state_pool
        self.kv_cache = kv_cache
        self.pages = kv_cache.allocator
        self.page_size = kv_cache.page_size
        self.stats = stats
        # Prefix caching (hybrid/prefix_cache.py): its entries hold state-pool slots beyond max_num_seqs
        entries = config.prefix_cache_slots
        self.prefix_cache = (PrefixCache(self.page_size, entries, config.cache.prefix_cache_interval)
                             if entries else None)
        self.launched = 0  # steps launched so far
        self.synced = 0  # steps whose device work is known to be complete
        self._deferred: list[tuple[int, int | None, list[int]]] = []  # (fence step, slot, pages) to free
        # The sanitizer's ledger (check_state only): slot -> tokens the state in it has absorbed, counted
        # from the slot's own history: 0 when allocated (zeroed), + each launched chunk's tokens, + a
        # verify's accepted inputs at commit, the source's count on a copy (fork, prefix cache). The host
        # check compares every row's context with it: the scheduler's num_computed cannot vouch for itself.
        self.state_tokens: dict[int, int] | None = {} if config.check_state else None

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    @property
    def verify_scratch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state pool's speculative verify scratch, which verify rows write (state_pool/step_batch.py)."""
        return self.state_pool.spec_scratch

    @property
    def num_deferred(self) -> int:
        """Releases waiting for a launched step to finish."""
        return len(self._deferred)

    # ------------------------------------------------------------------ allocation
    def allocate_slot(self) -> int | None:
        """A free (zeroed) slot, evicting one cached prefix if that frees one; None if none is free."""
        slot = self.state_pool.allocate()
        if slot is None and self.evict_cached_prefix():
            slot = self.state_pool.allocate()
        if slot is not None and self.state_tokens is not None:
            self.state_tokens[slot] = 0
        return slot

    def grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure the sequence has pages for `num_tokens` tokens in total (evicting cached
        prefixes while pages are short); False if they cannot be had."""
        need = cdiv(num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.pages.allocate(need)
        while pages is None and self.evict_cached_prefix():
            pages = self.pages.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` a copy of the parent's Mamba state and its full prompt pages, shared; the
        partially filled last page, which the branches write differently, is copied. False (and
        nothing taken) if no slot or page is free."""
        n = parent.num_computed
        full = n // self.page_size
        new_pages: list[int] = []
        if n % self.page_size:
            got = self.pages.allocate(1)
            if got is None:
                return False
            new_pages = got
        slot = self.state_pool.fork(parent.slot)
        if slot is None:
            if new_pages:
                self.pages.release(new_pages)
            return False
        if new_pages:
            self.kv_cache.copy_page(parent.pages[full], new_pages[0])
        self._copy_state_tokens(parent.slot, slot)
        shared = parent.pages[:full]
        self.pages.share(shared)
        child.slot = slot
        child.pages = shared + new_pages
        return True

    def commit_verify(self, seq: Sequence, scratch_index: int, position: int) -> None:
        """A verify row's accepted state (after its input `position`) into the sequence's slot."""
        self.state_pool.commit_spec(seq.slot, scratch_index, position)
        if self.state_tokens is not None and seq.slot in self.state_tokens:
            self.state_tokens[seq.slot] += position + 1  # inputs 0 .. position of the verify row

    def state_launched(self, chunks: list[ScheduledChunk]) -> None:
        """The sanitizer's ledger after a launch: each chunk's slot absorbed its tokens (a verify
        chunk's only at commit_verify). Before cache_prefixes, which copies the counts."""
        if self.state_tokens is None:
            return
        for c in chunks:
            if not c.draft and c.seq.slot in self.state_tokens:
                self.state_tokens[c.seq.slot] += c.num_tokens

    def _copy_state_tokens(self, src: int, dst: int) -> None:
        if self.state_tokens is not None:
            if src in self.state_tokens:
                self.state_tokens[dst] = self.state_tokens[src]
            else:
                self.state_tokens.pop(dst, None)

    # ------------------------------------------------------------------ release
    def release(self, seq: Sequence) -> None:
        """Give back the sequence's slot and pages; while a launched step may still use them they are
        freed only once that step is finished."""
        if seq.slot is None and not seq.pages:
            return
        if self.launched > self.synced:
            self._deferred.append((self.launched, seq.slot, seq.pages))
        else:
            self.free(seq.slot, seq.pages)
        seq.slot = None
        seq.pages = []

    def release_unused(self, seq: Sequence) -> None:
        """Give back what an admission took when nothing launched has used it yet: at once."""
        self.free(seq.slot, seq.pages)
        seq.slot, seq.pages = None, []

    def free(self, slot: int | None, pages: list[int]) -> None:
        if slot is not None:
            self.state_pool.free(slot)
            if self.state_tokens is not None:
                self.state_tokens.pop(slot, None)
        if pages:
            self.pages.release(pages)

    def step_launched(self) -> int:
        """Count a launched step; returns its index (the fence of releases made while it may run)."""
        self.launched += 1
        return self.launched

    def step_synced(self, index: int) -> None:
        """Step `index` (and every one before it) is finished on the device: free what waited for it."""
        self.synced = max(self.synced, index)  # (a failed step may have synced past this one)
        self.free_deferred()

    def all_synced(self) -> None:
        """The device has finished every launched step (a failed step waited for it)."""
        self.step_synced(self.launched)

    def free_deferred(self) -> None:
        keep = []
        for fence, slot, pages in self._deferred:
            if fence <= self.synced:
                self.free(slot, pages)
            else:
                keep.append((fence, slot, pages))
        self._deferred = keep

    def abandon(self) -> None:
        """The device is lost: forget every deferred release (nothing goes back to unusable pools)."""
        self._deferred.clear()

    # ------------------------------------------------------------------ prefix caching
    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """On admission: start from the longest cached prefix of the prompt (its Mamba state copied
        into the sequence's slot, its KV pages shared), and pick where the prompt is cached next.
        Returns the number of prompt tokens reused (0 without prefix caching)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        # prompt logprobs need the logits of every prompt position: a cached prefix would skip them
        entry = (None if seq.scores_prompt
                 else cache.lookup(seq.prompt_token_ids, seq.cache_salt, self._page_hashes(seq)))
        if entry is not None:
            self.state_pool.copy_slot(entry.slot, seq.slot)
            self._copy_state_tokens(entry.slot, seq.slot)
            self.pages.share(entry.pages)
            seq.pages = list(entry.pages)
            seq.num_computed = len(entry.tokens)
        seq.cache_at = cache.next_point(seq.prompt_token_ids, seq.num_computed)
        return seq.num_computed

    def plan_snapshots(self, chunks: list[ScheduledChunk]) -> None:
        """Before a step's batch is built: each caching point strictly inside a prefill chunk gets a slot
        of the cache's own, in which the step's Mamba layers leave the state after that point
        (StepBatch.state_snapshots), so that no chunk has to end there. A point already cached, or with
        no slot free, is passed over. cache_prefixes keeps them; drop_snapshots gives them back."""
        cache = self.prefix_cache
        if cache is None:
            return
        planned = 0
        for c in chunks:
            seq = c.seq
            if c.is_decode:
                continue
            end = seq.num_computed + c.num_tokens
            while seq.num_computed < seq.cache_at < end:
                point = seq.cache_at
                seq.cache_at = cache.next_point(seq.prompt_token_ids, point)
                if cache.contains(seq.prompt_token_ids[:point], seq.cache_salt, self._page_hashes(seq)):
                    continue
                self._make_room(planned)
                slot = self.state_pool.allocate() if len(cache) + planned < cache.max_entries else None
                if slot is None:
                    continue  # every slot is in use: not cached
                c.snapshots.append((point, slot))
                planned += 1

    def drop_snapshots(self, chunks: list[ScheduledChunk]) -> None:
        """The step of these chunks failed before cache_prefixes: give the planned snapshot slots back."""
        for c in chunks:
            for _, slot in c.snapshots:
                self.free(slot, [])
            c.snapshots = []

    def cache_prefixes(self, chunks: list[ScheduledChunk]) -> None:
        """Keep the prefixes of the caching points inside the step's prefill chunks (their snapshot
        slots, filled by the forward) and of those the chunks end at (a copy of the sequence's slot);
        called right after the forward, so each copy is queued behind the forward that computed it."""
        if self.prefix_cache is None:
            return
        for c in chunks:
            for point, slot in c.snapshots:
                if self.state_tokens is not None:
                    self.state_tokens[slot] = point
                self._insert(c.seq.prompt_token_ids[:point], slot, c.seq.pages[:point // self.page_size],
                             c.seq.cache_salt, self._page_hashes(c.seq))
            c.snapshots = []
            if c.seq.cache_at and not c.is_decode and c.seq.num_computed + c.num_tokens == c.seq.cache_at:
                self._cache_prefix(c.seq)

    def _cache_prefix(self, seq: Sequence) -> None:
        """Keep the prefix up to seq.cache_at: a copy of the slot and one more reference to its pages."""
        tokens = seq.prompt_token_ids[:seq.cache_at]
        cache = self.prefix_cache
        seq.cache_at = cache.next_point(seq.prompt_token_ids, seq.cache_at)
        if cache.contains(tokens, seq.cache_salt, self._page_hashes(seq)):
            return
        if self.state_tokens is not None and self.state_tokens.get(seq.slot, len(tokens)) != len(tokens):
            raise StateCorruptionError(
                f"{seq.label} would snapshot its Mamba slot {seq.slot} as the state after {len(tokens)} prompt "
                f"tokens, but that state has absorbed {self.state_tokens[seq.slot]}")
        self._make_room()
        slot = self.state_pool.allocate()
        if slot is None:
            return  # every slot runs a sequence: not cached
        self.state_pool.copy_slot(seq.slot, slot)
        self._copy_state_tokens(seq.slot, slot)
        self._insert(tokens, slot, seq.pages[:len(tokens) // self.page_size], seq.cache_salt, self._page_hashes(seq))

    def _page_hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of seq's whole prompt pages, computed on first use and kept on the sequence (its
        prompt and salt never change)."""
        if seq.prompt_page_hashes is None:
            prompt = seq.prompt_token_ids
            seq.prompt_page_hashes = self.prefix_cache.page_hashes(prompt, len(prompt) // self.page_size,
                                                                   seq.cache_salt)
        return seq.prompt_page_hashes

    def _make_room(self, pending: int = 0) -> None:
        """Evict least recently used prefixes until the cache has room for `pending` + 1 more entries
        (or is empty)."""
        cache = self.prefix_cache
        while len(cache) + pending >= cache.max_entries and self.evict_cached_prefix():
            pass

    def _insert(self, tokens: list[int], slot: int, pages: list[int], salt: str | None,
                hashes: list[int] | None = None) -> None:
        """A new cache entry: `slot` (the cache's now) holds the state after `tokens` (of a request salted
        `salt`; `hashes` as PrefixCache.insert's), whose KV pages get one more reference."""
        self.pages.share(pages)
        displaced = self.prefix_cache.insert(tokens, slot, pages, salt, hashes)
        if displaced is not None:  # a hash collision: the older prefix gives its slot and pages back
            self.free(displaced.slot, displaced.pages)
            self.stats["prefix_cache_evictions"] += 1

    def evict_cached_prefix(self) -> bool:
        """Drop the least recently used cached prefix (False: none). Freed at once even with steps in
        flight: its slot and pages were only read by copies and shares queued before this point, and
        whoever gets them next queues its work after."""
        entry = self.prefix_cache.pop_lru() if self.prefix_cache is not None else None
        if entry is None:
            return False
        self.free(entry.slot, entry.pages)
        self.stats["prefix_cache_evictions"] += 1
        return True

    def forget_prefixes_of(self, prompt: list[int], salt: str | None = None) -> None:
        """Drop the prefixes cached from a failed request's prompt: their state came from its steps."""
        if self.prefix_cache is not None:
            for entry in self.prefix_cache.remove_prefixes_of(prompt, salt):
                self.free(entry.slot, entry.pages)

    # ------------------------------------------------------------------ sanitizer
    def check_batch(self, batch: StepBatch, chunks: list[ScheduledChunk]) -> ExpectedInputs:
        """Raise StateCorruptionError if the batch would touch a slot or page its rows do not own (host
        copies only); return what its index tensors must hold as they run (checked on the device)."""
        self._check_snapshots(batch)
        return check_batch(batch, self.state_pool, self.pages, self.page_size,
                           row_owners(chunks, with_lengths=True, state_tokens=self.state_tokens), DUMMY_PAGE)

    def _check_snapshots(self, batch: StepBatch) -> None:
        """A snapshot slot must be one the cache took for it: live, no row's, no cached prefix's."""
        cached = {e.slot for e in self.prefix_cache.entries.values()} if self.prefix_cache is not None else set()
        rows = set(batch.state_slot_cpu)
        live = self.state_pool.allocator.live
        for row, snaps in batch.state_snapshots.items():
            for k, slot in snaps:
                if slot not in live or slot in rows or slot in cached:
                    raise StateCorruptionError(
                        f"row {row} would leave a prefix-cache snapshot (after {k} of its tokens) in Mamba slot "
                        f"{slot}, which is {'free' if slot not in live else 'in use'}")

    def state_nan(self, batch: StepBatch) -> torch.Tensor:
        """Per batch row: whether the Mamba state in the row's slot holds NaN now (in stream order:
        before or after the forward, depending on where it is queued). One NaN-propagating max over
        the pool per slot: a read of the pool, no copy of it."""
        pool = self.state_pool
        if pool.conv_state.shape[0] == 0:  # no Mamba layers
            return torch.zeros(batch.state_slot.shape[0], dtype=torch.bool, device=batch.state_slot.device)
        per_slot = pool.conv_state.amax(dim=(0, 2, 3)).isnan() | pool.ssm_state.amax(dim=(0, 2, 3, 4)).isnan()
        return per_slot[batch.state_slot.clamp(min=0)]
