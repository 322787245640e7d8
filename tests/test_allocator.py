"""Tests for planner.allocator, the CPU model of PyTorch's CUDA caching allocator.

Expected numbers are derived by hand from the rules cited in the module (CCA.cpp = CUDACachingAllocator.cpp):
round_size (512 B multiples), small pool <= 1 MiB in 2 MiB segments, large requests < 10 MiB in 20 MiB segments,
larger ones rounded to 2 MiB, best fit by (size, address), should_split, merging on free, the OOM retry chain, and
expandable segments mapping 2 MiB / 20 MiB pages.
"""

from __future__ import annotations

import random
import time

import pytest

from planner import allocator as A
from planner.allocator import AllocatorSettings, replay, round_size, roundup_power2_next_division

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB
EXPANDABLE = AllocatorSettings(expandable_segments=True)
MSS20 = AllocatorSettings(max_split_size=20 * MiB)  # the smallest max_split_size_mb torch accepts


def alloc(key, size):
    return ("alloc", key, size)


def free(key):
    return ("free", key, 0)


# --- request rounding and segment sizes ---------------------------------------------------------------------------
def test_one_byte_rounds_to_512_in_a_2mib_small_segment():
    # round_size(1) = kMinBlockSize = 512; 512 <= kSmallSize -> small pool; new segment = kSmallBuffer = 2 MiB,
    # split because the 2 MiB - 512 remainder >= kMinBlockSize -> allocated counts 512, reserved 2 MiB.
    s = replay([alloc("x", 1)])
    assert (s.peak_allocated, s.peak_reserved, s.segments, s.cuda_mallocs) == (512, 2 * MiB, 1, 1)


def test_small_requests_pack_into_one_2mib_segment():
    # Four 512 KiB requests: 2 MiB -> 512K + 1.5M free -> 512K + 1M free -> 512K + 512K free -> exact fit.
    # The fifth needs a second 2 MiB segment.
    events = [alloc(i, 512 * KiB) for i in range(4)]
    s = replay(events)
    assert (s.final_allocated, s.final_reserved, s.cuda_mallocs) == (2 * MiB, 2 * MiB, 1)
    s = replay([*events, alloc(4, 512 * KiB)])
    assert (s.final_allocated, s.final_reserved, s.cuda_mallocs) == (5 * 512 * KiB, 4 * MiB, 2)


def test_one_mib_is_small_and_one_mib_plus_one_byte_is_large():
    # size <= kSmallSize (1 MiB) -> small pool, 2 MiB segment; 1 MiB + 1 B rounds to 1 MiB + 512 -> large pool,
    # < kMinLargeAlloc -> 20 MiB segment.
    assert replay([alloc(0, MiB)]).peak_reserved == 2 * MiB
    s = replay([alloc(0, MiB + 1)])
    assert (s.peak_allocated, s.peak_reserved) == (MiB + 512, 20 * MiB)


def test_three_mib_gets_a_20mib_segment():
    # 1 MiB < 3 MiB < kMinLargeAlloc -> kLargeBuffer (20 MiB) segment; remainder 17 MiB > kSmallSize -> split.
    s = replay([alloc(0, 3 * MiB)])
    assert (s.peak_allocated, s.peak_reserved) == (3 * MiB, 20 * MiB)


@pytest.mark.parametrize(("request_bytes", "reserved", "allocated"), [
    (12 * MiB, 12 * MiB, 12 * MiB),  # >= 10 MiB: segment = size rounded up to 2 MiB, exact fit
    (11 * MiB, 12 * MiB, 12 * MiB),  # segment 12 MiB; remainder 1 MiB is not > kSmallSize -> no split, block 12 MiB
    (10 * MiB, 10 * MiB, 10 * MiB),  # exactly kMinLargeAlloc is not "< kMinLargeAlloc" -> rounded, not 20 MiB
    (10 * MiB - 512, 20 * MiB, 10 * MiB - 512),  # just below kMinLargeAlloc -> 20 MiB segment, split
])
def test_large_segment_sizes(request_bytes, reserved, allocated):
    s = replay([alloc(0, request_bytes)])
    assert (s.peak_reserved, s.peak_allocated) == (reserved, allocated)


@pytest.mark.parametrize(("request_bytes", "allocated"), [
    (10 * MiB + 512 * KiB, 10 * MiB + 512 * KiB),  # 12 MiB segment, remainder 1.5 MiB > kSmallSize: split
    (11 * MiB + 512 * KiB, 12 * MiB),  # remainder 0.5 MiB: not split, allocated counts the whole 12 MiB block
    (1000, 1024),  # small pool: split down to 512 B multiples, so only the request's rounding to 512 B shows
])
def test_allocated_counts_whole_blocks_requested_counts_the_request(request_bytes, allocated):
    # alloc_found_block: allocated_bytes += block->size, requested_bytes += block->requested_size (= the request)
    s = replay([alloc(0, request_bytes)])
    assert (s.peak_allocated, s.peak_requested, s.rounding) == (allocated, request_bytes, allocated - request_bytes)


def test_the_last_piece_of_a_20mib_segment_is_taken_whole():
    # 1.125 MiB (a 768 x 768 fp16 weight) x 17 from one 20 MiB segment: the 17th finds a 2 MiB block, whose 0.875 MiB
    # remainder is not > kSmallSize, so it takes all 2 MiB. Freeing it gives the 0.875 MiB back to allocated too.
    size = 1152 * KiB
    events = [alloc(i, size) for i in range(17)]
    s = replay(events)
    assert (s.cuda_mallocs, s.peak_allocated, s.peak_requested) == (1, 20 * MiB, 17 * size)
    assert s.rounding == 20 * MiB - 17 * size == 896 * KiB
    s = replay([*events, free(16)])
    assert (s.final_allocated, s.peak_requested) == (16 * size, 17 * size)


def test_get_allocation_size_and_round_size_helpers():
    assert round_size(0) == round_size(511) == 512
    assert round_size(513) == 1024
    assert A.get_allocation_size(512) == 2 * MiB
    assert A.get_allocation_size(9 * MiB) == 20 * MiB
    assert A.get_allocation_size(21 * MiB) == 22 * MiB
    assert A.get_allocation_size(9 * MiB, large_segment_size=40 * MiB) == 40 * MiB


# --- best fit, splitting, merging --------------------------------------------------------------------------------
def test_split_block_is_reused_and_small_remainder_is_not_split():
    # A 3 MiB: 20 MiB segment -> A[0,3) + free[3,20).  B 5 MiB: best fit is the 17 MiB block -> B[3,8) + free[8,20).
    # free A -> free blocks 3 MiB and 12 MiB.  C 2 MiB: best fit is the 3 MiB block; remainder 1 MiB is not
    # > kSmallSize -> C takes the whole 3 MiB.  allocated = 5 + 3 = 8 MiB, one 20 MiB segment.
    s = replay([alloc("A", 3 * MiB), alloc("B", 5 * MiB), free("A"), alloc("C", 2 * MiB)])
    assert (s.final_allocated, s.peak_allocated, s.peak_reserved, s.cuda_mallocs) == (8 * MiB, 8 * MiB, 20 * MiB, 1)


@pytest.mark.parametrize("order", [("A", "B"), ("B", "A")])
def test_two_frees_merge_back_into_the_whole_segment(order):
    # A 4 MiB, B 4 MiB from one 20 MiB segment: A[0,4) B[4,8) free[8,20).  Freeing both (either order) merges
    # everything into one 20 MiB block, so an 18 MiB request fits (remainder 2 MiB > 1 MiB -> split) without a new
    # segment.  Without merging the free blocks would be 4, 4, 12 MiB and 18 MiB would need a new segment (38 MiB).
    events = [alloc("A", 4 * MiB), alloc("B", 4 * MiB), free(order[0]), free(order[1]), alloc("D", 18 * MiB)]
    s = replay(events)
    assert (s.peak_reserved, s.cuda_mallocs, s.final_allocated) == (20 * MiB, 1, 18 * MiB)


def test_best_fit_takes_the_smallest_block_that_fits():
    # Two cached segments, 12 MiB and 16 MiB.  An 11 MiB request takes the 12 MiB block (smallest >= 11 MiB), whole
    # because the 1 MiB remainder is not > kSmallSize -> 12 MiB allocated.  Taking the 16 MiB one would split it
    # into 11 + 5 and count 11 MiB.
    events = [alloc("X", 12 * MiB), alloc("Y", 16 * MiB), free("X"), free("Y"), alloc("Z", 11 * MiB)]
    s = replay(events)
    assert (s.final_allocated, s.peak_reserved, s.cuda_mallocs) == (12 * MiB, 28 * MiB, 2)


def test_best_fit_ties_go_to_the_lower_address():
    sim = A._Allocator(AllocatorSettings())
    first, second = sim.malloc(12 * MiB), sim.malloc(12 * MiB)
    sim.free(second)
    sim.free(first)
    assert sim.malloc(12 * MiB) is first  # equal sizes: BlockComparatorSize orders by address next


# --- max_split_size ------------------------------------------------------------------------------------------------
def test_max_split_size_prevents_splitting_a_large_request():
    # 30 MiB segment cached.  25 MiB request: 30 < 25 + 20 (max_non_split_rounding) -> reused; 25 >= max_split_size
    # -> should_split is false -> the whole 30 MiB block is allocated.  Without max_split_size it is split (25 MiB).
    events = [alloc("A", 30 * MiB), free("A"), alloc("B", 25 * MiB)]
    with_mss, without = replay(events, MSS20), replay(events)
    assert (with_mss.final_allocated, with_mss.peak_reserved, with_mss.cuda_mallocs) == (30 * MiB, 30 * MiB, 1)
    assert (without.final_allocated, without.peak_reserved, without.cuda_mallocs) == (25 * MiB, 30 * MiB, 1)


def test_oversize_block_is_not_given_to_a_request_below_max_split_size():
    # Cached 30 MiB block >= max_split_size; a 12 MiB request (< max_split_size) must not take it -> new 12 MiB
    # segment (42 MiB reserved).  Without max_split_size the 30 MiB block is split: 30 MiB reserved.
    events = [alloc("A", 30 * MiB), free("A"), alloc("B", 12 * MiB)]
    assert (replay(events, MSS20).peak_reserved, replay(events, MSS20).cuda_mallocs) == (42 * MiB, 2)
    assert (replay(events).peak_reserved, replay(events).cuda_mallocs) == (30 * MiB, 1)


@pytest.mark.parametrize(("request_mib", "reserved_mib"), [(81, 100), (80, 180)])
def test_oversize_block_accepted_only_below_size_plus_rounding_limit(request_mib, reserved_mib):
    # Cached 100 MiB oversize block.  81 MiB: 100 < 81 + 20 -> reused.  80 MiB: 100 >= 80 + 20 -> rejected, so a
    # new 80 MiB segment: 180 MiB reserved (the rule is ">=", CCA.cpp get_free_block).
    events = [alloc("A", 100 * MiB), free("A"), alloc("B", request_mib * MiB)]
    assert replay(events, MSS20).peak_reserved == reserved_mib * MiB


def test_max_non_split_rounding_widens_the_limit():
    # max_non_split_rounding_mb:40 -> 100 < 80 + 40, so the 80 MiB request reuses the 100 MiB block.
    settings = AllocatorSettings.from_env("max_split_size_mb:20,max_non_split_rounding_mb:40")
    events = [alloc("A", 100 * MiB), free("A"), alloc("B", 80 * MiB)]
    assert replay(events, settings).peak_reserved == 100 * MiB


# --- running out of memory -----------------------------------------------------------------------------------------
def test_oom_retry_frees_cached_segments():
    # capacity 21 MiB.  A 1 KiB small request leaves a cached 2 MiB segment.  A 20 MiB request needs a 20 MiB
    # segment: 2 + 20 > 21 -> cudaMalloc fails; release_available_cached_blocks does nothing (no max_split_size);
    # release_cached_blocks frees the unused 2 MiB segment; the retry fits (20 <= 21).
    settings = AllocatorSettings(capacity_bytes=21 * MiB)
    s = replay([alloc("s", KiB), free("s"), alloc("L", 20 * MiB)], settings)
    assert (s.oom, s.peak_reserved, s.final_reserved) == (False, 20 * MiB, 20 * MiB)
    assert (s.cuda_frees, s.alloc_retries, s.cuda_mallocs) == (1, 1, 2)


def test_partly_used_segment_is_not_released_so_the_request_ooms():
    # Same, but a second 1 KiB block stays live in the 2 MiB segment: it is split, so release_cached_blocks cannot
    # free it; the retry fails -> OOM at event 3, after one retry.
    settings = AllocatorSettings(capacity_bytes=21 * MiB)
    s = replay([alloc("s1", KiB), alloc("s2", KiB), free("s1"), alloc("L", 20 * MiB), free("s2")], settings)
    assert (s.oom, s.oom_event, s.alloc_retries, s.peak_reserved, s.cuda_frees) == (True, 3, 1, 2 * MiB, 0)


def test_oom_when_nothing_can_be_freed():
    # capacity 30 MiB: 20 MiB live segment + a new 12 MiB segment > 30 MiB, nothing cached -> OOM at event 1.
    s = replay([alloc("A", 20 * MiB), alloc("B", 12 * MiB)], AllocatorSettings(capacity_bytes=30 * MiB))
    assert (s.oom, s.oom_event, s.alloc_retries, s.peak_reserved, s.allocations) == (True, 1, 1, 20 * MiB, 1)


def test_release_available_frees_only_the_oversize_block():
    # max_split_size 20 MiB, capacity 110 MiB.  Cached: a 2 MiB small segment and a 100 MiB segment (102 reserved).
    # 30 MiB request: the 100 MiB block is rejected (100 >= 30 + 20); cudaMalloc(30) fails (132 > 110);
    # release_available_cached_blocks frees the smallest cached block >= max(30, 20) MiB -- the 100 MiB one -- and
    # the retry fits.  The small segment stays cached; no full release, so no retry is counted.
    settings = AllocatorSettings(max_split_size=20 * MiB, capacity_bytes=110 * MiB)
    events = [alloc("s", KiB), free("s"), alloc("A", 100 * MiB), free("A"), alloc("B", 30 * MiB)]
    s = replay(events, settings)
    assert (s.final_reserved, s.peak_reserved, s.cuda_frees, s.alloc_retries) == (32 * MiB, 102 * MiB, 1, 0)


def test_release_available_frees_several_oversize_blocks_largest_first():
    # max_split_size 20 MiB, capacity 60 MiB.  Cached 30 MiB and 26 MiB (25 MiB rounds to 26) segments.  50 MiB
    # request: nothing cached fits, cudaMalloc fails (56 + 50 > 60); no single cached block >= 50 MiB, so oversize
    # blocks are freed from the largest down until >= 50 MiB: 30 then 26.  Retry: 50 MiB.
    settings = AllocatorSettings(max_split_size=20 * MiB, capacity_bytes=60 * MiB)
    events = [alloc("A", 30 * MiB), alloc("B", 25 * MiB), free("A"), free("B"), alloc("C", 50 * MiB)]
    s = replay(events, settings)
    assert (s.oom, s.peak_reserved, s.final_reserved, s.cuda_frees, s.alloc_retries) == (False, 56 * MiB,
                                                                                       50 * MiB, 2, 0)


# --- expandable segments -------------------------------------------------------------------------------------------
def test_expandable_small_request_maps_one_2mib_page():
    s = replay([alloc(0, 1)], EXPANDABLE)
    assert (s.peak_allocated, s.peak_reserved, s.segments, s.cuda_mallocs) == (512, 2 * MiB, 1, 1)


def test_expandable_large_request_maps_20mib_pages_and_splits():
    # 30 MiB -> ceil(30 / 20) = 2 pages = 40 MiB mapped; should_split with expandable segments only needs a
    # remainder >= 512 B -> 30 MiB allocated, 10 MiB free.  Freeing unmaps nothing.
    s = replay([alloc("A", 30 * MiB), free("A")], EXPANDABLE)
    assert (s.peak_allocated, s.peak_reserved, s.final_reserved, s.final_allocated) == (30 * MiB, 40 * MiB,
                                                                                      40 * MiB, 0)


def test_expandable_splits_large_blocks_down_to_512_bytes():
    # 39.5 MiB -> two 20 MiB pages (40 MiB); the 0.5 MiB remainder is split off because with expandable segments
    # should_split only needs remainder >= kMinBlockSize (classic large blocks need > kSmallSize, which would count
    # the whole 40 MiB as allocated).
    s = replay([alloc("A", 39 * MiB + 512 * KiB)], EXPANDABLE)
    assert (s.peak_allocated, s.peak_reserved) == (39 * MiB + 512 * KiB, 40 * MiB)


def test_expandable_best_fit_counts_the_room_a_block_can_grow_into():
    # M 12 MiB maps [0,20): M[0,12) + free[12,20).  G 8 MiB fills [12,20).  H 35 MiB maps [20,60): H[20,55) +
    # free[55,60).  free M -> free[0,12), boxed in by G.  R 5 MiB: the smallest fitting block is [55,60), but its
    # expandable_size includes the unmapped tail, so get_free_block moves on to [0,12), whose expandable size (12)
    # is smaller: R lands at M's old address.
    sim = A._Allocator(EXPANDABLE)
    m = sim.malloc(12 * MiB)
    m_addr = m.addr
    sim.malloc(8 * MiB)
    sim.malloc(35 * MiB)
    sim.free(m)
    assert sim.malloc(5 * MiB).addr == m_addr
    assert sim.reserved == 60 * MiB


def test_expandable_segment_grows_in_place():
    # A 30 MiB: pages [0,40) mapped, A[0,30) + free[30,40).  B 30 MiB: no free block fits; the free 10 MiB before the
    # unmapped tail plus one more 20 MiB page gives [30,60) exactly.  60 MiB reserved, one segment, two maps.
    s = replay([alloc("A", 30 * MiB), alloc("B", 30 * MiB)], EXPANDABLE)
    assert (s.peak_allocated, s.peak_reserved, s.segments, s.cuda_mallocs) == (60 * MiB, 60 * MiB, 1, 2)


def test_expandable_reserves_less_than_classic_for_growing_requests():
    # Classic: 30, 32, 34 MiB one after another (each freed) never fit a cached segment -> 30 + 32 + 34 = 96 MiB.
    # Expandable: the 40 MiB mapped for the first (two 20 MiB pages) serves all three.
    events = [alloc("a", 30 * MiB), free("a"), alloc("b", 32 * MiB), free("b"), alloc("c", 34 * MiB)]
    classic, expandable = replay(events), replay(events, EXPANDABLE)
    assert (classic.peak_reserved, classic.cuda_mallocs) == (96 * MiB, 3)
    assert (expandable.peak_reserved, expandable.cuda_mallocs) == (40 * MiB, 1)


def test_expandable_oom_unmaps_whole_free_pages_only():
    # capacity 60 MiB.  A 30 MiB -> [0,40) mapped.  B 5 MiB -> from the free [30,40): B[30,35), free[35,40).
    # free A -> free [0,30).  C 35 MiB: no free block fits; the free [35,40) + 2 new pages [40,80) would make 80 MiB
    # reserved > 60 -> fails.  release_cached_blocks unmaps the whole pages inside free blocks: [0,20) from [0,30)
    # ([20,30) is a partial page and stays mapped); nothing from [35,40).  Reserved 20; the retry maps [40,80):
    # 60 MiB.  C takes [35,70).  allocated = 5 + 35 MiB.
    settings = AllocatorSettings(expandable_segments=True, capacity_bytes=60 * MiB)
    events = [alloc("A", 30 * MiB), alloc("B", 5 * MiB), free("A"), alloc("C", 35 * MiB)]
    s = replay(events, settings)
    assert (s.oom, s.final_reserved, s.peak_reserved, s.final_allocated) == (False, 60 * MiB, 60 * MiB, 40 * MiB)
    assert (s.cuda_frees, s.alloc_retries, s.cuda_mallocs, s.segments) == (1, 1, 2, 1)


def test_expandable_oom_releases_a_fully_unmapped_segment():
    # capacity 40 MiB.  A 30 MiB maps [0,40) of the large segment; free A.  A 1 KiB request creates the small-pool
    # segment and needs one 2 MiB page: 42 > 40 -> fails.  release_cached_blocks unmaps the large pool's free
    # [0,40) (reserved 0), which leaves that segment wholly unmapped, so it is released.  Retry maps 2 MiB.
    settings = AllocatorSettings(expandable_segments=True, capacity_bytes=40 * MiB)
    s = replay([alloc("A", 30 * MiB), free("A"), alloc("s", KiB)], settings)
    assert (s.oom, s.final_reserved, s.peak_reserved, s.cuda_frees, s.alloc_retries) == (False, 2 * MiB,
                                                                                       40 * MiB, 1, 1)
    assert s.segments == 2  # peak: the large and the small expandable segment


# --- power-of-two rounding -----------------------------------------------------------------------------------------
def test_roundup_power2_next_division_example_from_the_source():
    # CCA.cpp's comment: 1200 with 4 divisions -> steps 1024, 1280, 1536, 1792 -> 1280.
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024  # powers of two are kept


def test_roundup_power2_divisions_option():
    # "roundup_power2_divisions:4": 1.1 MiB (index 0 interval) > 512 * 4 -> floor 1 MiB, step 256 KiB -> 1.25 MiB.
    settings = AllocatorSettings.from_env("roundup_power2_divisions:4")
    request = int(1.1 * MiB)
    assert replay([alloc(0, request)], settings).peak_allocated == 1280 * KiB
    assert replay([alloc(0, request)]).peak_allocated == 512 * -(-request // 512)


def test_roundup_power2_divisions_list_form():
    # [256:1,512:2,>:4]: intervals below 256 MiB take the first value (1 = off), [512 MiB, 1 GiB) has 2 divisions,
    # everything from 1 GiB has 4.
    table = AllocatorSettings.from_env("roundup_power2_divisions:[256:1,512:2,>:4]").roundup_power2_divisions
    assert table == (1,) * 9 + (2,) + (4,) * 6
    assert round_size(600 * MiB + 1, table) == 768 * MiB  # 512 MiB + 256 MiB steps
    assert round_size(int(1.1 * GiB), table) == 1280 * MiB  # 1 GiB + 256 MiB steps
    assert round_size(int(1.1 * MiB), table) == 512 * -(-int(1.1 * MiB) // 512)


# --- settings parsing ----------------------------------------------------------------------------------------------
def test_from_env_parses_the_common_options():
    s = AllocatorSettings.from_env("expandable_segments:True,max_split_size_mb:512", capacity_bytes=GiB)
    assert (s.expandable_segments, s.max_split_size, s.capacity_bytes) == (True, 512 * MiB, GiB)
    assert AllocatorSettings.from_env("") == AllocatorSettings()
    assert AllocatorSettings.from_env(" garbage_collection_threshold:0.6 , backend:native ") == AllocatorSettings()
    assert AllocatorSettings.from_env("large_segment_size_mb:40").large_segment_size == 40 * MiB


@pytest.mark.parametrize("text", [
    "max_split_size_mb:10",  # torch: "must be >= 20"
    "max_non_split_rounding_mb:1",
    "large_segment_size_mb:10",  # torch 2.13: "must be > 10 MB"
    "expandable_segments:true",  # only True / False
    "roundup_power2_divisions:3",
    "no_such_option:1",
    "backend:cudaMallocAsync",
    "expandable_segments",
])
def test_from_env_rejects_what_torch_rejects(text):
    with pytest.raises(ValueError):
        AllocatorSettings.from_env(text)


def test_large_segment_size_option_changes_the_1_to_10mib_segment():
    s = replay([alloc(0, 3 * MiB)], AllocatorSettings.from_env("large_segment_size_mb:40"))
    assert s.peak_reserved == 40 * MiB


# --- event forms and bookkeeping -----------------------------------------------------------------------------------
def test_compact_int_form_matches_tuples():
    compact = [3 * MiB, 5 * MiB, -1, 2 * MiB]  # alloc #0, alloc #1, free #0, alloc #2
    tuples = [alloc(0, 3 * MiB), alloc(1, 5 * MiB), free(0), alloc(2, 2 * MiB)]
    assert replay(compact) == replay(tuples)
    assert replay(compact).final_allocated == 8 * MiB


def test_zero_size_allocations_and_unknown_frees():
    s = replay([alloc("empty", 0), free("empty"), free("never"), alloc("x", 1), free("x")])
    assert (s.allocations, s.unknown_frees, s.peak_allocated, s.final_allocated) == (1, 1, 512, 0)


def test_bad_events_raise():
    with pytest.raises(ValueError):
        replay([alloc("x", 1), alloc("x", 1)])
    with pytest.raises(ValueError):
        replay([("realloc", "x", 1)])
    with pytest.raises(ValueError):
        replay([alloc("x", -1)])


# --- properties ----------------------------------------------------------------------------------------------------
def _check_invariants(sim: A._Allocator, live: dict) -> None:
    """Every segment is tiled exactly by linked blocks; free lists match the blocks; counters match the blocks."""
    blocks = [b for b in live.values() if b is not None]
    for pool in (sim.small, sim.large):
        assert pool.keys == sorted(pool.keys) and len(pool.keys) == len(pool.blocks)
        for key, b in pool.blocks.items():
            assert key == (b.size << 64 | b.addr) and b.mapped and not b.allocated and b.pool is pool
        for addr, b in pool.unmapped.items():
            assert addr == b.addr and not b.mapped and b.segment.page
        blocks += [*pool.blocks.values(), *pool.unmapped.values()]
    segments: dict[int, list] = {}
    for b in blocks:
        segments.setdefault(id(b.segment), []).append(b)
    reserved = allocated = 0
    for members in segments.values():
        segment = members[0].segment
        (head,) = [b for b in members if b.prev is None]
        b, addr, count, mapped = head, segment.base, 0, 0
        while b is not None:
            assert b.addr == addr and b.segment is segment and b.size > 0
            nxt = b.next
            if nxt is not None:
                assert nxt.prev is b
                assert b.allocated or nxt.allocated or b.mapped != nxt.mapped, "free neighbours left unmerged"
            mapped += b.size if b.mapped else 0
            allocated += b.size if b.allocated else 0
            addr, count, b = addr + b.size, count + 1, nxt
        assert addr == segment.base + segment.size and count == len(members)
        assert not segment.page or mapped % segment.page == 0
        reserved += mapped
    assert (reserved, allocated, len(segments)) == (sim.reserved, sim.allocated, sim.segments)
    live_blocks = [b for b in live.values() if b is not None]
    assert sim.requested == sum(b.requested for b in live_blocks) <= sim.allocated
    assert all(0 < b.requested <= b.size for b in live_blocks)


def _random_events(rng: random.Random, n: int, live_limit: int = 1 << 62) -> list:
    """Random allocs (mostly small and mid-size, some large) and frees in random order; frees are forced while the
    live bytes exceed live_limit, which keeps a capacity-limited replay fragmenting rather than running out."""
    events, live, sizes, live_bytes, key = [], [], {}, 0, 0
    for _ in range(n):
        if live and (rng.random() < 0.45 or live_bytes > live_limit):
            victim = live.pop(rng.randrange(len(live)))
            live_bytes -= sizes.pop(victim)
            events.append(free(victim))
            continue
        r = rng.random()
        if r < 0.5:
            size = rng.randint(1, 2 * MiB)
        elif r < 0.9:
            size = rng.randint(2 * MiB, 40 * MiB)
        else:
            size = rng.randint(40 * MiB, 300 * MiB)
        events.append(alloc(key, size))
        live.append(key)
        sizes[key] = size
        live_bytes += size
        key += 1
    return events + [free(k) for k in live]


SETTINGS = {
    "classic": AllocatorSettings(),
    "expandable": EXPANDABLE,
    "max_split": AllocatorSettings(max_split_size=64 * MiB),
    "capacity": AllocatorSettings(capacity_bytes=GiB),
    "expandable_capacity": AllocatorSettings(expandable_segments=True, capacity_bytes=GiB),
    "max_split_capacity": AllocatorSettings(max_split_size=64 * MiB, capacity_bytes=GiB),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_random_sequences_keep_the_invariants(name):
    settings, rng = SETTINGS[name], random.Random(1234)
    for _ in range(4):
        events = _random_events(rng, 400, live_limit=600 * MiB)
        sim, live = A._Allocator(settings), {}
        for op, key, size in events:
            if op == "alloc":
                live[key] = sim.malloc(size)
                if live[key] is None:  # OOM: the replay would stop here
                    del live[key]
                    break
            else:
                sim.free(live.pop(key))
            _check_invariants(sim, live)
        stats = replay(events, settings)
        assert stats.peak_reserved >= stats.peak_allocated >= stats.peak_requested >= 0
        assert stats.peak_allocated == sim.peak_allocated and stats.peak_reserved == sim.peak_reserved
        if settings.capacity_bytes is not None:
            assert stats.peak_reserved <= settings.capacity_bytes
        if not stats.oom:
            assert stats.final_allocated == 0 and stats.final_reserved > 0


def test_peak_allocated_is_at_least_the_peak_of_rounded_requests():
    rng = random.Random(7)
    for settings in SETTINGS.values():
        events = _random_events(rng, 400)
        current = peak = 0
        sizes = {}
        for op, key, size in events:
            if op == "alloc":
                sizes[key] = round_size(size)
                current += sizes[key]
                peak = max(peak, current)
            else:
                current -= sizes.pop(key)
        stats = replay(events, settings)
        if not stats.oom:
            assert stats.peak_allocated >= peak


def test_replay_of_100k_events_is_fast():
    rng = random.Random(0)
    events = _random_events(rng, 100_000)
    start = time.perf_counter()
    stats = replay(events)
    elapsed = time.perf_counter() - start
    assert stats.final_allocated == 0
    assert elapsed < 2.0, f"{len(events)} events took {elapsed:.2f} s"
