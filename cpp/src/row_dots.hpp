// Dot products of stored rows with a few query vectors: the CPU backend's selection scores (landmarks against the
// query heads of one KV head's group) and attention logits (keys against the same heads).
//
// Every result is what the plain loop
//     double sum = 0.0;
//     for (std::int64_t d = 0; d < dim; ++d) sum += static_cast<double>(row[d]) * query[d];
// gives, bit for bit: the same float64 operations in the same order (the reference's accumulation,
// docs/semantics.md). What differs is how many run at once. One such loop is a chain of dependent additions, each
// waiting for the previous one; here four rows meet up to four queries in one pass over d, so up to sixteen
// independent sums are in flight, and each row is read once for all queries of the group instead of once per query.
#pragma once

#include <algorithm>
#include <cstdint>

namespace shadowkv::detail {

inline constexpr int dot_block_rows = 4;     ///< rows per pass (dot_rows' scratch holds this many rows)
inline constexpr int dot_block_queries = 4;  ///< queries per pass

/// sums[r][q] = Σ_d rows[r][d] · queries[d * query_stride + q] for r < dot_block_rows, q < Queries.
template <int Queries>
void dot_block(const float* const* rows, const double* queries, std::int64_t query_stride, std::int64_t dim,
               double (&sums)[dot_block_rows][dot_block_queries]) noexcept {
  // Indexed [query][row], the rows innermost: the compiler packs neighbouring rows' sums into one vector register
  // (measured on x86-64: about twice as fast as rows outermost, whose vectors need shuffles).
  double block[Queries][dot_block_rows] = {};
  for (std::int64_t d = 0; d < dim; ++d) {
    double x[dot_block_rows];
    for (int r = 0; r < dot_block_rows; ++r) x[r] = rows[r][d];
    const double* query = queries + d * query_stride;
    for (int q = 0; q < Queries; ++q) {
      const double y = query[q];
      for (int r = 0; r < dot_block_rows; ++r) block[q][r] += x[r] * y;
    }
  }
  for (int q = 0; q < Queries; ++q) {
    for (int r = 0; r < dot_block_rows; ++r) sums[r][q] = block[q][r];
  }
}

/// out[q * out_stride + i] = Σ_d row_at(i)[d] · queries[d * query_count + q], each accumulated in float64 in order of
/// d, for rows i < count and queries q < query_count. `queries` is [dim, query_count] (the queries interleaved, so
/// that one pass reads theirs at d together). `row_at(i, room)` returns row i's `dim` floats: a pointer to the row
/// itself, or `room` (`dim` floats of `scratch`) after converting the row into it. `scratch` holds
/// dot_block_rows * dim floats.
template <typename RowAt>
void dot_rows(const RowAt& row_at, std::int64_t count, const double* queries, std::int64_t query_count,
              std::int64_t dim, float* scratch, double* out, std::int64_t out_stride) {
  const float* rows[dot_block_rows];
  double sums[dot_block_rows][dot_block_queries];
  for (std::int64_t first = 0; first < count; first += dot_block_rows) {
    const int in_block = static_cast<int>(std::min<std::int64_t>(dot_block_rows, count - first));
    for (int r = 0; r < dot_block_rows; ++r) {
      // A short last block repeats its first row; those sums are dropped.
      rows[r] = r < in_block ? row_at(first + r, scratch + r * dim) : rows[0];
    }
    for (std::int64_t q0 = 0; q0 < query_count; q0 += dot_block_queries) {
      const auto in_pass = static_cast<int>(std::min<std::int64_t>(dot_block_queries, query_count - q0));
      switch (in_pass) {
        case 1: dot_block<1>(rows, queries + q0, query_count, dim, sums); break;
        case 2: dot_block<2>(rows, queries + q0, query_count, dim, sums); break;
        case 3: dot_block<3>(rows, queries + q0, query_count, dim, sums); break;
        default: dot_block<4>(rows, queries + q0, query_count, dim, sums); break;
      }
      for (int r = 0; r < in_block; ++r) {
        for (int q = 0; q < in_pass; ++q) out[(q0 + q) * out_stride + first + r] = sums[r][q];
      }
    }
  }
}

}  // namespace shadowkv::detail
