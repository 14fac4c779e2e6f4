// Configuration of a KV store: model shapes, capacity, RoPE and the algorithm's parameters (docs/semantics.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shadowkv/dtype.hpp"

namespace shadowkv {

/// How RoPE pairs the rotary dimensions of a head.
enum class rope_style : std::uint8_t {
  half_split,   ///< pairs (i, i + rotary_dim/2) — transformers' rotate_half (Llama, Qwen, Mistral, Gemma)
  interleaved,  ///< pairs (2i, 2i+1) — GPT-J / GLM style
};

/// How the prefill computes the rank-r basis of the pre-RoPE keys.
enum class factorization_method : std::uint8_t {
  gram,  ///< leading eigenvectors of K^T K (fast; the default)
  svd,   ///< exact singular value decomposition of K
};

/// Where the value store of each sequence lives.
enum class value_store_policy : std::uint8_t {
  host,        ///< host memory (pinned on CUDA devices); the default
  device,      ///< device memory (no offload)
  auto_place,  ///< per sequence: device memory while `device_value_budget` lasts, then host (never split)
};

/// How the value store holds values.
enum class value_format : std::uint8_t {
  same,      ///< the store's dtype (kv_dtype)
  fp8_e4m3,  ///< e4m3 codes with one float32 scale per (chunk, KV head) run (shadowkv/fp8.hpp): half of bf16's bytes
};

/// The element type of the low-rank key factors A and B.
enum class factor_format : std::uint8_t {
  automatic,  ///< bfloat16 for bfloat16/float16 stores, float32 for float32 stores (`config::factor_dtype()`)
  float32,    ///< exact products of the factorisation (the rebuild runs 3xTF32 on CUDA)
  bfloat16,   ///< half the bytes; A and B are rounded once, the rebuild's products are then exact in float32
};

/// Which inputs the store checks for NaN and ±Inf (docs/semantics.md, "Non-finite inputs").
enum class finite_check : std::uint8_t {
  automatic,  ///< prefill inputs always; decode inputs where the check does not wait for the device (the CPU backend)
  prefill,    ///< prefill inputs only
  always,     ///< prefill and decode inputs (on CUDA: one stream synchronisation per decode call)
};

/// How a chunk's score combines the query heads of one KV head's group (each head's softmax probability of the
/// chunk's landmark, summed over query tokens).
enum class group_combine : std::uint8_t {
  max,   ///< the largest of the group's probabilities
  mean,  ///< their mean (the default: more attention mass covered and more temporal hits on real captures, docs/fidelity.md)
};

/// What a chunk's score of a query is computed from (docs/semantics.md, "Chunk scores").
enum class chunk_score_rule : std::uint8_t {
  landmark,       ///< s·q·L, L the mean of the chunk's keys (one row of the storage dtype per chunk and head)
  two_centroids,  ///< log(w1·exp(s·q·ĉ1) + w2·exp(s·q·ĉ2)) of a 2-means of the chunk's keys (shadowkv/chunk_centroids.hpp)
};

/// Where one sequence's values are.
enum class value_place : std::uint8_t { host, device };

/// All parameters of a store. Every field has a default; `validate()` checks them together.
struct config {
  /// The rank a config with rank = 0 gets where num_kv_heads*head_dim allows it (ShadowKV's setting for Llama-3-8B).
  static constexpr int default_rank = 160;

  // Model shapes (defaults: Llama-3-8B's attention).
  int num_layers = 1;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;

  // Capacity.
  int max_batch = 1;               ///< number of sequence slots
  std::int64_t max_seq_len = 4096;  ///< tokens per sequence: prompt + generated

  // RoPE.
  double rope_theta = 10000.0;   ///< used when inv_freq is empty
  std::vector<float> inv_freq;   ///< rotary_dim/2 inverse frequencies (e.g. a model's scaled RoPE); optional
  int rotary_dim = 0;            ///< rotated dims per head; 0 means head_dim
  rope_style rope = rope_style::half_split;
  float attention_scaling = 1.0F;  ///< multiplies cos and sin (transformers' attention_scaling)
  float softmax_scale = 0.0F;      ///< scale of q·k in scores and attention; 0 means 1/sqrt(head_dim)

  // The algorithm.
  /// Rank r of the key factorisation, 1 <= r <= num_kv_heads*head_dim; 0 (the default) means
  /// min(default_rank, num_kv_heads*head_dim), valid for every shape (the store runs with the resolved value).
  int rank = 0;
  int chunk_size = 8;            ///< tokens per chunk C
  /// Tokens selected per KV head per step: a positive multiple of chunk_size (the same unit as Python's `budget`).
  /// More than max_seq_len is allowed: the store clamps it (docs/semantics.md, "Capacity and errors").
  std::int64_t budget = 2048;
  /// Capacity of the selection cache per (sequence, layer, KV head) in tokens (docs/semantics.md, Decode 6): 0 means
  /// the budget (the cache holds exactly the last selection); else a multiple of chunk_size >= budget, whose extra
  /// slots keep recently selected chunks (LRU) so that more selections hit. Clamped with the budget (see there).
  std::int64_t cache_tokens = 0;
  int outlier_chunks = 48;       ///< chunks per KV head kept exact as outliers
  int sink_chunks = 1;           ///< of those, the prompt's first chunks, always (attention sinks; at most outlier_chunks)
  int local_chunks = 4;          ///< chunks at the end of the prompt kept exact as the local window
  int generation_window = 256;   ///< exact generated tokens kept before the oldest chunk is folded (multiple of C)
  /// Tokens of an extend call that share one selection (docs/semantics.md, "Extend"): 1 makes extend equal to one
  /// decode call per token; larger blocks select less often.
  int extend_block = 32;
  factorization_method factorization = factorization_method::gram;
  dtype kv_dtype = dtype::bfloat16;  ///< storage precision of keys, values and landmarks
  value_store_policy value_store = value_store_policy::host;
  value_format values_as = value_format::same;  ///< format of the value store (exact tokens keep kv_dtype)
  factor_format factors_as = factor_format::automatic;  ///< element type of A and B (see factor_dtype())
  group_combine group_score = group_combine::mean;      ///< how a chunk's score combines the group's query heads
  chunk_score_rule chunk_score = chunk_score_rule::landmark;  ///< what a chunk's score of one query head is
  /// Bytes of device memory the value stores of `auto_place` sequences may take together; -1: the backend's
  /// default (CUDA: device memory free after the store's reservations, less a margin; CPU: no limit).
  std::int64_t device_value_budget = -1;
  /// Parts a decode batch is cut into so that the value fetch of one part overlaps the selection of the next
  /// (CUDA backend with host values; other backends ignore it): 0 = the backend's choice, 1 = no pipelining, up to 8.
  int decode_pipeline_parts = 0;
  /// Which inputs are checked for NaN/±Inf before a call changes anything. An unchecked non-finite decode input is
  /// stored as given and makes that sequence's outputs non-finite; other sequences are not affected.
  finite_check check_finite = finite_check::automatic;

  /// Throws invalid_argument naming the first field (and its value) that is out of range.
  void validate() const;

  [[nodiscard]] int group_size() const noexcept { return num_q_heads / num_kv_heads; }
  [[nodiscard]] int effective_rotary_dim() const noexcept { return rotary_dim == 0 ? head_dim : rotary_dim; }
  /// `rank`, with 0 resolved to min(default_rank, num_kv_heads*head_dim).
  [[nodiscard]] int effective_rank() const noexcept {
    if (rank != 0) return rank;
    return kv_width() < default_rank ? static_cast<int>(kv_width()) : default_rank;
  }
  [[nodiscard]] float effective_softmax_scale() const noexcept;
  [[nodiscard]] std::int64_t kv_width() const noexcept {
    return static_cast<std::int64_t>(num_kv_heads) * head_dim;
  }
  /// Bytes of one (chunk, KV head) run of the value store: C*D elements (+ its float32 scale for fp8).
  [[nodiscard]] std::int64_t value_run_bytes() const noexcept {
    const std::int64_t run = static_cast<std::int64_t>(chunk_size) * head_dim;
    return values_as == value_format::fp8_e4m3 ? run + 4 : run * static_cast<std::int64_t>(dtype_size(kv_dtype));
  }
  /// The element type A and B are held in: `factors_as`, with `automatic` resolved from kv_dtype.
  [[nodiscard]] dtype factor_dtype() const noexcept {
    if (factors_as == factor_format::float32) return dtype::float32;
    if (factors_as == factor_format::bfloat16) return dtype::bfloat16;
    return kv_dtype == dtype::float32 ? dtype::float32 : dtype::bfloat16;
  }
  /// The budget in chunks, k = budget / chunk_size (what the selection and its cache are sized by).
  [[nodiscard]] std::int64_t budget_chunks() const noexcept { return chunk_size > 0 ? budget / chunk_size : 0; }
  /// Folded generated chunks whose exact rows the fold journal keeps for truncate: W / C (docs/semantics.md,
  /// "Truncate"), so that the last generation_window tokens can always be removed.
  [[nodiscard]] std::int64_t journal_chunks() const noexcept {
    return chunk_size > 0 ? generation_window / chunk_size : 0;
  }
  /// The selection cache's slots per (sequence, layer, KV head), K = cache_tokens / chunk_size (k when 0).
  [[nodiscard]] std::int64_t cache_slots() const noexcept {
    if (cache_tokens == 0) return budget_chunks();
    return chunk_size > 0 ? cache_tokens / chunk_size : 0;
  }
};

/// "half" or "interleaved".
std::string rope_style_name(rope_style style);
/// Parses "half"/"half_split"/"neox" or "interleaved"/"gptj"; throws invalid_argument otherwise.
rope_style parse_rope_style(const std::string& name);
/// Parses "gram" or "svd"; throws invalid_argument otherwise.
factorization_method parse_factorization(const std::string& name);
/// Parses "host", "device"/"gpu" or "auto"; throws invalid_argument otherwise.
value_store_policy parse_value_store(const std::string& name);
/// "host", "device" or "auto".
std::string value_store_name(value_store_policy policy);
/// "host" or "device".
std::string value_place_name(value_place place);
/// Parses "same" (or "", the store's dtype) or "fp8"/"float8_e4m3"/"e4m3"; throws invalid_argument otherwise.
value_format parse_value_format(const std::string& name);
/// "same" or "float8_e4m3".
std::string value_format_name(value_format format);
/// Parses "auto" (or ""), "prefill" or "always"; throws invalid_argument otherwise.
finite_check parse_finite_check(const std::string& name);
/// "auto", "prefill" or "always".
std::string finite_check_name(finite_check check);
/// Parses "max" or "mean"; throws invalid_argument otherwise.
group_combine parse_group_score(const std::string& name);
/// "max" or "mean".
std::string group_score_name(group_combine combine);
/// Parses "landmark" or "two_centroids"; throws invalid_argument otherwise.
chunk_score_rule parse_chunk_score(const std::string& name);
/// "landmark" or "two_centroids".
std::string chunk_score_name(chunk_score_rule rule);
/// Parses "auto" (or ""), "float32"/"fp32" or "bfloat16"/"bf16"; throws invalid_argument otherwise.
factor_format parse_factor_format(const std::string& name);
/// "auto", "float32" or "bfloat16".
std::string factor_format_name(factor_format format);

}  // namespace shadowkv
