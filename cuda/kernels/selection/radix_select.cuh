// Block-wide top-k over per-chunk radix keys (unsigned, larger is better, 0 for non-candidates): the threshold by an
// MSB-first radix select, then the selected ids compacted in ascending order with ties to the smaller id.
//
// Not cub::BlockRadixSort: it sorts a fixed tile of ITEMS_PER_THREAD keys held in registers, while n here is up to
// ~54K chunks and only the k-th key is needed; the digit search below does use cub::BlockScan.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "common/ordered_compaction.cuh"

namespace shadowkv::cuda::selection {

/// Bits of the first radix digit: its histogram (1 << 12 bins, 4 a thread in the digit search) is counted by the
/// caller while it writes the radix keys, saving a pass over them.
constexpr int kRadixFirstBits = 12;

/// The digit search's block scan (64-bit counts: a bin may hold up to n items and the sums run over 4 bins a thread).
template <int kThreads>
using radix_digit_scan = cub::BlockScan<unsigned long long, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

/// The selection rule found by the radix select: radix key c is taken when (key & mask) > prefix, or when
/// (key & mask) == prefix for the first need_ties such items in id order.
struct radix_threshold {
  unsigned prefix;
  unsigned mask;
  unsigned need_ties;
  /// With a hint target: the first digit's bin at which the count from the top reaches it (~0U: not reached, or no
  /// target). Its smallest key is where a later selection of similar scores may start (select_cluster_kernel).
  unsigned hint_bin;
};

/// "Not found" for radix_threshold::hint_bin.
constexpr unsigned kNoHintBin = ~0U;

/// One digit of the MSB-first radix select: digits of 12, 11 and 9 bits. 12 bits first (exponent and 3 mantissa
/// bits) spread probabilities over many bins, so plain shared atomics rarely collide; after it only a few dozen keys
/// still match the prefix.
struct radix_digit {
  int bits;
  int shift;
  [[nodiscard]] __device__ int bins() const { return 1 << bits; }
  [[nodiscard]] __device__ unsigned of(unsigned key) const { return (key >> shift) & static_cast<unsigned>(bins() - 1); }
};

__device__ __forceinline__ radix_digit radix_digit_of_pass(int pass) {
  return pass == 0 ? radix_digit{kRadixFirstBits, 32 - kRadixFirstBits} : (pass == 1 ? radix_digit{11, 9} : radix_digit{9, 0});
}

/// The rule that takes the k largest of a set of radix keys, of which `candidates` are nonzero. The histograms come
/// from the caller: histogram_of(pass, digit, prefix, mask) returns a shared array of digit.bins() counts of the keys
/// whose (key & mask) == prefix, ready to read by every thread (pass 0: prefix and mask are 0, the whole set). A
/// block counts its own keys (find_radix_threshold); a cluster merges the counts of its blocks (select_cluster_kernel).
/// The bin is found with one block scan; every thread of the block of kThreads threads calls this alike, with
/// `radix_found` (3 unsigned, shared; 4 with a hint target). `hint_target` > 0: the first digit's bin where the count
/// from the top reaches it is returned in hint_bin (select_cluster_kernel's next hint).
template <int kThreads, typename HistogramOf>
__device__ __forceinline__ radix_threshold radix_threshold_from(int candidates, int k, HistogramOf&& histogram_of,
                                                               typename radix_digit_scan<kThreads>::TempStorage& scan_storage,
                                                               unsigned* radix_found, unsigned hint_target = 0) {
  static_assert(4 * kThreads >= (1 << kRadixFirstBits), "a thread owns 4 bins of the largest digit");
  const int tid = threadIdx.x;
  unsigned prefix = 0;
  unsigned mask = 0xffffffffU;
  unsigned need_ties = 0;
  unsigned hint_bin = kNoHintBin;
  if (candidates > k) {
    mask = 0;
    unsigned remaining = static_cast<unsigned>(k);
    if (hint_target > 0) {
      if (tid == 0) radix_found[3] = kNoHintBin;
      __syncthreads();
    }
    for (int pass = 0; pass < 3; ++pass) {
      const radix_digit digit = radix_digit_of_pass(pass);
      const int bins = digit.bins();
      const unsigned* histogram = histogram_of(pass, digit, prefix, mask);
      // Thread t owns bins bins-1-4t-i (descending); a block scan finds where the count from the top reaches
      // `remaining`.
      unsigned count[4];
      unsigned local = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int index = 4 * tid + i;
        count[i] = index < bins ? histogram[bins - 1 - index] : 0U;
        local += count[i];
      }
      unsigned long long before_wide;
      radix_digit_scan<kThreads>(scan_storage).ExclusiveSum(static_cast<unsigned long long>(local), before_wide);
      unsigned before = static_cast<unsigned>(before_wide);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (before < remaining && before + count[i] >= remaining) {
          radix_found[0] = static_cast<unsigned>(bins - 1 - (4 * tid + i));
          radix_found[1] = before;
          radix_found[2] = count[i];
        }
        if (pass == 0 && hint_target > 0 && before < hint_target && before + count[i] >= hint_target) {
          radix_found[3] = static_cast<unsigned>(bins - 1 - (4 * tid + i));
        }
        before += count[i];
      }
      __syncthreads();
      if (pass == 0 && hint_target > 0) hint_bin = radix_found[3];
      prefix |= radix_found[0] << digit.shift;
      mask |= static_cast<unsigned>(bins - 1) << digit.shift;
      remaining -= radix_found[1];
      if (radix_found[2] == remaining) break;  // the whole bin is taken: no tie to break below this digit
    }
    need_ties = remaining;
  }
  return radix_threshold{prefix, mask, need_ties, hint_bin};
}

/// The rule that takes the k largest of radix_keys[0, n), of which `candidates` are nonzero, by one block. Called by
/// every thread of a block of kThreads threads. On entry `histogram` (1 << kRadixFirstBits unsigned, shared) holds the
/// counts of the top kRadixFirstBits of every key; it is reused for the later digits.
template <int kThreads>
__device__ __forceinline__ radix_threshold find_radix_threshold(
    const unsigned* radix_keys, int n, int candidates, int k, unsigned* histogram,
    typename radix_digit_scan<kThreads>::TempStorage& scan_storage, unsigned* radix_found) {
  const int tid = threadIdx.x;
  return radix_threshold_from<kThreads>(
      candidates, k,
      [&](int pass, radix_digit digit, unsigned prefix, unsigned mask) -> const unsigned* {
        if (pass > 0) {  // the first histogram was counted with the radix keys
          for (int i = tid; i < digit.bins(); i += kThreads) histogram[i] = 0;
          __syncthreads();
          for (int c = tid; c < n; c += kThreads) {
            const unsigned radix_key = radix_keys[c];
            if ((radix_key & mask) == prefix) atomicAdd(&histogram[digit.of(radix_key)], 1U);
          }
          __syncthreads();
        }
        return histogram;
      },
      scan_storage, radix_found);
}

/// Writes the ids the rule takes among [first, end) to their places in selected[0, take), ascending (ordered_pass_range:
/// every chunk strictly above the threshold and the first ties in ascending id; `base` gives the counts of the items
/// before `first`, for blocks of a cluster that compact consecutive ranges), and pads selected[take, k) with -1.
/// key_of(c) gives chunk c's radix key (the same in both passes); taken(c, at) is called for each chunk taken, `at`
/// its place in selected; verdict(c, taken) for every chunk after its key was read for the last time. Called by every
/// thread of a block of kOrderedPassThreads threads; `pass_scratch`: ordered_pass's shared scratch.
template <typename KeyOf, typename Taken, typename Verdict, typename Base>
__device__ __forceinline__ void compact_by_rule(int first, int end, int take, int k, const radix_threshold& rule,
                                                unsigned* pass_scratch, int* selected, KeyOf&& key_of,
                                                Taken&& taken_at, Verdict&& verdict, Base&& base) {
  ordered_pass_range(
      first, end, pass_scratch,
      [&](int c) -> unsigned {
        const unsigned masked = key_of(c) & rule.mask;
        return (masked > rule.prefix ? 1U : 0U) | (masked == rule.prefix ? 2U : 0U);
      },
      [&](int c, unsigned f, unsigned above_before, unsigned ties_before) {
        const bool taken = (f & 1U) != 0 || ((f & 2U) != 0 && ties_before < rule.need_ties);
        if (taken) {
          const unsigned at = above_before + min(ties_before, rule.need_ties);
          selected[at] = c;
          taken_at(c, at);
        }
        verdict(c, taken);
      },
      static_cast<Base&&>(base));
  for (int i = take + static_cast<int>(threadIdx.x); i < k; i += kOrderedPassThreads) selected[i] = -1;
  __syncthreads();
}

/// compact_by_rule over radix_keys[first, end), each key replaced by its chunk's "selected" flag (1 or 0).
template <typename Base>
__device__ __forceinline__ void compact_top_k_range(unsigned* radix_keys, int first, int end, int take, int k,
                                                    const radix_threshold& rule, unsigned* pass_scratch, int* selected,
                                                    Base&& base) {
  compact_by_rule(
      first, end, take, k, rule, pass_scratch, selected, [&](int c) { return radix_keys[c]; }, [](int, unsigned) {},
      [&](int c, bool taken) { radix_keys[c] = taken ? 1U : 0U; }, static_cast<Base&&>(base));
}

/// compact_top_k_range over radix_keys[0, n) by a block alone.
__device__ __forceinline__ void compact_top_k(unsigned* radix_keys, int n, int take, int k,
                                              const radix_threshold& rule, unsigned* pass_scratch, int* selected) {
  compact_top_k_range(radix_keys, 0, n, take, k, rule, pass_scratch, selected, block_alone{});
}

}  // namespace shadowkv::cuda::selection
