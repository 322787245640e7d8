"""A replayable model of PyTorch's CUDA caching allocator (the "native" backend of torch 2.13), in pure Python.

Given the tensor allocations and frees of one training step, `replay` runs them through a model of
`DeviceCachingAllocator` and returns what `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` would report
after `reset_peak_memory_stats()` on an empty cache, plus segment and device-call counts. No GPU and no torch needed.

Where the rules come from (cited at each rule):
  * "CCA.cpp:N" -- c10/cuda/CUDACachingAllocator.cpp of pytorch/pytorch at commit
    b944315b93d36f842ef94d67a041371993234a74, the newest version of that file the source index holds (it already has
    the AcceleratorAllocatorConfig / CachingDeviceAllocator split of torch >= 2.10). N are line numbers counted on
    that stored text (counted by hand, so they may be off by a line or two); function names are exact.
  * "AllocatorConfig.h:N" -- include/c10/core/AllocatorConfig.h shipped in the installed torch 2.13.0 wheel (git
    cf30153c4c131c8164ee7798e5022d810682e2cb): the exact 2.13 text. Option bounds were also confirmed by running
    2.13's parser (torch._C._accelerator_setAllocatorSettings) on this CPU build.
  * "AllocatorConfig.cpp" -- c10/core/AllocatorConfig.cpp (ConfigTokenizer-era version stored in the index).

2.13 differences from the commit read: 2.13 adds the option `large_segment_size_mb` (AllocatorConfig.h:174-176,
340: default 20 MiB == kLargeBuffer); CCA.cpp at b944315b still uses the constant kLargeBuffer for the 1-10 MiB
segment (get_allocation_size, CCA.cpp:2997-3005) and the large expandable page (CCA.cpp:2728). We assume 2.13 uses
large_segment_size in both places; with the default setting both readings give the same numbers.

Modelled: one device, one stream, the default (non-graph) pools. Not modelled: CUDA graphs and private pools,
cross-stream events (record_stream), IPC, garbage_collection_threshold, set_per_process_memory_fraction, and the
free-memory callbacks. `capacity_bytes` stands for the device memory cudaMalloc / cuMemCreate can still take.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

# --- constants (bytes) ----------------------------------------------------------------------------------------
kMinBlockSize = 512  # bytes; every request rounds up to a multiple of this. AllocatorConfig.h:19
kSmallSize = 1_048_576  # bytes (1 MiB); requests up to this use the small pool. AllocatorConfig.h:21
kSmallBuffer = 2_097_152  # bytes (2 MiB); small-pool segment, and small-pool expandable page. AllocatorConfig.h:17
kMinLargeAlloc = 10_485_760  # bytes (10 MiB); large requests below this get a kLargeBuffer segment. AllocatorConfig.h:23
kRoundLarge = 2_097_152  # bytes (2 MiB); larger requests round their segment up to this. AllocatorConfig.h:25
kLargeBuffer = 20_971_520  # bytes (20 MiB); default large_segment_size_ (AllocatorConfig.h:340), and default
#                            max_non_split_rounding (AllocatorConfig.cpp parseMaxNonSplitRoundingSize minimum).
kMB = 1_048_576  # bytes per "_mb" unit of PYTORCH_CUDA_ALLOC_CONF. AllocatorConfig.cpp anonymous namespace
kRoundUpPowerOfTwoIntervals = 16  # roundup_power2_divisions table: one entry per power of 2 from 1 MiB to 64 GiB
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): max_split_size when unset. AllocatorConfig.h:342
_KEY_SHIFT = 64  # free-list key = size << 64 | address, i.e. BlockComparatorSize order (CCA.cpp:844-852)
_DEFAULT_DEVICE_BYTES = 1 << 40  # device size used for the expandable address space when capacity_bytes is None
_ADDRESS_BASE = 1 << 32  # first synthetic device address

# Keys torch 2.13 accepts that this model does not use (accepted and ignored by AllocatorSettings.from_env).
_IGNORED_KEYS = frozenset({
    "garbage_collection_threshold", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "graph_capture_record_stream_reuse", "per_process_memory_fraction",
})

# --- settings and results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocatorSettings:
    """The PYTORCH_CUDA_ALLOC_CONF knobs the model honours, plus the device capacity. Sizes in bytes."""

    max_split_size: int | None = None  # "max_split_size_mb"; None = unlimited (SIZE_MAX)
    expandable_segments: bool = False  # "expandable_segments"
    capacity_bytes: int | None = None  # device bytes the allocator may reserve; None = unlimited
    max_non_split_rounding_size: int = kLargeBuffer  # "max_non_split_rounding_mb"
    roundup_power2_divisions: tuple[int, ...] = ()  # 16 entries (1 MiB .. 64 GiB intervals), or () = off
    large_segment_size: int = kLargeBuffer  # "large_segment_size_mb" (torch 2.13)

    def __post_init__(self) -> None:
        # Bounds as torch 2.13 enforces them (AllocatorConfig.cpp parseMaxSplitSize / parseMaxNonSplitRoundingSize:
        # ">= kLargeBuffer / kMB" MiB; large_segment_size_mb "must be > 10 MB", from 2.13's parser).
        if self.max_split_size is not None and self.max_split_size < kLargeBuffer:
            raise ValueError(f"max_split_size must be >= {kLargeBuffer} bytes (20 MiB)")
        if self.max_non_split_rounding_size < kLargeBuffer:
            raise ValueError(f"max_non_split_rounding_size must be >= {kLargeBuffer} bytes (20 MiB)")
        if self.large_segment_size <= kMinLargeAlloc:
            raise ValueError("large_segment_size must be > 10 MiB")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if len(self.roundup_power2_divisions) not in (0, kRoundUpPowerOfTwoIntervals):
            raise ValueError(f"roundup_power2_divisions needs {kRoundUpPowerOfTwoIntervals} entries or none")

    @classmethod
    def from_env(cls, text: str, capacity_bytes: int | None = None) -> AllocatorSettings:
        """Parse a PYTORCH_CUDA_ALLOC_CONF string, e.g. "expandable_segments:True,max_split_size_mb:512"."""
        values: dict = {"capacity_bytes": capacity_bytes}
        for key, value in _parse_pairs(_tokenize(text)):
            if key == "max_split_size_mb":
                values["max_split_size"] = _to_int(key, value) * kMB
            elif key == "max_non_split_rounding_mb":
                values["max_non_split_rounding_size"] = _to_int(key, value) * kMB
            elif key == "large_segment_size_mb":
                values["large_segment_size"] = _to_int(key, value) * kMB
            elif key == "expandable_segments":
                values["expandable_segments"] = _to_bool(key, value)
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = _parse_roundup(value)
            elif key == "backend":
                if value != "native":
                    raise ValueError(f"backend:{value} is not the native caching allocator this module models")
            elif key not in _IGNORED_KEYS:
                raise ValueError(f"unrecognized allocator option {key!r}")
        return cls(**values)


@dataclass(frozen=True)
class AllocatorStats:
    """Result of a replay. Byte counts are what torch's allocator statistics would show."""

    peak_allocated: int  # max_memory_allocated(): sum of in-use *block* sizes (rounded, unsplit remainders included)
    peak_requested: int  # memory_stats()["requested_bytes.all.peak"]: sum of in-use requests as asked (CCA.cpp:1655)
    peak_reserved: int  # max_memory_reserved(): cudaMalloc'd segments, or mapped pages of expandable segments
    segments: int  # peak number of live segments (cudaMalloc'd segments; ExpandableSegments in expandable mode)
    cuda_mallocs: int  # num_device_alloc: cudaMalloc calls (classic) or page-range maps (expandable)
    cuda_frees: int  # num_device_free: cudaFree calls (classic) or page-range unmaps (expandable)
    alloc_retries: int  # num_alloc_retries: allocations that had to free every cached segment and retry
    oom: bool  # an allocation failed even after freeing the cache (torch raises OutOfMemoryError)
    oom_event: int | None  # index of the failing event; the replay stops there
    final_allocated: int  # allocated bytes after the last event
    final_reserved: int  # reserved bytes after the last event
    allocations: int  # non-empty allocations served
    unknown_frees: int  # frees of keys that were not live (ignored)

    @property
    def rounding(self) -> int:
        """What max_memory_allocated counts beyond the bytes requested: alloc_found_block adds the whole block's size
        to allocated_bytes and the request's to requested_bytes (CCA.cpp:1653-1655), so each request's rounding to
        512 B and, where should_split keeps a block whole, its remainder (in the large pool up to kSmallSize, 1 MiB:
        a 10.5 MiB request splits its 12 MiB segment, an 11.5 MiB one takes all 12) are allocated bytes no tensor
        holds. Both are peaks of their own; allocated >= requested at every moment, so the difference is >= 0."""
        return self.peak_allocated - self.peak_requested


# --- size rules -------------------------------------------------------------------------------------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round size up to the next of `divisions` equal steps between powers of two (CCA.cpp:2473-2491)."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)  # >> (63 - countLeadingZeros(divisions))
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


def round_size(size: int, divisions: tuple[int, ...] = ()) -> int:
    """DeviceCachingAllocator::round_size (CCA.cpp:2493-2505): 512 B multiples, or power-of-2 divisions if set."""
    if size < kMinBlockSize:
        return kMinBlockSize
    if divisions:
        # AcceleratorAllocatorConfig::roundup_power2_divisions(size) (AllocatorConfig.cpp): interval index is
        # log2(size) - log2(1 MiB), clamped to [0, 15].
        index = min(max(size.bit_length() - 1 - 20, 0), kRoundUpPowerOfTwoIntervals - 1)
        div = divisions[index]
        if div > 1 and size > kMinBlockSize * div:  # CCA.cpp:2499
            return roundup_power2_next_division(size, div)
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int, large_segment_size: int = kLargeBuffer) -> int:
    """Size of a new segment for a rounded request (get_allocation_size, CCA.cpp:2997-3005)."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment_size  # kLargeBuffer at b944315b; large_segment_size() in 2.13 (see module doc)
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


# --- allocator state --------------------------------------------------------------------------------------------
class _Segment:
    """One cudaMalloc'd segment (page == 0) or one ExpandableSegment's address range (page = mapping unit)."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, size: int, page: int) -> None:
        self.base, self.size, self.page = base, size, page


class _Block:
    """struct Block (CCA.cpp:185): a piece of a segment, linked to its address neighbours."""

    __slots__ = ("addr", "allocated", "mapped", "next", "pool", "prev", "requested", "segment", "size")

    def __init__(self, addr: int, size: int, pool: _Pool, segment: _Segment, mapped: bool = True) -> None:
        self.addr, self.size, self.pool, self.segment, self.mapped = addr, size, pool, segment, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0  # Block::requested_size: the request's own bytes while allocated


class _Pool:
    """struct BlockPool: free mapped blocks ordered by (size, address); unmapped blocks ordered by address."""

    __slots__ = ("blocks", "keys", "small", "unmapped", "unmapped_addrs")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []  # sorted size << 64 | address
        self.blocks: dict[int, _Block] = {}
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, _Block] = {}

    def insert(self, block: _Block) -> None:
        key = block.size << _KEY_SHIFT | block.addr
        insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = block.size << _KEY_SHIFT | block.addr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def insert_unmapped(self, block: _Block) -> None:
        insort(self.unmapped_addrs, block.addr)
        self.unmapped[block.addr] = block

    def remove_unmapped(self, block: _Block) -> None:
        del self.unmapped_addrs[bisect_left(self.unmapped_addrs, block.addr)]
        del self.unmapped[block.addr]


def _splice(block: _Block, before: _Block | None, after: _Block | None) -> None:
    """Block::splice: link block between before and after."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after


def _allocatable(block: _Block | None) -> bool:
    """find_expandable_block's `allocatable` (CCA.cpp:2702-2705), with no cross-stream uses."""
    return block is not None and not block.allocated


def _expandable_size(block: _Block) -> int:
    """get_free_block's `expandable_size` (CCA.cpp:3027-3029): size plus the unmapped room right after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class _Allocator:
    """DeviceCachingAllocator for one device and one stream (CCA.cpp:1159)."""

    def __init__(self, settings: AllocatorSettings) -> None:
        self.max_split = SIZE_MAX if settings.max_split_size is None else settings.max_split_size
        self.rounding = settings.max_non_split_rounding_size
        self.expandable = settings.expandable_segments
        self.capacity = settings.capacity_bytes
        self.divisions = settings.roundup_power2_divisions
        self.large_segment_size = settings.large_segment_size
        self.device_total = _DEFAULT_DEVICE_BYTES if settings.capacity_bytes is None else settings.capacity_bytes
        self.small, self.large = _Pool(True), _Pool(False)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.requested = self.peak_requested = 0
        self.segments = self.peak_segments = 0
        self.device_allocs = self.device_frees = self.retries = 0
        self._next_address = _ADDRESS_BASE

    # -- malloc ---------------------------------------------------------------------------------------------------
    def malloc(self, orig_size: int) -> _Block | None:
        """DeviceCachingAllocator::malloc (CCA.cpp:1361-1576); None when the request runs out of memory."""
        size = round_size(orig_size, self.divisions)  # CCA.cpp:1386
        pool = self.small if size <= kSmallSize else self.large  # get_pool, CCA.cpp:1387, 2954-2976
        block = self._get_free_block(pool, size)  # CCA.cpp:1393-1397
        if block is None:
            block = self._alloc_with_retries(pool, size)
            if block is None:
                return None  # CCA.cpp:1450-1571: OutOfMemoryError
        return self._alloc_found_block(pool, block, size, orig_size)

    def _alloc_with_retries(self, pool: _Pool, size: int) -> _Block | None:
        """The retry chain of malloc (CCA.cpp:1413-1421): new segment; else free oversize cached blocks and retry;
        else free every unused cached segment (release_cached_blocks) and retry."""
        alloc_size = get_allocation_size(size, self.large_segment_size)  # CCA.cpp:1388
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self._release_cached_blocks()
            self.retries += 1  # alloc_block(isRetry=true) counts num_alloc_retries, CCA.cpp:3151-3153
            block = self._alloc_block(pool, size, alloc_size)
        return block

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block (CCA.cpp:3007-3065): best fit = smallest cached block >= size, lowest address on ties."""
        keys = pool.keys
        i = bisect_left(keys, size << _KEY_SHIFT)  # pool.blocks.lower_bound(&search_key), CCA.cpp:3016
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.segment.page:  # expandable block: compare by the size it can grow to, CCA.cpp:3020-3036
            i, block = self._expandable_best_fit(pool, i, block)
        # "Do not return an oversized block for a large request", CCA.cpp:3053-3056
        if size < self.max_split and block.size >= self.max_split:
            return None
        # "Allow oversized block size to be rounded up but within a limit", CCA.cpp:3057-3062
        if size >= self.max_split and block.size >= size + self.rounding:
            return None
        del pool.blocks[keys[i]]
        del keys[i]
        return block

    @staticmethod
    def _expandable_best_fit(pool: _Pool, i: int, block: _Block) -> tuple[int, _Block]:
        """Move to a bigger free block while its expandable_size is smaller (CCA.cpp:3030-3036)."""
        keys, blocks = pool.keys, pool.blocks
        grow = _expandable_size(block)
        j = i + 1
        while block.segment.page and j < len(keys):
            candidate = blocks[keys[j]]
            candidate_grow = _expandable_size(candidate)
            if candidate_grow >= grow:
                break
            i, block, grow = j, candidate, candidate_grow
            j += 1
        return i, block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """alloc_block (CCA.cpp:3140-3253): a new cudaMalloc segment of alloc_size, or expandable pages for size."""
        if self.expandable:
            return self._try_allocate_expandable_block(pool, size)  # p.size(), not alloc_size: CCA.cpp:3167-3184
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaMalloc returns cudaErrorMemoryAllocation, CCA.cpp:3200-3216
        segment = _Segment(self._new_address(alloc_size), alloc_size, 0)
        block = _Block(segment.base, alloc_size, pool, segment)
        self.device_allocs += 1  # CCA.cpp:3242
        self.segments += 1  # stats.segment, CCA.cpp:3229
        self.peak_segments = max(self.peak_segments, self.segments)
        self._grow_reserved(alloc_size)  # stats.reserved_bytes, CCA.cpp:3230
        return block

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, orig_size: int) -> _Block:
        """alloc_found_block (CCA.cpp:1578-1675): split off the remainder if should_split, then count the block."""
        if self._should_split(block, size):  # CCA.cpp:1573
            remaining = block
            block = _Block(remaining.addr, size, pool, remaining.segment)  # CCA.cpp:1595-1611
            _splice(block, remaining.prev, remaining)
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = orig_size  # block->requested_size = orig_size
        self.allocated += block.size  # allocated_bytes grows by the block size, CCA.cpp:1653
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.requested += orig_size  # requested_bytes by the request's, CCA.cpp:1655
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """should_split (CCA.cpp:2987-2995)."""
        remaining = block.size - size
        if block.pool.small or self.expandable:
            return remaining >= kMinBlockSize
        return size < self.max_split and remaining > kSmallSize

    # -- free -----------------------------------------------------------------------------------------------------
    def free(self, block: _Block) -> None:
        """DeviceCachingAllocator::free (CCA.cpp:1895-1958) without stream uses: free_block at once."""
        block.allocated = False
        self.allocated -= block.size  # CCA.cpp:1910
        self.requested -= block.requested
        block.requested = 0
        self._free_block(block)

    def _free_block(self, block: _Block) -> None:
        """free_block (CCA.cpp:2843-2917): merge with free neighbours of the segment, return to the pool."""
        pool = block.pool
        prev, nxt = block.prev, block.next  # merge_candidates, CCA.cpp:2867
        self._try_merge(block, prev, pool)
        self._try_merge(block, nxt, pool)
        pool.insert(block)

    @staticmethod
    def _try_merge(dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks (CCA.cpp:2921-2952): dst absorbs src when src is free and equally (un)mapped."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- expandable segments --------------------------------------------------------------------------------------
    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block (CCA.cpp:2809-2840): map pages until one free block covers size."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # invariant: free -> unmapped -> *, CCA.cpp:2827-2837
            nxt = candidate.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the old candidate into nxt
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block (CCA.cpp:2695-2738): lowest address with enough free + unmapped room, else a new
        ExpandableSegment whose address space covers 1 1/8 of the device (CCA.cpp:373-376)."""
        for addr in pool.unmapped_addrs:
            start = pool.unmapped[addr]
            if _allocatable(start.prev):  # CCA.cpp:2721-2723
                start = start.prev
            room, block = 0, start
            while room < size and _allocatable(block):  # has_available_address_space, CCA.cpp:2706-2713
                room += block.size
                block = block.next
            if room >= size:
                return start
        page = kSmallBuffer if pool.small else self.large_segment_size  # CCA.cpp:2728
        handles = -(-(self.device_total + self.device_total // 8) // page)  # numSegments(total * 9/8)
        segment = _Segment(self._new_address(handles * page), handles * page, page)
        candidate = _Block(segment.base, segment.size, pool, segment, mapped=False)
        pool.insert_unmapped(candidate)
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """map_block (CCA.cpp:2740-2807): back whole pages of [addr, addr + size) with memory (ExpandableSegment::map,
        CCA.cpp:390-472); reserved grows by the pages mapped. Fails (maps nothing) if the pages do not fit."""
        segment, pool = to_map.segment, to_map.pool
        offset = to_map.addr - segment.base
        begin, end = offset // segment.page, -(-(offset + size) // segment.page)  # segmentLeft / segmentRight
        mapped = (end - begin) * segment.page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate out of memory: map returns an empty range
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, pool, segment, mapped=False)
            _splice(rest, to_map, to_map.next)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev, pool)
        self._try_merge(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.device_allocs += 1  # CCA.cpp:2793
        self._grow_reserved(mapped)  # CCA.cpp:2785
        return True

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block (CCA.cpp:3414-3483): unmap the whole pages inside a free block (ExpandableSegment::unmap,
        CCA.cpp:477-486); the partial pages at either end stay mapped as free blocks."""
        segment, pool = block.segment, block.pool
        offset = block.addr - segment.base
        begin, end = -(-offset // segment.page), (offset + block.size) // segment.page
        if begin >= end:
            return
        pool.remove(block)
        start, stop = segment.base + begin * segment.page, segment.base + end * segment.page
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, pool, segment)
            _splice(before, block.prev, block)
            pool.insert(before)
        if stop < block.addr + block.size:
            after = _Block(stop, block.addr + block.size - stop, pool, segment)
            _splice(after, block, block.next)
            pool.insert(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        self.reserved -= stop - start  # CCA.cpp:3457-3461
        self.device_frees += 1  # CCA.cpp:3475

    # -- releasing cached memory ----------------------------------------------------------------------------------
    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks (CCA.cpp:3258-3304): only with max_split_size set; free the smallest
        cached oversize block >= max(size, max_split_size), else oversize blocks from the largest down."""
        if self.max_split == SIZE_MAX:
            return False
        target = max(size, self.max_split)  # CCA.cpp:3269-3271
        keys, blocks = pool.keys, pool.blocks
        i = bisect_left(keys, target << _KEY_SHIFT)
        if i < len(keys) and not blocks[keys[i]].segment.page:
            self._release_block(blocks[keys[i]])
            return True
        released = 0
        i -= 1  # back up to the largest block below the target
        while i >= 0 and released < target:
            block = blocks[keys[i]]
            if block.size < self.max_split:
                break
            i -= 1
            if not block.segment.page:
                released += block.size
                self._release_block(block)
        return released >= target

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks (CCA.cpp:3306-3349) for the default pools: large first, then small."""
        self._release_blocks(self.large)  # CCA.cpp:3318-3319
        self._release_blocks(self.small)

    def _release_blocks(self, pool: _Pool) -> None:
        """release_blocks (CCA.cpp:3485-3509): cudaFree every unsplit free segment; unmap free expandable pages."""
        to_unmap = []
        for key in list(pool.keys):
            block = pool.blocks[key]
            if block.segment.page:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if not block.mapped and block.prev is None and block.next is None:
                pool.remove_unmapped(block)  # release_expandable_segment, CCA.cpp:3351-3365
                self.segments -= 1

    def _release_block(self, block: _Block) -> None:
        """release_block (CCA.cpp:3367-3412): cudaFree a whole cached segment."""
        block.pool.remove(block)
        self.reserved -= block.size  # CCA.cpp:3400
        self.segments -= 1
        self.device_frees += 1  # CCA.cpp:3371

    # -- bookkeeping ----------------------------------------------------------------------------------------------
    def _grow_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _new_address(self, size: int) -> int:
        """Synthetic device addresses: increasing, 2 MiB aligned, never reused. Real cudaMalloc addresses are the
        driver's choice; they only matter for best-fit ties between equal-size blocks."""
        address = self._next_address
        self._next_address += kRoundLarge * (-(-size // kRoundLarge) + 1)
        return address


# --- replay -----------------------------------------------------------------------------------------------------
def iter_events(events: Iterable) -> Iterator[tuple[str, Hashable, int]]:
    """(op, key, size) tuples, or the compact form: an int n >= 0 allocates n bytes (its key is its ordinal among
    the allocations: 0, 1, 2, ...); an int n < 0 frees the allocation with ordinal -n - 1."""
    iterator = iter(events)
    first = next(iterator, None)
    if first is None:
        return
    rest = chain((first,), iterator)
    if not isinstance(first, int):
        yield from rest
        return
    ordinal = 0
    for value in rest:
        if value >= 0:
            yield ("alloc", ordinal, value)
            ordinal += 1
        else:
            yield ("free", -value - 1, 0)


def _run(events: Iterable, settings: AllocatorSettings) -> tuple[_Allocator, dict, int | None, int, int]:
    """Replay events; returns (allocator, live blocks by key, OOM event index, unknown frees, allocations)."""
    sim = _Allocator(settings)
    live: dict[Hashable, _Block | None] = {}
    unknown = allocations = 0
    for index, (op, key, size) in enumerate(iter_events(events)):
        if op == "alloc":
            if key in live:
                raise ValueError(f"event {index}: key {key!r} is already allocated")
            size = int(size)
            if size < 0:
                raise ValueError(f"event {index}: negative size {size}")
            if size == 0:  # raw_alloc / allocate of 0 bytes return nullptr without touching the allocator
                live[key] = None
                continue
            block = sim.malloc(size)
            if block is None:
                return sim, live, index, unknown, allocations
            live[key] = block
            allocations += 1
        elif op == "free":
            block = live.pop(key, False)
            if block is False:
                unknown += 1
            elif block is not None:
                sim.free(block)
        else:
            raise ValueError(f"event {index}: op must be 'alloc' or 'free', got {op!r}")
    return sim, live, None, unknown, allocations


def replay(events: Iterable, settings: AllocatorSettings = AllocatorSettings()) -> AllocatorStats:
    """Replay allocation events through the caching-allocator model, starting from an empty cache.

    events: iterable of ("alloc", key, size_bytes) / ("free", key, _) with any hashable key, or the compact int form
    described in `iter_events`. Frees of keys that are not live are counted and ignored; the replay stops at the
    first allocation that runs out of `settings.capacity_bytes` (oom=True).
    """
    sim, _, oom_event, unknown, allocations = _run(events, settings)
    return AllocatorStats(
        peak_allocated=sim.peak_allocated, peak_requested=sim.peak_requested, peak_reserved=sim.peak_reserved,
        segments=sim.peak_segments,
        cuda_mallocs=sim.device_allocs, cuda_frees=sim.device_frees, alloc_retries=sim.retries,
        oom=oom_event is not None, oom_event=oom_event, final_allocated=sim.allocated,
        final_reserved=sim.reserved, allocations=allocations, unknown_frees=unknown,
    )


# --- PYTORCH_CUDA_ALLOC_CONF parsing ------------------------------------------------------------------------------
def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer (AllocatorConfig.h:35-53): split on , : [ ] (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    buffer = ""
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


def _parse_pairs(tokens: list[str]) -> Iterator[tuple[str, str | list[str]]]:
    """key:value pairs separated by commas; a value may be a bracketed list (returned as its tokens)."""
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ValueError(f"expected '{key}:value'")
        if tokens[i + 2] == "[":
            if "]" not in tokens[i + 2:]:
                raise ValueError(f"missing ']' in the value of {key!r}")
            close = tokens.index("]", i + 2)
            value: str | list[str] = tokens[i + 3:close]
            i = close + 1
        else:
            value = tokens[i + 2]
            i += 3
        yield key, value
        if i < len(tokens):
            if tokens[i] != ",":
                raise ValueError(f"expected ',' after the value of {key!r}")
            i += 1


def _to_int(key: str, value: str | list[str]) -> int:
    if not isinstance(value, str) or not value.isdigit():
        raise ValueError(f"{key} expects a non-negative integer, got {value!r}")
    return int(value)


def _to_bool(key: str, value: str | list[str]) -> bool:
    if value not in ("True", "False"):  # ConfigTokenizer::toBool accepts exactly these, AllocatorConfig.h:80-95
        raise ValueError(f"{key} expects True or False, got {value!r}")
    return value == "True"


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_roundup(value: str | list[str]) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions (AllocatorConfig.cpp): "4" for every interval, or "[64:8,256:4,>:1]" where a
    key is the interval's start in MiB (a power of 2) and ">" sets every interval after the last one named."""
    if isinstance(value, str):
        divisions = _to_int("roundup_power2_divisions", value)
        if not _is_power_of_2(divisions):
            raise ValueError("roundup_power2_divisions must be a power of 2")
        return (divisions,) * kRoundUpPowerOfTwoIntervals
    table = [0] * kRoundUpPowerOfTwoIntervals
    items = [t for t in value if t != ","]
    if len(items) % 3 or any(items[j + 1] != ":" for j in range(0, len(items), 3)):
        raise ValueError(f"malformed roundup_power2_divisions list {value!r}")
    first, last_index = True, 0
    for j in range(0, len(items), 3):
        boundary, divisions = items[j], _to_int("roundup_power2_divisions", items[j + 2])
        if divisions != 0 and not _is_power_of_2(divisions):
            raise ValueError("roundup_power2_divisions values must be a power of 2 or 0")
        if boundary == ">":
            table[last_index + 1:] = [divisions] * (kRoundUpPowerOfTwoIntervals - last_index - 1)
            continue
        start_mb = _to_int("roundup_power2_divisions", boundary)
        if not _is_power_of_2(start_mb):
            raise ValueError("roundup_power2_divisions intervals must be powers of 2")
        index = min(start_mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first:
            table[:index] = [divisions] * index
            first = False
        table[index] = divisions
        last_index = index
    return tuple(table)


__all__ = [
    "AllocatorSettings",
    "AllocatorStats",
    "get_allocation_size",
    "iter_events",
    "kLargeBuffer",
    "kMinBlockSize",
    "kMinLargeAlloc",
    "kRoundLarge",
    "kSmallBuffer",
    "kSmallSize",
    "replay",
    "round_size",
    "roundup_power2_next_division",
]
