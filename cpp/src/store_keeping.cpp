// park / resume and save / load (docs/semantics.md, "Fork, park and save"; the
// file format: docs/api.md, "Saved sequences"), written against the backend
// seam: the store validates, places and accounts; the backend moves, writes and
// reads its arrays.
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // fsync
#endif

#include "fold_rule.hpp"
#include "shadowkv/store.hpp"

namespace shadowkv {

// --- parked_sequence
// ------------------------------------------------------------------------------------------------

parked_sequence::parked_sequence() = default;
parked_sequence::~parked_sequence() = default;
parked_sequence::parked_sequence(parked_sequence&&) noexcept = default;
parked_sequence& parked_sequence::operator=(parked_sequence&&) noexcept = default;

std::int64_t parked_sequence::host_bytes() const noexcept { return state_ ? state_->host_bytes() : 0; }

std::int64_t parked_sequence::tokens() const noexcept {
  return state_ && !layers_.empty() ? layers_.front().total_len() : 0;
}

namespace {

static_assert(std::endian::native == std::endian::little,
              "saved sequences are little-endian, and this host's byte order "
              "is not: the file code would need swaps");

// Throws invalid_argument unless every layer of `layers` (a live sequence in
// `slot`) is prefilled.
void expect_every_layer_prefilled(const std::vector<layer_state>& layers, int slot, const char* call) {
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    SHADOWKV_EXPECTS(layers[layer].prefilled, call, ": layer ", layer, " of slot ", slot,
                     " has no prompt yet; only a sequence prefilled in every layer can be ", call, "d");
  }
}

void expect_keeping(const backend& b) {
  SHADOWKV_EXPECTS(b.supports_keeping(), "the ", to_string(b.where()), " backend cannot fork, park or save sequences");
}

// --- the file format (docs/api.md, "Saved sequences")
// ---------------------------------------------------------------

constexpr std::string_view kMagic = "SHADOWKV";
constexpr std::uint32_t kFormatVersion = 1;
constexpr std::size_t kCountersPerLayer = 8;
// Bounds on the header's variable parts (far above what a writer produces), so
// that a corrupted length cannot make load allocate without limit before the
// checksum is known.
constexpr std::uint32_t kMaxLayoutBytes = 64;
constexpr std::uint32_t kMaxFingerprintBytes = 1U << 20;
constexpr std::uint32_t kMaxSectionNameBytes = 256;

// FNV-1a, 64 bits: a checksum against truncation and accidental corruption (not
// against a forger). Ten lines that docs/api.md specifies completely, so that
// any reader can check a file without a hashing library.
class fnv1a64 {
 public:
  void add(std::span<const std::byte> bytes) noexcept {
    std::uint64_t h = hash_;
    for (const std::byte b : bytes) {
      h ^= static_cast<std::uint64_t>(b);
      h *= 0x100000001b3ULL;
    }
    hash_ = h;
  }
  [[nodiscard]] std::uint64_t value() const noexcept { return hash_; }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
};

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_text(std::string& out, std::string_view text) {
  put(out, static_cast<std::uint32_t>(text.size()));
  out.append(text);
}

// One "name=value" line of the configuration's fingerprint.
template <typename... Parts>
void fingerprint_line(std::string& out, const char* name, const Parts&... value) {
  out += name;
  out += '=';
  out += detail::format_message(value...);
  out += '\n';
}

// Every field of the configuration (as the store runs it: rank, budget and
// cache_tokens resolved and clamped) that decides what a sequence's stored
// bytes are or mean, as text lines. Left out, because they decide how calls run
// or where a sequence lives, not its state: max_batch, max_seq_len (checked
// against the file's tokens instead), extend_block, value_store,
// device_value_budget, decode_pipeline_parts, check_finite.
std::string fingerprint_of(const config& c) {
  std::string out;
  fingerprint_line(out, "num_layers", c.num_layers);
  fingerprint_line(out, "num_q_heads", c.num_q_heads);
  fingerprint_line(out, "num_kv_heads", c.num_kv_heads);
  fingerprint_line(out, "head_dim", c.head_dim);
  if (c.inv_freq.empty()) {
    fingerprint_line(out, "rope_theta", c.rope_theta);
    fingerprint_line(out, "inv_freq", "none");
  } else {
    fingerprint_line(out, "rope_theta", "unused");
    std::string frequencies;
    for (std::size_t i = 0; i < c.inv_freq.size(); ++i) {
      frequencies += detail::format_message(i == 0 ? "" : ",", c.inv_freq[i]);
    }
    fingerprint_line(out, "inv_freq", frequencies);
  }
  fingerprint_line(out, "rotary_dim", c.effective_rotary_dim());
  fingerprint_line(out, "rope_style", rope_style_name(c.rope));
  fingerprint_line(out, "attention_scaling", c.attention_scaling);
  fingerprint_line(out, "softmax_scale", c.effective_softmax_scale());
  fingerprint_line(out, "rank", c.rank);
  fingerprint_line(out, "chunk_size", c.chunk_size);
  fingerprint_line(out, "budget", c.budget);
  fingerprint_line(out, "cache_tokens", c.cache_tokens);
  fingerprint_line(out, "outlier_chunks", c.outlier_chunks);
  fingerprint_line(out, "sink_chunks", c.sink_chunks);
  fingerprint_line(out, "local_chunks", c.local_chunks);
  fingerprint_line(out, "generation_window", c.generation_window);
  fingerprint_line(out, "factorization", c.factorization == factorization_method::svd ? "svd" : "gram");
  fingerprint_line(out, "dtype", dtype_name(c.kv_dtype));
  fingerprint_line(out, "value_format", value_format_name(c.values_as));
  fingerprint_line(out, "factor_dtype", dtype_name(c.factor_dtype()));
  fingerprint_line(out, "group_score", group_score_name(c.group_score));
  fingerprint_line(out, "chunk_score", chunk_score_name(c.chunk_score));
  return out;
}

// (name, value) pairs of a fingerprint's lines.
std::vector<std::pair<std::string_view, std::string_view>> fingerprint_fields(std::string_view text) {
  std::vector<std::pair<std::string_view, std::string_view>> fields;
  while (!text.empty()) {
    const std::size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    const std::size_t equals = line.find('=');
    if (equals == std::string_view::npos) {
      fields.emplace_back(line, std::string_view{});
    } else {
      fields.emplace_back(line.substr(0, equals), line.substr(equals + 1));
    }
    text.remove_prefix(std::min(end + 1, text.size()));
  }
  return fields;
}

// Throws invalid_argument naming the first field where the file's fingerprint
// differs from the store's.
void expect_same_fingerprint(std::string_view file, std::string_view store, const std::string& path) {
  if (file == store) return;
  const auto theirs = fingerprint_fields(file);
  const auto ours = fingerprint_fields(store);
  for (std::size_t i = 0; i < std::max(theirs.size(), ours.size()); ++i) {
    if (i < theirs.size() && i < ours.size() && theirs[i] == ours[i]) continue;
    if (i < theirs.size() && i < ours.size() && theirs[i].first == ours[i].first) {
      throw invalid_argument(detail::format_message(
          "load '", path, "': the file was saved by a store of another configuration: ", ours[i].first, " is ",
          theirs[i].second, " in the file and ", ours[i].second,
          " in this store (the fields that decide a saved "
          "sequence's bytes must be equal: docs/api.md, \"Saved sequences\")"));
    }
    throw invalid_argument(detail::format_message(
        "load '", path, "': the file's configuration fingerprint lists ",
        i < theirs.size() ? detail::format_message("'", theirs[i].first, "'") : std::string("nothing more"),
        " where this store's lists ",
        i < ours.size() ? detail::format_message("'", ours[i].first, "'") : "nothing more",
        " (a file of another shadowkv_core version?)"));
  }
}

// The bytes before the sections: magic, version, layout, fingerprint, counters,
// values_on, the section table.
std::string file_header(const char* layout, const std::string& fingerprint, const std::vector<layer_state>& layers,
                        value_place values_on, const std::vector<state_section>& sections) {
  std::string out(kMagic);
  put(out, kFormatVersion);
  put_text(out, layout);
  put_text(out, fingerprint);
  put(out, static_cast<std::uint32_t>(layers.size()));
  for (const layer_state& s : layers) {
    for (const std::int64_t counter : {s.prompt_len, s.prompt_context_chunks, s.context_chunks, s.outlier_chunks,
                                       s.local_len, s.generated_total, s.generated_exact_len, s.journal_chunks}) {
      put(out, counter);
    }
  }
  put(out, static_cast<std::uint8_t>(values_on == value_place::device ? 1 : 0));
  put(out, static_cast<std::uint32_t>(sections.size()));
  for (const state_section& section : sections) {
    put_text(out, section.name);
    put(out, section.bytes);
  }
  return out;
}

std::string errno_text(int code) { return code == 0 ? std::string("no error code") : std::string(std::strerror(code)); }

// Writes `path` + ".tmp", renamed to `path` by commit(); destroyed before
// commit, it removes the temporary file.
class file_writer {
 public:
  explicit file_writer(const std::string& path) : path_(path), temporary_(path + ".tmp") {
    file_ = std::fopen(temporary_.c_str(), "wb");
    if (file_ == nullptr) {
      const int code = errno;
      throw io_error(code, temporary_,
                     detail::format_message("save: cannot create '", temporary_, "': ", errno_text(code)));
    }
  }
  file_writer(const file_writer&) = delete;
  file_writer& operator=(const file_writer&) = delete;
  ~file_writer() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) std::remove(temporary_.c_str());
  }

  void write(std::span<const std::byte> bytes) {
    checksum_.add(bytes);
    if (bytes.empty()) return;
    if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) fail("cannot write");
  }
  void write(const std::string& bytes) { write(std::as_bytes(std::span(bytes.data(), bytes.size()))); }

  // Appends the checksum, flushes the file to the disk and renames it to
  // `path`.
  void commit() {
    std::string tail;
    put(tail, checksum_.value());
    write(tail);
    if (std::fflush(file_) != 0) fail("cannot write");
#if defined(__unix__) || defined(__APPLE__)
    if (::fsync(fileno(file_)) != 0) fail("cannot flush");
#endif
    std::FILE* file = file_;
    file_ = nullptr;
    if (std::fclose(file) != 0) fail("cannot close");
    if (std::rename(temporary_.c_str(), path_.c_str()) != 0) {
      const int code = errno;
      throw io_error(
          code, path_,
          detail::format_message("save: cannot rename '", temporary_, "' to '", path_, "': ", errno_text(code)));
    }
    committed_ = true;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    const int code = errno;
    throw io_error(code, temporary_, detail::format_message("save: ", what, " '", temporary_, "': ", errno_text(code)));
  }

  std::string path_;
  std::string temporary_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
  fnv1a64 checksum_;
};

// The whole file, read before anything is checked.
std::vector<std::byte> read_file(const std::string& path) {
  // fopen opens a directory for reading on Linux (its reads then fail, its size is no file's): refuse it first.
  std::error_code status;
  if (std::filesystem::is_directory(path, status)) {
    throw io_error(EISDIR, path, detail::format_message("load: cannot read '", path, "': ", errno_text(EISDIR)));
  }
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    const int code = errno;
    throw io_error(code, path, detail::format_message("load: cannot open '", path, "': ", errno_text(code)));
  }
  struct closer {
    std::FILE* file;
    ~closer() { std::fclose(file); }
  } close_at_exit{file};
  const auto fail = [&](const char* what) {
    const int code = errno;
    throw io_error(code, path, detail::format_message("load: cannot ", what, " '", path, "': ", errno_text(code)));
  };
  if (std::fseek(file, 0, SEEK_END) != 0) fail("seek in");
  const long size = std::ftell(file);
  if (size < 0) fail("tell the size of");
  if (std::fseek(file, 0, SEEK_SET) != 0) fail("seek in");
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  if (!bytes.empty() && std::fread(bytes.data(), 1, bytes.size(), file) != bytes.size()) fail("read");
  return bytes;
}

// What load knows of a file once its structure, size and checksum are checked.
struct parsed_file {
  std::string_view layout;
  std::string_view fingerprint;
  std::vector<layer_state> layers;
  value_place values_on = value_place::host;
  std::vector<state_section> sections;
  std::vector<std::span<const std::byte>> payloads;  ///< one per section
};

// Reads the header, checking each part against the file's size, then the total
// size and the checksum.
class file_reader {
 public:
  file_reader(std::span<const std::byte> bytes, const std::string& path) : bytes_(bytes), path_(path) {}

  parsed_file parse() {
    parsed_file out;
    need(kMagic.size(), "the magic");
    const std::string_view magic(reinterpret_cast<const char*>(bytes_.data()), kMagic.size());
    SHADOWKV_EXPECTS(magic == kMagic, "load '", path_, "': not a saved sequence (the file does not start with \"",
                     kMagic, "\")");
    position_ = kMagic.size();
    const auto version = get<std::uint32_t>("the format version");
    SHADOWKV_EXPECTS(version == kFormatVersion, "load '", path_, "': the file has format version ", version,
                     "; this build of shadowkv_core reads version ", kFormatVersion);
    out.layout = text("the backend layout", kMaxLayoutBytes);
    out.fingerprint = text("the configuration fingerprint", kMaxFingerprintBytes);
    const auto layers = get<std::uint32_t>("the layer count");
    need(static_cast<std::uint64_t>(layers) * kCountersPerLayer * sizeof(std::int64_t), "the layers' counters");
    out.layers.resize(layers);
    for (layer_state& s : out.layers) {
      s.prefilled = true;
      for (std::int64_t* counter : {&s.prompt_len, &s.prompt_context_chunks, &s.context_chunks, &s.outlier_chunks,
                                    &s.local_len, &s.generated_total, &s.generated_exact_len, &s.journal_chunks}) {
        *counter = get<std::int64_t>("the layers' counters");
      }
    }
    const auto values_on = get<std::uint8_t>("values_on");
    SHADOWKV_EXPECTS(values_on <= 1, "load '", path_, "': corrupted: values_on is ", static_cast<int>(values_on),
                     " (0: host, 1: device)");
    out.values_on = values_on == 1 ? value_place::device : value_place::host;
    const auto count = get<std::uint32_t>("the section count");
    need(static_cast<std::uint64_t>(count) * (sizeof(std::uint32_t) + sizeof(std::int64_t)), "the section table");
    out.sections.resize(count);
    std::uint64_t payload = 0;
    for (state_section& section : out.sections) {
      section.name = std::string(text("a section name", kMaxSectionNameBytes));
      section.bytes = get<std::int64_t>("the section table");
      SHADOWKV_EXPECTS(section.bytes >= 0 && static_cast<std::uint64_t>(section.bytes) <= bytes_.size(), "load '",
                       path_, "': corrupted: section '", section.name, "' has ", section.bytes, " bytes, and the file ",
                       bytes_.size());
      // Saturating: only a corrupted table sums past the file's size, and then
      // the size check below refuses it.
      payload = std::min(payload + static_cast<std::uint64_t>(section.bytes), std::uint64_t{1} << 62);
    }
    const std::uint64_t expected = position_ + payload + sizeof(std::uint64_t);
    SHADOWKV_EXPECTS(bytes_.size() >= expected, "load '", path_, "': truncated: expected ", expected,
                     " bytes, the file has ", bytes_.size());
    SHADOWKV_EXPECTS(bytes_.size() == expected, "load '", path_, "': corrupted: expected ", expected,
                     " bytes (as its header says), the file has ", bytes_.size());
    fnv1a64 checksum;
    checksum.add(bytes_.first(bytes_.size() - sizeof(std::uint64_t)));
    std::uint64_t stored = 0;
    std::memcpy(&stored, bytes_.data() + bytes_.size() - sizeof(std::uint64_t), sizeof(stored));
    SHADOWKV_EXPECTS(stored == checksum.value(), "load '", path_, "': corrupted: checksum mismatch (the file says ",
                     stored, ", its bytes give ", checksum.value(), ")");
    out.payloads.reserve(out.sections.size());
    for (const state_section& section : out.sections) {
      out.payloads.push_back(bytes_.subspan(position_, static_cast<std::size_t>(section.bytes)));
      position_ += static_cast<std::size_t>(section.bytes);
    }
    return out;
  }

 private:
  // The file must hold `bytes` more bytes at the current position.
  void need(std::uint64_t bytes, const char* what) const {
    SHADOWKV_EXPECTS(bytes <= bytes_.size() - position_, "load '", path_, "': truncated: ", what, " needs bytes [",
                     position_, ", ", position_ + bytes, "), the file has ", bytes_.size());
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }
  std::string_view text(const char* what, std::uint32_t most) {
    const auto length = get<std::uint32_t>(what);
    SHADOWKV_EXPECTS(length <= most, "load '", path_, "': corrupted: ", what, " of ", length, " bytes (at most ", most,
                     ")");
    need(length, what);
    const std::string_view result(reinterpret_cast<const char*>(bytes_.data() + position_), length);
    position_ += length;
    return result;
  }

  std::span<const std::byte> bytes_;
  const std::string& path_;
  std::size_t position_ = 0;
};

// Throws unless `s` (layer `layer` of a file) are counters a store of `c` could
// hold: the prefill's rule for the prompt, the fold rule for the generated
// tokens (docs/semantics.md), and capacity (capacity_error past max_seq_len).
void expect_consistent_counters(const config& c, const layer_state& s, std::size_t layer, const std::string& path) {
  const auto chunk = static_cast<std::int64_t>(c.chunk_size);
  const auto inconsistent = [&](const char* what, std::int64_t found, std::int64_t expected) {
    throw invalid_argument(detail::format_message("load '", path, "': corrupted: layer ", layer, "'s ", what, " is ",
                                                  found, " where its other counters and the configuration give ",
                                                  expected));
  };
  SHADOWKV_EXPECTS(s.prompt_len >= 1, "load '", path, "': corrupted: layer ", layer, "'s prompt has ", s.prompt_len,
                   " tokens");
  SHADOWKV_EXPECTS(s.generated_total >= 0, "load '", path, "': corrupted: layer ", layer, " holds ", s.generated_total,
                   " generated tokens");
  SHADOWKV_EXPECTS_CAPACITY(s.prompt_len <= c.max_seq_len && s.generated_total <= c.max_seq_len - s.prompt_len,
                            "load '", path, "': the saved sequence holds ", s.prompt_len, " + ", s.generated_total,
                            " tokens in layer ", layer, ", more than this store's max_seq_len = ", c.max_seq_len);
  const std::int64_t prompt_chunks = std::max<std::int64_t>(0, s.prompt_len / chunk - c.local_chunks);
  if (s.prompt_context_chunks != prompt_chunks)
    inconsistent("prompt_context_chunks", s.prompt_context_chunks, prompt_chunks);
  const std::int64_t outliers = std::min<std::int64_t>(c.outlier_chunks, prompt_chunks);
  if (s.outlier_chunks != outliers) inconsistent("outlier_chunks", s.outlier_chunks, outliers);
  const std::int64_t local = s.prompt_len - prompt_chunks * chunk;
  if (s.local_len != local) inconsistent("local_len", s.local_len, local);
  const detail::generated_advance advance = detail::advance_generated(0, s.generated_total, c.generation_window, chunk);
  if (s.context_chunks != prompt_chunks + advance.folds) {
    inconsistent("context_chunks", s.context_chunks, prompt_chunks + advance.folds);
  }
  if (s.generated_exact_len != advance.generated_exact_len) {
    inconsistent("generated_exact_len", s.generated_exact_len, advance.generated_exact_len);
  }
  SHADOWKV_EXPECTS(s.journal_chunks >= 0 && s.journal_chunks <= std::min(advance.folds, c.journal_chunks()), "load '",
                   path, "': corrupted: layer ", layer, "'s journal_chunks is ", s.journal_chunks, ", outside [0, ",
                   std::min(advance.folds, c.journal_chunks()), "]");
}

}  // namespace

// --- park and resume
// -------------------------------------------------------------------------------------------------

std::vector<parked_sequence> kv_store::park(std::span<const int> slots) {
  const std::lock_guard lock(*mutex_);
  check_batch_slots(slots);
  for (const int slot : slots)
    expect_every_layer_prefilled(sequences_[static_cast<std::size_t>(slot)].layers, slot, "park");
  expect_keeping(*backend_);
  // Every object and its copy of the counters first; then each state out of its
  // slot; only when all are out are the slots closed (until then a failure puts
  // the states back, which cannot fail).
  std::vector<parked_sequence> result(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const sequence& seq = sequences_[static_cast<std::size_t>(slots[i])];
    parked_sequence& p = result[i];
    p.store_id_ = id_;
    p.slot_ = slots[i];
    p.family_ = seq.family;
    p.values_on_ = seq.values_on;
    p.layers_ = seq.layers;
  }
  std::size_t parked = 0;
  try {
    for (; parked < slots.size(); ++parked) {
      result[parked].state_ = backend_->park_sequence(slots[parked], result[parked].layers_);
      SHADOWKV_ASSERT(result[parked].state_ != nullptr);
    }
  } catch (...) {
    for (std::size_t i = parked; i-- > 0;) backend_->unpark_sequence(slots[i], *result[i].state_);
    throw;
  }
  // As release: a parked sequence holds no device budget; the shared runs it carries for its family (which the
  // parked state still shares) pass to the lowest live member (docs/semantics.md, "Value placement").
  for (const int slot : slots) vacate(slot, /*parked=*/true);
  return result;
}

std::vector<int> kv_store::resume(std::span<parked_sequence> parked) {
  const std::lock_guard lock(*mutex_);
  SHADOWKV_EXPECTS(!parked.empty(), "resume needs at least one parked sequence");
  std::int64_t device_sequences = 0;
  for (std::size_t i = 0; i < parked.size(); ++i) {
    const parked_sequence& p = parked[i];
    SHADOWKV_EXPECTS(!p.empty(), "resume: parked sequence ", i,
                     " holds no sequence (it was resumed already, or never "
                     "parked): a parked sequence resumes once");
    SHADOWKV_EXPECTS(p.store_id_ == id_, "resume: parked sequence ", i, " (from slot ", p.slot_,
                     ") was parked by another store; a parked sequence resumes "
                     "only into the store that parked it");
    SHADOWKV_ASSERT(p.layers_.size() == static_cast<std::size_t>(config_.num_layers));
    if (p.values_on_ == value_place::device) ++device_sequences;
  }
  std::vector<int> free_slots;
  free_slots.reserve(parked.size());
  for (int slot = 0; slot < config_.max_batch && free_slots.size() < parked.size(); ++slot) {
    if (!sequences_[static_cast<std::size_t>(slot)].active) free_slots.push_back(slot);
  }
  SHADOWKV_EXPECTS_CAPACITY(free_slots.size() == parked.size(), "cannot resume ", parked.size(),
                            " parked sequence(s): only ", free_slots.size(), " of max_batch=", config_.max_batch,
                            " slots are free");
  // A value store that was in device memory goes back there, charged as release and park leave the family's charge
  // (docs/semantics.md, "Value placement"): a member of a fork's family of which a sequence is live on the device (or
  // resumes before it in this call) shares the prompt's runs that sequence carries, and takes what a child takes
  // (backend::forked_value_bytes); otherwise it takes a whole value store and carries the runs for the family. With
  // value_store = "auto" the budget must have room.
  const std::int64_t value_bytes = backend_->value_bytes_per_sequence();
  std::vector<std::int64_t> charges(parked.size(), 0);
  std::int64_t charged = 0;
  for (std::size_t i = 0; i < parked.size(); ++i) {
    const parked_sequence& p = parked[i];
    if (p.values_on_ != value_place::device) continue;
    bool shares = false;
    if (p.family_ != 0) {
      for (const sequence& seq : sequences_) {
        shares = shares || (seq.active && seq.family == p.family_ && seq.values_on == value_place::device);
      }
      for (std::size_t j = 0; j < i; ++j) {
        shares = shares || (parked[j].family_ == p.family_ && parked[j].values_on_ == value_place::device);
      }
    }
    charges[i] = shares ? backend_->forked_value_bytes(p.layers_) : value_bytes;
    charged += charges[i];
  }
  const std::int64_t device_bytes = device_value_bytes_ + charged;
  if (config_.value_store == value_store_policy::auto_place && device_sequences > 0 &&
      device_bytes > device_value_budget_) {
    throw out_of_memory(detail::format_message(
        "resume: ", device_sequences, " parked sequence(s) had their value stores in device memory (", charged,
        " bytes of device_value_budget in all), and device_value_budget has no room for them: ", device_value_bytes_,
        " of ", device_value_budget_, " bytes are in use"));
  }
  std::size_t resumed = 0;
  try {
    for (; resumed < parked.size(); ++resumed) {
      backend_->resume_sequence(free_slots[resumed], *parked[resumed].state_, parked[resumed].layers_);
    }
  } catch (...) {
    for (std::size_t i = resumed; i-- > 0;) backend_->unresume_sequence(free_slots[i], *parked[i].state_);
    throw;
  }
  for (std::size_t i = 0; i < parked.size(); ++i) {
    parked_sequence& p = parked[i];
    sequence& seq = sequences_[static_cast<std::size_t>(free_slots[i])];
    seq.active = true;
    seq.parked = false;
    seq.values_on = p.values_on_;
    seq.family = p.family_;
    seq.device_value_bytes = charges[i];
    seq.layers = std::move(p.layers_);
    p.layers_.clear();
    p.state_.reset();
  }
  device_value_bytes_ = device_bytes;
  return free_slots;
}

// --- save and load
// ---------------------------------------------------------------------------------------------------

void kv_store::save(int slot, const std::string& path) const {
  const std::lock_guard lock(*mutex_);
  check_slot(slot);
  const sequence& seq = sequences_[static_cast<std::size_t>(slot)];
  expect_every_layer_prefilled(seq.layers, slot, "save");
  expect_keeping(*backend_);
  SHADOWKV_EXPECTS(!path.empty(), "save: the path is empty");
  const std::vector<state_section> sections = backend_->state_sections(seq.layers);
  const std::string header =
      file_header(backend_->state_layout(), fingerprint_of(config_), seq.layers, seq.values_on, sections);
  std::vector<std::int64_t> written(sections.size(), 0);
  backend_->use_stream(std::nullopt);  // the backend's own stream: the state is
                                       // read before the call returns
  file_writer file(path);
  file.write(header);
  std::size_t current = 0;
  backend_->write_state(slot, seq.layers, [&](std::size_t index, std::span<const std::byte> bytes) {
    SHADOWKV_ASSERT(index < sections.size() && index >= current);
    current = index;
    written[index] += static_cast<std::int64_t>(bytes.size());
    SHADOWKV_ASSERT(written[index] <= sections[index].bytes);
    file.write(bytes);
  });
  for (std::size_t i = 0; i < sections.size(); ++i) SHADOWKV_ASSERT(written[i] == sections[i].bytes);
  file.commit();
  backend_->finish_call();
}

int kv_store::load(const std::string& path) {
  SHADOWKV_EXPECTS(!path.empty(), "load: the path is empty");
  // Read outside the lock: the file is not the store's.
  const std::vector<std::byte> bytes = read_file(path);
  const std::lock_guard lock(*mutex_);
  expect_keeping(*backend_);
  file_reader reader(bytes, path);
  parsed_file file = reader.parse();
  const std::string_view layout = backend_->state_layout();
  SHADOWKV_EXPECTS(file.layout == layout, "load '", path, "': the file holds the state of a '", file.layout,
                   "' backend, and this store's backend writes '", layout,
                   "': a saved sequence loads only into a store of the same backend kind");
  expect_same_fingerprint(file.fingerprint, fingerprint_of(config_), path);
  SHADOWKV_EXPECTS(file.layers.size() == static_cast<std::size_t>(config_.num_layers), "load '", path,
                   "': corrupted: the file holds the counters of ", file.layers.size(),
                   " layers, its fingerprint says ", config_.num_layers);
  for (std::size_t layer = 0; layer < file.layers.size(); ++layer) {
    expect_consistent_counters(config_, file.layers[layer], layer, path);
  }
  const std::vector<state_section> expected = backend_->state_sections(file.layers);
  for (std::size_t i = 0; i < std::max(expected.size(), file.sections.size()); ++i) {
    const bool same = i < expected.size() && i < file.sections.size() && expected[i].name == file.sections[i].name &&
                      expected[i].bytes == file.sections[i].bytes;
    if (same) continue;
    const auto describe = [](const std::vector<state_section>& list, std::size_t index) {
      return index < list.size() ? detail::format_message("'", list[index].name, "' of ", list[index].bytes, " bytes")
                                 : std::string("nothing");
    };
    throw invalid_argument(detail::format_message("load '", path, "': corrupted: section ", i, " of the file is ",
                                                  describe(file.sections, i),
                                                  " where its counters and the "
                                                  "configuration give ",
                                                  describe(expected, i)));
  }

  int slot = -1;
  for (int candidate = 0; candidate < config_.max_batch && slot < 0; ++candidate) {
    if (!sequences_[static_cast<std::size_t>(candidate)].active) slot = candidate;
  }
  SHADOWKV_EXPECTS_CAPACITY(slot >= 0, "load '", path, "': no free slot (all max_batch=", config_.max_batch,
                            " slots hold sequences)");
  sequence& seq = sequences_[static_cast<std::size_t>(slot)];
  seq.layers.reserve(static_cast<std::size_t>(config_.num_layers));  // so that the commit below cannot fail

  // The value store goes where add_sequences would put a new sequence's.
  const std::int64_t value_bytes = backend_->value_bytes_per_sequence();
  value_place place = config_.value_store == value_store_policy::device ? value_place::device : value_place::host;
  const auto read = [&](value_place where) {
    for (layer_state& s : file.layers) s.values_on = where;
    try {
      backend_->read_state(slot, where, file.layers, file.payloads);
    } catch (const invalid_argument& error) {
      throw invalid_argument(detail::format_message("load '", path, "': ", error.what()));
    }
  };
  backend_->use_stream(std::nullopt);
  if (config_.value_store == value_store_policy::auto_place) {
    const bool within_budget = device_value_bytes_ + value_bytes <= device_value_budget_;
    bool on_device = false;
    if (within_budget && backend_->device_has_room(value_bytes)) {
      try {
        read(value_place::device);
        on_device = true;
      } catch (const out_of_memory&) {
      }
    }
    if (on_device) {
      place = value_place::device;
    } else {
      try {
        read(value_place::host);
      } catch (const out_of_memory& error) {
        throw out_of_memory(detail::format_message(
            "load '", path, "': the value store of the sequence (", value_bytes, " bytes) fits neither on the device (",
            within_budget ? "no device memory left" : "device_value_budget exhausted", ": ", device_value_bytes_,
            " of ", device_value_budget_, " bytes in use) nor in host memory (", error.what(), ")"));
      }
    }
  } else {
    read(place);
  }
  backend_->finish_call();
  seq.active = true;
  seq.parked = false;
  seq.values_on = place;
  seq.family = 0;  // unshared: the file holds the whole state, and read_state built a prompt state of its own
  seq.device_value_bytes = place == value_place::device ? value_bytes : 0;
  seq.layers.assign(file.layers.begin(), file.layers.end());
  device_value_bytes_ += seq.device_value_bytes;
  return slot;
}

}  // namespace shadowkv
