// Ordered compaction of a block of 1024 threads (shared by the chunk selection and the prompt's outlier pick).
#pragma once

#include <cuda_runtime.h>

namespace shadowkv::cuda {

constexpr int kOrderedPassThreads = 1024;  // the warp totals are scanned by one warp's shuffles: 32 warps
constexpr int kOrderedPassWarps = kOrderedPassThreads / 32;
static_assert(kOrderedPassWarps == 32, "one warp scans the warp totals");

/// Counts before the block's first item: zero for a block that compacts alone.
struct block_alone {
  __device__ uint2 operator()(uint2 /*block_totals*/) const { return make_uint2(0U, 0U); }
};

/// Ordered compaction over [first, end) with two predicates: flag(i) returns bit 0 (predicate a) and bit 1 (b);
/// emit(i, flag, a_before, b_before) is called for every item and gets how many items before i satisfy each,
/// starting from base(block_totals), which every thread calls once between the two passes with the block's totals
/// (blocks of a cluster that compact consecutive ranges of one list give each other's totals there; the call may
/// synchronise the cluster). Each warp takes one contiguous segment, counts it with ballots, and after one exchange of
/// the 32 warp totals recounts it with ranks: two cheap passes and two barriers instead of a block scan per 1024
/// items. Returns the block's totals. Called by every thread of a block of kOrderedPassThreads threads; `scratch`
/// holds 2 * kOrderedPassWarps unsigned in shared memory; flag must give the same answer in both passes.
template <typename Flag, typename Emit, typename Base>
__device__ __forceinline__ uint2 ordered_pass_range(int first, int end_item, unsigned* scratch, Flag&& flag,
                                                    Emit&& emit, Base&& base) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rounds = (end_item - first + 31) / 32;
  const int segment = (rounds + kOrderedPassWarps - 1) / kOrderedPassWarps * 32;
  const int begin = first + warp * segment;
  const int end = min(end_item, begin + segment);
  unsigned a = 0;
  unsigned b = 0;
  for (int item = begin; item < end; item += 32) {  // warp-uniform
    const int i = item + lane;
    const unsigned f = i < end ? flag(i) : 0U;
    a += __popc(__ballot_sync(0xffffffffU, (f & 1U) != 0));
    b += __popc(__ballot_sync(0xffffffffU, (f & 2U) != 0));
  }
  if (lane == 0) {
    scratch[2 * warp] = a;
    scratch[2 * warp + 1] = b;
  }
  __syncthreads();
  // Warp prefix: lane l holds warp l's counts; an inclusive shuffle scan gives every warp its offset and the total.
  unsigned scan_a = scratch[2 * lane];
  unsigned scan_b = scratch[2 * lane + 1];
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned other_a = __shfl_up_sync(0xffffffffU, scan_a, offset);
    const unsigned other_b = __shfl_up_sync(0xffffffffU, scan_b, offset);
    if (lane >= offset) {
      scan_a += other_a;
      scan_b += other_b;
    }
  }
  const uint2 total = make_uint2(__shfl_sync(0xffffffffU, scan_a, 31), __shfl_sync(0xffffffffU, scan_b, 31));
  const unsigned prefix_a = __shfl_sync(0xffffffffU, scan_a, (warp + 31) & 31);
  const unsigned prefix_b = __shfl_sync(0xffffffffU, scan_b, (warp + 31) & 31);
  const uint2 before_block = base(total);
  unsigned a_before = before_block.x + (warp == 0 ? 0U : prefix_a);
  unsigned b_before = before_block.y + (warp == 0 ? 0U : prefix_b);
  const unsigned lower = (1U << lane) - 1U;
  for (int item = begin; item < end; item += 32) {
    const int i = item + lane;
    const unsigned f = i < end ? flag(i) : 0U;
    const unsigned ballot_a = __ballot_sync(0xffffffffU, (f & 1U) != 0);
    const unsigned ballot_b = __ballot_sync(0xffffffffU, (f & 2U) != 0);
    if (i < end) emit(i, f, a_before + __popc(ballot_a & lower), b_before + __popc(ballot_b & lower));
    a_before += __popc(ballot_a);
    b_before += __popc(ballot_b);
  }
  __syncthreads();  // scratch is reused; emitted writes are visible to the block
  return total;
}

/// ordered_pass_range over [0, count) by a block alone.
template <typename Flag, typename Emit>
__device__ __forceinline__ uint2 ordered_pass(int count, unsigned* scratch, Flag&& flag, Emit&& emit) {
  return ordered_pass_range(0, count, scratch, static_cast<Flag&&>(flag), static_cast<Emit&&>(emit), block_alone{});
}

}  // namespace shadowkv::cuda
