// A prefill on the CUDA backend: each sequence's prompt keys prepared (RoPE removed or applied, scaled for the Gram
// matrix), factorised (a batched eigensolve of Gram matrices, or an exact SVD), A = K·Bᵀ, landmarks or centroids,
// outliers, the scatter into the arenas and the values' copy to their store; the cuSOLVER infos are read once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend_support.hpp"
#include "cuda_backend.hpp"
#include "factor_format.cuh"
#include "prompt_kernels.cuh"
#include "shadowkv/errors.hpp"
#include "value_format.cuh"

namespace shadowkv::cuda {

using backend_support::as_strided;
using backend_support::device_guard;
using backend_support::factorizes_by_gram;
using backend_support::index_bits;

void cuda_backend::gram_matrix(const float* keys_pre, int rows, double* gram,
                               const device_resources::library_lease& libraries) {
  // Gram matrix KᵀK in float64, as the CPU backend's. It is split-K (prompt_kernels.cuh, gram_split): one batched
  // SGEMM computes the lower block triangle of each row slice's partial KᵀK in float32, a kernel adds the partials in
  // float64. One SYRK over all rows left a 1024 x 1024 output of a few dozen tiles to 132 SMs for 6 ms; the split
  // fills the GPU, skips the upper blocks, and sums fewer float32 terms per element than one SYRK (more accurate, not
  // less). (Row-major K[rows, n] is the column-major matrix Kᵀ[n, rows]; block (i, j) of a slice is Kᵀ_i · Kᵀ_jᵀ.)
  const int n = static_cast<int>(config_.kv_width());
  const gram_split split = plan_gram_split(n, rows, resources_->multiprocessors());
  const std::size_t entries = static_cast<std::size_t>(split.entries());
  device_buffer partials(std::max<std::size_t>(1, gram_partial_bytes(split, n)), stream_, resources_->device_memory());
  device_buffer pointers(std::max<std::size_t>(1, 3 * entries * sizeof(void*)), stream_, resources_->device_memory());
  auto** a_blocks = static_cast<const float**>(pointers.data());
  const float** b_blocks = a_blocks + entries;
  auto** c_blocks = static_cast<float**>(static_cast<void*>(b_blocks + entries));
  if (entries > 0) {
    launch_gram_block_pointers(keys_pre, n, split, static_cast<float*>(partials.data()), a_blocks, b_blocks, c_blocks,
                               stream_);
    const float one = 1.0F;
    const float zero = 0.0F;
    SHADOWKV_CUBLAS_TRY(cublasSgemmBatched(libraries.cublas(), CUBLAS_OP_N, CUBLAS_OP_T, split.block, split.block,
                                           split.slice_rows, &one, a_blocks, n, b_blocks, n, &zero, c_blocks, n,
                                           static_cast<int>(entries)));
  }
  // The sum writes the lower block triangle only (FILL_MODE_LOWER is all the eigensolver reads); the upper blocks are
  // zeroed so that no byte of the matrix is undefined: compute-sanitizer's initcheck reported one uninitialised
  // 8-byte read inside cuSOLVER's tridiagonal reduction (sytrd4_gpu) at 4e838fb. 8 MB at n = 1024: a few µs.
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(gram, 0, static_cast<std::size_t>(n) * n * sizeof(double), stream_));
  launch_sum_gram_partials(static_cast<const float*>(partials.data()), keys_pre, rows, n, split, gram, stream_);
  partials.release(stream_);
  pointers.release(stream_);
}

void cuda_backend::solve_gram_matrices(double* grams, int count, int* infos,
                                       const device_resources::library_lease& libraries) {
  // All eigenpairs of each matrix (cuSOLVER's batched solver has no index range); the basis takes the last `rank`
  // columns. Measured on the H200 (docs/performance.md; session 10): ~9.7 ms a 1024 x 1024 matrix, as Dsyevdx's top 160.
  const std::int64_t n = config_.kv_width();
  device_buffer eigenvalues(static_cast<std::size_t>(n) * count * sizeof(double), stream_, resources_->device_memory());
  std::size_t device_bytes = 0;
  std::size_t host_bytes = 0;
  SHADOWKV_CUSOLVER_TRY(cusolverDnXsyevBatched_bufferSize(
      libraries.cusolver(), libraries.cusolver_params(), CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
      CUDA_R_64F, grams, n, CUDA_R_64F, eigenvalues.data(), CUDA_R_64F, &device_bytes, &host_bytes, count));
  device_buffer device_work(std::max<std::size_t>(1, device_bytes), stream_, resources_->device_memory());
  std::vector<std::byte> host_work(std::max<std::size_t>(1, host_bytes));
  SHADOWKV_CUSOLVER_TRY(cusolverDnXsyevBatched(libraries.cusolver(), libraries.cusolver_params(),
                                               CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, grams,
                                               n, CUDA_R_64F, eigenvalues.data(), CUDA_R_64F, device_work.data(),
                                               device_bytes, host_work.data(), host_bytes, infos, count));
  // The infos stay on the device: the call reads every sequence's at once, after the last factorisation
  // (check_factorizations). Note that cuSOLVER's dense eigensolvers return only once the stream has drained, their
  // own work included (XsyevBatched, syevdx, syevd, syevj, gesvd; measured on the H200, docs/performance.md): the host
  // waits here once a group of sequences, and no ordering of our own calls removes that wait.
  eigenvalues.release(stream_);
  device_work.release(stream_);
}

void cuda_backend::svd_basis(const float* keys_pre, int rows, float* basis, int* info,
                             const device_resources::library_lease& libraries) {
  // Exact SVD of K (rows >= n): column-major float64 copy, cuSOLVER gesvd, B = the leading rows of Vᵀ.
  const int n = static_cast<int>(config_.kv_width());
  device_buffer matrix(static_cast<std::size_t>(rows) * n * sizeof(double), stream_, resources_->device_memory());
  device_buffer singular(static_cast<std::size_t>(n) * sizeof(double), stream_, resources_->device_memory());
  device_buffer vt(static_cast<std::size_t>(n) * n * sizeof(double), stream_, resources_->device_memory());
  launch_keys_to_double(keys_pre, rows, n, true, static_cast<double*>(matrix.data()), stream_);
  int lwork = 0;
  SHADOWKV_CUSOLVER_TRY(cusolverDnDgesvd_bufferSize(libraries.cusolver(), rows, n, &lwork));
  device_buffer work(static_cast<std::size_t>(lwork) * sizeof(double), stream_, resources_->device_memory());
  SHADOWKV_CUSOLVER_TRY(cusolverDnDgesvd(libraries.cusolver(), 'N', 'A', rows, n, static_cast<double*>(matrix.data()), rows,
                                         static_cast<double*>(singular.data()), nullptr, rows,
                                         static_cast<double*>(vt.data()), n, static_cast<double*>(work.data()), lwork,
                                         nullptr, info));
  // Vᵀ is column-major [n, n]: the i-th right singular vector is row i of Vᵀ.
  launch_basis_from_vectors(static_cast<const double*>(vt.data()), n, config_.rank, false, true, basis, stream_);
}

cuda_backend::prompt_keys cuda_backend::prepare_keys(const batch_entry& entry, std::size_t index,
                                                     const prefill_inputs& inputs) {
  const int len = static_cast<int>(entry.state->prompt_len);
  const std::size_t width = static_cast<std::size_t>(config_.kv_width());
  prompt_keys keys{
      device_buffer(len * width * sizeof(float), stream_, resources_->device_memory()),
      device_buffer(len * width * dtype_size(config_.kv_dtype), stream_, resources_->device_memory()),
      device_buffer(static_cast<std::size_t>(len) * sizeof(long long), stream_, resources_->device_memory())};
  launch_prepare_prompt_keys(dims_, kv_type_, as_strided(inputs.keys),
                             inputs.positions.empty() ? strided_tensor{nullptr, 0, {0, 0, 0, 0}}
                                                      : strided_tensor{inputs.positions.data, 0,
                                                                       {inputs.positions.strides[0],
                                                                        inputs.positions.strides[1], 0, 0}},
                             inputs.positions.empty() ? 64 : index_bits(inputs.positions), static_cast<int>(entry.row),
                             len, inputs.keys_post_rope, static_cast<const float*>(inv_freq_.data()),
                             static_cast<float*>(keys.pre_rope.data()), keys.post_rope.data(),
                             static_cast<long long*>(keys.positions.data()), stats_of(index), stream_);
  // Keys whose largest magnitude the float32 Gram matrix cannot square: scaled by a power of two, as on the CPU
  // backend (A is scaled back in prefill_one); nothing happens, but a launch that reads one word, for all other keys.
  launch_scale_keys_for_gram(static_cast<float*>(keys.pre_rope.data()), static_cast<long long>(len) * config_.kv_width(),
                             stats_of(index), stream_);
  return keys;
}

void cuda_backend::prefill_gram_group(int layer, std::span<const batch_entry> entries, std::size_t first,
                                      std::size_t end, const prefill_inputs& inputs,
                                      const device_resources::library_lease& libraries) {
  const std::size_t n = static_cast<std::size_t>(config_.kv_width());
  const std::size_t matrix = n * n;
  device_buffer grams(matrix * (end - first) * sizeof(double), stream_, resources_->device_memory());
  auto* gram = static_cast<double*>(grams.data());
  // Each sequence's keys are prepared twice: here for its Gram matrix, and again in prefill_one for A = K·Bᵀ, the
  // landmarks and the scatter (a pass at HBM speed, ~0.3 ms at 122K tokens), so that no group holds every prompt's
  // float32 keys (500 MB a sequence at 122K) across its eigensolve.
  for (std::size_t b = first; b < end; ++b) {
    prompt_keys keys = prepare_keys(entries[b], b, inputs);
    gram_matrix(static_cast<const float*>(keys.pre_rope.data()), static_cast<int>(entries[b].state->prompt_len),
                gram + matrix * (b - first), libraries);
    keys.release(stream_);
  }
  try {
    solve_gram_matrices(gram, static_cast<int>(end - first), static_cast<int*>(solver_infos_.data()) + first,
                        libraries);
  } catch (const cuda_error&) {
    // Keys that overflowed under RoPE make a Gram matrix of infinities, on which cuSOLVER may fail outright: the
    // caller's error is the keys, as on the CPU backend.
    reject_overflowed_keys(entries, first, end);
    throw;
  }
  // After the call's last factorisation every info is final and the stream has drained (cuSOLVER returns only then):
  // reading them here costs a copy, where a read at the end of the call would also wait for the last group's
  // A = K·Bᵀ, landmarks and scatter, which otherwise run on while the caller queues its next work.
  if (end == entries.size()) check_factorizations(entries);
  // Eigenvalues ascend: the leading `rank` vectors are the last columns of each matrix.
  const std::size_t leading = (n - static_cast<std::size_t>(config_.rank)) * n;
  for (std::size_t b = first; b < end; ++b) {
    prefill_one(layer, entries, b, inputs, libraries, gram + matrix * (b - first) + leading);
  }
  grams.release(stream_);
}

void cuda_backend::prefill_one(int layer, std::span<const batch_entry> entries, std::size_t index,
                               const prefill_inputs& inputs, const device_resources::library_lease& libraries,
                               const double* eigenvectors) {
  const batch_entry& entry = entries[index];
  const layer_state& state = *entry.state;
  const int len = static_cast<int>(state.prompt_len);
  const int chunks = static_cast<int>(state.prompt_context_chunks);
  const int outliers = static_cast<int>(state.outlier_chunks);
  const std::size_t width = static_cast<std::size_t>(config_.kv_width());
  const std::size_t element = dtype_size(config_.kv_dtype);
  const layer_view& view = host_view(entry.slot, layer);

  // All workspace first (the key preparation writes only its own buffers and key_stats): an allocation failure
  // leaves the layer untouched.
  prompt_keys keys = prepare_keys(entry, index, inputs);
  device_buffer& keys_pre = keys.pre_rope;
  device_buffer& keys_post = keys.post_rope;
  device_buffer& positions = keys.positions;
  device_buffer min_cosine(std::max<std::size_t>(1, static_cast<std::size_t>(config_.num_kv_heads) * chunks) * sizeof(float),
                           stream_, resources_->device_memory());
  device_buffer outlier_ids(std::max<std::size_t>(1, static_cast<std::size_t>(config_.num_kv_heads) * config_.outlier_chunks) *
                                sizeof(int), stream_, resources_->device_memory());
  // Two-centroid scores keep no landmarks, but the outlier rule needs them: computed into a scratch copy of the
  // layout ([Hkv, max_chunks, D]).
  device_buffer scratch_landmarks;
  if (dims_.chunk_centroids != 0 && chunks > 0) {
    scratch_landmarks = device_buffer(static_cast<std::size_t>(dims_.max_chunks) * width * element, stream_,
                                      resources_->device_memory());
  }
  void* landmarks = dims_.chunk_centroids != 0 ? scratch_landmarks.data() : view.landmarks;
  // bf16 factors are computed in float32 and rounded once: B first (the projection uses B as held), then A.
  const bool bf16_factors = dims_.factor_bf16 != 0;
  const int context_tokens = chunks * config_.chunk_size;
  const std::size_t basis_elements = static_cast<std::size_t>(config_.rank) * width;
  const std::size_t coefficient_elements = static_cast<std::size_t>(context_tokens) * config_.rank;
  device_buffer basis32;
  device_buffer coefficients32;
  if (bf16_factors) {
    basis32 = device_buffer(basis_elements * sizeof(float), stream_, resources_->device_memory());
    coefficients32 = device_buffer(std::max<std::size_t>(1, coefficient_elements) * sizeof(float), stream_,
                                   resources_->device_memory());
  }
  auto* basis = static_cast<float*>(bf16_factors ? basis32.data() : view.basis);
  auto* coefficients = static_cast<float*>(bf16_factors ? coefficients32.data() : view.coefficients);
  const std::size_t value_bytes = static_cast<std::size_t>(chunks) * config_.chunk_size * width * element;
  // The prompt's values are packed chunk-major in the store's dtype: straight into a device value store, else into a
  // device staging buffer. fp8 quantizes that into the store's layout (codes, scales) — in place on the device, or
  // into a second staging buffer — and a host value store then takes one copy of the codes and one of the scales.
  const bool values_on_device = values_on_[static_cast<std::size_t>(entry.slot)] == value_place::device;
  const bool fp8 = dims_.value_fp8 != 0;
  const long long runs = static_cast<long long>(chunks) * config_.num_kv_heads;
  const std::size_t code_bytes = static_cast<std::size_t>(runs) * config_.chunk_size * config_.head_dim;
  device_buffer value_staging;
  if (!values_on_device || fp8) {
    value_staging = device_buffer(std::max<std::size_t>(1, value_bytes), stream_, resources_->device_memory());
  }
  device_buffer fp8_staging;
  if (fp8 && !values_on_device) fp8_staging = device_buffer(value_layer_bytes_, stream_, resources_->device_memory());
  void* value_target = values_on_device && !fp8 ? view.value_store : value_staging.data();
  auto* codes_target = static_cast<std::uint8_t*>(values_on_device ? view.value_store : fp8_staging.data());
  float* scales_target = values_on_device ? view.value_scales
                                          : reinterpret_cast<float*>(static_cast<std::uint8_t*>(fp8_staging.data()) +
                                                                     value_codes_bytes_);

  if (eigenvectors != nullptr) {
    // Gram path (prefill_gram_group): the group's eigensolve has run and the call's infos are checked.
    launch_basis_from_vectors(eigenvectors, static_cast<int>(width), config_.rank, true, false, basis, stream_);
  } else {
    try {
      svd_basis(static_cast<const float*>(keys_pre.data()), len, basis,
                static_cast<int*>(solver_infos_.data()) + index, libraries);
    } catch (const cuda_error&) {
      reject_overflowed_keys(entries, index, index + 1);  // as in prefill_gram_group
      throw;
    }
    // After the call's last factorisation every info is final and the stream has drained (cuSOLVER returns only
    // then); see prefill_gram_group.
    if (index + 1 == entries.size()) check_factorizations(entries);
  }
  if (bf16_factors) {
    launch_factors_to_bf16(basis, static_cast<long long>(basis_elements), view.basis, true, stream_);
  }
  if (chunks > 0) {
    // A = K_ctx · Bᵀ: column-major Aᵀ[r, ctx] = (Bᵀ as column-major [width, r])ᵀ · Kᵀ[width, ctx].
    const float one = 1.0F;
    const float zero = 0.0F;
    SHADOWKV_CUBLAS_TRY(cublasSgemm(libraries.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, config_.rank, context_tokens,
                                    static_cast<int>(width), &one, basis, static_cast<int>(width),
                                    static_cast<const float*>(keys_pre.data()), static_cast<int>(width), &zero,
                                    coefficients, config_.rank));
    // From keys scaled for the Gram matrix (launch_scale_keys_for_gram): back to the keys' own scale.
    launch_unscale_coefficients(coefficients, static_cast<long long>(config_.rank) * context_tokens, stats_of(index),
                                stream_);
    if (bf16_factors) {
      launch_factors_to_bf16(coefficients, static_cast<long long>(coefficient_elements), view.coefficients, false,
                             stream_);
    }
  }
  launch_landmarks(dims_, kv_type_, keys_post.data(), chunks, landmarks, static_cast<float*>(min_cosine.data()),
                   stream_);
  if (dims_.chunk_centroids != 0) launch_chunk_centroids(dims_, kv_type_, keys_post.data(), chunks, view, stream_);
  const int sinks = std::min(config_.sink_chunks, outliers);
  if (sinks > 0) {
    // Attention sinks rank below every cosine: each byte 0xC0 makes the float 0xC0C0C0C0 = -6.02 (docs/semantics.md).
    SHADOWKV_CUDA_TRY(cudaMemset2DAsync(min_cosine.data(), static_cast<std::size_t>(chunks) * sizeof(float), 0xC0,
                                        static_cast<std::size_t>(sinks) * sizeof(float),
                                        static_cast<std::size_t>(config_.num_kv_heads), stream_));
  }
  launch_pick_outliers(dims_, static_cast<const float*>(min_cosine.data()), chunks, outliers, view.is_outlier,
                       static_cast<int*>(outlier_ids.data()), stream_);
  launch_scatter_prompt(dims_, kv_type_, keys_post.data(), as_strided(inputs.values), static_cast<int>(entry.row), len,
                        chunks, outliers, static_cast<const int*>(outlier_ids.data()),
                        static_cast<const long long*>(positions.data()), view, value_target, stream_);
  if (fp8) {
    launch_quantize_value_runs(kv_type_, value_staging.data(), runs, config_.chunk_size * config_.head_dim,
                               codes_target, scales_target, stream_);
  }
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.cache_chunks, 0xff,
                                    static_cast<std::size_t>(config_.num_kv_heads) * config_.cache_slots() * sizeof(int),
                                    stream_));
  if (view.cache_last_used != nullptr) {
    // K > k: the cache starts empty, with its LRU clock at zero (as the CPU backend's fresh cpu_layer_data).
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(
        view.cache_last_used, 0,
        static_cast<std::size_t>(config_.num_kv_heads) * config_.cache_slots() * sizeof(long long), stream_));
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selection_clock, 0,
                                      static_cast<std::size_t>(config_.num_kv_heads) * sizeof(long long), stream_));
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selected_slots, 0xff,
                                      static_cast<std::size_t>(config_.num_kv_heads) * config_.budget_chunks() *
                                          sizeof(int),
                                      stream_));
  }
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.slot_of_chunk, 0xff,
                                    static_cast<std::size_t>(config_.num_kv_heads) * dims_.max_chunks * sizeof(int),
                                    stream_));
  // No hint from an earlier sequence of the slot (any hint would select the same; this one starts on the full path).
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selection_hint, 0, static_cast<std::size_t>(config_.num_kv_heads) * sizeof(unsigned),
                                    stream_));
  launch_set_prefill_counters(device_view(entry.slot, layer), len, chunks, outliers,
                              static_cast<int>(state.local_len), static_cast<const long long*>(positions.data()), len,
                              stream_);
  // Values to the pinned value store on the copy stream, overlapping whatever the caller does next.
  if (!values_on_device && value_bytes > 0) {
    SHADOWKV_CUDA_TRY(cudaEventRecord(values_ready_event_, stream_));
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, values_ready_event_, 0));
    const host_buffer& store = values_[static_cast<std::size_t>(entry.slot)]->host;
    auto* host_target = static_cast<std::uint8_t*>(store.data()) +
                        (static_cast<std::uint8_t*>(view.value_store) -
                         static_cast<std::uint8_t*>(store.device_pointer()));
    if (fp8) {
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target, fp8_staging.data(), code_bytes, cudaMemcpyDeviceToHost,
                                        copy_stream_));
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target + value_codes_bytes_,
                                        static_cast<std::uint8_t*>(fp8_staging.data()) + value_codes_bytes_,
                                        static_cast<std::size_t>(runs) * sizeof(float), cudaMemcpyDeviceToHost,
                                        copy_stream_));
      fp8_staging.release(copy_stream_);
    } else {
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target, value_staging.data(), value_bytes, cudaMemcpyDeviceToHost,
                                        copy_stream_));
    }
  }
  value_staging.release(values_on_device ? stream_ : copy_stream_);
  keys_pre.release(stream_);
  keys_post.release(stream_);
  positions.release(stream_);
  min_cosine.release(stream_);
  outlier_ids.release(stream_);
  scratch_landmarks.release(stream_);
}

void cuda_backend::prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) {
  device_guard guard(device_);
  prefilling_ = true;  // its selection (with q_last) is not followed by an attention: no fused rebuild (fuse_step)
  // The device's cuBLAS/cuSOLVER handles, bound to this call's stream, for the whole call (another store on the same
  // device waits for them; device_resources.hpp).
  const device_resources::library_lease libraries = resources_->libraries(stream_);
  // No sequence waits for its own factorisation: each leaves its cuSOLVER info in its own int of solver_infos_, and
  // the host reads them all once, after the call's last factorisation. So the layers are written whatever the infos
  // say: until the store commits them (after this returns) nothing reads a layer's device arrays, and a later prefill
  // of it rewrites them all. A failed call puts the counters back as well (forget_prefill). Consecutive sequences
  // factorised by their Gram matrices share one batched eigensolve (kEigensolveGroup at most): cuSOLVER's host wait
  // comes once a group, not once a sequence.
  try {
    std::size_t first = 0;
    while (first < entries.size()) {
      const auto by_gram = [&](std::size_t b) { return factorizes_by_gram(config_, entries[b].state->prompt_len); };
      if (!by_gram(first)) {
        prefill_one(layer, entries, first, inputs, libraries, nullptr);
        ++first;
        continue;
      }
      std::size_t end = first + 1;
      while (end < entries.size() && end - first < kEigensolveGroup && by_gram(end)) ++end;
      prefill_gram_group(layer, entries, first, end, inputs, libraries);
      first = end;
    }
  } catch (...) {
    forget_prefill(layer, entries);
    throw;
  }
}

key_stats* cuda_backend::stats_of(std::size_t index) const {
  return static_cast<key_stats*>(key_stats_.data()) + index;
}

void cuda_backend::reject_overflowed_keys(std::span<const batch_entry> entries, std::size_t first, std::size_t end) {
  auto* stats = static_cast<key_stats*>(key_stats_host_.data());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(stats + first, stats_of(first), (end - first) * sizeof(key_stats),
                                    cudaMemcpyDeviceToHost, stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  for (std::size_t b = first; b < end; ++b) {
    // The CPU backend's words (cpu_backend.cpp), so that both backends reject the same keys alike.
    SHADOWKV_EXPECTS(stats[b].overflowed == 0, "keys of slot ", entries[b].slot,
                     " are too large: applying or removing RoPE overflows float32");
  }
}

void cuda_backend::check_factorizations(std::span<const batch_entry> entries) {
  reject_overflowed_keys(entries, 0, entries.size());  // first: such keys make the infos meaningless
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(solver_infos_host_.data(), solver_infos_.data(), entries.size() * sizeof(int),
                                    cudaMemcpyDeviceToHost, stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  const auto* infos = static_cast<const int*>(solver_infos_host_.data());
  for (std::size_t b = 0; b < entries.size(); ++b) {
    if (infos[b] == 0) continue;
    const batch_entry& entry = entries[b];
    const std::int64_t rows = entry.state->prompt_len;
    const std::int64_t n = config_.kv_width();
    throw cuda_error(factorizes_by_gram(config_, rows)
                         ? shadowkv::detail::format_message("cusolverDnXsyevBatched failed on the ", n, "x", n,
                                                            " Gram matrix of slot ", entry.slot, " (row ", entry.row,
                                                            " of the batch; info=", infos[b], ")")
                         : shadowkv::detail::format_message("cusolverDnDgesvd failed on a ", rows, "x", n,
                                                            " key matrix of slot ", entry.slot, " (row ", entry.row,
                                                            " of the batch; info=", infos[b], ")"));
  }
}

void cuda_backend::forget_prefill(int layer, std::span<const batch_entry> entries) noexcept {
  // The store does not commit a failed prefill, so its layers' arrays stay unread; but their counters are what
  // outlier_chunks and last_position read, and the store answers outlier_chunks for a layer not prefilled too. Wait
  // for what the call queued, then put back the views open_sequence uploaded (fresh counters, the same pointers).
  (void)cudaStreamSynchronize(stream_);
  for (const batch_entry& entry : entries) {
    (void)cudaMemcpyAsync(device_view(entry.slot, layer), &host_view(entry.slot, layer), sizeof(layer_view),
                          cudaMemcpyHostToDevice, own_stream_);
  }
  (void)cudaStreamSynchronize(own_stream_);
}

}  // namespace shadowkv::cuda
