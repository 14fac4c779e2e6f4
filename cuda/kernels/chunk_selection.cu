// Landmark scores, top-k per KV head and the temporal-cache update (see chunk_selection.cuh): the host planner. It
// plans the kernels below from dims, the batch size and the device, and launches them; the kernels live in
// cuda/kernels/selection/ (landmark_scoring.cu, select_kernel.cu; the select kernel's block-wide steps in
// group_scores.cuh, softmax_partials.cuh, radix_select.cuh and cache_policy.cuh). The workspace rows of its own (tile partials,
// and radix keys too many for shared memory) are sized by chunk_selection_workspace, which the backend asks when it
// reserves the step workspace.
//
// Decode (one query token) runs two kernels whose shapes depend only on dims and the batch size, so the step can
// be captured in a CUDA graph (the context length is read from the device layer_view, never from the host):
//
//   1. landmark_logits_kernel (selection/landmark_scoring.cu), grid (ceil(tiles / tiles_per_cta), Hkv, B), 256
//      threads. A tile is up to 128 consecutive chunks of one head: contiguous rows of T [Hkv, max_chunks, D], staged
//      in shared memory with 16-byte cp.async (two stages: the next tile loads while this one is computed) and used
//      once for all G query heads (q in shared memory as float, read as broadcasts; two threads a row). It writes
//      softmax_scale * q_j·L[c] (-inf for outliers) to workspace.logits [B, Hq, max_chunks], and each tile's softmax
//      partial (max, sum exp) per query head. CTA x takes tiles x, x + gridDim.x, ... below context_chunks; the
//      number of tiles per CTA is chosen on the host from dims, batch and the device (about one wave of CTAs). The
//      partials go to workspace.selection_partials: row (b, h) of [G][tiles][2] floats. Decode shapes that the
//      streaming kernel of landmark_logits.cu covers use that kernel instead (same outputs up to the float32 order of
//      the sums; bf16 rows of 64 or 128 elements in batches with many tiles on tensor cores over bulk-copied tiles).
//   2. select_kernel (selection/select_kernel.cu), one CTA of 1024 threads per (b, h): merges the tile partials into
//      one normaliser per query head of the group and scores each chunk from its G logits (selection/group_scores.cuh):
//      score(c) = max_j p_j(c) = exp2(max_j(x_j(c) * log2 e - offset_j)) (dims::group_mean: the mean of the p_j(c), an
//      exp each; -1 for non-candidates), into per-chunk radix keys (float bits + 1; 0 for non-candidates) and
//      workspace.scores (chunks c < context_chunks; 0 for outliers); the top-k by an MSB-first radix select over the radix keys (digits of 12, 11 and 9 bits,
//      shared-memory histograms, the digit found with one cub::BlockScan over the bins); then an ordered compaction
//      (warp ballots and one exchange of warp totals) that takes every chunk strictly above the k-th radix key and the
//      first ties in ascending id, writing workspace.selected ascending; then the cache update with the same
//      compaction (free slots ascending, misses ascending), slot_of_chunk giving O(1) membership. A cache larger
//      than the budget (K > k) picks its victims with a second radix select over per-slot eviction keys and ranks
//      the (at most k) victims exactly by their 64-bit stamps (selection/cache_policy.cuh, update_lru_cache). The
//      radix keys live in shared memory when max_chunks fits (4 B per chunk, up to about 54K chunks on an H200);
//      else in workspace.radix_keys (plan_select decides, for the workspace query and the launch alike).
//      When the batch leaves multiprocessors idle (B = 1: one CTA a head on 8 of 132 SMs), a cluster of 8 CTAs (or 4,
//      where the GPCs hold no more clusters of 8) takes each (b, h) instead (select_cluster_kernel, plan_select_cluster): CTA r ranks the r-th slice of
//      the chunks, the radix select's histograms are summed over the cluster through distributed shared memory, the
//      compaction offsets each CTA's ids by the counts of the CTAs before it, and the first CTA updates the cache;
//      the radix keys live in workspace.radix_keys there (rows for such small launches are always reserved).
//
// Several query tokens (a prefill's q_last, an extend block) need one softmax per token before the sum over tokens,
// i.e. a normaliser per (b, j, t) that only a full pass can give, and the logits buffer has room for one token. So,
// per group of up to kScoringTokenGroup tokens, kernel 1 runs twice: logit_mode::statistics writes the tile partials of
// each token of the group (a partials row per token), then logit_mode::accumulate recomputes the logits, normalises
// them with the merged partials and adds p_{j,t} into logits row j (-1 for non-candidates), token after token from
// each staged tile. Kernel 2 then takes the score over the group. 2*ceil(Tq/16) + 1 launches, two landmark passes
// per group of tokens. (One launch pair per token made an extend block of 32 tokens take ~3 ms at 122K tokens on an
// H100, at f49271d.)
//
// Every chunk's logit is computed by the same sequence of float operations wherever it sits in a tile, so identical
// landmarks give bit-identical scores and ties are broken by chunk id exactly as the CPU reference does.
#include "chunk_selection.cuh"

#include <algorithm>
#include <type_traits>

#include "common/dispatch.cuh"
#include "common/per_device_cache.hpp"
#include "cuda_check.hpp"
#include "landmark_logits.cuh"
#include "selection/landmark_scoring.cuh"
#include "selection/select_kernel.cuh"
#include "selection/selection_plan.cuh"

namespace shadowkv::cuda {
namespace {

using selection::device_limits;
using selection::logit_geometry;

/// The current device's limits, asked once per device ordinal (each GPU of a process gets its own numbers).
device_limits current_device_limits() {
  static per_device_cache<device_limits> known;
  return known.get(0, [](int device, int) {
    device_limits limits{};
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&limits.optin_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&limits.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    limits.clusters_at_once[0] = selection::select_clusters_at_once(4);
    limits.clusters_at_once[1] = selection::select_clusters_at_once(8);
    return limits;
  });
}

void plan_and_launch(const dims& d, int kv_type, int element_bytes, const layer_view* views, const int* batch_slots,
                     int layer, int batch, const strided_tensor& queries, int tokens, const step_workspace& ws,
                     int beside_ctas, cudaStream_t stream, cudaEvent_t logits_done) {
  const logit_geometry logit_geo = selection::plan_logits(d, element_bytes);
  SHADOWKV_EXPECTS(logit_geo.tiles == 0 || ws.selection_partials != nullptr,
                   "chunk selection: step_workspace::selection_partials is null (size it with "
                   "chunk_selection_workspace)");
  const device_limits limits = current_device_limits();
  if (logit_geo.tiles > 0) {
    // Decode: the streaming kernel of landmark_logits.cu where it covers the shape, else the tiled one.
    const bool decode_kernel =
        tokens == 1 && launch_decode_landmark_logits(d, kv_type, views, batch_slots, layer, batch, queries,
                                                     logit_geo.tile_rows, logit_geo.tiles, limits.multiprocessors,
                                                     beside_ctas, ws.logits, ws.selection_partials,
                                                     ws.logits_claims, stream);
    if (!decode_kernel) {
      selection::launch_landmark_scoring(d, kv_type, views, batch_slots, layer, batch, queries, tokens, logit_geo, ws,
                                         limits, stream);
    }
  }
  if (logits_done != nullptr) SHADOWKV_CUDA_TRY(cudaEventRecord(logits_done, stream));
  selection::launch_select_kernel(d, views, batch_slots, layer, batch, ws, selection::plan_select(d, limits),
                                  selection::plan_select_cluster(d, batch, limits, ws.radix_keys != nullptr),
                                  tokens > 1 ? selection::score_input::summed_probabilities
                                             : selection::score_input::logits_and_partials,
                                  logit_geo, stream);
}

/// Bytes per element of a scored row: the landmarks' type, or 2 for two-centroid codes (2·D bytes a chunk).
int element_bytes_of(const dims& d, int kv_type) {
  int element_bytes = 0;
  shadowkv_dispatch_element(kv_type, [&](auto tag) {
    element_bytes = static_cast<int>(sizeof(std::remove_pointer_t<decltype(tag)>));
  });
  return d.chunk_centroids != 0 ? 2 : element_bytes;
}

}  // namespace

void launch_select_chunks(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                          strided_tensor queries, int tokens, const step_workspace& workspace, int beside_ctas,
                          cudaStream_t stream, cudaEvent_t logits_done) {
  SHADOWKV_EXPECTS(batch >= 0, "chunk selection: batch must be >= 0, got ", batch);
  if (batch == 0) {
    if (logits_done != nullptr) SHADOWKV_CUDA_TRY(cudaEventRecord(logits_done, stream));
    return;
  }
  SHADOWKV_EXPECTS(tokens >= 1, "chunk selection: tokens must be >= 1, got ", tokens);
  SHADOWKV_EXPECTS(d.kv_heads >= 1 && d.group >= 1 && d.q_heads == d.kv_heads * d.group,
                   "chunk selection: q_heads must be kv_heads * group");
  SHADOWKV_EXPECTS(d.head_dim >= 1 && d.budget >= 1 && d.max_chunks >= 0,
                   "chunk selection: head_dim and budget must be >= 1, max_chunks >= 0");
  // K > k reuses the per-chunk radix keys (max_chunks of them) as per-slot eviction keys.
  SHADOWKV_EXPECTS(d.cache_slots == d.budget || (d.cache_slots > d.budget && d.cache_slots <= d.max_chunks),
                   "chunk selection: cache_slots must be budget or in (budget, max_chunks], got cache_slots ",
                   d.cache_slots, ", budget ", d.budget, ", max_chunks ", d.max_chunks);
  SHADOWKV_EXPECTS(queries.type == element_f32 || queries.type == element_f16 || queries.type == element_bf16,
                   "chunk selection: unknown query element type ", queries.type);
  plan_and_launch(d, kv_type, element_bytes_of(d, kv_type), views, batch_slots, layer, batch, queries, tokens, workspace,
                  std::max(beside_ctas, 0), stream, logits_done);
}

selection_workspace_bytes chunk_selection_workspace(const dims& d, int kv_type, int max_batch) {
  SHADOWKV_EXPECTS(max_batch >= 0 && d.kv_heads >= 1 && d.group >= 1 && d.max_chunks >= 0,
                   "chunk selection workspace: need max_batch >= 0, kv_heads >= 1, group >= 1 and max_chunks >= 0");
  const long long rows = static_cast<long long>(max_batch) * d.kv_heads;
  const logit_geometry logit_geo = selection::plan_logits(d, element_bytes_of(d, kv_type));
  selection_workspace_bytes bytes{};
  bytes.partials = static_cast<std::size_t>(rows * selection::kScoringTokenGroup *
                                            selection::partial_row_floats(d, logit_geo)) * sizeof(float);
  // One row per (sequence, KV head) of a launch when the keys do not fit in shared memory; else rows for the
  // launches small enough to run in clusters, which keep their radix keys here (plan_select_cluster).
  const device_limits limits = current_device_limits();
  const long long radix_rows = selection::plan_select(d, limits).radix_keys_in_shared == 0
                                   ? rows
                                   : std::min(rows, selection::select_cluster_rows(limits));
  bytes.radix_keys = static_cast<std::size_t>(radix_rows * d.max_chunks) * sizeof(unsigned);
  return bytes;
}

}  // namespace shadowkv::cuda
