// Rows of A times one KV head's columns of B: the CPU backend's key rebuild before RoPE (docs/semantics.md, decode
// step 6: a rebuilt key is A[t] · B[:, h*D:(h+1)*D]).
//
// Each element is a float32 sum over l in ascending order, started from zero: the order of the reference BLAS's
// sgemm, which the rebuild called before (same bits). The loop runs over j innermost, which the compiler vectorises;
// at the rebuild's shapes (8 to a few hundred rows, r and D 64 to 160) it measured about 3x faster than that netlib
// sgemm (0.22-0.27 against 0.76-0.82 ns per multiply-add), and it does not depend on which BLAS a build found.
// (Register-tiled versions were measured too: written portably, GCC 12 vectorises them across l with in-order
// reductions and they run about 3x slower than this loop; with GCC vector extensions they gain only ~1.3x.)
#pragma once

#include <algorithm>
#include <cstdint>

namespace shadowkv::detail {

/// keys[k * dim + j] = Σ_l a[k * rank + l] · basis[l * ldb + j] for k < count, j < dim: `count` rows of A (row-major,
/// `rank` wide) times the [rank, dim] block of B that starts at `basis` (row stride `ldb`), into row-major keys.
inline void low_rank_rows(const float* a, std::int64_t count, std::int64_t rank, const float* basis, std::int64_t ldb,
                          std::int64_t dim, float* keys) noexcept {
  for (std::int64_t k = 0; k < count; ++k) {
    float* key = keys + k * dim;
    std::fill(key, key + dim, 0.0F);
    for (std::int64_t l = 0; l < rank; ++l) {
      const float coefficient = a[k * rank + l];
      const float* row = basis + l * ldb;
      for (std::int64_t j = 0; j < dim; ++j) key[j] += coefficient * row[j];
    }
  }
}

}  // namespace shadowkv::detail
