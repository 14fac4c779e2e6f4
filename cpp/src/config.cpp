#include "shadowkv/config.hpp"

#include <cmath>
#include <limits>

#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv {

void config::validate() const {
  SHADOWKV_EXPECTS(num_layers >= 1, "num_layers must be >= 1, got ", num_layers);
  SHADOWKV_EXPECTS(num_q_heads >= 1, "num_q_heads must be >= 1, got ", num_q_heads);
  SHADOWKV_EXPECTS(num_kv_heads >= 1, "num_kv_heads must be >= 1, got ", num_kv_heads);
  SHADOWKV_EXPECTS(num_q_heads % num_kv_heads == 0, "num_q_heads (", num_q_heads,
                   ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  SHADOWKV_EXPECTS(head_dim >= 2 && head_dim <= 1024, "head_dim must be in [2, 1024], got ", head_dim);
  SHADOWKV_EXPECTS(max_batch >= 1, "max_batch must be >= 1, got ", max_batch);
  SHADOWKV_EXPECTS(max_seq_len >= 1, "max_seq_len must be >= 1, got ", max_seq_len);

  const int rotary = effective_rotary_dim();
  SHADOWKV_EXPECTS(rotary_dim >= 0 && rotary <= head_dim && rotary % 2 == 0,
                   "rotary_dim must be even and in [2, head_dim=", head_dim, "] (0 means head_dim), got ",
                   rotary_dim);
  if (inv_freq.empty()) {
    SHADOWKV_EXPECTS(std::isfinite(rope_theta) && rope_theta > 0.0, "rope_theta must be > 0, got ", rope_theta);
  } else {
    SHADOWKV_EXPECTS(static_cast<int>(inv_freq.size()) == rotary / 2, "inv_freq must have rotary_dim/2 = ",
                     rotary / 2, " entries, got ", inv_freq.size());
    for (const float f : inv_freq) SHADOWKV_EXPECTS(std::isfinite(f), "inv_freq entries must be finite, got ", f);
  }
  SHADOWKV_EXPECTS(std::isfinite(attention_scaling) && attention_scaling > 0.0F,
                   "attention_scaling must be > 0, got ", attention_scaling);
  SHADOWKV_EXPECTS(std::isfinite(softmax_scale) && softmax_scale >= 0.0F,
                   "softmax_scale must be >= 0 (0 means 1/sqrt(head_dim)), got ", softmax_scale);

  SHADOWKV_EXPECTS(rank == 0 || (rank >= 1 && rank <= kv_width()), "rank must be in [1, num_kv_heads*head_dim = ",
                   kv_width(), "] (or 0: min(", default_rank, ", num_kv_heads*head_dim)), got ", rank);
  SHADOWKV_EXPECTS(chunk_size >= 1, "chunk_size must be >= 1, got ", chunk_size);
  SHADOWKV_EXPECTS(chunk_score != chunk_score_rule::two_centroids || chunk_size <= rules::kMaxCentroidChunk,
                   "chunk_score='two_centroids' takes chunk_size up to ", rules::kMaxCentroidChunk, ", got ",
                   chunk_size);
  SHADOWKV_EXPECTS(budget >= chunk_size && budget % chunk_size == 0,
                   "budget must be a positive multiple of chunk_size (", chunk_size, ") tokens, got ", budget);
  SHADOWKV_EXPECTS(budget_chunks() <= std::numeric_limits<int>::max(), "budget = ", budget, " tokens is ",
                   budget_chunks(), " chunks of ", chunk_size, ", more than a C int holds (",
                   std::numeric_limits<int>::max(), ")");
  SHADOWKV_EXPECTS(cache_tokens >= 0, "cache_tokens must be >= 0 tokens (0 means the budget), got ", cache_tokens);
  if (cache_tokens != 0) {
    SHADOWKV_EXPECTS(cache_tokens % chunk_size == 0, "cache_tokens must be a multiple of chunk_size (", chunk_size,
                     ") tokens, got ", cache_tokens);
    SHADOWKV_EXPECTS(cache_tokens >= budget, "cache_tokens (", cache_tokens,
                     ") must be >= budget (", budget, " tokens): the cache holds at least the last selection");
    SHADOWKV_EXPECTS(cache_slots() <= std::numeric_limits<int>::max(), "cache_tokens = ", cache_tokens,
                     " tokens is ", cache_slots(), " chunks of ", chunk_size, ", more than a C int holds (",
                     std::numeric_limits<int>::max(), ")");
  }
  SHADOWKV_EXPECTS(outlier_chunks >= 0, "outlier_chunks must be >= 0, got ", outlier_chunks);
  SHADOWKV_EXPECTS(sink_chunks >= 0, "sink_chunks must be >= 0, got ", sink_chunks);
  SHADOWKV_EXPECTS(local_chunks >= 0, "local_chunks must be >= 0, got ", local_chunks);
  SHADOWKV_EXPECTS(generation_window >= chunk_size && generation_window % chunk_size == 0,
                   "generation_window must be a positive multiple of chunk_size (", chunk_size, "), got ",
                   generation_window);
  SHADOWKV_EXPECTS(extend_block >= 1 && extend_block <= 65536, "extend_block must be in [1, 65536] tokens, got ",
                   extend_block);
  SHADOWKV_EXPECTS(decode_pipeline_parts >= 0 && decode_pipeline_parts <= 8,
                   "decode_pipeline_parts must be in [0, 8] (0: the backend's choice), got ", decode_pipeline_parts);
  SHADOWKV_EXPECTS(check_finite == finite_check::automatic || check_finite == finite_check::prefill ||
                       check_finite == finite_check::always,
                   "check_finite must be auto, prefill or always, got the value ", static_cast<int>(check_finite));
  SHADOWKV_EXPECTS(device_value_budget >= -1, "device_value_budget must be >= 0 bytes (or -1: the backend's default), got ",
                   device_value_budget);
}

float config::effective_softmax_scale() const noexcept {
  return softmax_scale > 0.0F ? softmax_scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

std::string rope_style_name(rope_style style) { return style == rope_style::half_split ? "half" : "interleaved"; }

rope_style parse_rope_style(const std::string& name) {
  if (name == "half" || name == "half_split" || name == "neox") return rope_style::half_split;
  if (name == "interleaved" || name == "gptj") return rope_style::interleaved;
  throw invalid_argument(detail::format_message("rope_style must be 'half' or 'interleaved', got '", name, "'"));
}

factorization_method parse_factorization(const std::string& name) {
  if (name == "gram") return factorization_method::gram;
  if (name == "svd") return factorization_method::svd;
  throw invalid_argument(detail::format_message("factorization must be 'gram' or 'svd', got '", name, "'"));
}

value_store_policy parse_value_store(const std::string& name) {
  if (name == "host") return value_store_policy::host;
  if (name == "device" || name == "gpu") return value_store_policy::device;
  if (name == "auto") return value_store_policy::auto_place;
  throw invalid_argument(
      detail::format_message("value_store must be 'host', 'device' or 'auto', got '", name, "'"));
}

std::string value_store_name(value_store_policy policy) {
  switch (policy) {
    case value_store_policy::device: return "device";
    case value_store_policy::auto_place: return "auto";
    case value_store_policy::host: break;
  }
  return "host";
}

value_format parse_value_format(const std::string& name) {
  if (name.empty() || name == "same") return value_format::same;
  if (name == "fp8" || name == "float8_e4m3" || name == "e4m3" || name == "float8_e4m3fn") return value_format::fp8_e4m3;
  throw invalid_argument(detail::format_message("value format must be 'same' or 'float8_e4m3' (fp8), got '", name, "'"));
}

std::string value_format_name(value_format format) {
  return format == value_format::fp8_e4m3 ? "float8_e4m3" : "same";
}

group_combine parse_group_score(const std::string& name) {
  if (name == "max") return group_combine::max;
  if (name == "mean") return group_combine::mean;
  throw invalid_argument(detail::format_message("group_score must be 'max' or 'mean', got '", name, "'"));
}

std::string group_score_name(group_combine combine) { return combine == group_combine::mean ? "mean" : "max"; }

chunk_score_rule parse_chunk_score(const std::string& name) {
  if (name == "landmark") return chunk_score_rule::landmark;
  if (name == "two_centroids") return chunk_score_rule::two_centroids;
  throw invalid_argument(
      detail::format_message("chunk_score must be 'landmark' or 'two_centroids', got '", name, "'"));
}

std::string chunk_score_name(chunk_score_rule rule) {
  return rule == chunk_score_rule::two_centroids ? "two_centroids" : "landmark";
}

factor_format parse_factor_format(const std::string& name) {
  if (name.empty() || name == "auto") return factor_format::automatic;
  if (name == "float32" || name == "fp32") return factor_format::float32;
  if (name == "bfloat16" || name == "bf16") return factor_format::bfloat16;
  throw invalid_argument(
      detail::format_message("factor_dtype must be 'auto', 'float32' or 'bfloat16', got '", name, "'"));
}

std::string factor_format_name(factor_format format) {
  switch (format) {
    case factor_format::float32: return "float32";
    case factor_format::bfloat16: return "bfloat16";
    case factor_format::automatic: break;
  }
  return "auto";
}

finite_check parse_finite_check(const std::string& name) {
  if (name.empty() || name == "auto") return finite_check::automatic;
  if (name == "prefill") return finite_check::prefill;
  if (name == "always") return finite_check::always;
  throw invalid_argument(
      detail::format_message("check_finite must be 'auto', 'prefill' or 'always', got '", name, "'"));
}

std::string finite_check_name(finite_check check) {
  switch (check) {
    case finite_check::prefill: return "prefill";
    case finite_check::always: return "always";
    case finite_check::automatic: break;
  }
  return "auto";
}

std::string value_place_name(value_place place) { return place == value_place::device ? "device" : "host"; }

}  // namespace shadowkv
