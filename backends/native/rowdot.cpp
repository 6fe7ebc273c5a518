// y = x @ w.T for a few rows of x (float32, both contiguous), each row of w read from memory once.
//
// Why a product of our own: at one or two rows a decode step's products are matrix-vector products
// over weights that come from memory, not cache, and the libraries' kernels read a small matrix
// (0.6-10 MB) at a third to a half of the machine's streaming bandwidth (measured on a 2-core
// AVX-512 AMD EPYC, Zen 4: 7-16 GB/s against 22 GB/s for torch.sum over the same flushed matrix).
// This one streams w row by row: each weight row is multiplied by every row of x while it is in
// registers or L1, the rows of w split between torch's threads (at::parallel_for).
// It is one candidate among the others; backends/native/kernels.py measures which one wins on the
// machine it runs on, per weight shape and row count, and it is compiled there (-march=native).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int V = 16;  // lanes per accumulator: one AVX-512 register, two AVX2 ones

// One or two rows of x: R x V accumulators, each weight element loaded once for all of them.
template <int R>
void rows_together(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin,
                   int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* wr = w + n * k_dim;
    float acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = 0.f;
    int64_t k = 0;
    for (; k + V <= k_dim; k += V) {
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * k_dim + k;
#pragma omp simd
        for (int v = 0; v < V; ++v) acc[r][v] += wr[k + v] * xr[v];
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int v = 0; v < V; ++v) s += acc[r][v];
      for (int64_t t = k; t < k_dim; ++t) s += wr[t] * x[r * k_dim + t];
      y[r * n_dim + n] = s;
    }
  }
}

// Three rows of x: one dot product after another over the weight row, which stays in L1 between
// them (R x V accumulators at once, as above, measured slower here).
template <int R>
void rows_one_by_one(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin,
                     int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* wr = w + n * k_dim;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < k_dim; ++k) s += wr[k] * xr[k];
      y[r * n_dim + n] = s;
    }
  }
}

// Four rows of x and more: the same with one explicit 16-float vector per row (GCC's vector
// extension: an AVX-512 register, or two AVX2 ones), R independent chains of multiply-adds where
// one dot product after another waits on a single accumulator (measured 10-25% faster at 5 and 8
// rows on a 2-core AVX-512 AMD EPYC, slower at 3).
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));

inline vec16 load16(const float* p) { return *reinterpret_cast<const vec16_unaligned*>(p); }

template <int R>
void rows_in_vectors(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin,
                     int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* wr = w + n * k_dim;
    vec16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vec16{};
    int64_t k = 0;
    for (; k + V <= k_dim; k += V) {
      const vec16 wv = load16(wr + k);
      for (int r = 0; r < R; ++r) acc[r] += wv * load16(x + r * k_dim + k);
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int v = 0; v < V; ++v) s += acc[r][v];
      for (int64_t t = k; t < k_dim; ++t) s += wr[t] * x[r * k_dim + t];
      y[r * n_dim + n] = s;
    }
  }
}

}  // namespace

torch::Tensor rowdot(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rowdot: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rowdot: x [M, K] and w [N, K]");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rowdot: CPU tensors only");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "rowdot: a contiguous weight");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = w.size(0);
  auto y = torch::empty({m_dim, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += 8) {  // 8 rows of x at a time: w is read once per 8
      const float* xm = xp + m0 * k_dim;
      float* ym = yp + m0 * n_dim;
      switch (std::min<int64_t>(8, m_dim - m0)) {
        case 1: rows_together<1>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 2: rows_together<2>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 3: rows_one_by_one<3>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 4: rows_in_vectors<4>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 5: rows_in_vectors<5>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 6: rows_in_vectors<6>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 7: rows_in_vectors<7>(wp, xm, ym, k_dim, n_dim, begin, end); break;
        default: rows_in_vectors<8>(wp, xm, ym, k_dim, n_dim, begin, end); break;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rowdot", &rowdot, "y = x @ w.T, w streamed row by row"); }
