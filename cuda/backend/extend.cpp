// extend and truncate on the CUDA backend (docs/semantics.md, "Extend" and "Truncate").
//
// An extend block runs the decode step's selection machinery (select_parts, fetch_values, rebuild_keys) with the
// block's s queries, then attends with its own kernels around two batched GEMMs of cuBLAS (block_attention.cuh): the
// block's tokens are read from the caller's tensors there and appended to the ring only afterwards, one launch for
// the whole block (launch_append_block), so that the ring never holds more than its window. That is the CPU
// backend's order of results: the union a block token attends over is the same.
#include <algorithm>
#include <cstdint>

#include <cublas_v2.h>

#include "backend_support.hpp"
#include "block_attention.cuh"
#include "cuda_backend.hpp"
#include "generated_tokens.cuh"

namespace shadowkv::cuda {

using backend_support::as_strided;
using backend_support::index_bits;

namespace {

cudaDataType_t cuda_type(int kv_type) {
  switch (kv_type) {
    case element_f16: return CUDA_R_16F;
    case element_bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// float32 stores keep float32 products (no TF32); 16-bit stores multiply on tensor cores and add in float32.
cublasComputeType_t compute_type(int kv_type) {
  return kv_type == element_f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}

strided_tensor positions_of(const tensor_view& positions) {
  if (positions.empty()) return strided_tensor{nullptr, 0, {0, 0, 0, 0}};
  return strided_tensor{positions.data, 0, {positions.strides[0], positions.strides[1], 0, 0}};
}

}  // namespace

void cuda_backend::reserve_extend(int /*layer*/, std::span<const batch_entry> entries,
                                  std::span<const std::int64_t> tokens) {
  const int batch = static_cast<int>(entries.size());
  const std::int64_t longest = tokens.empty() ? 1 : *std::max_element(tokens.begin(), tokens.end());
  const int block = static_cast<int>(std::min<std::int64_t>(config_.extend_block, longest));
  if (batch <= extend_batch_ && block <= extend_block_) return;
  const int new_batch = std::max(batch, extend_batch_);
  const int new_block = std::max(block, extend_block_);
  // Allocated on the backend's own stream and waited for; the buffer it replaces may still be read by earlier calls'
  // kernels, so the device finishes those first.
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  device_buffer grown(block_attention_bytes(dims_, kv_type_, new_batch, new_block), own_stream_,
                      resources_->device_memory());
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  extend_memory_ = std::move(grown);
  extend_batch_ = new_batch;
  extend_block_ = new_block;
}

void cuda_backend::extend_block(int layer, std::span<const batch_entry> entries, const block_inputs& inputs,
                                const mutable_tensor_view& out) {
  const int batch = static_cast<int>(entries.size());
  const int tokens = static_cast<int>(inputs.queries.shape[1]);
  SHADOWKV_EXPECTS(batch <= extend_batch_ && tokens <= extend_block_, "extend_block of ", batch, " entries and ",
                   tokens, " tokens without reserve_extend (room for ", extend_batch_, " and ", extend_block_, ")");
  prefilling_ = false;
  extending_ = true;
  auto* views = static_cast<layer_view*>(views_.data());
  const auto* slots = static_cast<const int*>(batch_slots_.data());
  const auto* inv_freq = static_cast<const float*>(inv_freq_.data());
  try {
    upload_batch(entries);
    join_append();
    // 1. A full ring folds first (a no-op for the others), as a decode step's.
    launch_fold_generated(dims_, kv_type_, views, slots, layer, batch, inv_freq, stream_);
    // 2–3. One selection with the block's queries; the misses' values and keys.
    select_parts(layer, entries, inputs.queries);
    fetch_values(layer, entries);
    rebuild_keys(layer, entries);
    join_fetch();
    // 4. The block attention: S = Q·Kᵀ, P = causal softmax, O = P·V, for every (entry, KV head) at once.
    const block_attention_buffers buffers =
        block_attention_layout(dims_, kv_type_, extend_batch_, extend_block_, extend_memory_.data());
    const strided_tensor positions = positions_of(inputs.positions);
    const int positions_bits = inputs.positions.empty() ? 64 : index_bits(inputs.positions);
    launch_gather_block_union(dims_, kv_type_, views, slots, layer, batch, tokens, workspace_.selected,
                              as_strided(inputs.queries), as_strided(inputs.keys), as_strided(inputs.values),
                              positions, positions_bits, inputs.keys_post_rope, inv_freq, buffers, stream_);
    const device_resources::library_lease libraries = resources_->libraries(stream_);
    const int heads = batch * config_.num_kv_heads;
    const int rows = buffers.union_rows;
    const int queries = tokens * config_.group_size();
    const long long query_stride = static_cast<long long>(buffers.block) * config_.group_size();
    const int dim = config_.head_dim;
    const float one = 1.0F;
    const float zero = 0.0F;
    const cudaDataType_t type = cuda_type(kv_type_);
    // Column-major views of the row-major buffers: Sᵀ [rows x queries] = K [dim x rows]ᵀ · Q [dim x queries].
    SHADOWKV_CUBLAS_TRY(cublasGemmStridedBatchedEx(
        libraries.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, rows, queries, dim, &one, buffers.keys, type, dim,
        static_cast<long long>(rows) * dim, buffers.queries, type, dim, query_stride * dim, &zero, buffers.scores,
        CUDA_R_32F, rows, query_stride * rows, heads, compute_type(kv_type_), CUBLAS_GEMM_DEFAULT));
    launch_block_softmax(dims_, kv_type_, batch, tokens, buffers, stream_);
    // Oᵀ [dim x queries] = V [dim x rows] · Pᵀ [rows x queries].
    SHADOWKV_CUBLAS_TRY(cublasGemmStridedBatchedEx(
        libraries.cublas(), CUBLAS_OP_N, CUBLAS_OP_N, dim, queries, rows, &one, buffers.values, type, dim,
        static_cast<long long>(rows) * dim, buffers.probabilities, type, rows, query_stride * rows, &zero,
        buffers.outputs, CUDA_R_32F, dim, query_stride * dim, heads, compute_type(kv_type_), CUBLAS_GEMM_DEFAULT));
    launch_scatter_block_outputs(dims_, batch, tokens, buffers, as_strided(out), stream_);
    // 5. The block's tokens into the ring, each after decode's fold rule, and the fold of a ring the block filled.
    launch_append_block(dims_, kv_type_, views, slots, layer, batch, tokens, as_strided(inputs.keys),
                        as_strided(inputs.values), positions, positions_bits, inputs.keys_post_rope, inv_freq,
                        stream_);
  } catch (...) {
    extending_ = false;
    throw;
  }
  extending_ = false;
}

void cuda_backend::truncate_generated(int layer, std::span<const batch_entry> entries,
                                      std::span<const layer_state> targets) {
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::int64_t undone = entries[i].state->context_chunks - targets[i].context_chunks;
    SHADOWKV_EXPECTS(undone <= config_.journal_chunks(), "truncate of slot ", entries[i].slot, " would undo ", undone,
                     " folds; the fold journal holds ", config_.journal_chunks());
  }
  // Earlier calls may have run on any stream (a decode on the caller's): their writes to these counters come first.
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    launch_truncate_generated(dims_, kv_type_, device_view(entries[i].slot, layer),
                              static_cast<int>(targets[i].context_chunks),
                              static_cast<int>(targets[i].generated_exact_len), stream_);
  }
}

}  // namespace shadowkv::cuda
