// Kernel 1b of the chunk selection: scores from the logits and the merged tile partials (see chunk_selection.cu).
#include "selection/score_merge.cuh"

#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "cuda_check.hpp"
#include "selection/softmax_partials.cuh"

namespace shadowkv::cuda::selection {
namespace {

constexpr int kScoreThreads = 256;  // one chunk a thread

/// Grid (ceil(max_chunks / 256), Hkv, B). `input`: what the logits rows hold (score_merge.cuh).
/// Writes score(c) = max_j p_j(c) into logits row 0 of the group, in place, or -1 for a non-candidate.
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const dims d, const layer_view* views,
                                                              const int* batch_slots, const int layer,
                                                              const int tile_rows, const int tiles,
                                                              const score_input input, float* logits,
                                                              const float* partials) {
  const bool probabilities = input != score_input::logits_and_partials;
  extern __shared__ float offsets[];  // [G]: p_j(c) = exp2(x * log2(e) - offsets[j])
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const int c = blockIdx.x * kScoreThreads + threadIdx.x;
  if (blockIdx.x * kScoreThreads >= n) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long head_row = static_cast<long long>(b) * d.kv_heads + h;
  float* logits_group = logits + (static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * d.group) * d.max_chunks;
  if (!probabilities) {
    const int used_tiles = (n + tile_rows - 1) / tile_rows;
    for (int g = warp; g < d.group; g += kScoreThreads / 32) {
      float m = kNegativeInfinity;
      float s = 0.0F;
      const float* partial = partials + (head_row * d.group + g) * tiles * 2;
      for (int t = lane; t < used_tiles; t += 32) merge_partial(m, s, partial[2 * t], partial[2 * t + 1]);
      warp_merge_partial(m, s);
      // p_j(c) = exp(x - M) / Z = exp2(x * log2(e) - offset); exp2 is monotonic, so the max over j can be taken on
      // the arguments: one exp per chunk instead of one per query head.
      if (lane == 0) offsets[g] = m * kLog2e + log2f(s);
    }
    __syncthreads();
  }
  if (c >= n) return;
  float best = probabilities ? 0.0F : kNegativeInfinity;
  float sum = 0.0F;  // group_mean: the probabilities' sum (an exp per head: the max's one-exp shortcut does not apply)
  bool candidate = false;
#pragma unroll 4
  for (int g = 0; g < d.group; ++g) {
    const float x = logits_group[static_cast<long long>(g) * d.max_chunks + c];
    if (g == 0) candidate = probabilities ? x >= 0.0F : x != kNegativeInfinity;
    if (d.group_mean != 0) {
      sum += probabilities ? x : exp2f(fmaf(x, kLog2e, -offsets[g]));
    } else {
      best = fmaxf(best, probabilities ? x : fmaf(x, kLog2e, -offsets[g]));
    }
  }
  const float score = d.group_mean != 0 ? sum / static_cast<float>(d.group) : (probabilities ? best : exp2f(best));
  logits_group[c] = candidate ? score : -1.0F;
}

}  // namespace

void launch_score_merge(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                        const logit_geometry& geo, score_input input, const step_workspace& ws, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((d.max_chunks + kScoreThreads - 1) / kScoreThreads),
                  static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
  const long long shared = 4LL * d.group;
  allow_shared(score_kernel, shared);
  score_kernel<<<grid, kScoreThreads, static_cast<size_t>(shared), stream>>>(d, views, batch_slots, layer,
                                                                            geo.tile_rows, geo.tiles, input, ws.logits,
                                                                            ws.selection_partials);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda::selection
