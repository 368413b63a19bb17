"""The tiered expert store: disk -> RAM slots -> VRAM slots, driven by the router.

It satisfies the engine's ExpertSource protocol (engine/core/sources.py) structurally:
    acquire(layer, ids)  -> starts every missing read at once and returns at once; each expert is
                            waited for only when the MoE first touches it (``ready`` says whether it
                            would wait), so the shared expert and already-resident experts compute
                            while misses load; all are pinned
    release(layer, ids)  -> unpins them
    prefetch(layer, ids) -> reads predicted experts of the next layer into free or
                            evictable RAM slots; never blocks, never evicts anything in use
    lookahead(layers)    -> the coming layers a guess is for: see below
    offers()             -> its speed paths: max_acquire, resident + count_resident (no VRAM tier),
                            memory_of; see each below
Experts are materialised by a caller-supplied function over the slot bytes (storage knows bytes,
not maths). Reads run on a thread pool: one ``pread`` per expert straight into its slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch

from storage.container.reader import Container, ExpertReader
from storage.errors import BudgetError, CorruptDataError
from storage.files.buffers import aligned_empty
from storage.files.page_cache import Bypass, file_bypass
from storage.tiers.config import StoreConfig
from storage.tiers.device_copy import DeviceCopies
from storage.tiers.history import UsageHistory
from storage.tiers.policy import FrequentPolicy, ram_policy
from storage.tiers.read_queue import ReadQueue, ReadScheduler
from storage.tiers.spread_reads import SpreadReads
from storage.tiers.stats import DeviceStats, Key, RoutingCounts, StoreStats, TierView
from storage.tiers.tier import Entry, SlotTier
from storage.tiers.trace import TraceWriter

HUGE_PAGE = 2 << 20  # slot block alignment: lets the kernel back it with transparent huge pages

# slot bytes (numpy uint8 or torch uint8 tensor) -> expert: views of the slot, copying nothing. Built once
# per slot and kept for every record the slot holds (a read changes the bytes, not the views): at a low
# budget a decode step re-reads dozens of records, and building their typed views anew each time cost a
# noticeable share of a token (docs/benchmarks.md, "Figures behind the code").
Materialize = Callable[[Any], Any]


def slots_for(budget_bytes: int, record_bytes: int) -> int:
    return budget_bytes // record_bytes


def check_expert_files(container: Container) -> None:
    """Structure checks that cost no reads: every expert array's metadata, every record file's size.
    (Contents are checked by crc32c on first read.)"""
    size = container.layout.record_bytes
    for layer in container.moe_layers:
        container.check_expert_metadata(layer)
        for expert in range(container.n_experts):
            path = container.expert_path(layer, expert)
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise CorruptDataError(f"layer {layer} expert {expert}: chunk file {path} is missing") from None
            if actual != size:
                raise CorruptDataError(f"layer {layer} expert {expert}: {path} holds {actual} bytes, expected {size}")


def total_records(container: Container) -> int:
    return len(container.moe_layers) * container.n_experts


def minimum_slots(container: Container) -> int:
    """One token's routed experts (top-k): a step whose rows route to more distinct experts of a layer
    acquires them in chunks of what the RAM slots can pin at once (``TieredExpertStore.max_acquire``)."""
    return container.experts_per_token


def pinned_room(container: Container, n_slots: int) -> int:
    """RAM slots the ``pinned`` policy leaves unpinned: one layer's routed experts where the budget holds
    them (a prompt's union then fits in one acquire, and prefetch has room), else every slot."""
    return min(container.n_experts, n_slots)


@dataclass(frozen=True)
class StoreOffers:
    """The store's speed paths, as the engine's ``Offers`` declares them (engine/core/sources.py)."""

    max_acquire: int
    resident: TieredExpertStore | None  # None with a VRAM tier: it moves experts
    read_ahead: TieredExpertStore


class TieredExpertStore:
    def __init__(
        self,
        container: Container,
        config: StoreConfig,
        materialize: Materialize,
        history: UsageHistory | None = None,
        trace: TraceWriter | None = None,
        settle: Materialize | None = None,
    ):
        self.container = container
        self.config = config
        check_expert_files(container)
        self.materialize = materialize
        # what a RAM slot becomes once ``resident`` hands it out: such a slot keeps its record for the rest of the
        # run, so the engine may rearrange its bytes in place for its kernels (None: ``materialize``'s views)
        self.settle = settle
        self.record_bytes = container.layout.record_bytes
        self.history = history if history is not None else UsageHistory(container.n_experts)
        self.stats = StoreStats()
        self.routed = RoutingCounts(container.moe_layers, container.n_experts)
        self._stats_lock = threading.Lock()
        first = container.expert_path(container.moe_layers[0], 0)
        self._reader = ExpertReader(container, bypass=file_bypass(first) if config.direct else Bypass.NONE)
        # A spread container gets one queue per device (storage/tiers/spread_reads.py); a whole one the single
        # queue, read exactly as before. Either serves demand reads before queued prefetch guesses.
        self._spread: SpreadReads | None = None
        self._reads: ReadScheduler
        if container.parts is None:
            self._queue = ReadQueue(config.threads)
            self._reads = self._queue
        else:
            self._spread = SpreadReads(
                container, container.parts, config.threads, config.direct, on_read=self._counted_read
            )
            self._reads = self._spread
        self.ram = self._make_ram_tier()
        self.vram = self._make_vram_tier()
        self._predicted: dict[int, set[int]] = {}  # prefetch guesses per layer, for recall
        self._slot_experts: dict[tuple[bool, int], Any] = {}  # (VRAM?, slot) -> materialize(slot), built once
        self._settled: set[int] = set()  # RAM slots whose bytes ``settle`` rearranged
        self._resident: dict[int, tuple[Any, ...]] = {}  # layer -> resident()'s answer
        self._guess: tuple[int, set[int] | None] = (-1, None)  # the guess the layer being acquired is scored on
        self.trace = trace  # every acquire, streamed to a file (--trace); never accumulated here

    # ------------------------------------------------------------------------------ construction
    def _make_ram_tier(self) -> SlotTier:
        # More slots than records would never be used: a budget above the expert bytes holds them all.
        n_slots = min(slots_for(self.config.ram_bytes, self.record_bytes), total_records(self.container))
        floor = minimum_slots(self.container)
        if n_slots < floor:
            raise BudgetError(
                f"RAM budget {self.config.ram_bytes} B holds {n_slots} expert records of {self.record_bytes} B; "
                f"the minimum is {floor} (one token's routed experts) = {floor * self.record_bytes} B"
            )
        hot: list[tuple[int, int]] = []
        if self.config.policy == "pinned":  # pin the most-routed experts beyond the unpinned room
            hot = self.history.hottest(n_slots - pinned_room(self.container, n_slots))
        uses_per_token = len(self.container.moe_layers) * self.container.experts_per_token
        policy = ram_policy(self.config.policy, uses_per_token, self.config.half_life)
        self._ram_block = self._host_block(n_slots, prefault=not self.preloads(n_slots))
        return SlotTier("ram", n_slots, policy, hot=frozenset(hot))

    def preloads(self, n_slots: int | None = None) -> bool:
        """Whether ``preload`` reads every expert: asked for, and the RAM slots hold them all."""
        n_slots = self.ram.n_slots if n_slots is None else n_slots
        return self.config.preload and n_slots >= total_records(self.container)

    def _host_block(self, n_slots: int, prefault: bool) -> np.ndarray:
        """All RAM slots in one aligned allocation; pinned when it feeds a CUDA tier (async copies)."""
        if self.config.vram_bytes and self.config.vram_device.startswith("cuda") and torch.cuda.is_available():
            return torch.empty(n_slots * self.record_bytes, dtype=torch.uint8, pin_memory=True).numpy()
        block = aligned_empty(n_slots * self.record_bytes, HUGE_PAGE)
        if prefault:
            # Fault the budget in now, once: a first-touch fault inside every O_DIRECT read made cold reads
            # slower than the raw disk (docs/benchmarks.md, "Figures behind the code"); the memory is the
            # budget the user granted.
            block.fill(0)
        return block

    def _make_vram_tier(self) -> SlotTier | None:
        if not self.config.vram_bytes:
            return None
        n_slots = slots_for(self.config.vram_bytes, self.record_bytes)
        if n_slots < 1:
            raise BudgetError(f"VRAM budget {self.config.vram_bytes} B holds no {self.record_bytes} B expert record")
        self._vram_block = torch.empty((n_slots, self.record_bytes), dtype=torch.uint8, device=self.config.vram_device)
        self._copies = DeviceCopies(self._vram_block.device)
        return SlotTier("vram", n_slots, FrequentPolicy())

    def ram_slot(self, slot: int) -> np.ndarray:
        return self._ram_block[slot * self.record_bytes : (slot + 1) * self.record_bytes]

    # ---------------------------------------------------------------------------------- verbs
    def max_acquire(self) -> int:
        """How many experts of one layer may be pinned at once: the RAM slots the learned hot store does
        not hold for good. An acquired expert takes at most one RAM slot (a VRAM hit none, a VRAM miss is
        read through RAM), so VRAM never adds to this. Of the RAM slots, only hot experts and the current
        acquire's are never evicted (an in-flight prefetch is waited for), so a chunk this size always fits."""
        return self.ram.n_slots - len(self.ram.hot)

    def lookahead(self, layers: Sequence[int]) -> list[int]:
        """Of the coming layers (nearest first), those within ``prefetch_layers`` of the first a guess
        could start a read for (``_wants``)."""
        return [layer for layer in layers[: self.config.prefetch_layers] if self._wants(layer)]

    def _wants(self, layer: int) -> bool:
        """Whether a guess for ``layer`` could start a read: not when prefetch is off or every expert of
        the layer is already held (a budget that fits them all, once warm), so the model skips the
        guess's router run, a cost per layer and token (docs/benchmarks.md, "Figures behind the code")."""
        if not self.config.prefetch or len(self.ram.entries) >= total_records(self.container):
            return False  # (the second: every expert in RAM, without looking at each)
        return not all(self._held((layer, expert)) for expert in range(self.container.n_experts))

    def routed_sum(self) -> None:
        """None: the engine sums these experts itself (acquire / release)."""
        return None

    def offers(self) -> StoreOffers:
        """Chunked acquires, its RAM slots to read ahead, and, without a VRAM tier (which moves experts),
        the resident path."""
        return StoreOffers(self.max_acquire(), None if self.vram is not None else self, self)

    def _held(self, key: tuple[int, int]) -> bool:
        """In a RAM or VRAM slot (loaded or being loaded)."""
        return key in self.ram or (self.vram is not None and key in self.vram)

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        if not self.config.prefetch:
            return
        self._drop_guesses(layer, self._predicted.get(layer, set()) - set(expert_ids))  # a nearer guess replaces it
        self._predicted[layer] = set(expert_ids)
        for expert in expert_ids:
            key = (layer, expert)
            if self._held(key):
                continue
            entry = self.ram.allocate(key, demand=False)
            if entry is None:
                return  # full of experts in use or awaited: a guess never displaces them
            entry.prefetched = entry.awaited = True
            self._start_read(key, entry, demand=False)
            self._count(prefetch_issued=1)

    def preload(self, progress: Callable[[int], object] = lambda records: None) -> int:
        """Read every expert into its RAM slot now, when ``preloads()``; returns the records read (0
        otherwise). ``progress`` gets 1 as each read lands, in file order. The reads count in
        the store's stats before any turn, so a turn's own counters stay that turn's."""
        if not self.preloads():
            return 0
        keys = [(layer, expert) for layer in self.container.moe_layers for expert in range(self.container.n_experts)]
        keys = [key for key in keys if key not in self.ram]
        entries = []
        for key in keys:  # every read queued at once: the threads never wait for the caller
            entry = self.ram.allocate(key)  # a free slot: the tier holds every record
            assert entry is not None  # preloads() holds: a slot for every record
            self._start_read(key, entry)
            entries.append((key, entry))
        for key, entry in entries:
            self._land(key, entry)
            progress(1)
        return len(keys)

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> AcquiredExperts:
        self._record_routing(layer, expert_ids)
        predicted = self._predicted.pop(layer, None)
        if predicted is not None or layer != self._guess[0]:  # else: a further chunk of the same layer's step
            self._guess = (layer, predicted)
        # counted under the lock once per acquire, not per expert
        counts: dict[str, float] = {"requests": len(expert_ids)}
        if self._guess[1] is not None:
            counts.update(recall_hits=len(self._guess[1] & set(expert_ids)), recall_total=len(expert_ids))
        try:
            for expert in expert_ids:  # pin hits and start every miss before waiting on anything
                self._pin(layer, expert, counts)
        finally:
            self._count(**counts)
        if predicted:
            self._drop_guesses(layer, predicted - set(expert_ids))  # the router did not pick them
        return AcquiredExperts(self, layer, tuple(expert_ids))

    def release(self, layer: int, expert_ids: Sequence[int]) -> None:
        keys = [(layer, e) for e in expert_ids]
        if self.vram is not None:
            for key in keys:  # before the RAM unpin: a queued copy may still read the RAM slot
                entry = self.vram.entries.get(key)
                self._copies.release(key, None if entry is None else entry.slot)
            self.vram.unpin(keys)
        self.ram.unpin(keys)

    # ------------------------------------------------------------------------------- internals
    def _pin(self, layer: int, expert: int, counts: dict[str, float]) -> None:
        """Pin one expert (starting its read on a miss); its hit/miss goes into ``counts``."""
        key = (layer, expert)
        if self.vram is not None and (entry := self.vram.lookup(key)) is not None:
            entry.pins += 1
            counts["hits_vram"] = counts.get("hits_vram", 0) + 1
            return
        entry = self.ram.lookup(key)
        if entry is not None:
            counts["hits_ram"] = counts.get("hits_ram", 0) + 1
            if entry.reading:
                self._reads.promote(entry.loading)  # type: ignore[arg-type]  # reading: loading is set
            if entry.prefetched:
                entry.prefetched = entry.awaited = False
                counts["prefetch_useful"] = counts.get("prefetch_useful", 0) + 1
        else:
            entry = self._allocate_ram(key)
            self._start_read(key, entry)
            counts["misses"] = counts.get("misses", 0) + 1
        entry.pins += 1

    def _drop_guesses(self, layer: int, experts: set[int]) -> None:
        """Cancel the prefetches of these experts whose reads have not started: on a busy disk a wrong
        guess would take the place of a needed read. Their slots are freed; started reads land and are
        no longer awaited (the router has passed them by: they leave as any other expert would)."""
        for expert in experts:
            entry = self.ram.entries.get((layer, expert))
            if entry is None or not entry.prefetched:
                continue
            entry.awaited = False
            if entry.pins or not entry.reading:
                continue
            if self._reads.cancel(entry.loading):  # type: ignore[arg-type]  # reading: loading is set
                entry.prefetched = False  # not read: not a wasted read either
                self.ram.remove((layer, expert))
                self._count(prefetch_cancelled=1)

    def _allocate_ram(self, key: tuple[int, int]) -> Entry:
        while (entry := self.ram.allocate(key)) is None:
            in_flight = self.ram.loading()
            if not in_flight:
                raise BudgetError(
                    f"RAM tier full: {self.ram.n_slots} slots are all in use by this step; raise the RAM budget"
                )
            reading = in_flight[0].loading  # a prefetch still reading: let it land, then evict it
            assert reading is not None  # SlotTier.loading() lists entries whose read is under way
            self._reads.promote(reading)
            self._wait(reading)
        return entry

    def _start_read(self, key: tuple[int, int], entry: Entry, demand: bool = True) -> None:
        slot = self.ram_slot(entry.slot)
        if entry.slot in self._settled:  # a record read over settled bytes (not while resident() holds): views anew
            self._settled.discard(entry.slot)
            self._slot_experts.pop((False, entry.slot), None)
        if self._spread is not None:
            entry.loading = self._spread.submit(key, slot, demand)
            return
        entry.loading = self._queue.submit(lambda: self._read(key, slot), demand)

    def _read(self, key: tuple[int, int], slot: np.ndarray) -> None:
        start = time.perf_counter()
        self._reader.read_into(key[0], key[1], slot)
        self._count(io_service_s=time.perf_counter() - start, expert_bytes_read=self.record_bytes, reads=1)

    def _counted_read(self, seconds: float) -> None:
        self._count(io_service_s=seconds, expert_bytes_read=self.record_bytes, reads=1)

    def _wait(self, future: Future[None]) -> None:
        if future.done():
            future.result()
            return
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self._count(io_wait_s=time.perf_counter() - start)

    def loaded(self, layer: int, expert: int) -> bool:
        """Whether a pinned key's bytes are in memory (``expert`` would not wait for a read)."""
        key = (layer, expert)
        if self.vram is not None and key in self.vram.entries:
            return True
        return not self.ram.entries[key].reading

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> list[np.ndarray]:
        """The RAM slots of those of these experts that are read and in RAM now, not pinned: what a
        read-ahead into the CPU caches may touch. A slot may be reused later; its memory stays the store's."""
        slots = []
        for expert in expert_ids:
            entry = self.ram.entries.get((layer, expert))
            if entry is not None and not entry.reading:
                slots.append(self.ram_slot(entry.slot))
        return slots

    def resident(self, layer: int) -> tuple[Any, ...] | None:
        """Every expert of ``layer`` by id, when the RAM slots hold every record, all read, and there is no
        VRAM tier: nothing is evicted then (every key has its slot, so nothing is allocated again) and no
        slot is rewritten. Built once per layer, the same tuple after (``settle``'s experts, where given).
        None otherwise."""
        if self.vram is not None or len(self.ram.entries) < total_records(self.container):
            return None
        held = self._resident.get(layer)
        if held is None and layer in self.container.moe_layers:
            entries = [self.ram.entries[(layer, e)] for e in range(self.container.n_experts)]
            if any(entry.reading for entry in entries):
                return None
            for expert, entry in enumerate(entries):
                self._land((layer, expert), entry)  # observed complete (a failed read raises here, as expert() does)
            held = self._resident[layer] = tuple(self._settled_expert(entry) for entry in entries)
        return held

    def _settled_expert(self, entry: Entry) -> Any:
        """A resident slot's expert: ``settle``'s (which may rearrange the slot's bytes: every later use of the
        slot gets this one), else the slot's materialised one."""
        if self.settle is None:
            return self._materialized(entry, False)
        if entry.slot not in self._settled:
            self._slot_experts[(False, entry.slot)] = self.settle(self.ram_slot(entry.slot))
            self._settled.add(entry.slot)
        return self._slot_experts[(False, entry.slot)]

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """A step's experts used from ``resident`` without acquire, counted as ``acquire`` counts RAM hits:
        requests, hits, routing counts, usage history and trace."""
        requests = 0
        for layer, expert_ids in used.items():
            self._record_routing(layer, expert_ids)
            requests += len(expert_ids)
        self._count(requests=requests, hits_ram=requests)

    def _record_routing(self, layer: int, expert_ids: Sequence[int]) -> None:
        """What the router chose, into the usage history, the routing counts and the trace."""
        self.history.record(layer, expert_ids)
        self.routed.record(layer, expert_ids)
        if self.trace is not None:
            self.trace.write(layer, expert_ids)

    def expert(self, layer: int, expert: int) -> Any:
        """The materialised expert of a pinned key, waiting for its read if needed."""
        key = (layer, expert)
        if self.vram is not None and (entry := self.vram.entries.get(key)) is not None:
            return self._materialized(entry, True)
        entry = self.ram.entries[key]
        self._land(key, entry)
        if self.vram is not None:
            return self._copy_up(key, entry)
        return self._materialized(entry, False)

    def _land(self, key: tuple[int, int], entry: Entry) -> None:
        """Wait for a RAM entry's read, if one is under way; a failed read frees the slot (it holds
        garbage; a later acquire reads the expert again) and raises."""
        if entry.loading is None:
            return
        try:
            self._wait(entry.loading)
        except BaseException:
            self.ram.remove(key)
            raise
        entry.loading = None

    def _copy_up(self, key: tuple[int, int], ram_entry: Entry) -> Any:
        assert self.vram is not None  # called only with a VRAM tier
        vram_entry = self.vram.allocate(key)
        if vram_entry is None:  # VRAM full of experts in use: compute from RAM this time
            return self._materialized(ram_entry, False)
        vram_entry.pins = 1
        target = self._vram_block[vram_entry.slot]
        self._copies.copy(key, vram_entry.slot, target, torch.from_numpy(self.ram_slot(ram_entry.slot)))
        return self._materialized(vram_entry, True)

    def _materialized(self, entry: Entry, vram: bool) -> Any:
        key = (vram, entry.slot)
        if key not in self._slot_experts:
            data = self._vram_block[entry.slot] if vram else self.ram_slot(entry.slot)
            self._slot_experts[key] = self.materialize(data)
        return self._slot_experts[key]

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            self.stats.add(**deltas)

    # ------------------------------------------------------------------------------- lifecycle
    def snapshot(self) -> StoreStats:
        """A copy of the counters now; ``store.snapshot().minus(earlier)`` is a phase's own counts."""
        with self._stats_lock:
            self.stats.prefetch_wasted = self.ram.evicted_unused_prefetches
            return replace(self.stats)

    def tiers(self) -> list[TierView]:
        """The RAM tier and, with a VRAM budget, the VRAM tier as they are now. Safe from another thread:
        each tier's entries are copied in one step (atomic under the GIL), so a view may be a step old,
        never torn."""
        views = [self._view(self.ram, self.config.ram_bytes)]
        if self.vram is not None:
            views.append(self._view(self.vram, self.config.vram_bytes))
        return views

    def _view(self, tier: SlotTier, budget_bytes: int) -> TierView:
        # this store's tiers are keyed (layer, expert); SlotTier itself takes any hashable key
        resident = cast(frozenset[Key], frozenset(tier.entries.copy()))
        return TierView(
            tier.name, tier.n_slots, self.record_bytes, budget_bytes, resident, cast(frozenset[Key], tier.hot)
        )

    def report(self) -> dict[str, Any]:
        report = {
            **self.snapshot().as_dict(),
            "store": "tiered",
            "page_cache_bypass": self.bypass.value,
            "direct_io": self.bypass is not Bypass.NONE,
            "ram_slots": self.ram.n_slots,
        }
        if self._spread is not None:
            report["devices"] = [device.as_dict() for device in self.device_stats()]
        return report

    @property
    def bypass(self) -> Bypass:
        """How expert reads pass the page cache (storage/files/page_cache.py); a spread container's devices
        all, or none."""
        return self._reader.bypass if self._spread is None else self._spread.bypass

    def device_stats(self) -> tuple[DeviceStats, ...]:
        """Per device of a spread container, since the store opened (empty for a whole one)."""
        return () if self._spread is None else self._spread.stats()

    def end_turn(self) -> None:
        """Persist the usage history (atomically) and flush the trace after a turn; neither fails the turn on a
        full disk (each warns)."""
        if self.trace is not None:
            self.trace.flush()
        if self.config.history_path is not None:
            self.history.save_or_warn(self.config.history_path)  # an optimisation: a full disk only warns

    def close(self) -> None:
        self._reads.shutdown()
        if self.trace is not None:
            self.trace.close()


class AcquiredExperts(Mapping[int, Any]):
    """The experts of one acquire; indexing waits for that expert's read only."""

    def __init__(self, store: TieredExpertStore, layer: int, expert_ids: tuple[int, ...]):
        self._store, self._layer, self._ids = store, layer, expert_ids

    def __getitem__(self, expert: int) -> Any:
        if expert not in self._ids:
            raise KeyError(expert)
        return self._store.expert(self._layer, expert)

    def ready(self, expert: int) -> bool:
        """Whether indexing ``expert`` returns without waiting for its read."""
        if expert not in self._ids:
            raise KeyError(expert)
        return self._store.loaded(self._layer, expert)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)
