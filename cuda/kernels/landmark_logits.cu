#include "landmark_logits.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/bf16_mma.cuh"
#include "cutlass/arch/barrier.h"
#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "common/fp8_vectors.cuh"
#include "common/per_device_cache.hpp"
#include "common/phase_stamps.cuh"
#include "cuda_check.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// CTAs per multiprocessor that the register budget must allow: four (64 registers a thread, 32 warps) up to four
// query heads a KV head; with eight, the CTA's shared memory (~60 KiB: the copy rings, q and the tile logits of
// eight heads) leaves room for three on an H100/H200 anyway, so the registers may grow to 80. Two centroids (kC = 2)
// double the sums a lane keeps and hold 16 decoded codes a vector: one CTA fewer from two query heads up. On tensor
// cores (kMma) a batch is 16 rows a warp, twice the copy ring: two CTAs an SM, as their ~107 KiB of shared memory
// allows anyway.
template <int kG, int kC, bool kMma>
constexpr int min_ctas_per_multiprocessor() {
  if constexpr (kMma) return 2;
  // Two centroids: one CTA an SM fewer than their sums alone would allow. At 64 and 80 registers the e4m3
  // instantiations spilled 24-176 bytes of stack inside the tile loop; with these bounds none spills, and the kernel
  // went 40.3 -> 24.9 µs at B = 1 and 232.7 -> 151.1 at B = 8 (S = 122880; docs/performance.md; session 32).
  if constexpr (kC == 2) return kG * kC <= 4 ? 3 : 2;
  return kG * kC <= 4 ? 4 : (kG * kC <= 8 ? 3 : 2);
}
// Batches in a warp's copy ring: two are in flight while the warp computes the third, also across tile boundaries,
// block barriers and tile epilogues.
constexpr int kStages = 3;
// Tensor-core instantiations (kMma): whole tiles copied by the TMA's bulk copies, each stage one tile with its
// transaction barrier; up to kTileStages tiles of a CTA in flight.
constexpr int kTileStages = 3;
// Sequence entries in shared memory are reserved in multiples of this, so that the dynamic shared memory size (and
// the cached occupancy that depends on it) changes only every kSequenceRounding sequences of batch size.
constexpr int kSequenceRounding = 32;

/// How a warp covers landmark rows of T, kRowBytes each, for kG query heads. A lane reads two 16-byte vectors of a row
/// (vectors part and part + kLanesPerRow: each warp-wide copy covers whole 32-byte sectors) and two rows per batch, so
/// a batch is 2 KiB a warp and the two rows share every shared-memory read of q (q stays out of registers). Two
/// vectors a lane keep a row to 4-16 lanes, so summing it over its lanes takes few shuffles.
///
/// Two-centroid rows (kC = 2, T = e4m3_code): a row is a chunk's 2·D codes, centroid 1's D then centroid 2's, so the
/// lane's vector k = 0 is a slice of centroid 1 and k = 1 the same slice of centroid 2: both meet the same q elements,
/// and each (row, head) has two sums, one per centroid (index (u * kG + g) * kC + c).
///
/// On tensor cores (kMma, bf16 landmarks; see the kernel): four lanes a row, each reading every fourth 16-byte vector
/// of it (vectors part, part + 4, ...) from the tile in shared memory, and two rows eight apart, so that a batch is 16
/// rows, one MMA's M, and the 16 bytes a lane reads are its A fragments as they stand (the MMA's k order permuted,
/// q's alike).
template <typename T, int kRowBytes, int kG, int kC, bool kMma = false>
struct row_split {
  static constexpr int kElements = vector16<T>::elements;  // per 16-byte vector
  static constexpr int kDims = kRowBytes / static_cast<int>(sizeof(T));
  static constexpr bool kTensorCores = kMma;
  static constexpr int kBytesPerRow = kRowBytes;
  static constexpr int kLanesPerRow = kMma ? 4 : kRowBytes / 32;
  static constexpr int kVectorsPerLane = kRowBytes / 16 / kLanesPerRow;  // of each row
  static constexpr int kRowGroups = 32 / kLanesPerRow;  // rows side by side in one warp-wide copy
  static constexpr int kRowsPerLane = 2;                // per batch
  static constexpr int kBatchRows = kRowGroups * kRowsPerLane;
  static constexpr int kSlots = kRowsPerLane * kVectorsPerLane;  // 16-byte copies a lane makes per batch
  static constexpr int kSums = kRowsPerLane * kG * kC;            // dot products a lane accumulates per batch
  static constexpr int kQueryDims = kDims / kC;                   // elements of q a row meets (D)
  // After the reduction over a row's lanes: whole sums a lane holds (when there are fewer sums than lanes, every
  // lane holds one, shared by kLanesPerRow / kSums lanes).
  static constexpr int kKept = kSums >= kLanesPerRow ? kSums / kLanesPerRow : 1;
  // Tensor cores: the B operand is q in three bf16 terms (common/bf16_mma.cuh), an n8 block of columns (head, term):
  // one (hi, mid) block a quad of heads, column 2h + term for head 4 * quad + h, then one block of lo terms, column
  // 2h for head h and 2h + 1 for head h + 4. A lane's accumulators (columns 2t, 2t + 1) then hold whole heads.
  static constexpr int kKSteps = kDims / 16;
  static constexpr int kHeadQuads = (kG + 3) / 4;
  static constexpr int kBlocks = kHeadQuads + 1;
  /// q in shared memory: float [kG][kQueryDims], or the B fragments [kKSteps][kBlocks][32 lanes] as uint2.
  static constexpr int kQueryBytes = kMma ? kKSteps * kBlocks * 32 * 8 : kG * kQueryDims * 4;
  static_assert(kRowBytes % 32 == 0 && kLanesPerRow >= 2 && kLanesPerRow <= 32, "row of 64-1024 bytes");
  static_assert(!kMma || (std::is_same_v<T, __nv_bfloat16> && kC == 1 && kG <= 8 && kDims % 32 == 0),
                "tensor-core logits: bf16 landmark rows of a multiple of 32 elements, up to 8 query heads");
  static_assert(kElements % 4 == 0, "q is read as float4");
  static_assert(kC == 1 || kLanesPerRow * kElements == kQueryDims, "two centroids: vector k of a lane is centroid k");
};

/// The per-chunk weights of two-centroid scores (layer_view::centroid_scales and first_counts), kept only by the
/// instantiations that score two centroids (an empty base elsewhere: the landmark kernel's shared memory is as before).
struct centroid_weights {
  const float* scales;               ///< [.., 2]: centroid 1's and 2's scale
  const std::uint8_t* first_counts;  ///< keys in the first cluster
};
struct no_centroid_weights {};
template <int kC>
using weights_of = std::conditional_t<kC == 2, centroid_weights, no_centroid_weights>;

/// One sequence of the batch as the CTA sees it (the weights from [Hkv, max_chunks] on).
template <int kC>
struct sequence_entry : weights_of<kC> {
  const void* landmarks;         ///< T [Hkv, max_chunks, D], or the codes [Hkv, max_chunks, 2·D]
  const std::uint8_t* outliers;  ///< [Hkv, max_chunks]
  int context_chunks;
  int first_tile;  ///< live tiles of the sequences before this one (every head's); the last entry holds the total
};

/// One live tile of the CTA's share: rows [index * tile_rows, index * tile_rows + rows) of head `head` of batch entry
/// `sequence` (the weights from the tile's first row on).
template <int kC>
struct tile_descriptor : weights_of<kC> {
  const void* source;            ///< T: the tile's first landmark row
  const std::uint8_t* outliers;  ///< the tile's first outlier flag
  int rows;
  int sequence;
  int head;
  int index;
};

// The CTA's tile descriptors live in a ring in shared memory (the warps would otherwise each keep two tile cursors in
// registers): the first kDescribedAhead are written before the main loop, then one thread writes descriptor
// t + kDescribedAhead right after the barrier that ends tile t. It is visible to every warp after the barrier ending
// tile t + 1, and first read in tile t + 3 (the copies run at most two tiles ahead of the arithmetic). In use at
// once: t (its epilogue) to t + kDescribedAhead, six slots of eight.
constexpr int kDescriptorSlots = 8;
constexpr int kDescribedAhead = 5;
// With a pool (a launch beside the value fetch, whose CTAs slow the logits CTAs that share their multiprocessors by
// up to ~1.6x: docs/performance.md; session 17), each CTA's fixed share is 1 / kFixedShareDivisor of its even share, and
// the rest of the tiles are claimed from a shared counter kClaimTiles at a time (consecutive tiles, mostly of one
// (sequence, head): one staging of q for several tiles), so that the slowed CTAs take fewer.
constexpr int kFixedShareDivisor = 2;
constexpr int kClaimTiles = 4;
static_assert(kTileStages <= kDescribedAhead, "a tile's descriptor is written before its bulk copy is issued");

/// Dynamic shared memory of one CTA: byte offsets, each 16-byte aligned.
struct shared_layout {
  int rings;        ///< uint4 [kWarps][kStages][kSlots][32]: each lane's own copy ring; kMma: [kTileStages] tiles
  int barriers;     ///< kMma: a transaction barrier (uint64) per tile stage
  int queries;      ///< float [kG][kDims], in the order the lanes read them (see stage_queries)
  int tile_logits;  ///< float [2][kG][tile_rows]: this tile's logits and the previous tile's, still being written out
  int tile_maxima;  ///< kMma: float [2][kWarps][kG]: each warp's max of its rows' logits a query head, by tile parity
  int descriptors;  ///< tile_descriptor [kDescriptorSlots]
  int sequences;    ///< sequence_entry [batch + 1, rounded up]
  int bytes;
};

template <typename Split, int kG, int kC>
__host__ __device__ shared_layout shared_layout_for(int tile_rows, int batch) {
  auto align16 = [](int bytes) { return (bytes + 15) / 16 * 16; };
  shared_layout layout{};
  layout.rings = 0;
  layout.barriers = layout.rings + (Split::kTensorCores ? kTileStages * tile_rows * Split::kBytesPerRow
                                                : kWarps * kStages * Split::kSlots * 32 * 16);
  layout.queries = layout.barriers + (Split::kTensorCores ? align16(kTileStages * 8) : 0);
  layout.tile_logits = layout.queries + align16(Split::kQueryBytes);
  layout.tile_maxima = layout.tile_logits + align16(2 * kG * tile_rows * 4);
  layout.descriptors = layout.tile_maxima + (Split::kTensorCores ? align16(2 * kWarps * kG * 4) : 0);
  layout.sequences = layout.descriptors + align16(kDescriptorSlots * static_cast<int>(sizeof(tile_descriptor<kC>)));
  const int entries = (batch + 1 + kSequenceRounding - 1) / kSequenceRounding * kSequenceRounding;
  layout.bytes = layout.sequences + entries * static_cast<int>(sizeof(sequence_entry<kC>));
  return layout;
}

/// Sums each of the kSums values over the lanes of a row group (kOffset: half their number; `part`: the lane's index
/// among them): a reduce-scatter. Each round halves the values a lane holds (a lane keeps the upper half when its
/// offset bit is set and receives its partner's copy of that half), so the shuffles total about kSums instead of
/// kSums * log2(lanes). Afterwards lane `part` holds the sums [part * kKept, (part + 1) * kKept) in v[0, kKept); with
/// fewer values than lanes the last rounds are butterflies and lanes holding the same index hold the same sum. Every
/// value is summed by the same tree over the lanes (pairs at offset kLanesPerRow / 2 first, then half that, ...),
/// whichever lane ends with it, so equal rows give bit-equal sums.
template <int kOffset, int kCount, int kSums>
__device__ __forceinline__ void reduce_scatter(float (&v)[kSums], int part) {
  if constexpr (kOffset > 0) {
    if constexpr (kCount > 1) {
      constexpr int kHalf = kCount / 2;
      const bool upper = (part & kOffset) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float keep = upper ? v[i + kHalf] : v[i];
        const float give = upper ? v[i] : v[i + kHalf];
        v[i] = keep + __shfl_xor_sync(0xffffffffU, give, kOffset);
      }
      reduce_scatter<kOffset / 2, kHalf>(v, part);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffU, v[0], kOffset);
      reduce_scatter<kOffset / 2, 1>(v, part);
    }
  }
}

/// The live tile at position `live_index` of the batch's enumeration (sequence-major, then head, then tile).
template <int kDims, typename T, int kC>
__device__ tile_descriptor<kC> describe_tile(const sequence_entry<kC>* sequences, int batch, int live_index,
                                             int tile_rows, const dims& d) {
  // The last entry that starts at or before live_index; empty sequences start where the next one does, so this one
  // is not empty.
  int low = 0;
  int high = batch - 1;
  while (low < high) {
    const int middle = (low + high + 1) / 2;
    if (sequences[middle].first_tile <= live_index) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  const sequence_entry<kC>& sequence = sequences[low];
  const int per_head = (sequence.context_chunks + tile_rows - 1) / tile_rows;
  const int within = live_index - sequence.first_tile;
  tile_descriptor<kC> tile;
  tile.sequence = low;
  tile.head = within / per_head;
  tile.index = within - tile.head * per_head;
  tile.rows = min(tile_rows, sequence.context_chunks - tile.index * tile_rows);
  const long long first_row =
      static_cast<long long>(tile.head) * d.max_chunks + static_cast<long long>(tile.index) * tile_rows;
  tile.source = static_cast<const T*>(sequence.landmarks) + first_row * kDims;
  tile.outliers = sequence.outliers + first_row;
  if constexpr (kC == 2) {
    tile.scales = sequence.scales + 2 * first_row;
    tile.first_counts = sequence.first_counts + first_row;
  }
  return tile;
}

/// Asks L2 for a described tile's outlier flags (its rows' bytes, one or two 128-byte lines), so that the warps'
/// loads of them, a few tiles later, find them there and not in DRAM behind the landmark stream (Nsight Compute's
/// PC sampling, session 31: the flags' loads held 15-25% of the logits kernels' warp stall samples). Measured at
/// B = 8: the logits kernel 78 -> 72 µs; an evict_last priority was no better (docs/performance.md; session 31). The
/// tensor-core path only: on the FMA path it made the bf16 G = 4 instantiation (B = 1's) spill 20 bytes, and B = 1's
/// logits were level with it (17.1 -> 17.3 µs).
template <int kC>
__device__ __forceinline__ void prefetch_outlier_flags(const tile_descriptor<kC>& tile) {
  if (tile.rows <= 0) return;
  const char* first = reinterpret_cast<const char*>(tile.outliers);
  asm volatile("prefetch.global.L2 [%0];" ::"l"(first));
  asm volatile("prefetch.global.L2 [%0];" ::"l"(first + tile.rows - 1));
}

// A persistent grid: CTA x takes a contiguous share of the batch's live tiles (sequence-major, then head, then tile;
// the shares differ by at most one tile, whatever the context lengths), so there is no partial last wave and a CTA
// mostly stays on one (sequence, head) and its q. With a pool (`claims`: a launch beside the value fetch) the shares
// cover the first half of the tiles, and thread 0 claims the rest kClaimTiles at a time as its descriptors run out. The 8 warps split each tile into batches of kBatchRows rows
// (warp w takes batches w, w + 8, ...). Every lane copies its own slices of the rows into its own ring slots with
// cp.async, kStages - 1 batches ahead, and reads back only what it copied: no barrier guards the ring, and the copies
// need no registers, so the bytes in flight (2 KiB a batch, two batches a warp) do not compete with the arithmetic
// for registers. One block barrier per tile hands the tile's logits (double-buffered in shared memory) to the
// epilogue: coalesced logit writes and the tile's softmax partial per query head, one warp per head; the copies of
// the next batches are in flight meanwhile.
//
// kMma (bf16 rows of 64 or 128 elements when the batch has many tiles; the planner in launch_decode_landmark_logits): whole tiles land in
// shared memory by the TMA's bulk copies (thread 0 issues tile t + kTileStages into the stage that tile t frees; a
// transaction barrier a stage), a warp's batch is 16 rows, one m16n8k16 MMA's M, and each lane's A fragments are
// 16-byte vectors of the tile as they stand (row_split: every fourth vector of rows g and g + 8). q is the B operand, in three bf16 terms (hi + mid + lo == q, so every product is
// exact and only the float32 accumulation differs from the FMA sums), staged once per (sequence, head) as ready
// fragments in shared memory: D / 16 k steps x (one block a quad of heads + one of lo terms) MMAs a batch, ~40
// instructions a warp per 4 KiB of landmarks where the FMA path issues ~500, so the kernel is left to its bytes.
// Every row of a batch goes through the same MMAs and the same (hi + mid) + lo additions, so equal landmarks still give
// bit-equal logits.
//
// kC = 2: two-centroid scores (T = e4m3_code, rows of codes; see row_split). The logit of a row is
// log(w1 e^(s q·ĉ1) + w2 e^(s q·ĉ2)) as in selection/landmark_scoring.cu's tiled kernel (shadowkv/chunk_centroids.hpp),
// formed by the lane that keeps the row's two sums.
template <typename T, int kRowBytes, int kG, int kC, bool kMma>
__global__ void __launch_bounds__(kThreads, min_ctas_per_multiprocessor<kG, kC, kMma>())
    decode_landmark_logits_kernel(const dims d, const layer_view* views, const int* batch_slots, const int layer,
                                  const int batch, const strided_tensor queries, const int tile_rows, const int tiles,
                                  float* logits, float* partials, unsigned* claims) {
  start_phase_stamps(stamped_kernel::logits);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  phase_stamp(stamped_kernel::logits, 1);
  using split = row_split<T, kRowBytes, kG, kC, kMma>;
  using sequence_entry = shadowkv::cuda::sequence_entry<kC>;
  using tile_descriptor = shadowkv::cuda::tile_descriptor<kC>;
  constexpr int kLanesPerRow = split::kLanesPerRow;
  constexpr int kVectorsPerLane = split::kVectorsPerLane;
  constexpr int kQuads = split::kElements / 4;  // float4 of q per 16-byte vector of landmarks
  constexpr int kQueryVectors = kC == 2 ? 1 : kVectorsPerLane;  // q vectors a lane reads per head
  extern __shared__ __align__(16) unsigned char shared[];
  const shared_layout layout = shared_layout_for<split, kG, kC>(tile_rows, batch);
  uint4* rings = reinterpret_cast<uint4*>(shared + layout.rings);
  float* q_shared = reinterpret_cast<float*>(shared + layout.queries);
  float* tile_logits = reinterpret_cast<float*>(shared + layout.tile_logits);
  float* tile_maxima = reinterpret_cast<float*>(shared + layout.tile_maxima);
  // The lean epilogue (tensor cores only): the warps store their rows' logits to global memory and their
  // maxima to tile_maxima as they compute them, and the epilogue's head g falls to warp kWarps - 1 - g, away from
  // thread 0, which issues the tiles and writes the descriptors.
  constexpr bool lean = kMma;
  tile_descriptor* descriptors = reinterpret_cast<tile_descriptor*>(shared + layout.descriptors);
  sequence_entry* sequences = reinterpret_cast<sequence_entry*>(shared + layout.sequences);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int part = lane % kLanesPerRow;       // which vectors of a row this lane reads
  const int row_group = lane / kLanesPerRow;  // which of the rows side by side

  for (int b = threadIdx.x; b < batch; b += kThreads) {
    const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
    if constexpr (kC == 2) {
      sequences[b].landmarks = view->centroid_codes;
      sequences[b].scales = view->centroid_scales;
      sequences[b].first_counts = view->first_counts;
    } else {
      sequences[b].landmarks = view->landmarks;
    }
    sequences[b].outliers = view->is_outlier;
    sequences[b].context_chunks = context_chunks_of(view, d);
  }
  using tile_barrier = cutlass::arch::ClusterTransactionBarrier;
  std::uint64_t* barriers = reinterpret_cast<std::uint64_t*>(shared + layout.barriers);
  if constexpr (kMma) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kTileStages; ++s) tile_barrier::init(&barriers[s], 1);
      cutlass::arch::fence_barrier_init();
    }
  }
  __syncthreads();
  phase_stamp(stamped_kernel::logits, 42);
  // The CTA's fixed share [share_edge(x), share_edge(x + 1)) of the first `fixed_tiles()` live tiles, once warp 0 has
  // counted them; with a pool (claims), the rest are claimed kClaimTiles at a time (see next_descriptor).
  auto fixed_tiles = [&] {
    const int live = sequences[batch].first_tile;
    return claims != nullptr ? live / kFixedShareDivisor : live;
  };
  auto share_edge = [&](int cta) {
    return static_cast<int>(static_cast<long long>(cta) * fixed_tiles() / gridDim.x);
  };
  // Thread 0's cursor over the CTA's tiles: its fixed share, then claims from the pool until it is empty. Each call
  // describes the CTA's next tile, or returns rows == 0 when there is none (and so on every later call).
  int fixed_next = 0;
  int fixed_end = 0;
  int claim_next = 0;
  int claim_end = 0;
  bool pool_empty = claims == nullptr;
  auto next_descriptor = [&]() {
    int live = -1;
    if (fixed_next < fixed_end) {
      live = fixed_next++;
    } else if (!pool_empty) {
      if (claim_next == claim_end) {
        const int total = sequences[batch].first_tile;
        claim_next = fixed_tiles() + static_cast<int>(atomicAdd(claims, static_cast<unsigned>(kClaimTiles)));
        claim_end = min(claim_next + kClaimTiles, total);
        if (claim_next >= total) {
          pool_empty = true;
          claim_next = claim_end;
        }
      }
      if (claim_next < claim_end) live = claim_next++;
    }
    tile_descriptor tile{};
    if (live >= 0) tile = describe_tile<split::kDims, T, kC>(sequences, batch, live, tile_rows, d);
    return tile;
  };
  if (warp == 0) {
    int before = 0;
    for (int first = 0; first <= batch; first += 32) {
      const int b = first + lane;
      const int count = b < batch ? d.kv_heads * ((sequences[b].context_chunks + tile_rows - 1) / tile_rows) : 0;
      int inclusive = count;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffU, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      if (b <= batch) sequences[b].first_tile = before + inclusive - count;
      before += __shfl_sync(0xffffffffU, inclusive, 31);
    }
    __syncwarp();
    if (claims == nullptr) {
      // No pool: the share's first kDescribedAhead tiles, a lane each (thread 0 alone took ~1.6 µs at B = 1, a
      // serial chain of divisions and shared loads before the first copy; docs/performance.md; session 19).
      const int share_first = share_edge(blockIdx.x);
      const int share_end = share_edge(blockIdx.x + 1);
      if (lane < kDescribedAhead) {
        tile_descriptor tile{};
        if (share_first + lane < share_end) {
          tile = describe_tile<split::kDims, T, kC>(sequences, batch, share_first + lane, tile_rows, d);
        }
        descriptors[lane] = tile;
        if constexpr (kMma) prefetch_outlier_flags(tile);
      }
      if (lane == 0) {
        fixed_next = min(share_first + kDescribedAhead, share_end);
        fixed_end = share_end;
      }
    } else if (lane == 0) {
      fixed_next = share_edge(blockIdx.x);
      fixed_end = share_edge(blockIdx.x + 1);
      for (int i = 0; i < kDescribedAhead; ++i) {
        descriptors[i] = next_descriptor();
        if constexpr (kMma) prefetch_outlier_flags(descriptors[i]);
      }
    }
  }
  __syncthreads();
  phase_stamp(stamped_kernel::logits, 43);
  // Whether the CTA's tile `ordinal` exists (its descriptor, written kDescribedAhead tiles ahead, has rows): every
  // thread sees the same answer once a block barrier has followed the write.
  auto has_tile = [&](int ordinal) { return descriptors[ordinal % kDescriptorSlots].rows > 0; };

  // q of (sequence, head) as float, ordered [g][k][quad][part][4]: for one (g, k, quad) the lanes of a row group
  // read kLanesPerRow consecutive float4 (no bank conflicts), and the row groups read the same ones (broadcasts).
  // Two centroids: D elements, k = 0 only (both of a lane's vectors meet the same slice of q).
  // Staged in two halves: load_queries issues every load of the thread's elements before any is used (one round trip,
  // not one an element or fragment), store_queries writes them to q_shared; at the start the landmark copies are
  // issued between the two, so that q's loads do not queue behind them (docs/performance.md; session 19).
  auto query = [&](const tile_descriptor& tile, int g, int e) {
    return g < d.group ? load_any(queries.data, queries.type,
                                  tile.sequence * queries.stride[0] +
                                      (static_cast<long long>(tile.head) * d.group + g) * queries.stride[2] +
                                      e * queries.stride[3])
                       : 0.0F;
  };
  // kMma: the B fragments of every k step and column block, [kKSteps][kBlocks][lane] (uint2: b0, b1), item i a
  // fragment of 4 elements; else item i is element i of [kG][kQueryDims].
  constexpr int kQueryItems = kMma ? split::kKSteps * split::kBlocks * 32 : kG * split::kQueryDims;
  constexpr int kItemsPerThread = (kQueryItems + kThreads - 1) / kThreads;
  constexpr int kValuesPerItem = kMma ? 4 : 1;
  // Items a thread keeps in registers from load_queries to store_queries: all of them on tensor cores (up to 12
  // values under their 128 registers), two on the FMA path (64-80 registers: with more, the 8-head instantiations
  // spill); store_queries loads the rest itself.
  constexpr int kStagedItems = kMma ? kItemsPerThread : (kItemsPerThread < 2 ? kItemsPerThread : 2);
  struct staged_queries {
    float values[kStagedItems][kValuesPerItem];
  };
  // Lane l of fragment item i gives column n = l / 4 and the k pairs of t = l % 4; k step 2j + h meets the elements
  // 8 (t + 4j) + 4h + 0..3 of q, as the A fragments of the lane's copies meet the landmark row (row_split).
  auto fragment_of = [](int i, int& g, int& term, int& e) {
    const int l = i % 32;
    const int block = (i / 32) % split::kBlocks;
    const int step = i / (32 * split::kBlocks);
    const int n = l / 4;
    const bool lo_block = block == split::kHeadQuads;
    g = lo_block ? n / 2 + 4 * (n % 2) : 4 * block + n / 2;
    term = lo_block ? 2 : n % 2;
    e = 8 * (l % 4 + 4 * (step / 2)) + 4 * (step % 2);
  };
  auto load_items = [&](const tile_descriptor& tile, int first_item, auto& values) {
    constexpr int kCount = static_cast<int>(sizeof(values) / sizeof(values[0]));
#pragma unroll
    for (int jj = 0; jj < kCount; ++jj) {
      const int j = first_item + jj;
      const int i = threadIdx.x + j * kThreads;
      if constexpr (kMma) {
        int g = 0;
        int term = 0;
        int e = 0;
        fragment_of(i, g, term, e);
#pragma unroll
        for (int x = 0; x < 4; ++x) values[jj][x] = i < kQueryItems ? query(tile, g, e + x) : 0.0F;
      } else {
        values[jj][0] = i < kQueryItems ? query(tile, i / split::kQueryDims, i % split::kQueryDims) : 0.0F;
      }
    }
  };
  auto load_queries = [&](const tile_descriptor& tile) {
    staged_queries staged;
    load_items(tile, 0, staged.values);
    return staged;
  };
  auto store_item = [&](int j, const float (&value)[kValuesPerItem]) {
    {
      const int i = threadIdx.x + j * kThreads;
      if (i >= kQueryItems) return;
      if constexpr (kMma) {
        int g = 0;
        int term = 0;
        int e = 0;
        fragment_of(i, g, term, e);
        unsigned low[kBf16Terms];
        unsigned high[kBf16Terms];
        split_bf16x2(value[0], value[1], low);
        split_bf16x2(value[2], value[3], high);
        // (a selection, not an index: the terms stay in registers)
        auto pick = [term](const unsigned(&terms)[kBf16Terms]) {
          return term == 0 ? terms[0] : (term == 1 ? terms[1] : terms[2]);
        };
        reinterpret_cast<uint2*>(q_shared)[i] = make_uint2(pick(low), pick(high));
      } else {
        const int e = i % split::kQueryDims;
        const int g = i / split::kQueryDims;
        const int vector = e / split::kElements;
        const int within = e - vector * split::kElements;
        const int k = vector / kLanesPerRow;
        const int owner = vector - k * kLanesPerRow;
        q_shared[(((g * kQueryVectors + k) * kQuads + within / 4) * kLanesPerRow + owner) * 4 + within % 4] = value[0];
      }
    }
  };
  auto store_queries = [&](const tile_descriptor& tile, const staged_queries& staged) {
#pragma unroll
    for (int j = 0; j < kStagedItems; ++j) store_item(j, staged.values[j]);
    if constexpr (kItemsPerThread > kStagedItems) {
      float rest[kItemsPerThread - kStagedItems][kValuesPerItem];
      load_items(tile, kStagedItems, rest);
#pragma unroll
      for (int j = kStagedItems; j < kItemsPerThread; ++j) store_item(j, rest[j - kStagedItems]);
    }
  };

  // Logits of the tile to global memory, and its softmax partial (max, sum exp) per query head (rows past the
  // context are not in it, as in chunk_selection.cu: they would add -inf to the max and 0 to the sum).
  // Lean (tensor cores): the logits are stored already, and the max is that of the warps' maxima of the tile (the
  // max of the same values, so the same bits).
  auto write_tile = [&](const tile_descriptor& tile, const float* tile_buffer, const float* maxima) {
    for (int g = lean ? kWarps - 1 - warp : warp; g < d.group; g += kWarps) {
      const float* row_logits = tile_buffer + g * tile_rows;
      const long long j =
          static_cast<long long>(tile.sequence) * d.q_heads + static_cast<long long>(tile.head) * d.group + g;
      float m = kNegativeInfinity;
      if (lean) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, maxima[w * kG + g]);
      } else {
        float* out = logits + j * d.max_chunks + static_cast<long long>(tile.index) * tile_rows;
        for (int r = lane; r < tile.rows; r += 32) {
          const float x = row_logits[r];
          out[r] = x;
          m = fmaxf(m, x);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffU, m, offset));
      }
      float s = 0.0F;
      for (int r = lane; r < tile.rows; r += 32) {
        const float x = row_logits[r];
        s += x == kNegativeInfinity ? 0.0F : expf(x - m);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffU, s, offset);
      if (lane == 0) {
        // step_workspace::selection_partials: row (sequence, head) of 2 * G * tiles floats.
        float* partial = partials + ((static_cast<long long>(tile.sequence) * d.kv_heads + tile.head) * d.group + g) *
                                        tiles * 2 +
                         static_cast<long long>(tile.index) * 2;
        partial[0] = m;
        partial[1] = s;
      }
    }
  };

  const int batches_per_tile = (tile_rows + split::kBatchRows - 1) / split::kBatchRows;
  const int steps_per_tile = (batches_per_tile + kWarps - 1) / kWarps;  // batches of each warp per tile
  uint4* warp_ring = rings + warp * kStages * split::kSlots * 32 + lane;  // slot i of stage s: [(s * kSlots + i) * 32]

  // The copy side runs kStages - 1 steps ahead of the arithmetic over the same sequence of (tile, batch).
  int copy_ordinal = 0;
  int copy_sub = 0;  // the warp's batch within the tile
  auto issue_copies = [&](int copy_stage) {
    if (has_tile(copy_ordinal)) {
      const tile_descriptor& tile = descriptors[copy_ordinal % kDescriptorSlots];
      const int rows = tile.rows;
      const int first_row = (warp + copy_sub * kWarps) * split::kBatchRows;
      if (first_row < rows) {
        // Every landmark is read once a step (read_once_policy; made here, not held across the loop in registers).
        const unsigned long long landmark_policy = read_once_policy();
        const T* tile_source = static_cast<const T*>(tile.source);
        uint4* ring = warp_ring + copy_stage * split::kSlots * 32;
#pragma unroll
        for (int u = 0; u < split::kRowsPerLane; ++u) {
          const int row = first_row + u * split::kRowGroups + row_group;
          const bool live = row < rows;  // else zeros: those sums are computed and never stored
          const T* source =
              tile_source + static_cast<long long>(live ? row : 0) * split::kDims + part * split::kElements;
#pragma unroll
          for (int k = 0; k < kVectorsPerLane; ++k) {
            copy_async_or_zero_with_policy(ring + (u * kVectorsPerLane + k) * 32,
                                           source + k * kLanesPerRow * split::kElements, live, landmark_policy);
          }
        }
      }
      if (++copy_sub == steps_per_tile) {
        copy_sub = 0;
        ++copy_ordinal;
      }
    }
    commit_async_copies();  // possibly empty: one group per step keeps the wait count fixed
  };

  // kMma: the whole of tile `ordinal` (its rows are contiguous) into its stage, by thread 0; its barrier completes when
  // the bytes have landed. Called for a stage only after the barrier that ends the tile it held before.
  auto issue_tile = [&](int ordinal) {
    const tile_descriptor& tile = descriptors[ordinal % kDescriptorSlots];
    const int stage_index = ordinal % kTileStages;
    const int bytes = tile.rows * kRowBytes;
    tile_barrier::arrive_and_expect_tx(&barriers[stage_index], static_cast<std::uint32_t>(bytes));
    const unsigned long long landmark_policy = read_once_policy();  // read once a step
    bulk_copy_with_policy(shared + layout.rings + stage_index * tile_rows * kRowBytes, tile.source,
                          reinterpret_cast<unsigned long long*>(&barriers[stage_index]),
                          static_cast<unsigned>(bytes), landmark_policy);
  };
  staged_queries first_queries{};
  if (has_tile(0)) first_queries = load_queries(descriptors[0]);
  if constexpr (kMma) {
    if (threadIdx.x == 0) {
      for (int ordinal = 0; ordinal < kTileStages && has_tile(ordinal); ++ordinal) issue_tile(ordinal);
    }
  } else {
#pragma unroll
    for (int stage = 0; stage < kStages - 1; ++stage) issue_copies(stage);
  }
  if (has_tile(0)) store_queries(descriptors[0], first_queries);
  __syncthreads();
  phase_stamp(stamped_kernel::logits, 44);

  // Of the kSums sums (index (u * kG + g) * kC + c), the ones this lane keeps after the reduction, and so the row it
  // stores. Two centroids: a lane keeping one sum gets the other of its pair from the lane that keeps it (lane ^
  // kPartner), and only the lane of the pair's first sum stores.
  int kept_first = 0;
  bool keeps = true;
  if constexpr (split::kSums >= kLanesPerRow) {
    static_assert((kG * kC) % split::kKept == 0, "a lane's kept sums belong to one row");
    kept_first = part * split::kKept;
  } else {
    kept_first = part / (kLanesPerRow / split::kSums);
    keeps = part % (kLanesPerRow / split::kSums) == 0;
  }
  constexpr int kPartner = split::kSums >= kLanesPerRow ? 1 : kLanesPerRow / split::kSums;
  if constexpr (kC == 2 && split::kKept == 1) keeps = keeps && kept_first % 2 == 0;
  constexpr int kKeptPairs = kC == 2 ? (split::kKept >= 2 ? split::kKept / 2 : 1) : split::kKept;  // logits stored
  const int kept_row_offset = (kept_first / (kG * kC)) * split::kRowGroups + row_group;

  int stage = 0;
  for (int ordinal = 0; has_tile(ordinal); ++ordinal) {
    const tile_descriptor& tile = descriptors[ordinal % kDescriptorSlots];
    float* buffer = tile_logits + (ordinal & 1) * kG * tile_rows;
    float* maxima_of_tile = tile_maxima + (ordinal & 1) * kWarps * kG;  // lean: [kWarps][kG]
    if constexpr (kMma) tile_barrier::wait(&barriers[ordinal % kTileStages], (ordinal / kTileStages) & 1);
    if constexpr (kMma) phase_stamp(stamped_kernel::logits, 40);
    for (int sub = 0; sub < steps_per_tile; ++sub) {
      if constexpr (!kMma) {
        // Refills the stage that the previous step read (its values were consumed before this point).
        issue_copies(stage == 0 ? kStages - 1 : stage - 1);
        wait_async_copies<kStages - 1>();  // this lane's copies for this step have landed
      }
      const int rows = tile.rows;
      const int first_row = (warp + sub * kWarps) * split::kBatchRows;
      if constexpr (kMma) {
        if (first_row < rows) {
          // Rows first_row + row_group and 8 further: the A fragments' rows g and g + 8 (row_group == lane / 4).
          const int row = first_row + row_group;
          const bool live[2] = {row < rows, row + 8 < rows};
          const bool outlier[2] = {live[0] && __ldg(tile.outliers + row) != 0,
                                   live[1] && __ldg(tile.outliers + row + 8) != 0};
          // The lane's vectors part + 4k of rows `row` and `row + 8` of the tile (rows past tile.rows hold stale bytes:
          // an MMA's rows are independent, and theirs are never stored).
          const unsigned char* row_bytes =
              shared + layout.rings + (ordinal % kTileStages) * tile_rows * kRowBytes + row * kRowBytes + part * 16;
          const uint2* fragments = reinterpret_cast<const uint2*>(q_shared) + lane;
          float acc[split::kBlocks][4];
#pragma unroll
          for (int block = 0; block < split::kBlocks; ++block) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[block][i] = 0.0F;
          }
#pragma unroll
          for (int k = 0; k < kVectorsPerLane; ++k) {
            // Vector part + 4k of each row: elements 8 (part + 4k) + 0..7, i.e. the lane's k pairs of k steps 2k
            // (elements 0-3) and 2k + 1 (elements 4-7).
            const uint4 upper = *reinterpret_cast<const uint4*>(row_bytes + k * 64);
            const uint4 lower = *reinterpret_cast<const uint4*>(row_bytes + 8 * kRowBytes + k * 64);
            const unsigned steps[2][4] = {{upper.x, lower.x, upper.y, lower.y}, {upper.z, lower.z, upper.w, lower.w}};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
              for (int block = 0; block < split::kBlocks; ++block) {
                const uint2 b = fragments[((2 * k + h) * split::kBlocks + block) * 32];
                mma_bf16(acc[block], steps[h], b.x, b.y);
              }
            }
          }
          // Head 4 * quad + part of rows row and row + 8: (hi + mid) + lo, the same additions for every row.
#pragma unroll
          for (int quad = 0; quad < split::kHeadQuads; ++quad) {
            const int g = 4 * quad + part;
            float m = kNegativeInfinity;  // the max of the lane's live rows, then of the warp's 16
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              if (g < d.group && live[u]) {
                const float sum = (acc[quad][2 * u] + acc[quad][2 * u + 1]) + acc[split::kHeadQuads][2 * u + quad];
                const float logit = outlier[u] ? kNegativeInfinity : d.softmax_scale * sum;
                buffer[g * tile_rows + row + 8 * u] = logit;
                const long long j = static_cast<long long>(tile.sequence) * d.q_heads +
                                    static_cast<long long>(tile.head) * d.group + g;
                logits[j * d.max_chunks + static_cast<long long>(tile.index) * tile_rows + row + 8 * u] = logit;
                m = fmaxf(m, logit);
              }
            }
            // The 8 lanes of head g (lane % 4 == part) hold its 16 rows, the warp's only batch of the tile (the
            // tensor-core path takes tiles of 128 rows: 8 warps x 16; launch_decode_landmark_logits).
#pragma unroll
            for (int offset = 4; offset < 32; offset <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffU, m, offset));
            if (row_group == 0 && g < d.group) maxima_of_tile[warp * kG + g] = m;
          }
        } else if (row_group == 0) {
          // No rows of this tile for the warp: the identity of the max.
#pragma unroll
          for (int quad = 0; quad < split::kHeadQuads; ++quad) {
            if (4 * quad + part < d.group) maxima_of_tile[warp * kG + 4 * quad + part] = kNegativeInfinity;
          }
        }
      } else if (first_row < rows) {
        const int kept_row = first_row + kept_row_offset;
        const bool kept_live = keeps && kept_row < rows;
        // Loaded before the arithmetic so that its latency hides behind it.
        const bool outlier = kept_live && __ldg(tile.outliers + kept_row) != 0;
        // Two centroids: the row's scales and cluster weights, log w (-inf for an empty cluster).
        float scale1 = 0.0F;
        float scale2 = 0.0F;
        int first_count = 0;
        if constexpr (kC == 2) {
          if (kept_live) {
            scale1 = __ldg(tile.scales + 2 * kept_row);
            scale2 = __ldg(tile.scales + 2 * kept_row + 1);
            first_count = __ldg(tile.first_counts + kept_row);
          }
        }

        const uint4* ring = warp_ring + stage * split::kSlots * 32;
        const float4* q_vectors = reinterpret_cast<const float4*>(q_shared) + part;
        float sums[split::kSums];
#pragma unroll
        for (int i = 0; i < split::kSums; ++i) sums[i] = 0.0F;
        // Each lane sums its 2 * kElements elements of a row in the same order for every row.
#pragma unroll
        for (int k = 0; k < kVectorsPerLane; ++k) {
          float x[split::kRowsPerLane][split::kElements];
#pragma unroll
          for (int u = 0; u < split::kRowsPerLane; ++u) {
            vector16<T>::to_floats(ring[(u * kVectorsPerLane + k) * 32], x[u]);
          }
#pragma unroll
          for (int quad = 0; quad < kQuads; ++quad) {
#pragma unroll
            for (int g = 0; g < kG; ++g) {
              const float4 q = q_vectors[((g * kQueryVectors + (kC == 2 ? 0 : k)) * kQuads + quad) * kLanesPerRow];
#pragma unroll
              for (int u = 0; u < split::kRowsPerLane; ++u) {
                float& sum = sums[(u * kG + g) * kC + (kC == 2 ? k : 0)];
                sum = fmaf(q.x, x[u][4 * quad + 0], sum);
                sum = fmaf(q.y, x[u][4 * quad + 1], sum);
                sum = fmaf(q.z, x[u][4 * quad + 2], sum);
                sum = fmaf(q.w, x[u][4 * quad + 3], sum);
              }
            }
          }
        }
        reduce_scatter<kLanesPerRow / 2, split::kSums>(sums, part);
        // Two centroids: the second sum of each kept pair (a lane keeping one sum takes its partner's: every lane
        // takes part in the shuffle).
        float second[kKeptPairs];
        if constexpr (kC == 2 && split::kKept == 1) {
          second[0] = __shfl_xor_sync(0xffffffffU, sums[0], kPartner);
        } else if constexpr (kC == 2) {
#pragma unroll
          for (int i = 0; i < kKeptPairs; ++i) second[i] = sums[2 * i + 1];
        }
        if (kept_live) {
          float log_w1 = kNegativeInfinity;
          float log_w2 = kNegativeInfinity;
          if constexpr (kC == 2) {
            if (first_count > 0) log_w1 = logf(static_cast<float>(first_count) / static_cast<float>(d.chunk));
            if (first_count < d.chunk) {
              log_w2 = logf(static_cast<float>(d.chunk - first_count) / static_cast<float>(d.chunk));
            }
          }
#pragma unroll
          for (int i = 0; i < kKeptPairs; ++i) {
            const int g = (kept_first / kC + i) % kG;
            if (g < d.group) {
              float logit = kNegativeInfinity;
              if (outlier) {
              } else if constexpr (kC == 2) {
                // As the tiled kernel: logaddexp(s q·ĉ1 + log w1, s q·ĉ2 + log w2).
                const float first = d.softmax_scale * (sums[kC * i] * scale1) + log_w1;
                const float other = d.softmax_scale * (second[i] * scale2) + log_w2;
                const float top = fmaxf(first, other);
                logit = top + logf(expf(first - top) + expf(other - top));
              } else {
                logit = d.softmax_scale * sums[i];
              }
              buffer[g * tile_rows + kept_row] = logit;
            }
          }
        }
      }
      stage = stage + 1 == kStages ? 0 : stage + 1;
    }

    const bool more = has_tile(ordinal + 1);
    const tile_descriptor& next = descriptors[(ordinal + 1) % kDescriptorSlots];
    const bool new_queries = more && (next.sequence != tile.sequence || next.head != tile.head);
    // Every warp's rows of this tile are in `buffer`; every warp is done with q_shared, with the epilogue of the
    // other buffer (the previous tile), which the next tile overwrites, and with descriptor slot
    // (ordinal + kDescribedAhead) % kDescriptorSlots.
    if constexpr (kMma) phase_stamp(stamped_kernel::logits, 41);
    __syncthreads();
    phase_stamp(stamped_kernel::logits, 45);
    // kMma: every warp is done with this tile's stage; refill it with the tile kTileStages on (its descriptor was
    // written kDescribedAhead - kTileStages tiles ago).
    if (kMma && threadIdx.x == 0 && has_tile(ordinal + kTileStages)) issue_tile(ordinal + kTileStages);
    if (threadIdx.x == 0) {
      if constexpr (kMma) {
        const tile_descriptor ahead = next_descriptor();
        descriptors[(ordinal + kDescribedAhead) % kDescriptorSlots] = ahead;
        prefetch_outlier_flags(ahead);
      } else {
        descriptors[(ordinal + kDescribedAhead) % kDescriptorSlots] = next_descriptor();
      }
    }
    if (new_queries) {
      if constexpr (kMma) {
        store_queries(next, load_queries(next));
      } else {
        // An item at a time here: the FMA instantiations' registers are full inside the tile loop (staging them all
        // at once spills the 8-head ones).
#pragma unroll 1
        for (int j = 0; j < kItemsPerThread; ++j) {
          float value[1][kValuesPerItem];
          load_items(next, j, value);
          store_item(j, value[0]);
        }
      }
    }
    write_tile(tile, buffer, maxima_of_tile);
    if constexpr (kMma) phase_stamp(stamped_kernel::logits, 56);
    if (new_queries) __syncthreads();
  }
  if (claims != nullptr && threadIdx.x == 0) {
    // The last CTA to finish puts the pool's counters back to zero for the next launch (every CTA has made its last
    // claim before it counts itself done; the next launch reads them after this grid has completed).
    if (atomicAdd(claims + 1, 1U) == gridDim.x - 1) {
      atomicExch(claims, 0U);
      atomicExch(claims + 1, 0U);
    }
  }
  finish_phase_stamps(stamped_kernel::logits, 49);
}

/// CTAs of the instantiation that fit on one multiprocessor of the current device with `shared_bytes` of dynamic
/// shared memory; 0 if it does not fit. Host-side queries and attributes on every launch are a slow path, so the
/// answer is kept per (device, size); a query also lets the kernel use the device's opt-in shared memory (one fixed
/// value, so concurrent launches of other sizes never see it lowered) and asks for the largest shared-memory carveout,
/// so that the launch gets the residency the grid is sized for (one CTA short per multiprocessor would leave a
/// second wave of whole shares).
template <typename T, int kRowBytes, int kG, int kC, bool kMma>
int resident_ctas(int shared_bytes) {
  static per_device_cache<int> known;  // (device, shared bytes) -> CTAs per multiprocessor
  return known.get(shared_bytes, [](int device, int bytes) {
    auto kernel = decode_landmark_logits_kernel<T, kRowBytes, kG, kC, kMma>;
    int optin = 0;
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    int ctas = 0;
    if (bytes <= optin) {
      SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
      SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
      SHADOWKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kThreads,
                                                                      static_cast<std::size_t>(bytes)));
    }
    return ctas;
  });
}

/// The current device's compute capability (major), asked once per device.
int compute_capability_major() {
  static per_device_cache<int> known;
  return known.get(0, [](int device, int) {
    int major = 0;
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major;
  });
}

template <typename T, int kRowBytes, int kG, int kC, bool kMma>
bool launch_with(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                 const strided_tensor& queries, int tile_rows, int tiles, int multiprocessors, int beside_ctas,
                 float* logits, float* partials, unsigned* claims, cudaStream_t stream) {
  using split = row_split<T, kRowBytes, kG, kC, kMma>;
  const shared_layout layout = shared_layout_for<split, kG, kC>(tile_rows, batch);
  const int per_multiprocessor = resident_ctas<T, kRowBytes, kG, kC, kMma>(layout.bytes);
  if (per_multiprocessor < 1) return false;
  // Exactly the resident CTAs (one wave) less those another kernel may hold beside it (each takes the place of one of
  // ours on its multiprocessor), fewer only when there are fewer tiles than that even with every chunk live.
  const long long most_tiles = static_cast<long long>(batch) * d.kv_heads * tiles;
  const long long resident = static_cast<long long>(per_multiprocessor) * std::max(multiprocessors, 1);
  const long long ctas = std::min<long long>(
      std::max<long long>(resident - std::max(beside_ctas, 0), std::max(multiprocessors, 1)), most_tiles);
  launch_after_prior_grid(decode_landmark_logits_kernel<T, kRowBytes, kG, kC, kMma>, dim3(static_cast<unsigned>(ctas)),
                          dim3(kThreads), static_cast<std::size_t>(layout.bytes), stream, true,
                          d, views, batch_slots, layer, batch, queries, tile_rows, tiles, logits, partials, claims);
  return true;
}

template <typename T, int kRowBytes, int kC, bool kMma = false>
bool launch_for_group(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                      const strided_tensor& queries, int tile_rows, int tiles, int multiprocessors, int beside_ctas,
                      float* logits, float* partials, unsigned* claims, cudaStream_t stream) {
  bool launched = false;
  shadowkv_dispatch_head_tile(d.group, [&](auto head_tile) {
    launched = launch_with<T, kRowBytes, decltype(head_tile)::value, kC, kMma>(
        d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors, beside_ctas, logits, partials, claims,
        stream);
  });
  return launched;
}

}  // namespace

bool launch_decode_landmark_logits(const dims& d, int kv_type, const layer_view* views, const int* batch_slots,
                                   int layer, int batch, const strided_tensor& queries, int tile_rows, int tiles,
                                   int multiprocessors, int beside_ctas, float* logits, float* partials,
                                   unsigned* claims, cudaStream_t stream) {
  if (d.group < 1 || d.group > 8 || batch <= 0 || tiles <= 0 || tile_rows <= 0) return false;
  // The tile pool only where another kernel may slow some of the CTAs.
  if (beside_ctas <= 0) claims = nullptr;
  if (d.chunk_centroids != 0) {
    // Rows of 2·D codes, whatever the store's element type.
    auto launch = [&](auto row_bytes) {
      return launch_for_group<e4m3_code, decltype(row_bytes)::value, 2>(d, views, batch_slots, layer, batch, queries,
                                                                         tile_rows, tiles, multiprocessors,
                                                                         beside_ctas, logits, partials, claims, stream);
    };
    switch (2 * d.head_dim) {
      case 128: return launch(std::integral_constant<int, 128>{});
      case 256: return launch(std::integral_constant<int, 256>{});
      case 512: return launch(std::integral_constant<int, 512>{});
      default: return false;  // the tiled kernel (selection/landmark_scoring.cu)
    }
  }
  bool launched = false;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int row_bytes = d.head_dim * static_cast<int>(sizeof(T));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 rows of 64 or 128 elements on a device with bulk copies (sm_90 on): the tensor-core instantiations
      // (wider rows would halve the rows a tile: fewer than a warp each). The planner takes them when the batch has at
      // least 16 tiles a multiprocessor even with every chunk live (a choice from dims and the batch only, so the step
      // stays capturable): measured on the H200 (docs/performance.md; session 16), B = 8 and 24 at S = 122880 run 3-6%
      // faster on them, B = 1 (7 tiles a multiprocessor) 0.8 µs slower, its two CTAs an SM sharing fewer tiles.
      const bool many_tiles = static_cast<long long>(batch) * d.kv_heads * tiles >= 16LL * multiprocessors;
      if (many_tiles && (row_bytes == 128 || row_bytes == 256) && tile_rows == 128 &&
          compute_capability_major() >= 9) {
        launched = row_bytes == 128
                       ? launch_for_group<T, 128, 1, true>(d, views, batch_slots, layer, batch, queries, tile_rows,
                                                           tiles, multiprocessors, beside_ctas, logits, partials, claims,
                                                           stream)
                       : launch_for_group<T, 256, 1, true>(d, views, batch_slots, layer, batch, queries, tile_rows,
                                                           tiles, multiprocessors, beside_ctas, logits, partials, claims,
                                                           stream);
        return;
      }
    }
    switch (row_bytes) {
      case 128:
        launched = launch_for_group<T, 128, 1>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles,
                                            multiprocessors, beside_ctas, logits, partials, claims, stream);
        break;
      case 256:
        launched = launch_for_group<T, 256, 1>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles,
                                            multiprocessors, beside_ctas, logits, partials, claims, stream);
        break;
      case 512:
        launched = launch_for_group<T, 512, 1>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles,
                                            multiprocessors, beside_ctas, logits, partials, claims, stream);
        break;
      default: break;
    }
  });
  return launched;
}

}  // namespace shadowkv::cuda
