// config::validate() (shadowkv/config.hpp): every out-of-range field is rejected with shadowkv::invalid_argument and a
// message that names it; the parse helpers and derived values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "shadowkv/build_info.hpp"
#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"

namespace {

using shadowkv::config;

// A small valid configuration; each test breaks one field.
config valid_config() {
  config cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 8;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 2;
  cfg.max_seq_len = 1024;
  cfg.rank = 32;
  cfg.chunk_size = 8;
  cfg.budget = 128;  // tokens: 16 chunks of 8
  cfg.outlier_chunks = 4;
  cfg.local_chunks = 4;
  cfg.generation_window = 64;
  return cfg;
}

struct bad_field {
  std::string name;      // test label
  std::string expected;  // text the message must contain (the field's name)
  std::function<void(config&)> breaks;
};

std::string rejection_message(const config& cfg) {
  try {
    cfg.validate();
  } catch (const shadowkv::invalid_argument& error) {
    return error.what();
  } catch (const std::exception& error) {
    return std::string("WRONG EXCEPTION TYPE: ") + error.what();
  }
  return "NOT REJECTED";
}

TEST(Config, ValidConfigPasses) {
  EXPECT_NO_THROW(valid_config().validate());
  config cfg = valid_config();
  cfg.rank = 2 * 64;  // rank == Hkv*D is allowed
  cfg.rotary_dim = 32;
  cfg.inv_freq.assign(16, 0.5F);
  cfg.outlier_chunks = 0;
  cfg.local_chunks = 0;
  cfg.num_q_heads = 2;  // MHA
  cfg.generation_window = 8;
  cfg.softmax_scale = 0.1F;
  EXPECT_NO_THROW(cfg.validate());
}

TEST(Config, EachBadFieldIsRejectedByName) {
  const std::vector<bad_field> cases = {
      {"num_layers_0", "num_layers", [](config& c) { c.num_layers = 0; }},
      {"num_q_heads_0", "num_q_heads", [](config& c) { c.num_q_heads = 0; }},
      {"num_kv_heads_0", "num_kv_heads", [](config& c) { c.num_kv_heads = 0; }},
      {"num_kv_heads_negative", "num_kv_heads", [](config& c) { c.num_kv_heads = -2; }},
      {"q_heads_not_multiple_of_kv_heads", "num_kv_heads", [](config& c) { c.num_q_heads = 6; c.num_kv_heads = 4; c.rank = 8; }},
      {"kv_heads_above_q_heads", "num_q_heads", [](config& c) { c.num_q_heads = 2; c.num_kv_heads = 4; }},
      {"head_dim_1", "head_dim", [](config& c) { c.head_dim = 1; c.rank = 1; }},
      {"head_dim_0", "head_dim", [](config& c) { c.head_dim = 0; c.rank = 1; }},
      {"max_batch_0", "max_batch", [](config& c) { c.max_batch = 0; }},
      {"max_seq_len_0", "max_seq_len", [](config& c) { c.max_seq_len = 0; }},
      {"rotary_dim_odd", "rotary_dim", [](config& c) { c.rotary_dim = 31; }},
      {"rotary_dim_above_head_dim", "rotary_dim", [](config& c) { c.rotary_dim = 66; }},
      {"rotary_dim_negative", "rotary_dim", [](config& c) { c.rotary_dim = -2; }},
      {"rope_theta_0", "rope_theta", [](config& c) { c.rope_theta = 0.0; }},
      {"rope_theta_nan", "rope_theta", [](config& c) { c.rope_theta = std::nan(""); }},
      {"inv_freq_too_short", "inv_freq", [](config& c) { c.inv_freq.assign(31, 1.0F); }},
      {"inv_freq_too_long", "inv_freq", [](config& c) { c.inv_freq.assign(33, 1.0F); }},
      {"inv_freq_full_length_with_partial_rotary", "inv_freq", [](config& c) { c.rotary_dim = 32; c.inv_freq.assign(32, 1.0F); }},
      {"inv_freq_infinite", "inv_freq", [](config& c) {
         c.inv_freq.assign(32, 1.0F);
         c.inv_freq[3] = std::numeric_limits<float>::infinity();
       }},
      {"attention_scaling_0", "attention_scaling", [](config& c) { c.attention_scaling = 0.0F; }},
      {"attention_scaling_nan", "attention_scaling", [](config& c) { c.attention_scaling = std::nanf(""); }},
      {"softmax_scale_negative", "softmax_scale", [](config& c) { c.softmax_scale = -1.0F; }},
      {"softmax_scale_infinite", "softmax_scale", [](config& c) { c.softmax_scale = std::numeric_limits<float>::infinity(); }},
      {"rank_negative", "rank", [](config& c) { c.rank = -1; }},
      {"rank_above_kv_width", "rank", [](config& c) { c.rank = 2 * 64 + 1; }},
      {"chunk_size_0", "chunk_size", [](config& c) { c.chunk_size = 0; }},
      {"budget_0", "budget", [](config& c) { c.budget = 0; }},
      {"budget_negative", "budget", [](config& c) { c.budget = -8; }},
      {"budget_below_chunk", "budget", [](config& c) { c.budget = 4; }},
      {"budget_not_multiple_of_chunk", "budget", [](config& c) { c.budget = 20; }},
      {"budget_chunks_beyond_c_int", "budget", [](config& c) { c.budget = std::int64_t{8} << 40; }},
      {"cache_tokens_negative", "cache_tokens", [](config& c) { c.cache_tokens = -8; }},
      {"cache_tokens_not_multiple_of_chunk", "cache_tokens", [](config& c) { c.cache_tokens = 4 * 128 + 4; }},
      {"cache_tokens_below_budget", "cache_tokens", [](config& c) { c.cache_tokens = 120; }},
      {"cache_tokens_chunks_beyond_c_int", "cache_tokens", [](config& c) { c.cache_tokens = std::int64_t{8} << 40; }},
      {"outlier_chunks_negative", "outlier_chunks", [](config& c) { c.outlier_chunks = -1; }},
      {"local_chunks_negative", "local_chunks", [](config& c) { c.local_chunks = -1; }},
      {"generation_window_not_multiple_of_chunk", "generation_window", [](config& c) { c.generation_window = 60; }},
      {"generation_window_below_chunk", "generation_window", [](config& c) { c.generation_window = 4; c.chunk_size = 8; }},
      {"generation_window_0", "generation_window", [](config& c) { c.generation_window = 0; }},
      {"check_finite_unknown", "check_finite", [](config& c) { c.check_finite = static_cast<shadowkv::finite_check>(7); }},
  };
  for (const bad_field& bad : cases) {
    SCOPED_TRACE(bad.name);
    config cfg = valid_config();
    bad.breaks(cfg);
    const std::string message = rejection_message(cfg);
    EXPECT_NE(message.find(bad.expected), std::string::npos) << "message: " << message;
    // The store's constructor validates too, with the same exception type.
    EXPECT_THROW(shadowkv::kv_store store(cfg), shadowkv::invalid_argument);
  }
}

TEST(Config, MessagesNameTheOffendingValue) {
  config cfg = valid_config();
  cfg.rank = 777;
  EXPECT_NE(rejection_message(cfg).find("777"), std::string::npos) << rejection_message(cfg);
  cfg = valid_config();
  cfg.generation_window = 60;
  EXPECT_NE(rejection_message(cfg).find("60"), std::string::npos) << rejection_message(cfg);
  cfg = valid_config();
  cfg.budget = 20;  // not a multiple of chunk_size 8: the message names the value, the chunk size and the unit
  EXPECT_NE(rejection_message(cfg).find("multiple of chunk_size (8) tokens, got 20"), std::string::npos)
      << rejection_message(cfg);
  cfg = valid_config();
  cfg.inv_freq.assign(5, 1.0F);
  const std::string message = rejection_message(cfg);
  EXPECT_NE(message.find("32"), std::string::npos) << "expected count: " << message;
  EXPECT_NE(message.find("5"), std::string::npos) << "given count: " << message;
}

TEST(Config, ErrorTypesDeriveFromStandardOnes) {
  config cfg = valid_config();
  cfg.rank = -1;
  EXPECT_THROW(cfg.validate(), std::invalid_argument);
  EXPECT_THROW(throw shadowkv::capacity_error("full"), std::length_error);
  EXPECT_THROW(throw shadowkv::logic_error("bug"), std::logic_error);
  EXPECT_THROW(throw shadowkv::out_of_memory("oom"), std::bad_alloc);
  EXPECT_STREQ(shadowkv::out_of_memory("requested 8 bytes").what(), "requested 8 bytes");
}

TEST(Config, DerivedValues) {
  config cfg = valid_config();
  EXPECT_EQ(cfg.group_size(), 4);
  EXPECT_EQ(cfg.kv_width(), 128);
  EXPECT_EQ(cfg.budget, 128);
  EXPECT_EQ(cfg.budget_chunks(), 16);
  EXPECT_EQ(cfg.effective_rotary_dim(), 64);
  cfg.rotary_dim = 16;
  EXPECT_EQ(cfg.effective_rotary_dim(), 16);
  EXPECT_FLOAT_EQ(cfg.effective_softmax_scale(), 0.125F);
  cfg.softmax_scale = 0.3F;
  EXPECT_FLOAT_EQ(cfg.effective_softmax_scale(), 0.3F);
}

TEST(Config, ParseHelpers) {
  using shadowkv::factorization_method;
  using shadowkv::rope_style;
  using shadowkv::value_store_policy;
  EXPECT_EQ(shadowkv::parse_rope_style("half"), rope_style::half_split);
  EXPECT_EQ(shadowkv::parse_rope_style("neox"), rope_style::half_split);
  EXPECT_EQ(shadowkv::parse_rope_style("interleaved"), rope_style::interleaved);
  EXPECT_EQ(shadowkv::parse_rope_style("gptj"), rope_style::interleaved);
  EXPECT_EQ(shadowkv::parse_rope_style(shadowkv::rope_style_name(rope_style::interleaved)), rope_style::interleaved);
  EXPECT_EQ(shadowkv::parse_rope_style(shadowkv::rope_style_name(rope_style::half_split)), rope_style::half_split);
  EXPECT_THROW((void)shadowkv::parse_rope_style("rotate"), shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::parse_factorization("gram"), factorization_method::gram);
  EXPECT_EQ(shadowkv::parse_factorization("svd"), factorization_method::svd);
  EXPECT_THROW((void)shadowkv::parse_factorization("qr"), shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::parse_value_store("host"), value_store_policy::host);
  EXPECT_EQ(shadowkv::parse_value_store("gpu"), value_store_policy::device);
  EXPECT_THROW((void)shadowkv::parse_value_store("disk"), shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::parse_factor_format("auto"), shadowkv::factor_format::automatic);
  EXPECT_EQ(shadowkv::parse_factor_format("bf16"), shadowkv::factor_format::bfloat16);
  EXPECT_EQ(shadowkv::parse_factor_format(shadowkv::factor_format_name(shadowkv::factor_format::float32)),
            shadowkv::factor_format::float32);
  EXPECT_THROW((void)shadowkv::parse_factor_format("float16"), shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::parse_finite_check(""), shadowkv::finite_check::automatic);
  for (const auto check : {shadowkv::finite_check::automatic, shadowkv::finite_check::prefill, shadowkv::finite_check::always}) {
    EXPECT_EQ(shadowkv::parse_finite_check(shadowkv::finite_check_name(check)), check);
  }
  EXPECT_THROW((void)shadowkv::parse_finite_check("never"), shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::config{}.check_finite, shadowkv::finite_check::automatic);
  EXPECT_EQ(shadowkv::parse_device("cpu"), (shadowkv::device{shadowkv::device_type::cpu, 0}));
  EXPECT_EQ(shadowkv::parse_device("cuda:3"), (shadowkv::device{shadowkv::device_type::cuda, 3}));
  EXPECT_EQ(shadowkv::to_string(shadowkv::parse_device("cuda:1")), "cuda:1");
  EXPECT_THROW((void)shadowkv::parse_device("cuda:x"), shadowkv::invalid_argument);
  EXPECT_THROW((void)shadowkv::parse_device("tpu"), shadowkv::invalid_argument);
}

TEST(Config, FactorDtypeFollowsTheStoreUnlessSet) {
  shadowkv::config cfg;
  EXPECT_EQ(cfg.factors_as, shadowkv::factor_format::automatic);
  cfg.kv_dtype = shadowkv::dtype::bfloat16;
  EXPECT_EQ(cfg.factor_dtype(), shadowkv::dtype::bfloat16);
  cfg.kv_dtype = shadowkv::dtype::float16;
  EXPECT_EQ(cfg.factor_dtype(), shadowkv::dtype::bfloat16);  // bf16's range: A's entries are as large as the keys
  cfg.kv_dtype = shadowkv::dtype::float32;
  EXPECT_EQ(cfg.factor_dtype(), shadowkv::dtype::float32);
  cfg.factors_as = shadowkv::factor_format::bfloat16;
  EXPECT_EQ(cfg.factor_dtype(), shadowkv::dtype::bfloat16);
  cfg.kv_dtype = shadowkv::dtype::bfloat16;
  cfg.factors_as = shadowkv::factor_format::float32;
  EXPECT_EQ(cfg.factor_dtype(), shadowkv::dtype::float32);
}

TEST(Config, DefaultsWithModelShapesAreValid) {
  // Llama-3-8B attention shapes with every algorithm parameter at its default (docs/semantics.md).
  config cfg;
  cfg.num_layers = 32;
  cfg.num_q_heads = 32;
  cfg.num_kv_heads = 8;
  cfg.head_dim = 128;
  EXPECT_NO_THROW(cfg.validate());
  EXPECT_EQ(cfg.rank, 0);  // the default rank: min(160, Hkv*D)
  EXPECT_EQ(cfg.effective_rank(), 160);
  EXPECT_EQ(cfg.budget, 2048);  // tokens, as Python's KVStore(budget=2048)
  EXPECT_EQ(cfg.budget_chunks(), 256);
}

// The default rank is min(160, Hkv*D): every shape builds a store with the defaults (issue 51: Hkv*D = 128 < 160 was
// rejected), and the store runs with the resolved rank. An explicit rank above Hkv*D stays an error.
TEST(Config, DefaultRankFitsEveryShape) {
  for (const auto& [heads, dim, expected] : std::vector<std::tuple<int, int, int>>{{2, 64, 128}, {1, 2, 2}, {3, 64, 160},
                                                                                  {8, 128, 160}}) {
    SCOPED_TRACE("num_kv_heads=" + std::to_string(heads) + " head_dim=" + std::to_string(dim));
    config cfg;
    cfg.num_layers = 1;
    cfg.num_q_heads = 2 * heads;
    cfg.num_kv_heads = heads;
    cfg.head_dim = dim;
    cfg.max_seq_len = 256;
    cfg.budget = 64;
    EXPECT_NO_THROW(cfg.validate());
    EXPECT_EQ(cfg.effective_rank(), expected);
    const shadowkv::kv_store store(cfg);
    EXPECT_EQ(store.get_config().rank, expected);
  }
  config cfg;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.rank = 129;
  EXPECT_THROW(cfg.validate(), shadowkv::invalid_argument);
}

TEST(Config, StoreOnDeviceWithoutBackendIsRejected) {
  const shadowkv::build_info info = shadowkv::get_build_info();
  EXPECT_FALSE(info.version.empty());
  ASSERT_FALSE(info.backends.empty());
  EXPECT_EQ(info.backends.front(), "cpu");
  EXPECT_NO_THROW(shadowkv::kv_store store(valid_config()));
  const bool has_cuda = std::find(info.backends.begin(), info.backends.end(), "cuda") != info.backends.end();
  if (has_cuda) GTEST_SKIP() << "this build has a CUDA backend";
  EXPECT_THROW(shadowkv::kv_store store(valid_config(), shadowkv::device{shadowkv::device_type::cuda, 0}),
               shadowkv::invalid_argument);
}

}  // namespace
