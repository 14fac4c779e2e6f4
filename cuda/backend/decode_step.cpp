// A decode step's orchestration on the CUDA backend, over the call's compute stream and the backend's copy stream:
// the fold and append of the generated region, the selection part by part, the value fetch on the copy stream, the key
// rebuild, and the sparse attention part by part as each part's values arrive (cuda_backend.hpp draws the streams).
// What the plan decides (parts, CTAs, early attention, fused misses) is in pipeline_plan.cpp.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend_support.hpp"
#include "chunk_rebuild.cuh"
#include "chunk_selection.cuh"
#include "cuda_backend.hpp"
#include "generated_tokens.cuh"
#include "shadowkv/generated_region.hpp"
#include "sparse_attention.cuh"
#include "value_fetch.cuh"

namespace shadowkv::cuda {

using backend_support::as_strided;
using backend_support::index_bits;

void cuda_backend::upload_batch(std::span<const batch_entry> entries) {
  std::vector<int> slots(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) slots[i] = entries[i].slot;
  batch_size_ = static_cast<std::int64_t>(entries.size());
  if (slots == uploaded_slots_) return;
  // The staging buffer may still be read by an earlier copy, and the slot list by the kernels on either stream (the
  // append, fetch and fold of a call that failed before stream_ joined them): wait for both streams.
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  std::copy(slots.begin(), slots.end(), static_cast<int*>(batch_staging_.data()));
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(batch_slots_.data(), batch_staging_.data(), slots.size() * sizeof(int),
                                    cudaMemcpyHostToDevice, stream_));
  uploaded_slots_ = slots;
}

void cuda_backend::fold_oldest_generated_chunk(int /*layer*/, std::span<const batch_entry> /*entries*/) {
  // The device folds a full ring at the end of the step that filled it (attend: after the attention's split kernel,
  // beside its combine), by the same rule, so that neither the fold nor the append waits in front of this step's
  // selection. The store calls this at the start of the next step, when its counters say a ring is full: append_token
  // (which the store calls next, with the whole batch) launches the fold again over that batch first, a no-op on the
  // device for every ring that is not full, i.e. unless the step that filled it did not reach its end. (Launched here,
  // over `entries`, a subset of the batch in a ragged one, it would upload another slot list, and each upload waits
  // for both streams.) Not while a graph is captured: its replays fold at the end of each replayed step.
  if (!capturing()) fold_requested_ = true;
}

void cuda_backend::append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) {
  prefilling_ = false;  // a decode call (a prefill that failed before its finish_call may have left it set)
  upload_batch(entries);
  if (fold_requested_) {  // fold_oldest_generated_chunk
    fold_requested_ = false;
    join_append();  // an append of a call that failed before its attention still writes the counters this reads
    launch_fold_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                          static_cast<const int*>(batch_slots_.data()), layer, static_cast<int>(entries.size()),
                          static_cast<const float*>(inv_freq_.data()), stream_);
  }
  // Queued, not launched: select_chunks launches it on the copy stream once the first part's landmark logits are
  // done, beside the select kernel (the logits' one-wave grid fills every multiprocessor, and a CTA of the append
  // beside it made one of theirs wait: logits 17.0 -> 18.3 µs at B = 1, docs/performance.md; session 20). Nothing of the
  // selection reads the generated region; the attention waits for the append (attend). The inputs stay valid: the
  // append is launched within this decode call (select_chunks, else attend or finish_call).
  queued_append_ = queued_append{layer,
                                 static_cast<int>(entries.size()),
                                 as_strided(inputs.keys),
                                 as_strided(inputs.values),
                                 inputs.positions.empty()
                                     ? strided_tensor{nullptr, 0, {0, 0, 0, 0}}
                                     : strided_tensor{inputs.positions.data, 0, {inputs.positions.strides[0], 0, 0, 0}},
                                 inputs.positions.empty() ? 64 : index_bits(inputs.positions),
                                 inputs.keys_post_rope};
}

void cuda_backend::launch_queued_append(bool beside_select) {
  if (!queued_append_.has_value()) return;
  const queued_append append = *queued_append_;
  queued_append_.reset();
  cudaStream_t stream = stream_;
  if (beside_select) {  // logits_done_event_ follows the caller's work on stream_ too (k_new, v_new)
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, logits_done_event_, 0));
    stream = copy_stream_;
  }
  launch_append_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                          static_cast<const int*>(batch_slots_.data()), append.layer, append.batch, append.keys,
                          append.values, append.positions, append.positions_bits, append.keys_post_rope,
                          static_cast<const float*>(inv_freq_.data()), stream);
  if (beside_select) {
    SHADOWKV_CUDA_TRY(cudaEventRecord(appended_event_, copy_stream_));
    append_pending_ = true;
  }
}

step_workspace cuda_backend::workspace_from(int first) const {
  const long long b = first;
  step_workspace part = workspace_;
  part.logits += b * config_.num_q_heads * dims_.max_chunks;
  part.scores += b * config_.num_kv_heads * dims_.max_chunks;
  part.selected += b * config_.num_kv_heads * config_.budget_chunks();
  part.miss_slots += b * config_.num_kv_heads * config_.budget_chunks();
  part.miss_counts += b * config_.num_kv_heads;
  part.partial += b * config_.num_q_heads * workspace_.max_splits * (config_.head_dim + 2);
  return part;
}

void cuda_backend::select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) {
  try {
    select_parts(layer, entries, queries);
  } catch (...) {
    launch_queued_append(false);  // while this call's inputs are valid
    throw;
  }
}

void cuda_backend::select_parts(int layer, std::span<const batch_entry> entries, const tensor_view& queries) {
  join_fetch();  // a call that failed after its fetch was queued: the selection below rewrites what it reads
  fused_step_ = false;
  upload_batch(entries);
  parts_ = pipeline_parts(entries);
  const strided_tensor all_queries = as_strided(queries);
  // [B, L, Hq, D] -> the first query token's [B, Hq, D], for a fused step's key rebuild (miss_attention).
  selection_queries_ = all_queries;
  selection_queries_.stride[1] = all_queries.stride[2];
  selection_queries_.stride[2] = all_queries.stride[3];
  const std::size_t element = dtype_size(queries.float_type);
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    const batch_part& part = parts_[p];
    strided_tensor part_queries = all_queries;
    part_queries.data = static_cast<const std::uint8_t*>(all_queries.data) +
                        static_cast<std::ptrdiff_t>(part.first) * all_queries.stride[0] * static_cast<std::ptrdiff_t>(element);
    // After the first part, an earlier part's fetch may hold up to its CTAs (one each on as many multiprocessors)
    // while this part's landmark logits run: the one-wave logits grid leaves room for them.
    const int beside = p == 0 ? 0 : fetch_ctas(entries.subspan(parts_[p - 1].first, parts_[p - 1].count));
    const bool append_after = p == 0 && queued_append_.has_value();
    launch_select_chunks(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                         static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count, part_queries,
                         static_cast<int>(queries.shape[1]), workspace_from(part.first), beside, stream_,
                         append_after ? static_cast<cudaEvent_t>(logits_done_event_) : nullptr);
    SHADOWKV_CUDA_TRY(cudaEventRecord(part_selected_events_[p], stream_));
    if (append_after) launch_queued_append(true);
  }
}

void cuda_backend::fetch_values(int layer, std::span<const batch_entry> entries) {
  // A fused step (fuse_step, decided here for rebuild_keys and attend) launches no fetch: its key rebuild copies the
  // missed values into the selection cache itself, from the shared memory its attention over them reads, and counts
  // their bytes.
  fused_step_ = fuse_step(entries);
  if (fused_step_) return;
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    const batch_part& part = parts_[p];
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, part_selected_events_[p], 0));
    launch_fetch_values(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count,
                        workspace_from(part.first), fetch_ctas(entries.subspan(part.first, part.count)),
                        any_host_values(entries.subspan(part.first, part.count)) ? fetch_priority_host_ : 0,
                        copy_stream_);
    if (p + 1 < parts_.size()) SHADOWKV_CUDA_TRY(cudaEventRecord(part_fetched_events_[p], copy_stream_));
  }
  SHADOWKV_CUDA_TRY(cudaEventRecord(fetched_event_, copy_stream_));
  fetch_pending_ = true;
}

void cuda_backend::rebuild_keys(int layer, std::span<const batch_entry> entries) {
  const int batch = static_cast<int>(entries.size());
  dims d = step_dims(batch);
  if (fused_step_) {  // decided by fetch_values, which the store calls first
    // The rebuild attends over the missed rows (its partials after the attention's splits) and releases the attention
    // at its start: the attention then walks the other rows beside it (attend).
    d.fused_misses = 1;
    d.attention_early = 1;
    const miss_attention attention{selection_queries_, workspace_.partial,
                                   sparse_attention_splits(d, kv_type_, batch, workspace_.max_splits),
                                   workspace_.max_splits};
    launch_rebuild_keys(d, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()), layer, batch, workspace_,
                        static_cast<const float*>(inv_freq_.data()), stream_, &attention);
    return;
  }
  launch_rebuild_keys(d, kv_type_, static_cast<layer_view*>(views_.data()),
                      static_cast<const int*>(batch_slots_.data()), layer, batch, workspace_,
                      static_cast<const float*>(inv_freq_.data()), stream_);
  // No wait for the fetch here: attention waits for each part's values (attend), and finish_call (or the next
  // select_chunks, after a failed call) joins the whole fetch.
}

void cuda_backend::join_append() {
  if (!append_pending_) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, appended_event_, 0));
  append_pending_ = false;
}

void cuda_backend::join_fetch() {
  if (!fetch_pending_) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, fetched_event_, 0));
  fetch_pending_ = false;
}

void cuda_backend::attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                          const mutable_tensor_view& out) {
  // Part by part, each as soon as its values are in: the attention of the earlier parts runs while the later parts'
  // values still cross PCIe, so only the last part's attention follows the fetch. The split count is chosen per part
  // (sparse_attention.cu): a part's outputs equal the whole batch's up to the rounding of the split combine.
  const strided_tensor all_queries = as_strided(queries);
  const strided_tensor all_out = as_strided(out);
  const auto query_element = static_cast<std::ptrdiff_t>(dtype_size(queries.float_type));
  const auto out_element = static_cast<std::ptrdiff_t>(dtype_size(out.float_type));
  const std::vector<batch_part> one_part{batch_part{0, static_cast<int>(entries.size())}};
  const std::vector<batch_part>& parts = parts_.empty() ? one_part : parts_;
  // Whether a ring is full after this step's append (the store's counters already count it), so that the step ends
  // with a fold; while a graph is captured the counters stand still, and every replay checks on the device.
  const bool fold_after = capturing() || std::any_of(entries.begin(), entries.end(), [&](const batch_entry& entry) {
                            return rules::fold_due<std::int64_t>(entry.state->generated_exact_len,
                                                                 config_.generation_window);
                          });
  launch_queued_append(false);  // (when no selection launched it)
  join_append();                // the new tokens' rows
  // A fused step (rebuild_keys): the attention reads no slot this step missed, so it does not wait for their values;
  // stream_ joins the fetch after it.
  const bool fused = fused_step_ && parts.size() == 1;
  fused_step_ = false;
  dims d = step_dims(static_cast<int>(entries.size()));
  if (fused) {
    d.fused_misses = 1;
    d.attention_early = 1;
  }
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const batch_part& part = parts[p];
    // The last part waits for the whole fetch (fetched_event_ follows its fetch), the others for their own; a fused
    // step's part waits for none.
    if (p + 1 == parts.size() && !fused) {
      join_fetch();
    } else if (fetch_pending_ && !fused) {
      SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, part_fetched_events_[p], 0));
    }
    strided_tensor part_queries = all_queries;
    strided_tensor part_out = all_out;
    part_queries.data = static_cast<const std::uint8_t*>(all_queries.data) +
                        static_cast<std::ptrdiff_t>(part.first) * all_queries.stride[0] * query_element;
    part_out.data = static_cast<const std::uint8_t*>(all_out.data) +
                    static_cast<std::ptrdiff_t>(part.first) * all_out.stride[0] * out_element;
    const bool last = p + 1 == parts.size();
    const step_workspace part_workspace = workspace_from(part.first);
    launch_sparse_attention(d, kv_type_, static_cast<const layer_view*>(views_.data()),
                            static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count,
                            part_queries, part_out, part_workspace.partial, workspace_.max_splits, stream_,
                            last && fold_after ? static_cast<cudaEvent_t>(splits_done_event_) : nullptr,
                            fused ? part_workspace.miss_slots : nullptr, fused ? part_workspace.miss_counts : nullptr);
  }
  if (fused) join_fetch();
  // Full rings are folded now, for the next step's selection (fold_oldest_generated_chunk), on the copy stream
  // beside the last combine: after the split kernels, nothing of this step reads the generated region or the
  // context arrays. stream_ waits for it before the call ends (the caller's next work, and a graph's capture, see
  // one stream again). Eager steps that fill no ring launch nothing here (the fold would find nothing to do).
  if (!fold_after) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, splits_done_event_, 0));
  launch_fold_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()), layer, static_cast<int>(entries.size()),
                        static_cast<const float*>(inv_freq_.data()), copy_stream_);
  SHADOWKV_CUDA_TRY(cudaEventRecord(folded_event_, copy_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, folded_event_, 0));
}

}  // namespace shadowkv::cuda
