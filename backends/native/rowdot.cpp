// y = x @ w.T for a few rows of x (float32, both contiguous): two products, `rowdot` and `rowblock`.
//
// Why products of our own: at one to a few rows a decode or verify step's products are
// matrix-vector products over weights that come from memory, not cache, and the libraries' kernels
// read a small matrix (0.6-10 MB) at a third to a half of the machine's streaming bandwidth
// (measured on a 2-core AVX-512 AMD EPYC, Zen 4: 7-16 GB/s against 22 GB/s for torch.sum over the
// same flushed matrix).
// - rowdot streams w row by row: each weight row is multiplied by every row of x while it is in
//   registers or L1.
// - rowblock takes several weight rows at once and prefetches the next ones (below, where it is).
// The rows of w are split between torch's threads (at::parallel_for). Both are candidates among the
// others; backends/native/kernels.py measures which one wins on the machine it runs on, per weight
// shape and row count, and they are compiled there (-march=native).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the lane sums below (AVX-512, AVX); other CPUs take the plain path
#endif

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

// rowblock: NB weight rows x R rows of x at once, NB x R accumulators in registers (each weight
// vector loaded once for R products, each x vector once for NB), and the weight rows NB x
// PREFETCH_BLOCKS ahead asked of memory while these are multiplied. Why: from 3-4 rows of x on, the
// row-by-row kernels above spend enough time per weight row that the hardware prefetcher falls
// behind, and the product reads memory at half the streaming rate (262144 x 640 float32, 5 rows,
// flushed: 48 ms against 34-37 ms for this one on a 2-core AVX-512 AMD EPYC, Zen 4); at 1-3 rows
// it is the slower one there. Both are candidates: kernels.py measures which wins on the machine.
#if defined(__AVX512F__)
constexpr int LANES = 16, VECTOR_REGISTERS = 32;
typedef float lanes_t __attribute__((vector_size(64)));
typedef float lanes_unaligned_t __attribute__((vector_size(64), aligned(4)));
inline float lanes_sum(lanes_t a) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(a)); }
#elif defined(__AVX__)
constexpr int LANES = 8, VECTOR_REGISTERS = 16;
typedef float lanes_t __attribute__((vector_size(32)));
typedef float lanes_unaligned_t __attribute__((vector_size(32), aligned(4)));
inline float lanes_sum(lanes_t a) {
  const __m256 v = reinterpret_cast<__m256>(a);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else  // SSE, or a CPU that is not x86: GCC's vector extension alone
constexpr int LANES = 4, VECTOR_REGISTERS = 16;
typedef float lanes_t __attribute__((vector_size(16)));
typedef float lanes_unaligned_t __attribute__((vector_size(16), aligned(4)));
inline float lanes_sum(lanes_t a) { return a[0] + a[1] + a[2] + a[3]; }
#endif
constexpr int PREFETCH_BLOCKS = 2;  // 1, 2 and 4 blocks ahead measured alike at 5-8 rows; no prefetch 25-30% slower

inline lanes_t load_lanes(const float* p) { return *reinterpret_cast<const lanes_unaligned_t*>(p); }

// as many weight rows per block (up to 4) as leave the accumulators, the weight vectors and one x
// vector in registers: with AVX-512's 32 registers 4 at 1-6 rows of x and 3 at 7-8; with AVX2's 16,
// 4 at 1-2 rows down to 1 at 7-8
constexpr int weight_rows_per_block(int r) { return std::max(1, std::min(4, (VECTOR_REGISTERS - 1) / (r + 1))); }

template <int NB, int R>
inline void block(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t n) {
  lanes_t acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = lanes_t{};
  const float* ahead[NB];  // the rows to prefetch, the last row of w at its end
  for (int b = 0; b < NB; ++b) ahead[b] = w + std::min(n + b + PREFETCH_BLOCKS * NB, n_dim - 1) * k_dim;
  int64_t k = 0;
  for (; k + LANES <= k_dim; k += LANES) {
    lanes_t wv[NB];
    for (int b = 0; b < NB; ++b) {
      wv[b] = load_lanes(w + (n + b) * k_dim + k);
      if (k % 16 == 0) __builtin_prefetch(ahead[b] + k, 0, 0);  // once per 64-byte line
    }
    for (int r = 0; r < R; ++r) {
      const lanes_t xv = load_lanes(x + r * k_dim + k);
      for (int b = 0; b < NB; ++b) acc[b][r] += wv[b] * xv;
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      float s = lanes_sum(acc[b][r]);
      for (int64_t t = k; t < k_dim; ++t) s += w[(n + b) * k_dim + t] * x[r * k_dim + t];
      y[r * n_dim + n + b] = s;
    }
}

template <int R>
void rows_in_blocks(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin,
                    int64_t end) {
  constexpr int NB = weight_rows_per_block(R);
  int64_t n = begin;
  for (; n + NB <= end; n += NB) block<NB, R>(w, x, y, k_dim, n_dim, n);
  for (; n < end; ++n) block<1, R>(w, x, y, k_dim, n_dim, n);
}

// x [M, K] and w [N, K], float32, checked; returns an empty y [M, N]
torch::Tensor checked_output(torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [M, K] and w [N, K]");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(w.is_contiguous(), name, ": a contiguous weight");
  x = x.contiguous();
  return torch::empty({x.size(0), w.size(0)}, x.options());
}

// kernel<R>(w, x, y, k_dim, n_dim, begin, end) for R = 1..8, over the weight rows split between
// torch's threads, 8 rows of x at a time (w is read once per 8)
template <template <int> class Kernel>
torch::Tensor product(torch::Tensor x, torch::Tensor w, const char* name) {
  auto y = checked_output(x, w, name);
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = w.size(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += 8) {
      const float* xm = xp + m0 * k_dim;
      float* ym = yp + m0 * n_dim;
      switch (std::min<int64_t>(8, m_dim - m0)) {
        case 1: Kernel<1>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 2: Kernel<2>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 3: Kernel<3>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 4: Kernel<4>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 5: Kernel<5>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 6: Kernel<6>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        case 7: Kernel<7>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
        default: Kernel<8>::run(wp, xm, ym, k_dim, n_dim, begin, end); break;
      }
    }
  });
  return y;
}

// row by row: rows_together at 1-2 rows of x, rows_one_by_one at 3, rows_in_vectors from 4
template <int R>
struct RowByRow {
  static void run(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin, int64_t end) {
    if constexpr (R <= 2) rows_together<R>(w, x, y, k_dim, n_dim, begin, end);
    else if constexpr (R == 3) rows_one_by_one<R>(w, x, y, k_dim, n_dim, begin, end);
    else rows_in_vectors<R>(w, x, y, k_dim, n_dim, begin, end);
  }
};

template <int R>
struct InBlocks {
  static void run(const float* w, const float* x, float* y, int64_t k_dim, int64_t n_dim, int64_t begin, int64_t end) {
    rows_in_blocks<R>(w, x, y, k_dim, n_dim, begin, end);
  }
};

}  // namespace

torch::Tensor rowdot(torch::Tensor x, torch::Tensor w) { return product<RowByRow>(x, w, "rowdot"); }
torch::Tensor rowblock(torch::Tensor x, torch::Tensor w) { return product<InBlocks>(x, w, "rowblock"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowdot", &rowdot, "y = x @ w.T, w streamed row by row");
  m.def("rowblock", &rowblock, "y = x @ w.T, w in blocks of rows with software prefetch");
}
