// The CPU rank-r factorisation (cpp/src/factorization.hpp): exact SVD and Gram/eigensolver paths agree on the
// subspace, full rank reconstructs the keys, and rank > rows still yields an orthonormal basis.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "factorization.hpp"
#include "shadowkv/config.hpp"

namespace {

using shadowkv::factorization_method;
using shadowkv::detail::gemm_row_major;
using shadowkv::detail::leading_right_singular_vectors;
using shadowkv::detail::project_onto_basis;

const char* method_name(factorization_method method) { return method == factorization_method::svd ? "svd" : "gram"; }

// Row-major [rows, cols] = X[rows, rank] · Y[rank, cols] with Y's rows scaled by a decaying spectrum, plus noise.
std::vector<float> planted_rank_matrix(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, int rank,
                                       double noise, std::vector<double>* planted_rows = nullptr) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(rows * rank));
  std::vector<double> y(static_cast<std::size_t>(rank * cols));
  for (double& v : x) v = normal(rng);
  for (int i = 0; i < rank; ++i) {
    const double strength = 4.0 * std::pow(0.85, i);
    for (std::int64_t j = 0; j < cols; ++j) y[static_cast<std::size_t>(i * cols + j)] = strength * normal(rng);
  }
  std::vector<float> k(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      double sum = noise * normal(rng);
      for (int i = 0; i < rank; ++i) sum += x[static_cast<std::size_t>(r * rank + i)] * y[static_cast<std::size_t>(i * cols + c)];
      k[static_cast<std::size_t>(r * cols + c)] = static_cast<float>(sum);
    }
  }
  if (planted_rows != nullptr) *planted_rows = y;
  return k;
}

// Projector Bᵀ·B [cols, cols] of the row space of an orthonormal B[rank, cols].
std::vector<double> projector(const std::vector<float>& basis, int rank, std::int64_t cols) {
  std::vector<double> p(static_cast<std::size_t>(cols * cols), 0.0);
  for (int i = 0; i < rank; ++i) {
    const float* row = basis.data() + static_cast<std::ptrdiff_t>(i) * cols;
    for (std::int64_t a = 0; a < cols; ++a) {
      for (std::int64_t b = 0; b < cols; ++b) p[static_cast<std::size_t>(a * cols + b)] += static_cast<double>(row[a]) * row[b];
    }
  }
  return p;
}

double frobenius_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(sum);
}

// max |B·Bᵀ - I|
double orthonormality_error(const std::vector<float>& basis, int rank, std::int64_t cols) {
  double worst = 0.0;
  for (int i = 0; i < rank; ++i) {
    for (int j = 0; j < rank; ++j) {
      double dot = 0.0;
      for (std::int64_t c = 0; c < cols; ++c) {
        dot += static_cast<double>(basis[static_cast<std::size_t>(i * cols + c)]) * basis[static_cast<std::size_t>(j * cols + c)];
      }
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

// Orthonormal basis (Gram–Schmidt, float64) of the rows of Y[rank, cols].
std::vector<float> orthonormal_rows(std::vector<double> y, int rank, std::int64_t cols) {
  for (int i = 0; i < rank; ++i) {
    double* row = y.data() + static_cast<std::ptrdiff_t>(i) * cols;
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < i; ++j) {
        const double* other = y.data() + static_cast<std::ptrdiff_t>(j) * cols;
        double dot = 0.0;
        for (std::int64_t c = 0; c < cols; ++c) dot += row[c] * other[c];
        for (std::int64_t c = 0; c < cols; ++c) row[c] -= dot * other[c];
      }
    }
    double norm = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) norm += row[c] * row[c];
    norm = std::sqrt(norm);
    for (std::int64_t c = 0; c < cols; ++c) row[c] /= norm;
  }
  return {y.begin(), y.end()};
}

// Fraction of ‖K‖²_F captured by the row space of B.
double captured_energy(const std::vector<float>& k, std::int64_t rows, std::int64_t cols, const std::vector<float>& basis,
                       int rank) {
  const std::vector<float> a = project_onto_basis(k.data(), rows, cols, basis.data(), rank);
  double total = 0.0;
  double captured = 0.0;
  for (const float v : k) total += static_cast<double>(v) * v;
  for (const float v : a) captured += static_cast<double>(v) * v;
  return captured / total;
}

TEST(Factorization, SvdAndGramAgreeOnPlantedSubspace) {
  for (const std::uint64_t seed : {11ULL, 12ULL, 13ULL}) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const std::int64_t rows = 300;
    const std::int64_t cols = 96;
    const int rank = 12;
    std::vector<double> planted;
    const std::vector<float> k = planted_rank_matrix(rng, rows, cols, rank, 1e-2, &planted);

    const std::vector<float> svd = leading_right_singular_vectors(k.data(), rows, cols, rank, factorization_method::svd);
    const std::vector<float> gram = leading_right_singular_vectors(k.data(), rows, cols, rank, factorization_method::gram);
    ASSERT_EQ(svd.size(), static_cast<std::size_t>(rank * cols));
    ASSERT_EQ(gram.size(), static_cast<std::size_t>(rank * cols));
    EXPECT_LT(orthonormality_error(svd, rank, cols), 1e-5);
    EXPECT_LT(orthonormality_error(gram, rank, cols), 1e-5);

    const std::vector<double> p_svd = projector(svd, rank, cols);
    const std::vector<double> p_gram = projector(gram, rank, cols);
    const double between = frobenius_difference(p_svd, p_gram);
    EXPECT_LT(between, 1e-4) << "the two methods must span the same subspace";
    const std::vector<double> p_planted = projector(orthonormal_rows(planted, rank, cols), rank, cols);
    EXPECT_LT(frobenius_difference(p_svd, p_planted), 1e-2) << "svd must find the planted subspace";
    EXPECT_LT(frobenius_difference(p_gram, p_planted), 1e-2) << "gram must find the planted subspace";
    // Non-trivial: the projectors have trace = rank, and a basis of the wrong size would not match.
    double trace = 0.0;
    for (std::int64_t i = 0; i < cols; ++i) trace += p_svd[static_cast<std::size_t>(i * cols + i)];
    EXPECT_NEAR(trace, rank, 1e-4);
    EXPECT_GT(captured_energy(k, rows, cols, svd, rank), 0.9999);
    EXPECT_GT(captured_energy(k, rows, cols, gram, rank), 0.9999);
    // A smaller basis must not cover the planted subspace: the test can tell subspaces apart.
    const std::vector<float> smaller = leading_right_singular_vectors(k.data(), rows, cols, rank - 1, factorization_method::gram);
    std::vector<double> p_smaller = projector(smaller, rank - 1, cols);
    EXPECT_GT(frobenius_difference(p_smaller, p_planted), 0.9);
  }
}

TEST(Factorization, LeadingVectorsComeFirst) {
  // Ordering: the first basis row alone must capture more energy than any later row alone.
  const std::uint64_t seed = 21;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t rows = 200;
  const std::int64_t cols = 40;
  const int rank = 6;
  const std::vector<float> k = planted_rank_matrix(rng, rows, cols, rank, 1e-3);
  for (const factorization_method method : {factorization_method::svd, factorization_method::gram}) {
    SCOPED_TRACE(method_name(method));
    const std::vector<float> basis = leading_right_singular_vectors(k.data(), rows, cols, rank, method);
    const std::vector<float> a = project_onto_basis(k.data(), rows, cols, basis.data(), rank);
    std::vector<double> column_energy(static_cast<std::size_t>(rank), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int i = 0; i < rank; ++i) column_energy[static_cast<std::size_t>(i)] += std::pow(a[static_cast<std::size_t>(r * rank + i)], 2);
    }
    for (int i = 1; i < rank; ++i) EXPECT_GE(column_energy[static_cast<std::size_t>(i - 1)], column_energy[static_cast<std::size_t>(i)]) << "i=" << i;
  }
}

TEST(Factorization, FullRankReconstructsKeys) {
  for (const factorization_method method : {factorization_method::svd, factorization_method::gram}) {
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{150, 64}, {40, 128}}) {
      const std::uint64_t seed = 31 + static_cast<std::uint64_t>(rows);
      SCOPED_TRACE(std::string(method_name(method)) + " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                   " seed=" + std::to_string(seed));
      std::mt19937_64 rng(seed);
      std::normal_distribution<float> normal(0.0F, 1.0F);
      std::vector<float> k(static_cast<std::size_t>(rows * cols));
      for (float& v : k) v = normal(rng) + 0.5F;  // a non-zero mean, like real keys
      const int rank = static_cast<int>(cols);
      const std::vector<float> basis = leading_right_singular_vectors(k.data(), rows, cols, rank, method);
      EXPECT_LT(orthonormality_error(basis, rank, cols), 1e-5);
      const std::vector<float> a = project_onto_basis(k.data(), rows, cols, basis.data(), rank);
      ASSERT_EQ(a.size(), static_cast<std::size_t>(rows * rank));
      std::vector<float> rebuilt(static_cast<std::size_t>(rows * cols), 0.0F);
      gemm_row_major(a.data(), rank, basis.data(), cols, rebuilt.data(), cols, rows, rank, cols);
      double worst = 0.0;
      double largest = 0.0;
      for (std::size_t i = 0; i < k.size(); ++i) {
        worst = std::max(worst, std::fabs(static_cast<double>(rebuilt[i]) - k[i]));
        largest = std::max(largest, std::fabs(static_cast<double>(k[i])));
      }
      EXPECT_GT(largest, 1.0);
      EXPECT_LT(worst, 2e-5 * largest) << "A·B must equal K at full rank";
    }
  }
}

TEST(Factorization, RankAboveRowsGivesOrthonormalBasis) {
  for (const factorization_method method : {factorization_method::svd, factorization_method::gram}) {
    const std::uint64_t seed = 41;
    SCOPED_TRACE(std::string(method_name(method)) + " seed=" + std::to_string(seed));
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    const std::int64_t rows = 5;
    const std::int64_t cols = 32;
    const int rank = 20;  // > rows: 15 vectors complete the basis
    std::vector<float> k(static_cast<std::size_t>(rows * cols));
    for (float& v : k) v = normal(rng);
    const std::vector<float> basis = leading_right_singular_vectors(k.data(), rows, cols, rank, method);
    ASSERT_EQ(basis.size(), static_cast<std::size_t>(rank * cols));
    for (const float v : basis) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(orthonormality_error(basis, rank, cols), 1e-5);
    // K's rows lie in the span: A·B reconstructs K, and the completing vectors' coefficients are ~0.
    const std::vector<float> a = project_onto_basis(k.data(), rows, cols, basis.data(), rank);
    std::vector<float> rebuilt(static_cast<std::size_t>(rows * cols), 0.0F);
    gemm_row_major(a.data(), rank, basis.data(), cols, rebuilt.data(), cols, rows, rank, cols);
    for (std::size_t i = 0; i < k.size(); ++i) EXPECT_NEAR(rebuilt[i], k[i], 1e-4) << "i=" << i;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int i = static_cast<int>(rows); i < rank; ++i) EXPECT_NEAR(a[static_cast<std::size_t>(r * rank + i)], 0.0F, 1e-4);
    }
  }
}

TEST(Factorization, FullRankBasisAboveRowsIsSquareOrthogonal) {
  // The store's full-rank case with a prompt shorter than Hkv*D: rank = cols > rows.
  for (const factorization_method method : {factorization_method::svd, factorization_method::gram}) {
    const std::uint64_t seed = 51;
    SCOPED_TRACE(std::string(method_name(method)) + " seed=" + std::to_string(seed));
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    const std::int64_t rows = 7;
    const std::int64_t cols = 48;
    std::vector<float> k(static_cast<std::size_t>(rows * cols));
    for (float& v : k) v = normal(rng);
    const std::vector<float> basis = leading_right_singular_vectors(k.data(), rows, cols, static_cast<int>(cols), method);
    EXPECT_LT(orthonormality_error(basis, static_cast<int>(cols), cols), 1e-5);
  }
}

TEST(Factorization, ProjectAndGemmOnSmallKnownMatrices) {
  // K = [[1, 2, 3], [4, 5, 6]], B = [[1, 0, 0], [0, 0, 1]] -> A = K·Bᵀ = [[1, 3], [4, 6]].
  const std::vector<float> k = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {1, 0, 0, 0, 0, 1};
  const std::vector<float> a = project_onto_basis(k.data(), 2, 3, b.data(), 2);
  EXPECT_EQ(a, (std::vector<float>{1, 3, 4, 6}));
  EXPECT_TRUE(project_onto_basis(k.data(), 0, 3, b.data(), 2).empty());
  // C = A·B with leading dimensions: [[1, 3], [4, 6]]·[[1, 0, 0], [0, 0, 1]] = [[1, 0, 3], [4, 0, 6]].
  std::vector<float> c(6, -1.0F);
  gemm_row_major(a.data(), 2, b.data(), 3, c.data(), 3, 2, 2, 3);
  EXPECT_EQ(c, (std::vector<float>{1, 0, 3, 4, 0, 6}));
  // Only the last two columns of B (ldb = 3, 2 output columns).
  std::vector<float> d(4, -1.0F);
  gemm_row_major(a.data(), 2, b.data() + 1, 3, d.data(), 2, 2, 2, 2);
  EXPECT_EQ(d, (std::vector<float>{0, 3, 0, 6}));
}

TEST(Factorization, RejectsRankAboveColumns) {
  const std::vector<float> k(4 * 8, 1.0F);
  EXPECT_ANY_THROW((void)leading_right_singular_vectors(k.data(), 4, 8, 9, factorization_method::gram));
  EXPECT_ANY_THROW((void)leading_right_singular_vectors(k.data(), 4, 8, 0, factorization_method::svd));
}

}  // namespace
