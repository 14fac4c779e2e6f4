// Decode step 4 (misses only). Keys: a gather-GEMM on tensor cores (CuTe; 3xTF32 for fp32 accuracy on float32 factors,
// bf16 MMAs on bf16 factors, whose products they compute exactly) followed by RoPE at each token's own position.
// (The values of the same misses: value_fetch.cu.)
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "chunk_rebuild.cuh"
#include "common/async_copy.cuh"
#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "common/phase_stamps.cuh"
#include "cuda_check.hpp"
#include "shape_support.hpp"

namespace shadowkv::cuda {
namespace {

// CTAs per (entry, head) ("splits"; each takes every gridDim.z-th group): the count that would finish soonest if
// every (entry, head) missed `most` groups, counting whole waves of `resident_per_sm` CTAs per SM:
//   minimise waves(s) * ceil(most / s),  waves(s) = ceil(batch * kv_heads * s / resident),
// the smallest such s (fewest CTAs). The earlier rule, ceil(2 * SMs / pairs), could pass one wave by a few CTAs: at
// B=8, Hkv=8 it gave 5 splits, 320 CTAs on 264 places, and the 56 of the second wave doubled the kernel's longest
// path (~12 group-times where one wave of 4 splits takes 8). Depends on dims, batch and the device only (capturable).
// The SM count is the current device's, asked at each launch (a cached driver attribute).
int splits_for(int batch, int kv_heads, int most, int resident_per_sm) {
  int device = 0;
  int multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    multiprocessors = 1;  // a failing device fails the launch itself, with its own error
  }
  const long long resident = static_cast<long long>(std::max(multiprocessors, 1)) * std::max(resident_per_sm, 1);
  const long long pairs = static_cast<long long>(std::max(batch, 1)) * std::max(kv_heads, 1);
  int best = 1;
  long long best_time = -1;
  for (int s = 1; s <= std::max(most, 1); ++s) {
    const long long waves = (pairs * s + resident - 1) / resident;
    const long long time = waves * ((std::max(most, 1) + s - 1) / s);
    if (best_time < 0 || time < best_time) {
      best_time = time;
      best = s;
    }
  }
  return best;
}

// ---------------------------------------------------------------------------------------------------------------------
// Key rebuild as a gather-GEMM: keys[rows, D] = A[rows, 0:r] · B[0:r, h*D:(h+1)*D], rows = the C tokens of each missed
// chunk of (entry, head), then RoPE, rounded to T, into the chunks' buffer slots.
//
// Tiles (one CTA works on one (entry, head), one group of missed chunks after another; M = rows, N = dims, K = rank):
//  * M = 64 gathered rows = floor(64 / C) whole chunks (8 at C = 8, 4 at C = 16, 64 at C = 1). A group never splits
//    a chunk, so every row of the tile has one destination row and one position.
//  * N = D, the whole head: RoPE pairs dim i with i + rotary_dim/2 (or 2i with 2i+1), so the epilogue needs whole
//    rows. D is a template parameter so that every partition below is static (D/16 MMA columns per warp pair).
//  * K = 32 rank columns per stage: one 128-byte line of each float32 A row (eight 16-byte cp.async), or 64 bytes of a
//    bf16 row; three stages, so that the gathers of the next two K tiles overlap the MMAs of this one. Rank tails are
//    zero-filled (A and B both: a garbage B row times a zero A column could still be NaN).
//  * 8 warps as 4 (M) x 2 (N) of the SM80 16x8x8 TF32 atom (bf16 factors: the 16x8x16 bf16 atom, fed by ldmatrix;
//    add_bf16_tile_products): a warp owns 16 rows and D/2 columns, D/4 fp32
//    accumulators per thread (64 at D = 256, 32 at D = 128), twice: the running sum and the current K tile's.
// Shared memory rows are padded so that the MMA operand loads are free of bank conflicts: a float32 A row is 36
// floats (lanes (g, t) read row g, column t: bank 4g + t), a bf16 row 40 halves (word 20g + t/2); a B row (fixed k, all
// D dims) is D + 8 elements (float: bank 8t + g, or 24t + g at D = 80; bf16: word 4t + g/2, or 12t + g/2). All pads
// keep rows 16-byte aligned for cp.async.
//
// Groups overlap: while group g is in its epilogue (RoPE, stores), the row tables of the CTA's next group and its first
// two K tiles are already in flight, so that its main loop starts on landed tiles (the kernel's group loop lists the
// barriers that order the two groups). Shared memory, each stage its A rows then its B rows: [stage 0 | stage 1 |
// stage 2 ... | row tables x 2]. The epilogue's [64, D + 8] fp32 tile of the results (sC) starts at stage 2 and may
// run past it: the next group's prologue fills stages 0 and 1 only, and its main loop refills stage 2 (K tile 2) only
// after a barrier that follows this group's stores. sC beside all three stages would gain nothing: K tile 2 could then
// load during the epilogue too, but tile 3 needs the stage that tile 0's MMAs free, so the main loop would still wait
// for one gather round trip; and it would cost 13.5 KiB more at D = 128 with bf16 factors, and with float32 factors
// (115 KiB) no longer allow two CTAs an SM. Sharing stage 2, both factor types keep two CTAs an SM up to D = 128
// (rebuild_tile's static_assert), so both take the one, overlapped, schedule. The row tables are double-buffered: the
// next group's are written while this group's RoPE and stores read its own.
//
// Precision: the CPU backend (the oracle) computes this product with fp32 sgemm, and the parity tests compare at
// fp32 tolerances, so plain TF32 (10-bit mantissa) is not enough for float32 factors. Each operand is split as
// x = big + small (big = x rounded to tf32, small = the exact fp32 remainder rounded to tf32) and acc +=
// small_a*big_b + big_a*small_b + big_a*big_b: about 22 significant bits per product (what CUTLASS calls
// OpMultiplyAddFastF32). A bf16 factor (8-bit mantissa) times another is exact in fp32 on the bf16 MMA (and on a TF32
// MMA too, but the bf16 MMA takes half as many; add_bf16_tile_products).
// The tensor cores accumulate each K tile from zero; the tiles are summed with ordinary fp32 adds (see the main loop).
constexpr int kRebuildRows = 64;      // M
static_assert(kRebuildRows == kMaxChunkSize, "shape_support.hpp's chunk limit is the rebuild tile's rows");
constexpr int kRebuildRankTile = 32;  // K per stage
// Three stages: two K tiles in flight while one is multiplied. With two, each K tile of a group waited a whole
// gather round trip (ncu at B=1: 15.7 µs for one group a CTA, 17% SM throughput, 2.5% DRAM).
constexpr int kRebuildStages = 3;
constexpr int kRebuildThreads = 256;  // 8 warps, 4 x 2 over (M, N)

// Two CTAs per SM up to D = 128 (the grid of splits_for is sized for two per SM), which caps registers at 128 (no
// spills with the overlapped groups, -Xptxas -v; the 40-byte stack frame is the float64 sincos's); at D = 256 the
// 2 x 64 accumulators alone need one CTA per SM.
template <int D>
constexpr int rebuild_min_ctas_per_sm() {
  return D <= 128 ? 2 : 1;
}

// sm_90 (H100/H200): 228 KiB of shared memory per SM, at most 227 KiB a CTA, 1 KiB of each resident CTA's reserved.
constexpr std::size_t kSharedPerSm = 228 * 1024;
constexpr std::size_t kSharedPerCtaMax = 227 * 1024;
constexpr std::size_t kSharedReservedPerCta = 1024;

// F: the factors' element type (float or __nv_bfloat16).
template <typename F, int D>
struct rebuild_tile {
  static_assert(D % 16 == 0, "D must be a multiple of 16 (two warps of n8 MMA atoms)");
  static constexpr int vector = 16 / static_cast<int>(sizeof(F));  // elements per 16-byte copy
  static constexpr int a_stride = kRebuildRankTile + vector;       // elements per gathered A row in shared memory
  static constexpr int b_stride = D + 8;                           // elements per B row (one rank index)
  static constexpr int c_stride = D + 8;                           // floats per row of the epilogue tile
  static constexpr int a_stage = kRebuildRows * a_stride;
  static constexpr int b_stage = kRebuildRankTile * b_stride;
  static constexpr int stage = a_stage + b_stage;  // elements of one stage: its A rows, then its B rows
  static constexpr std::size_t stage_bytes = stage * sizeof(F);
  static constexpr std::size_t c_bytes = kRebuildRows * c_stride * sizeof(float);
  // sC begins at the last stage, the one the next group's prologue leaves alone (see above).
  static constexpr std::size_t c_offset = (kRebuildStages - 1) * stage_bytes;
  static constexpr std::size_t tile_bytes = c_offset + std::max(stage_bytes, c_bytes);
  // Then two buffers of three tables of kRebuildRows long longs: coefficient row, destination offset and position of
  // each row.
  static constexpr int table_entries = 3 * kRebuildRows;
  static constexpr std::size_t shared_bytes = tile_bytes + 2 * table_entries * sizeof(long long);
  // With the store's RoPE table (step_workspace::rope_table): the current group's coefficients, [kRebuildRows, D / 2]
  // float2 after the row tables, copied from the table during its main loop. Only where they fit beside
  // rebuild_min_ctas_per_sm CTAs (all shapes but float32 factors at D = 128); elsewhere the rows' coefficients are
  // computed as without a table.
  static constexpr std::size_t coefficient_bytes = kRebuildRows * (D / 2) * sizeof(float2);
  static constexpr std::size_t shared_bytes_with_table = shared_bytes + coefficient_bytes;
  static constexpr bool table_fits =
      rebuild_min_ctas_per_sm<D>() * (shared_bytes_with_table + kSharedReservedPerCta) <= kSharedPerSm &&
      shared_bytes_with_table <= kSharedPerCtaMax;
  static_assert(shared_bytes % 16 == 0, "the coefficients' 16-byte copies need a 16-byte aligned start");
  // bf16 factors: 40 / 46 / 52 / 64 / 112 KiB at D = 64 / 80 / 96 / 128 / 256; float32: 57 / 65 / 73 / 89 / 153 KiB.
  static_assert(rebuild_min_ctas_per_sm<D>() * (shared_bytes + kSharedReservedPerCta) <= kSharedPerSm &&
                    shared_bytes <= kSharedPerCtaMax,
                "the rebuild's shared memory must allow rebuild_min_ctas_per_sm CTAs on an SM");

  // (row, rank, stage): rows padded to a_stride.
  using a_layout = decltype(cute::make_layout(
      cute::make_shape(cute::Int<kRebuildRows>{}, cute::Int<kRebuildRankTile>{}, cute::Int<kRebuildStages>{}),
      cute::make_stride(cute::Int<a_stride>{}, cute::Int<1>{}, cute::Int<stage>{})));
  // (dim, rank, stage): B[k0 + k, h*D + n] at n + k * b_stride, i.e. row-major B as in global memory; from the stage's
  // first element + a_stage.
  using b_layout = decltype(cute::make_layout(
      cute::make_shape(cute::Int<D>{}, cute::Int<kRebuildRankTile>{}, cute::Int<kRebuildStages>{}),
      cute::make_stride(cute::Int<1>{}, cute::Int<b_stride>{}, cute::Int<stage>{})));
  // (row, dim): the results, row-major.
  using c_layout = decltype(cute::make_layout(cute::make_shape(cute::Int<kRebuildRows>{}, cute::Int<D>{}),
                                              cute::make_stride(cute::Int<c_stride>{}, cute::Int<1>{})));
  static_assert((a_stride * sizeof(F)) % 16 == 0 && (b_stride * sizeof(F)) % 16 == 0 &&
                    (a_stage * sizeof(F)) % 16 == 0 && (b_stage * sizeof(F)) % 16 == 0,
                "16-byte cp.async needs 16-byte aligned shared rows");
  static_assert(tile_bytes % alignof(long long) == 0, "row tables follow the tiles");
};

/// The rebuild's attention (miss_attention, kAttend) in shared memory: the current group's values [kRebuildRows, D]
/// (T), then the G query heads' scaled queries [G, D] and their scores [G, kRebuildRows] (float), then two buffers of
/// the rows' value addresses [2, kRebuildRows] (found with the row tables, so that the values' copies are issued
/// without arithmetic or loads of their own, and prefetched to L2 then). The values take the
/// RoPE coefficients' place when the RoPE runs in the accumulators: the coefficients are dead from barrier A (after
/// that RoPE) until barrier C (after which the next group's are copied), and the values are copied after A and read
/// before C. So the rebuild keeps two CTAs an SM at D = 128 with a group of 4 (~106 KiB a CTA). Otherwise (RoPE over
/// sC, which reads the coefficients between A and B) they follow the coefficients.
template <typename T, typename F, int D>
struct attend_tile {
  using tile = rebuild_tile<F, D>;
  static constexpr std::size_t values_bytes = kRebuildRows * D * sizeof(T);
  static_assert(values_bytes % 16 == 0 && values_bytes <= tile::coefficient_bytes, "the values fit the coefficients");
  /// Offset of the values from the start of the kernel's shared memory.
  static constexpr std::size_t values_offset(bool table, bool values_in_coefficients) {
    return values_in_coefficients ? tile::shared_bytes : (table ? tile::shared_bytes_with_table : tile::shared_bytes);
  }
  /// Offset of the queries (the scores follow them).
  static constexpr std::size_t queries_offset(bool table, bool values_in_coefficients) {
    return values_in_coefficients ? tile::shared_bytes_with_table : values_offset(table, false) + values_bytes;
  }
  /// Offset of the value addresses (after the scores).
  static constexpr std::size_t value_rows_offset(bool table, bool values_in_coefficients, int group) {
    return queries_offset(table, values_in_coefficients) +
           static_cast<std::size_t>(group) * (D + kRebuildRows) * sizeof(float);
  }
  /// The kernel's shared memory.
  static constexpr std::size_t shared_bytes(bool table, bool values_in_coefficients, int group) {
    return value_rows_offset(table, values_in_coefficients, group) + 2 * kRebuildRows * sizeof(const T*);
  }
};

/// x = big + small with both parts tf32 (low 13 mantissa bits zero) and x - big exact in fp32. Rounding is to
/// nearest, ties away from zero (cvt.rna), done on the bits so that the discarded bits are certainly zero.
__device__ __forceinline__ void split_tf32(float x, cutlass::tfloat32_t& big, cutlass::tfloat32_t& small) {
  const std::uint32_t big_bits = (__float_as_uint(x) + 0x1000U) & 0xFFFFE000U;
  const float remainder = x - __uint_as_float(big_bits);
  big = cutlass::tfloat32_t::bitcast(big_bits);
  small = cutlass::tfloat32_t::bitcast((__float_as_uint(remainder) + 0x1000U) & 0xFFFFE000U);
}


/// Whether the rebuild rotates a group's keys in the MMA accumulators, where every thread holds both dims of each of
/// its pairs (SM80_16x8_Row: a thread's values v = 0, 1 of an n8 block are (row g, columns 2t, 2t + 1), v = 2, 3 the
/// same columns of row g + 8; a warp's n8 blocks j are 16 columns apart): interleaved pairs (2i, 2i + 1) are values v
/// and v + 1 of one block; half-split pairs (i, i + D/2) with the whole head rotary are blocks j and j + D/32 where D/2
/// is a multiple of 16. It needs the store's RoPE table: every row's coefficients are then in shared memory
/// (issue_coefficients computes those of rows past the table), so the unrolled rotation has no float64 sincos in it.
/// Elsewhere (half-split at D = 80 or with a partial rotary_dim, or no table) RoPE runs over the results in shared
/// memory.
template <int D>
__host__ __device__ __forceinline__ bool rope_in_registers(const dims& d, bool table) {
  if (!table) return false;
  return d.rope_interleaved != 0 || ((D / 2) % 16 == 0 && d.rotary_dim == D);
}

/// The 4 x 2 warps' MMAs for bf16 factors: SM80's m16n8k16 bf16 atom (products exact, sums in fp32). Its accumulators
/// (SM80_16x8_Row) are laid out as those of the 16x8x8 TF32 atom, so both tiled MMAs partition the results alike
/// (asserted in the kernel) and share the kernel's accumulators.
using bf16_rebuild_mma = decltype(cute::make_tiled_mma(cute::SM80_16x8x16_F32BF16BF16F32_TN{},
                                                       cute::Layout<cute::Shape<cute::_4, cute::_2, cute::_1>>{}));

/// Adds one K tile's products (32 rank columns of the stage at `stage`: its A rows, then its B rows, as rebuild_tile
/// lays them out) into `tile_sums` on bf16 MMAs: per k-block of 16, the warp's A operand (16 rows x 16) by one
/// ldmatrix.x4 and each n8 block's B operand (16 x 8, stored dim-major) by one ldmatrix.x2.trans. Both are free of bank
/// conflicts with rebuild_tile's padded rows (A: 80 bytes a row, B: 2 (D + 8) bytes, an odd number of 16-byte units).
/// Against bf16 factors widened to tf32 (the way before session 15): half the MMAs, and one shared-memory instruction for what
/// took eight scalar loads and conversions (docs/performance.md; session 14: ~260 instructions a warp a K tile).
template <int D, typename Sums>
__device__ __forceinline__ void add_bf16_tile_products(const __nv_bfloat16* stage, Sums& tile_sums) {
  using namespace cute;
  using tile = rebuild_tile<__nv_bfloat16, D>;
  const auto* base = reinterpret_cast<const cute::bfloat16_t*>(stage);
  Tensor sA = make_tensor(make_smem_ptr(base), make_layout(make_shape(Int<kRebuildRows>{}, Int<kRebuildRankTile>{}),
                                                           make_stride(Int<tile::a_stride>{}, Int<1>{})));
  Tensor sB = make_tensor(make_smem_ptr(base + tile::a_stage),
                          make_layout(make_shape(Int<D>{}, Int<kRebuildRankTile>{}),
                                      make_stride(Int<1>{}, Int<tile::b_stride>{})));
  bf16_rebuild_mma mma;
  ThrMMA thread_mma = mma.get_slice(threadIdx.x);
  Tensor a = thread_mma.partition_fragment_A(sA);  // (MMA, MMA_M = 1, MMA_K = 2)
  Tensor b = thread_mma.partition_fragment_B(sB);  // (MMA, MMA_N = D / 16, MMA_K = 2)
  auto copy_a = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, cute::bfloat16_t>{}, mma);
  auto copy_b = make_tiled_copy_B(Copy_Atom<SM75_U16x4_LDSM_T, cute::bfloat16_t>{}, mma);
  ThrCopy thread_copy_a = copy_a.get_slice(threadIdx.x);
  ThrCopy thread_copy_b = copy_b.get_slice(threadIdx.x);
  Tensor a_from = thread_copy_a.partition_S(sA);
  Tensor a_to = thread_copy_a.retile_D(a);
  Tensor b_from = thread_copy_b.partition_S(sB);
  Tensor b_to = thread_copy_b.retile_D(b);
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    copy(copy_a, a_from(_, _, kb), a_to(_, _, kb));
    copy(copy_b, b_from(_, _, kb), b_to(_, _, kb));
    gemm(mma, tile_sums, a(_, _, kb), b(_, _, kb), tile_sums);
  }
}

// kAttend: the group's attention too (miss_attention, chunk_rebuild.cuh), after its stores. Its registers stay
// capped as for two CTAs an SM, so that an attention CTA (sparse_attention.cu, which runs beside it in a fused step)
// still fits beside one rebuild CTA; its shared memory allows one.
template <typename T, typename F, int D, bool kAttend>
__global__ void __launch_bounds__(kRebuildThreads, rebuild_min_ctas_per_sm<D>())
    rebuild_keys_kernel(dims d, layer_view* views, const int* batch_slots, int layer, step_workspace workspace,
                        const float* inv_freq, miss_attention attend) {
  start_phase_stamps(stamped_kernel::rebuild);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  // The attention may start now: before its own wait it reads only what the selection and earlier kernels wrote.
  if (d.attention_early != 0) release_dependents();
  phase_stamp(stamped_kernel::rebuild, 1);
  using namespace cute;
  using tile = rebuild_tile<F, D>;
  constexpr bool kSplitOperands = std::is_same_v<F, float>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  F* shared = reinterpret_cast<F*>(shared_bytes);
  // Row tables of buffer 0 or 1: row of A (-1: padding), element offset of the key row in this head's cache_keys,
  // RoPE position.
  long long* const tables = reinterpret_cast<long long*>(shared_bytes + tile::tile_bytes);
  const auto row_token = [&](int buffer) { return tables + buffer * tile::table_entries; };
  const auto row_target = [&](int buffer) { return tables + buffer * tile::table_entries + kRebuildRows; };
  const auto row_position = [&](int buffer) { return tables + buffer * tile::table_entries + 2 * kRebuildRows; };
  // The current group's RoPE coefficients from the store's table: [kRebuildRows, D / 2] (rebuild_tile).
  // (Asked where needed rather than held: a kernel parameter costs no register across the main loop.)
  const auto use_table = [&] { return tile::table_fits && workspace.rope_table != nullptr; };
  // The copy group a pass commits after barrier C for the next group (the RoPE coefficients, with the table); the main
  // loop's waits count it.
  const auto extra_group = [&] { return use_table(); };
  float2* const rope_rows = reinterpret_cast<float2*>(shared_bytes + tile::shared_bytes);
  // kAttend: attend_tile's regions.
  using attend_layout = attend_tile<T, F, D>;
  const bool values_in_coefficients = rope_in_registers<D>(d, use_table());
  T* const group_values = reinterpret_cast<T*>(
      shared_bytes + attend_layout::values_offset(use_table(), values_in_coefficients));  // [kRebuildRows, D]
  float* const queries = reinterpret_cast<float*>(
      shared_bytes + attend_layout::queries_offset(use_table(), values_in_coefficients));  // [G, D]
  float* const scores = queries + d.group * D;                                             // [G, kRebuildRows]
  // kAttend: this head's values in the selection cache (cache_values, [K, C, D] a head), where the group's values go
  // once they have landed (what the value fetch does in an unfused step; the backend launches none in a fused one).
  // Set by thread 0 in pass 0.
  __shared__ T* cache_values_of_head;
  const auto value_rows = [&](int buffer) {  // [kRebuildRows]: a row's values in the value store (padding: nullptr)
    return reinterpret_cast<const T**>(shared_bytes + attend_layout::value_rows_offset(use_table(),
                                                                                       values_in_coefficients,
                                                                                       d.group)) +
           buffer * kRebuildRows;
  };

  const int b = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int misses = workspace.miss_counts[b * d.kv_heads + h];
  // Miss lists hold k entries per head; cache slots are K (dims::cache_slots) per head.
  const int* miss_slots = workspace.miss_slots + static_cast<long long>(b * d.kv_heads + h) * d.budget;
  const int* cache_chunks = view->cache_chunks + static_cast<long long>(h) * d.cache_slots;
  T* cache_keys = static_cast<T*>(view->cache_keys) + static_cast<long long>(h) * d.cache_slots * d.chunk * D;
  const F* coefficients = static_cast<const F*>(view->coefficients);  // A [max_chunks*C, r]
  const F* basis = static_cast<const F*>(view->basis) + h * D;        // B[:, h*D:(h+1)*D], row stride `width`
  const long long width = static_cast<long long>(d.kv_heads) * D;
  const int rank = d.rank;
  const int group_chunks = kRebuildRows / d.chunk;
  const int k_tiles = (rank + kRebuildRankTile - 1) / kRebuildRankTile;
  // 16-byte copies need 16-byte aligned sources: A rows are `rank` elements apart, B rows `width` (D a multiple of 16).
  const bool a_vectors = rank % tile::vector == 0 && reinterpret_cast<std::uintptr_t>(coefficients) % 16 == 0;
  const bool b_vectors = reinterpret_cast<std::uintptr_t>(basis) % 16 == 0;

  Tensor sA = make_tensor(make_smem_ptr(shared), typename tile::a_layout{});                 // (64, 32, 3)
  Tensor sB = make_tensor(make_smem_ptr(shared + tile::a_stage), typename tile::b_layout{});  // (D, 32, 3)
  Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<float*>(shared_bytes + tile::c_offset)),
                          typename tile::c_layout{});  // (64, D), from stage 2 on

  TiledMMA mma = make_tiled_mma(SM80_16x8x8_F32TF32TF32F32_TN{}, Layout<Shape<_4, _2, _1>>{});
  static_assert(decltype(size(mma))::value == kRebuildThreads);
  ThrMMA thread_mma = mma.get_slice(threadIdx.x);
  Tensor tCsA = thread_mma.partition_A(sA);  // (MMA, MMA_M = 1, MMA_K = 4, stage)
  Tensor tCsB = thread_mma.partition_B(sB);  // (MMA, MMA_N = D/16, MMA_K = 4, stage)
  Tensor tCsC = thread_mma.partition_C(sC);  // (MMA, MMA_M, MMA_N)
  Tensor accumulators = thread_mma.partition_fragment_C(sC);  // (MMA, MMA_M, MMA_N) fp32
  Tensor tile_sums = make_fragment_like(accumulators);         // this K tile's products, added in with fp32 adds
  // Operands of one k-block (8 rank columns), split into tf32 big and small parts: A for the warp's 16 rows, B for
  // one n8 column block at a time (fewer live registers than splitting all D/16 blocks first).
  Tensor a_big = make_fragment_like<cutlass::tfloat32_t>(tCsA(_, _, 0, 0));  // (MMA, MMA_M = 1)
  Tensor a_small = make_fragment_like<cutlass::tfloat32_t>(tCsA(_, _, 0, 0));
  Tensor b_big = make_fragment_like<cutlass::tfloat32_t>(tCsB(_, 0, 0, 0));  // (MMA)
  Tensor b_small = make_fragment_like<cutlass::tfloat32_t>(tCsB(_, 0, 0, 0));
  static_assert(decltype(size<1>(tCsA))::value == 1, "one MMA row block per warp");
  static_assert(std::is_same_v<decltype(bf16_rebuild_mma{}.get_slice(0).partition_C(sC).layout()),
                               decltype(tCsC.layout())>,
                "the bf16 and the TF32 MMAs must partition the results alike: they share the accumulators");

  // Issues the cp.async of K tile `k_tile` (rank columns [32 k_tile, 32 k_tile + 32)) into `stage`: the gathered A
  // rows (of the group whose row_token table is `tokens`) and B[k0:k0+32, head]. Out-of-range elements are zero-filled
  // (src-size 0; the source address stays valid).
  auto load_stage = [&](int k_tile, int stage, const long long* tokens) {
    const int k0 = k_tile * kRebuildRankTile;
    if (a_vectors) {
      constexpr int per_row = kRebuildRankTile / tile::vector;
      for (int v = static_cast<int>(threadIdx.x); v < kRebuildRows * per_row; v += kRebuildThreads) {
        const int row = v / per_row;
        const int k = (v % per_row) * tile::vector;
        const long long token = tokens[row];
        const bool valid = token >= 0 && k0 + k < rank;
        const F* source = valid ? coefficients + token * rank + k0 + k : coefficients;
        copy_async_or_zero<16, copy_cache::l2_only, true>(&sA(row, k, stage), source, valid);
      }
    } else {
      for (int e = static_cast<int>(threadIdx.x); e < kRebuildRows * kRebuildRankTile; e += kRebuildThreads) {
        const int row = e / kRebuildRankTile;
        const int k = e % kRebuildRankTile;
        const long long token = tokens[row];
        const bool valid = token >= 0 && k0 + k < rank;
        const F* source = valid ? coefficients + token * rank + k0 + k : coefficients;
        if constexpr (kSplitOperands) {
          copy_async_or_zero<4, copy_cache::all_levels, true>(&sA(row, k, stage), source, valid);
        } else {
          // cp.async moves 4 bytes at least: 2-byte elements off the vector path are plain loads.
          sA(row, k, stage) = valid ? *source : F(0.0F);
        }
      }
    }
    if (b_vectors) {
      constexpr int per_row = D / tile::vector;
      for (int v = static_cast<int>(threadIdx.x); v < kRebuildRankTile * per_row; v += kRebuildThreads) {
        const int k = v / per_row;
        const int n = (v % per_row) * tile::vector;
        const bool valid = k0 + k < rank;
        const F* source = valid ? basis + (k0 + k) * width + n : basis;
        copy_async_or_zero<16, copy_cache::l2_only, true>(&sB(n, k, stage), source, valid);
      }
    } else {
      for (int e = static_cast<int>(threadIdx.x); e < kRebuildRankTile * D; e += kRebuildThreads) {
        const int k = e / D;
        const int n = e % D;
        const bool valid = k0 + k < rank;
        const F* source = valid ? basis + (k0 + k) * width + n : basis;
        if constexpr (kSplitOperands) {
          copy_async_or_zero<4, copy_cache::all_levels, true>(&sB(n, k, stage), source, valid);
        } else {
          sB(n, k, stage) = valid ? *source : F(0.0F);
        }
      }
    }
  };

  // Copies the RoPE coefficients of the first `rows` rows (their positions in `positions`) from the store's table into
  // rope_rows: four threads a row, two pairs a 16-byte copy where the pairs per position are even, else one a copy.
  // A row whose position is outside the table gets the coefficients rope_coefficients computes (the table's values
  // for the positions it holds: float32 numbers, cos and sin rounded to float and scaled in float), for the RoPE in
  // the accumulators; the RoPE over sC computes its own for such rows.
  static_assert(kRebuildThreads == 4 * kRebuildRows, "four threads copy a row's coefficients");
  auto issue_coefficients = [&](int rows, const long long* positions) {
    const int row = static_cast<int>(threadIdx.x) / 4;
    if (row >= rows) return;
    const int half = d.rotary_dim / 2;
    const long long position = positions[row];
    const bool live = position >= 0 && position < workspace.rope_table_positions;
    const float2* source = workspace.rope_table + (live ? position * half : 0);
    float2* target = rope_rows + row * (D / 2);
    if (!live) {
      for (int pair = static_cast<int>(threadIdx.x) % 4; pair < half; pair += 4) {
        double cos_a;
        double sin_a;
        rope_coefficients(inv_freq[pair], position, d.attention_scaling, false, cos_a, sin_a);
        target[pair] = make_float2(static_cast<float>(cos_a), static_cast<float>(sin_a));
      }
    } else if (half % 2 == 0) {
      for (int pair = 2 * (static_cast<int>(threadIdx.x) % 4); pair < half; pair += 8) {
        copy_async_or_zero<16, copy_cache::l2_only>(target + pair, source + pair, live);
      }
    } else {
      for (int pair = static_cast<int>(threadIdx.x) % 4; pair < half; pair += 4) {
        copy_async_or_zero<8, copy_cache::all_levels>(target + pair, source + pair, live);
      }
    }
  };

  // kAttend: the values of a group's first `rows` rows (their addresses in `sources`, value_rows) from the value
  // store (device memory: the backend fuses only then) into group_values, 16-byte copies, and zeros in its other rows
  // (so that the attention's fixed-length loops add 0 x 0 there).
  auto issue_values = [&](int rows, const T* const* sources) {
    constexpr int kVector = 16 / static_cast<int>(sizeof(T));
    constexpr int kVectorsPerRow = D / kVector;
    for (int v = static_cast<int>(threadIdx.x); v < kRebuildRows * kVectorsPerRow; v += kRebuildThreads) {
      const int row = v / kVectorsPerRow;
      const int column = (v % kVectorsPerRow) * kVector;
      const bool live = row < rows;
      // Not live: zeros, from any valid global address (attend.partial).
      const void* const source = live ? static_cast<const void*>(sources[row] + column) : attend.partial;
      copy_async_or_zero<16>(group_values + row * D + column, source, live);
    }
  };

  // kAttend: the attention over the current group's `rows` rows (keys in sC, rounded to T by the stores as they are
  // stored; values in group_values (T = bf16: the backend fuses only bf16 keys and values), zeros past `rows`), each
  // query head's partial to split attend.first_split + `group_index`: the format of sparse_attention.cu's split
  // kernels (max of the scores in log2 units, sum of 2^(score - max), unnormalised accumulator). Phases:
  //  1. scores, kHeadsPerPass heads at a time: warp w takes rows w, w + 8, ...; its lanes are 4 heads x 8 dim slices
  //     (slice c: dims 16 i + 2c, + 1), the slice's query pairs in registers, a row's key pairs read once for the 4
  //     heads (one wavefront a pair: the 8 slices are 64 consecutive bytes), three shuffles a (row, head);
  //  2. softmax: a warp a head, two rows a lane: the max, the probabilities (into the scores' place, 0 past `rows`),
  //     their sum; lane 0 writes the partial's (max, sum);
  //  3. P V, kHeadsPerPass heads at a time: a thread a (pair of dims, part of the rows), a value pair read once for the
  //     4 heads; the parts' sums meet in sC (free after phase 1), added in part order, and go to the partials.
  // (Session 23's versions, a thread a (head, row) reading every key row once a head and a thread a (head, pair)
  // reading every value row once a head, took ~8 µs a group: docs/performance.md.) Called by every thread; the caller's
  // barrier C follows before sC or the buffers are reused.
  auto attend_group = [&](int rows, int group_index) {
    static_assert(kRebuildRows == 64 && kRebuildThreads == 256, "rows and threads as assumed below");
    static_assert(!kAttend || std::is_same_v<T, __nv_bfloat16>, "the rebuild attends over bf16 keys and values");
    constexpr int kHeadsPerPass = 4;
    constexpr int kLanesPerHead = 32 / kHeadsPerPass;
    constexpr int kSlicePairs = D / (2 * kLanesPerHead);  // key pairs a lane takes of a row
    static_assert(D % (2 * kLanesPerHead) == 0, "whole pairs a slice");
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    {
      const int pass_head = lane / kLanesPerHead;
      const int slice = 2 * (lane % kLanesPerHead);
      for (int first = 0; first < d.group; first += kHeadsPerPass) {
        const int g = first + pass_head;
        float2 query[kSlicePairs];
#pragma unroll
        for (int i = 0; i < kSlicePairs; ++i) {
          query[i] = g < d.group
                         ? *reinterpret_cast<const float2*>(queries + g * D + 2 * kLanesPerHead * i + slice)
                         : make_float2(0.0F, 0.0F);
        }
        for (int row = warp; row < rows; row += kRebuildThreads / 32) {
          float s0 = 0.0F;
          float s1 = 0.0F;
#pragma unroll
          for (int i = 0; i < kSlicePairs; ++i) {
            const float2 key = *reinterpret_cast<const float2*>(&sC(row, 2 * kLanesPerHead * i + slice));
            s0 = fmaf(query[i].x, key.x, s0);
            s1 = fmaf(query[i].y, key.y, s1);
          }
          float score = s0 + s1;
#pragma unroll
          for (int offset = 1; offset < kLanesPerHead; offset *= 2) {
            score += __shfl_xor_sync(0xFFFFFFFFU, score, offset);
          }
          if (slice == 0 && g < d.group) scores[g * kRebuildRows + row] = score;
        }
      }
    }
    __syncthreads();
    phase_stamp(stamped_kernel::rebuild, 37);
    const long long b_heads = static_cast<long long>(b) * d.q_heads;
    const auto partial_of = [&](int g) {
      const long long j = static_cast<long long>(h) * d.group + g;
      return attend.partial + ((b_heads + j) * attend.max_splits + attend.first_split + group_index) * (D + 2);
    };
    for (int g = warp; g < d.group; g += kRebuildThreads / 32) {
      float* const head = scores + g * kRebuildRows;
      const float s0 = lane < rows ? head[lane] : -INFINITY;
      const float s1 = lane + 32 < rows ? head[lane + 32] : -INFINITY;
      float best = fmaxf(s0, s1);
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) best = fmaxf(best, __shfl_xor_sync(0xFFFFFFFFU, best, offset));
      const float p0 = lane < rows && best != -INFINITY ? exp2f(s0 - best) : 0.0F;
      const float p1 = lane + 32 < rows && best != -INFINITY ? exp2f(s1 - best) : 0.0F;
      float sum = p0 + p1;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFU, sum, offset);
      head[lane] = p0;
      head[lane + 32] = p1;
      if (lane == 0) {
        float* const out = partial_of(g);
        out[0] = best;
        out[1] = sum;
      }
    }
    __syncthreads();
    phase_stamp(stamped_kernel::rebuild, 46);
    constexpr int kDimPairs = D / 2;
    constexpr int kRowParts = kRebuildThreads / kDimPairs >= 8 ? 8 : (kRebuildThreads / kDimPairs >= 4 ? 4 : 2);
    constexpr int kPartRows = kRebuildRows / kRowParts;
    static_assert(kRowParts * kDimPairs <= kRebuildThreads && kRowParts * kHeadsPerPass * D <= kRebuildRows * (D + 8),
                  "the parts' sums fit sC");
    float* const part_sums = &sC(0, 0);  // [kRowParts][kHeadsPerPass][D]
    const int pair = 2 * (tid % kDimPairs);
    const int part = tid / kDimPairs;
    for (int first = 0; first < d.group; first += kHeadsPerPass) {
      if (part < kRowParts) {
        float acc[kHeadsPerPass][2] = {};
#pragma unroll 8
        for (int r = part * kPartRows; r < (part + 1) * kPartRows; ++r) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(group_values + r * D + pair));
#pragma unroll
          for (int k = 0; k < kHeadsPerPass; ++k) {
            const float p = first + k < d.group ? scores[(first + k) * kRebuildRows + r] : 0.0F;
            acc[k][0] = fmaf(p, v.x, acc[k][0]);
            acc[k][1] = fmaf(p, v.y, acc[k][1]);
          }
        }
#pragma unroll
        for (int k = 0; k < kHeadsPerPass; ++k) {
          part_sums[(part * kHeadsPerPass + k) * D + pair] = acc[k][0];
          part_sums[(part * kHeadsPerPass + k) * D + pair + 1] = acc[k][1];
        }
      }
      __syncthreads();
      for (int item = tid; item < kHeadsPerPass * kDimPairs; item += kRebuildThreads) {
        const int k = item / kDimPairs;
        const int dim = 2 * (item % kDimPairs);
        if (first + k >= d.group) continue;
        float acc0 = 0.0F;
        float acc1 = 0.0F;
#pragma unroll
        for (int p = 0; p < kRowParts; ++p) {
          acc0 += part_sums[(p * kHeadsPerPass + k) * D + dim];
          acc1 += part_sums[(p * kHeadsPerPass + k) * D + dim + 1];
        }
        float* const out = partial_of(first + k);
        out[2 + dim] = acc0;
        out[3 + dim] = acc1;
      }
      __syncthreads();  // the next pass rewrites the parts' sums
    }
  };

  // Pass p of the loop below finishes the CTA's group p - 1 ("current"; none at p = 0) and starts its group p ("next";
  // none in the last pass), with row tables in buffers (p - 1) % 2 and p % 2:
  //   main loop of current, its results to sC | row_token, row_target of next; cp.async of its row_position |
  //   barrier A | cp.async of next's K tiles 0 and 1 | RoPE of current in sC | barrier B | stores of current |
  //   barrier C.
  // What orders the two groups' uses of shared memory:
  //  * stages 0 and 1: next's prologue (after A) fills them; current's main loop has finished reading them (each K
  //    tile's closing barrier) and has no copies in flight (its last K tile waits for all).
  //  * sC (stage 2 on): written after current's last closing barrier; read by RoPE after A and by the stores after B;
  //    next's main loop refills stage 2 (K tile 2, in its first iteration) only after C.
  //  * next's table buffer: last read by the group before current (its RoPE and stores, one pass earlier, before that
  //    pass's C); row_token and row_target are written before A, which the prologue after A needs; row_position is
  //    committed with K tile 0, so next's main loop waits for it (and its barrier publishes it) before next's RoPE.
  //  * current's table buffer: written one pass earlier, read by its main loop (tokens), RoPE (positions) and stores
  //    (targets).
  // The cp.async groups pending when a main loop starts are the prologue's alone (the epilogue commits no others), so
  // the main loop's wait counts are those of a prologue issued right before it.
  // With the RoPE table, a group's coefficients are copied from it at the end of the pass that starts the group, after
  // barrier C (its positions landed, the previous group's RoPE done with the buffer), as a copy group of their own
  // after its K tiles 0 and 1; so its main loop's iterations 0 and 1 wait for one group more, its last K tile for
  // all, and that tile's closing barrier publishes them to its RoPE (in the accumulators, or over sC after barrier A).
  // Everything per pass is derived from p, not carried from pass to pass: fewer registers live across the main loop.
  const int group_stride = static_cast<int>(gridDim.z) * group_chunks;
  const int first_group = static_cast<int>(blockIdx.z) * group_chunks;  // first miss-list entry of the CTA's group 0
  if (first_group >= misses) {  // nothing for this CTA (the whole CTA returns: no barrier is left waiting)
    finish_phase_stamps(stamped_kernel::rebuild, 38);
    return;
  }
  for (int pass = 0;; ++pass) {
    const int buffer = pass % 2;
    const int next = first_group + pass * group_stride;  // first miss-list entry of the next group
    const int current_rows = pass == 0 ? 0 : min(group_chunks, misses - (next - group_stride)) * d.chunk;
    if (current_rows > 0) {
      const long long* const tokens = row_token(buffer ^ 1);
      // Main loop: three stages; stage kt % 3 is computed while tiles kt + 1 and kt + 2 land in the other two. Tiles 0
      // and 1 were issued during the previous pass's epilogue.
      static_assert(kRebuildStages == 3, "the prologue and the waits below are written for three stages");
      clear(accumulators);
#pragma unroll 1
      for (int kt = 0; kt < k_tiles; ++kt) {
        // Stage (kt + 2) % 3 was last computed in iteration kt - 1, whose closing barrier every thread has passed
        // (stage 2 at kt = 0: the previous group's sC, released by barrier C).
        if (kt + 2 < k_tiles) {
          load_stage(kt + 2, (kt + 2) % kRebuildStages, tokens);
          commit_async_copies();
        }
        // Tile kt has landed (this thread's copies) once no more groups are pending than were committed after it:
        // the tiles issued after it and, with the RoPE table, the coefficients (committed after tile 1, or after
        // tile 0 when it is the only one, at the end of the previous pass) ...
        // The last K tile waits for every copy: the coefficients too, which its closing barrier then publishes to
        // the RoPE (in the accumulators right after this loop, or over sC after barrier A).
        const int tiles_after = min(kt + 2, k_tiles - 1) - kt;
        wait_async_copies_at_most(kt == k_tiles - 1 ? 0 : tiles_after + (extra_group() && kt <= 1 ? 1 : 0));
        __syncthreads();  // ... and every thread's
        phase_stamp(stamped_kernel::rebuild, 50 + kt);
        const int stage = kt % kRebuildStages;
        clear(tile_sums);
        if constexpr (kSplitOperands) {
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tCsA); ++kb) {
            CUTE_UNROLL
            for (int i = 0; i < size(a_big); ++i) split_tf32(tCsA(_, _, kb, stage)(i), a_big(i), a_small(i));
            CUTE_UNROLL
            for (int n = 0; n < size<1>(tCsB); ++n) {
              CUTE_UNROLL
              for (int i = 0; i < size(b_big); ++i) split_tf32(tCsB(_, n, kb, stage)(i), b_big(i), b_small(i));
              // Small products first: they are added while the sum is still small.
              gemm(mma, tile_sums(_, 0, n), a_small(_, 0), b_big, tile_sums(_, 0, n));
              gemm(mma, tile_sums(_, 0, n), a_big(_, 0), b_small, tile_sums(_, 0, n));
              gemm(mma, tile_sums(_, 0, n), a_big(_, 0), b_big, tile_sums(_, 0, n));
            }
          }
        } else {
          add_bf16_tile_products<D>(shared + stage * tile::stage, tile_sums);
        }
        // Tensor cores round their fp32 sums toward zero, so one accumulator chained through all 3 * r / 8 MMAs
        // drifts (a host model that truncates every MMA result: 1.3e-5 of sum |a*b| at r = 2048, near the parity
        // tests' tolerance). Chains of 12 MMAs per K tile, summed with round-to-nearest fp32 adds: 2e-7 in the same
        // model.
        CUTE_UNROLL
        for (int i = 0; i < size(accumulators); ++i) accumulators(i) += tile_sums(i);
        __syncthreads();  // everyone is done with this stage before it is refilled (or stage 2 reused as sC)
      }
      phase_stamp(stamped_kernel::rebuild, 30);
      if (rope_in_registers<D>(d, use_table())) {
        // RoPE of the thread's pairs in its accumulators (rope_in_registers), each pair rotated as over sC below:
        // the same coefficients, the same float64 rotation, so the same keys. Rows past current_rows (padding) are
        // rotated too and never stored.
        const Tensor coordinates = thread_mma.partition_C(make_identity_tensor(shape(sC)));  // (row, dim) of each
        const int row0 = get<0>(coordinates(0));
        const int column0 = get<1>(coordinates(0));
        const auto rotate = [&](float& x1, float& x2, int row, int pair) {
          const float2 c = rope_rows[row * (D / 2) + pair];  // from the table, or computed there (issue_coefficients)
          rotate_pair(x1, x2, static_cast<double>(c.x), static_cast<double>(c.y));
        };
        constexpr int kBlocks = decltype(size<2>(accumulators))::value;  // n8 blocks of the thread: D / 16
        static_assert(kBlocks == D / 16 && decltype(size<0>(accumulators))::value == 4);
        if (d.rope_interleaved != 0) {
          CUTE_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            const int column = column0 + 16 * j;  // even: the first dim of pair column / 2
            if (column < d.rotary_dim) {
              rotate(accumulators(0, 0, j), accumulators(1, 0, j), row0, column / 2);
              rotate(accumulators(2, 0, j), accumulators(3, 0, j), row0 + 8, column / 2);
            }
          }
        } else {
          CUTE_UNROLL
          for (int j = 0; j < kBlocks / 2; ++j) {
            CUTE_UNROLL
            for (int v = 0; v < 4; ++v) {
              rotate(accumulators(v, 0, j), accumulators(v, 0, j + kBlocks / 2), row0 + 8 * (v / 2),
                     column0 + 16 * j + v % 2);
            }
          }
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size(accumulators); ++i) tCsC(i) = accumulators(i);
    }

    // The next group's tables. The two dependent loads that the prologue needs (miss slot, then the slot's chunk)
    // are waited for here. The position (a third, random load) is needed only by the next pass's RoPE: a cp.async
    // (zeros for padding rows), committed with K tile 0 below and so waited for by the next main loop's first wait.
    // (Held in a register across the RoPE instead, it cost a 4-byte spill at D = 96: the float64 sincos's slow path
    // is a call.)
    const bool has_next = next < misses;
    if (has_next && threadIdx.x < kRebuildRows) {
      const int next_rows = min(group_chunks, misses - next) * d.chunk;
      const int row = static_cast<int>(threadIdx.x);
      long long token = -1;
      long long target = 0;
      [[maybe_unused]] const T* value_row = nullptr;
      if (row < next_rows) {
        const int slot = miss_slots[next + row / d.chunk];
        const int j = row % d.chunk;
        const long long chunk_id = cache_chunks[slot];
        token = chunk_id * d.chunk + j;
        target = (static_cast<long long>(slot) * d.chunk + j) * D;
        if constexpr (kAttend) {
          // The row's values (a (chunk, head) run is [C, D] in the value store), into L2 now: the group's attention
          // copies them to shared memory only after its own main loop and RoPE (attend_tile). A 128-byte line at a
          // time.
          const value_runs values = value_runs_of(*view, chunk_id);  // a forked sequence's prompt runs are shared
          value_row = static_cast<const T*>(values.store) + ((values.chunk * d.kv_heads + h) * d.chunk + j) * D;
#pragma unroll
          for (int line = 0; line < (D * static_cast<int>(sizeof(T)) + 127) / 128; ++line) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(value_row) + 128 * line));
          }
        }
      }
      if constexpr (kAttend) value_rows(buffer)[row] = value_row;
      row_token(buffer)[row] = token;
      row_target(buffer)[row] = target;
      const long long* const positions = view->context_positions;
      const bool live = token >= 0;
      copy_async_or_zero<8, copy_cache::all_levels>(row_position(buffer) + row, live ? positions + token : positions,
                                                    live);
    }
    if constexpr (kAttend) {
      // The KV head's G query heads, scaled so that scores are in log2 units (as the attention's), once, by the
      // threads that write no row table (their loads land beside the tables' dependent ones): published by barrier
      // A, read by every group's attention.
      if (pass == 0 && threadIdx.x == kRebuildRows) {
        // The head's values in the selection cache, and the bytes this (sequence, head) reads from the value store
        // this step counted once (by its CTA 0), as the value fetch counts them (counters[3]).
        cache_values_of_head =
            static_cast<T*>(view->cache_values) + static_cast<long long>(h) * d.cache_slots * d.chunk * D;
        if (blockIdx.z == 0) {
          atomicAdd(workspace.counters + 3,
                    static_cast<unsigned long long>(misses) * d.chunk * D * static_cast<unsigned long long>(sizeof(T)));
        }
      }
      if (pass == 0 && threadIdx.x >= kRebuildRows) {
        const float q_scale = d.softmax_scale * kLog2e;
        const long long head0 = static_cast<long long>(h) * d.group;
        for (int item = static_cast<int>(threadIdx.x) - kRebuildRows; item < d.group * D;
             item += kRebuildThreads - kRebuildRows) {
          const int g = item / D;
          const int dim = item % D;
          queries[item] = q_scale * load_any(attend.q.data, attend.q.type,
                                             b * attend.q.stride[0] + (head0 + g) * attend.q.stride[1] +
                                                 dim * attend.q.stride[2]);
        }
      }
    }
    __syncthreads();  // A: sC and the next group's row_token are written
    phase_stamp(stamped_kernel::rebuild, 31);
    if constexpr (kAttend) {
      // The current group's values (attend_tile: in the coefficients' place, which its RoPE is done with), a copy
      // group of their own before the next group's prologue; waited for before its attention, after the stores.
      if (current_rows > 0) issue_values(current_rows, value_rows(buffer ^ 1));
      commit_async_copies();
    }

    if (has_next) {
      // The next group's prologue: K tiles 0 and 1 into stages 0 and 1, landing during the RoPE below.
      // (A loop, not two calls: one more inlined copy of load_stage made ptxas spill ~200 bytes with bf16 factors.)
#pragma unroll 1
      for (int kt = 0; kt < kRebuildStages - 1 && kt < k_tiles; ++kt) {
        load_stage(kt, kt, row_token(buffer));
        commit_async_copies();
        phase_stamp(stamped_kernel::rebuild, 34 + kt);  // thread 0 has issued tile kt (then barrier B waits for all)
      }
    }

    // Epilogue of the current group: RoPE in place in sC (a thread per pair; unless it was done in the accumulators),
    // then 16-byte stores of whole rows.
    if (current_rows > 0 && !rope_in_registers<D>(d, use_table())) {
      const long long* const positions = row_position(buffer ^ 1);
      const int half = d.rotary_dim / 2;
      for (int item = static_cast<int>(threadIdx.x); item < current_rows * half; item += kRebuildThreads) {
        const int row = item / half;
        const int pair = item % half;
        int first_dim;
        int second_dim;
        rope_dims(d, pair, first_dim, second_dim);
        float x1 = sC(row, first_dim);
        float x2 = sC(row, second_dim);
        const long long position = positions[row];
        if (use_table() && position >= 0 && position < workspace.rope_table_positions) {
          // The table holds rope_coefficients' values for this (position, pair) as they are: the same rotation.
          const float2 coefficients_here = rope_rows[row * (D / 2) + pair];
          rotate_pair(x1, x2, static_cast<double>(coefficients_here.x), static_cast<double>(coefficients_here.y));
        } else {
          rope_pair(x1, x2, inv_freq[pair], position, d.attention_scaling, false);
        }
        sC(row, first_dim) = x1;
        sC(row, second_dim) = x2;
      }
    }
    __syncthreads();  // B: RoPE is done with sC
    phase_stamp(stamped_kernel::rebuild, 32);
    if (current_rows > 0) {
      const long long* const targets = row_target(buffer ^ 1);
      constexpr int kVector = 16 / static_cast<int>(sizeof(T));  // D * sizeof(T) is a multiple of 16 for every D
      constexpr int kVectorsPerRow = D / kVector;
      for (int item = static_cast<int>(threadIdx.x); item < current_rows * kVectorsPerRow; item += kRebuildThreads) {
        const int row = item / kVectorsPerRow;
        const int column = (item % kVectorsPerRow) * kVector;
        union {
          uint4 vector;
          T elements[kVector];
        } packed;
#pragma unroll
        for (int i = 0; i < kVector; ++i) packed.elements[i] = from_float<T>(sC(row, column + i));
        *reinterpret_cast<uint4*>(cache_keys + targets[row] + column) = packed.vector;
        if constexpr (kAttend) {
          // The keys as stored, for the group's attention (attend_group reads sC).
#pragma unroll
          for (int i = 0; i < kVector; ++i) sC(row, column + i) = to_float(packed.elements[i]);
        }
      }
    }
    if constexpr (kAttend) {
      if (current_rows > 0) {
        // The values' group is older than the next group's prologue (up to two groups, committed after it).
        wait_async_copies_at_most(has_next ? min(kRebuildStages - 1, k_tiles) : 0);
        __syncthreads();  // every thread's values have landed
        phase_stamp(stamped_kernel::rebuild, 36);
        // The group's values into their selection-cache slots (the keys' targets), 16-byte stores.
        const long long* const targets = row_target(buffer ^ 1);
        constexpr int kVectorsPerRow = D * static_cast<int>(sizeof(T)) / 16;
        for (int v = static_cast<int>(threadIdx.x); v < current_rows * kVectorsPerRow; v += kRebuildThreads) {
          const int row = v / kVectorsPerRow;
          const int piece = v % kVectorsPerRow;
          reinterpret_cast<uint4*>(cache_values_of_head + targets[row])[piece] =
              reinterpret_cast<const uint4*>(group_values + row * D)[piece];
        }
        phase_stamp(stamped_kernel::rebuild, 48);  // (thread 0's stores issued; no barrier)
        attend_group(current_rows, (next - group_stride) / group_chunks);
        phase_stamp(stamped_kernel::rebuild, 47);
      }
    }
    if (!has_next) {
      finish_phase_stamps(stamped_kernel::rebuild, 39);
      break;
    }
    // With the RoPE table: the next group's positions (committed with its K tile 0 in the prologue above) have
    // landed for this thread's rows, and after barrier C for every thread's ...
    if (use_table()) wait_async_copies_at_most(k_tiles >= 2 ? 1 : 0);
    __syncthreads();  // C: the stores are done with sC before the main loop refills stage 2
    phase_stamp(stamped_kernel::rebuild, 33);
    // ... so the next group's coefficients are copied from the table now, a group of their own after its K tiles 0
    // and 1, landing during its main loop. The current group's RoPE, their last reader, ended before barrier B.
    if (use_table()) {
      issue_coefficients(min(group_chunks, misses - next) * d.chunk, row_position(buffer));
      commit_async_copies();
    }
  }
}

template <typename T, typename F, int D, bool kAttend>
void launch_rebuild_for(const dims& d, layer_view* views, const int* batch_slots, int layer, int batch,
                        const step_workspace& workspace, const float* inv_freq, const miss_attention& attend,
                        cudaStream_t stream) {
  using tile = rebuild_tile<F, D>;
  static std::atomic<std::uint64_t> allowed_on_devices{0};  // above 48 KiB: the opt-in limit, once per device
  shadowkv_allow_large_shared_memory(rebuild_keys_kernel<T, F, D, kAttend>, allowed_on_devices);
  const bool use_table = tile::table_fits && workspace.rope_table != nullptr;  // as the kernel decides
  std::size_t shared = use_table ? tile::shared_bytes_with_table : tile::shared_bytes;
  if constexpr (kAttend) {
    shared = attend_tile<T, F, D>::shared_bytes(use_table, rope_in_registers<D>(d, use_table), d.group);
  }
  // CTAs an SM: rebuild_min_ctas_per_sm where the shared memory allows it (the attention's regions may not).
  const int resident = std::max<int>(
      1, std::min<int>(rebuild_min_ctas_per_sm<D>(),
                       static_cast<int>(kSharedPerSm / (shared + kSharedReservedPerCta))));
  const int groups = rebuild_max_groups(d);
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(d.kv_heads),
                  static_cast<unsigned>(splits_for(batch, d.kv_heads, groups, resident)));
  launch_after_prior_grid(rebuild_keys_kernel<T, F, D, kAttend>, grid, dim3(kRebuildThreads), shared, stream,
                          true, d, views, batch_slots, layer, workspace, inv_freq, attend);
}

template <typename T, int D, bool kAttend>
void launch_rebuild_for(const dims& d, layer_view* views, const int* batch_slots, int layer, int batch,
                        const step_workspace& workspace, const float* inv_freq, const miss_attention& attend,
                        cudaStream_t stream) {
  if (d.factor_bf16 != 0) {
    launch_rebuild_for<T, __nv_bfloat16, D, kAttend>(d, views, batch_slots, layer, batch, workspace, inv_freq, attend,
                                                     stream);
  } else {
    launch_rebuild_for<T, float, D, kAttend>(d, views, batch_slots, layer, batch, workspace, inv_freq, attend, stream);
  }
}

}  // namespace

int rebuild_group_chunks(const dims& d) { return d.chunk >= 1 ? std::max(1, kRebuildRows / d.chunk) : 1; }

int rebuild_max_groups(const dims& d) {
  const int group_chunks = rebuild_group_chunks(d);
  return (std::max(d.budget, 0) + group_chunks - 1) / group_chunks;
}

void launch_rebuild_keys(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, const float* inv_freq, cudaStream_t stream,
                         const miss_attention* attend) {
  SHADOWKV_EXPECTS(supported_head_dim(d.head_dim), "key rebuild supports head_dim 64, 80, 96, 128 or 256, got ",
                   d.head_dim);
  SHADOWKV_EXPECTS(d.chunk >= 1 && d.chunk <= kRebuildRows, "chunk_size ", d.chunk,
                   " is not supported by the CUDA key rebuild (1 to ", kRebuildRows, ")");
  SHADOWKV_EXPECTS(d.rank >= 1, "key rebuild: rank must be >= 1, got ", d.rank);
  SHADOWKV_EXPECTS(d.rotary_dim >= 0 && d.rotary_dim <= d.head_dim && d.rotary_dim % 2 == 0,
                   "key rebuild: rotary_dim must be even and in [0, head_dim = ", d.head_dim, "], got ", d.rotary_dim);
  SHADOWKV_EXPECTS(d.kv_heads >= 1 && d.kv_heads <= 65535 && d.budget >= 1 && d.cache_slots >= d.budget,
                   "key rebuild: need 1 <= kv_heads <= 65535, budget >= 1 and cache_slots >= budget, got kv_heads ",
                   d.kv_heads, ", budget ", d.budget, ", cache_slots ", d.cache_slots);
  SHADOWKV_EXPECTS(batch >= 0, "key rebuild: batch must be >= 0, got ", batch);
  if (attend != nullptr) {
    SHADOWKV_EXPECTS(kv_type == element_bf16 && d.head_dim <= 128 && d.value_fp8 == 0 && d.group >= 1 &&
                         d.group <= kMissAttentionMaxGroup,
                     "key rebuild: the attention over the rebuilt rows needs bf16 keys and values, head_dim <= 128 and "
                     "1 to ", kMissAttentionMaxGroup, " query heads per KV head, got element type ", kv_type,
                     ", head_dim ", d.head_dim, ", value_fp8 ", d.value_fp8, ", group ", d.group);
    SHADOWKV_EXPECTS(attend->partial != nullptr && attend->q.data != nullptr && attend->first_split >= 0 &&
                         attend->first_split + rebuild_max_groups(d) <= attend->max_splits,
                     "key rebuild: the attention's partials need first_split + ", rebuild_max_groups(d),
                     " groups <= max_splits, got first_split ", attend->first_split, ", max_splits ",
                     attend->max_splits);
  }
  if (batch == 0) return;
  if (attend != nullptr) {
    shadowkv_dispatch_head_dim(d.head_dim, "key rebuild", [&](auto head_dim) {
      constexpr int kD = decltype(head_dim)::value;
      if constexpr (kD <= 128) {
        launch_rebuild_for<__nv_bfloat16, kD, true>(d, views, batch_slots, layer, batch, workspace, inv_freq, *attend,
                                                    stream);
      }
    });
    SHADOWKV_CUDA_CHECK_LAUNCH();
    return;
  }
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    shadowkv_dispatch_head_dim(d.head_dim, "key rebuild", [&](auto head_dim) {
      launch_rebuild_for<T, decltype(head_dim)::value, false>(d, views, batch_slots, layer, batch, workspace, inv_freq,
                                                              miss_attention{}, stream);
    });
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
