// Rank-r factorisation of pre-RoPE keys on the CPU (docs/semantics.md step 2): K[m, n] ≈ A[m, r] · B[r, n].
#pragma once

#include <cstdint>
#include <vector>

#include "shadowkv/config.hpp"

namespace shadowkv::detail {

/// B = V_rᵀ: the `rank` leading right singular vectors of row-major K[rows, cols], as rows of a row-major
/// [rank, cols] matrix, by the exact SVD or the Gram/eigensolver path. Throws logic_error if LAPACK fails.
std::vector<float> leading_right_singular_vectors(const float* keys, std::int64_t rows, std::int64_t cols, int rank,
                                                  factorization_method method);

/// A = K · Bᵀ for row-major K[rows, cols] and B[rank, cols]; returns row-major A[rows, rank].
std::vector<float> project_onto_basis(const float* keys, std::int64_t rows, std::int64_t cols, const float* basis,
                                      int rank);

/// C[rows, cols_out] = A[rows, inner] · B[inner, cols_out] with leading dimensions (row-major), float32.
void gemm_row_major(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc,
                    std::int64_t rows, std::int64_t inner, std::int64_t cols_out);

}  // namespace shadowkv::detail
