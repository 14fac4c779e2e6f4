#include "factorization.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "lapack.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::detail {
namespace {

int as_lapack_int(std::int64_t value) {
  SHADOWKV_EXPECTS(value <= INT_MAX, "matrix dimension ", value, " exceeds the 32-bit LAPACK interface");
  return static_cast<int>(value);
}

// Keys scaled by a power of two (exact) so that the largest magnitude is about 1, when the float32 Gram matrix of the
// keys as given could overflow (or lose its small entries to underflow); empty when the keys can be used as they are.
// The eigenvectors of (sK)ᵀ(sK) are those of KᵀK.
std::vector<float> rescaled_for_gram(const float* keys, std::int64_t count) {
  float largest = 0.0F;
  for (std::int64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(keys[i]));
  int exponent = 0;
  (void)std::frexp(largest, &exponent);
  if (largest == 0.0F || (exponent >= -40 && exponent <= 40)) return {};
  std::vector<float> scaled(keys, keys + count);
  for (float& value : scaled) value = std::ldexp(value, -exponent);
  return scaled;
}

// Leading eigenvectors of the Gram matrix KᵀK (float32 product, float64 eigensolver).
std::vector<float> gram_basis(const float* keys, std::int64_t rows, std::int64_t cols, int rank) {
  const int n = as_lapack_int(cols);
  const int k = as_lapack_int(rows);
  const std::vector<float> rescaled = rescaled_for_gram(keys, rows * cols);
  if (!rescaled.empty()) keys = rescaled.data();
  std::vector<float> gram(static_cast<std::size_t>(cols * cols), 0.0F);
  const float one = 1.0F;
  const float zero = 0.0F;
  // Row-major K[rows, cols] is column-major Kᵀ[cols, rows]: C = Kᵀ (Kᵀ)ᵀ = KᵀK.
  ssyrk_("U", "N", &n, &k, &one, keys, &n, &zero, gram.data(), &n, 1, 1);
  std::vector<double> gram64(gram.begin(), gram.end());

  const int first = n - rank + 1;  // eigenvalues come ascending: take the last `rank`
  const int last = n;
  const double bound = 0.0;
  const double abstol = 0.0;
  int found = 0;
  int info = 0;
  std::vector<double> eigenvalues(static_cast<std::size_t>(n));
  std::vector<double> vectors(static_cast<std::size_t>(n) * static_cast<std::size_t>(rank));
  std::vector<int> support(static_cast<std::size_t>(2 * rank));
  double work_query = 0.0;
  int iwork_query = 0;
  int lwork = -1;
  int liwork = -1;
  dsyevr_("V", "I", "U", &n, gram64.data(), &n, &bound, &bound, &first, &last, &abstol, &found, eigenvalues.data(),
          vectors.data(), &n, support.data(), &work_query, &lwork, &iwork_query, &liwork, &info, 1, 1, 1);
  SHADOWKV_ASSERT(info == 0);
  lwork = static_cast<int>(work_query);
  liwork = iwork_query;
  std::vector<double> work(static_cast<std::size_t>(lwork));
  std::vector<int> iwork(static_cast<std::size_t>(liwork));
  dsyevr_("V", "I", "U", &n, gram64.data(), &n, &bound, &bound, &first, &last, &abstol, &found, eigenvalues.data(),
          vectors.data(), &n, support.data(), work.data(), &lwork, iwork.data(), &liwork, &info, 1, 1, 1);
  if (info != 0 || found != rank) {
    throw logic_error(format_message("dsyevr failed on the ", n, "x", n, " Gram matrix (info=", info, ", found ",
                                     found, " of ", rank, " eigenvectors)"));
  }
  std::vector<float> basis(static_cast<std::size_t>(rank) * static_cast<std::size_t>(n));
  for (int i = 0; i < rank; ++i) {
    const double* column = vectors.data() + static_cast<std::size_t>(rank - 1 - i) * static_cast<std::size_t>(n);
    std::transform(column, column + n, basis.begin() + static_cast<std::ptrdiff_t>(i) * n,
                   [](double v) { return static_cast<float>(v); });
  }
  return basis;
}

// Right singular vectors of K by float64 divide-and-conquer SVD of Kᵀ (whose left singular vectors they are).
std::vector<float> svd_basis(const float* keys, std::int64_t rows, std::int64_t cols, int rank) {
  const int m = as_lapack_int(cols);  // Kᵀ is [cols, rows] column-major
  const int n = as_lapack_int(rows);
  const int smaller = std::min(m, n);
  // With rank > min(rows, cols) the complete left basis is needed to have `rank` orthonormal vectors.
  const char* job = rank > smaller ? "A" : "S";
  const int u_cols = rank > smaller ? m : smaller;
  std::vector<double> matrix(keys, keys + rows * cols);
  std::vector<double> singular(static_cast<std::size_t>(smaller));
  std::vector<double> u(static_cast<std::size_t>(m) * static_cast<std::size_t>(u_cols));
  std::vector<double> vt(static_cast<std::size_t>(n) * static_cast<std::size_t>(rank > smaller ? n : smaller));
  const int ldvt_real = rank > smaller ? n : smaller;
  std::vector<int> iwork(static_cast<std::size_t>(8 * smaller));
  int info = 0;
  int lwork = -1;
  double work_query = 0.0;
  dgesdd_(job, &m, &n, matrix.data(), &m, singular.data(), u.data(), &m, vt.data(), &ldvt_real, &work_query, &lwork,
          iwork.data(), &info, 1);
  SHADOWKV_ASSERT(info == 0);
  lwork = static_cast<int>(work_query);
  std::vector<double> work(static_cast<std::size_t>(lwork));
  dgesdd_(job, &m, &n, matrix.data(), &m, singular.data(), u.data(), &m, vt.data(), &ldvt_real, work.data(), &lwork,
          iwork.data(), &info, 1);
  if (info != 0) {
    throw logic_error(format_message("dgesdd failed on a ", rows, "x", cols, " key matrix (info=", info, ")"));
  }
  std::vector<float> basis(static_cast<std::size_t>(rank) * static_cast<std::size_t>(m));
  for (int i = 0; i < rank; ++i) {
    const double* column = u.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(m);
    std::transform(column, column + m, basis.begin() + static_cast<std::ptrdiff_t>(i) * m,
                   [](double v) { return static_cast<float>(v); });
  }
  return basis;
}

}  // namespace

std::vector<float> leading_right_singular_vectors(const float* keys, std::int64_t rows, std::int64_t cols, int rank,
                                                  factorization_method method) {
  SHADOWKV_ASSERT(rows >= 1 && cols >= 1 && rank >= 1 && rank <= cols);
  return method == factorization_method::svd ? svd_basis(keys, rows, cols, rank) : gram_basis(keys, rows, cols, rank);
}

void gemm_row_major(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc,
                    std::int64_t rows, std::int64_t inner, std::int64_t cols_out) {
  if (rows == 0 || cols_out == 0) return;
  // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ.
  const int m = as_lapack_int(cols_out);
  const int n = as_lapack_int(rows);
  const int k = as_lapack_int(inner);
  const int ldb_i = as_lapack_int(ldb);
  const int lda_i = as_lapack_int(lda);
  const int ldc_i = as_lapack_int(ldc);
  const float one = 1.0F;
  const float zero = 0.0F;
  sgemm_("N", "N", &m, &n, &k, &one, b, &ldb_i, a, &lda_i, &zero, c, &ldc_i, 1, 1);
}

std::vector<float> project_onto_basis(const float* keys, std::int64_t rows, std::int64_t cols, const float* basis,
                                      int rank) {
  std::vector<float> coefficients(static_cast<std::size_t>(rows) * static_cast<std::size_t>(rank));
  if (rows == 0) return coefficients;
  // Column-major Aᵀ[rank, rows] = B[rank, cols] · Kᵀ; B row-major is column-major Bᵀ[cols, rank].
  const int m = rank;
  const int n = as_lapack_int(rows);
  const int k = as_lapack_int(cols);
  const float one = 1.0F;
  const float zero = 0.0F;
  sgemm_("T", "N", &m, &n, &k, &one, basis, &k, keys, &k, &zero, coefficients.data(), &m, 1, 1);
  return coefficients;
}

}  // namespace shadowkv::detail
