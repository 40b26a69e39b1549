// Decode-sized matmuls (a few rows, every weight read from memory once a step) on weights laid out in
// 16-column panels, with the next 32 KB of the weight stream prefetched while the FMAs run.
//
// Why: a decode step multiplies up to 64 rows by every weight of the model, so the weights stream
// from DRAM once a step (the benchmark model's 191 MB; the caches hold none of it). oneDNN's GEMM at
// 16 rows runs the benchmark model's projections at 55-70 % of this host's FMA peak from DRAM,
// against ~100 % when the same weight sits in L3: the core waits on memory between its FMAs.
// Here each thread walks runs of ~256 KB of panels, each one sequential stream, and prefetches
// 32 KB ahead into L2; measured at 16 rows (min of 12 interleaved rounds, two threads): the LM
// head 2.9 against 4.0 ms, gate_up 310 against 430 us, down 190 against 210 us. The runs go to
// whichever thread is free (an atomic counter), not one fixed half to each: on a host whose other
// processes wake on its cores (a one-host stack's frontends) a preempted thread used to hold up
// the whole matmul; measured, decode steps in-process beside a load of ~27 % of one core: 17.9-19.9
// ms against 23.0 with fixed halves (14.1-15.4 either way without the load).
//
// Layout: panels [ceil(N / 16), K, 16]: panels[p, k, j] = W[k, 16 p + j] (W = weight_t [K, N]),
// the last panel zero-padded. y[m, n] = sum over k, in order, of x[m, k] * W[k, n] (one fused
// multiply-add per k, as oneDNN's own order for K <= 512), then + bias[n].
// Registered as torch.ops.pdd.panel_linear and torch.ops.pdd.panel_gemm_supported (AVX-512F only:
// elsewhere the engine keeps oneDNN, see pdd/engine/panel_gemm.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define PDD_PANEL_GEMM 1
#else
#define PDD_PANEL_GEMM 0  // elsewhere panel_gemm_supported() is false and the engine keeps oneDNN
#endif

namespace {

constexpr int64_t kPanel = 16;          // columns a panel (one AVX-512 register of floats)
constexpr int64_t kRowBlock = 16;       // rows a pass over a panel: 16 accumulators
constexpr int64_t kPrefetchRows = 512;  // k-rows of a panel prefetched ahead: 32 KB
constexpr int64_t kRunBytes = 256 * 1024;  // a run of panels a thread takes at a time

struct Job {
  const float* xt;      // x transposed: [K, M]
  const float* panels;  // [NP, K, 16]
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N]
  int64_t M, K, N;
};

#if PDD_PANEL_GEMM
#define PDD_AVX512 __attribute__((target("avx512f")))

// y[m0 : m0 + R, 16 p : 16 p + 16] of one panel; the first row block also prefetches ahead.
template <int R>
PDD_AVX512 __attribute__((always_inline)) inline void panel_rows(const Job& j, int64_t p, int64_t m0, bool prefetch,
                                                                 const float* stop) {
  const float* w = j.panels + p * j.K * kPanel;
  const float* x = j.xt + m0;
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < j.K; ++k) {
    // NOTE: only within this thread's run of panels (`stop`): the next run may be another's.
    const float* ahead = w + (k + kPrefetchRows) * kPanel;
    if (prefetch && ahead < stop) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    const __m512 b = _mm512_loadu_ps(w + k * kPanel);
    const float* xk = x + k * j.M;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), b, acc[r]);
  }
  const int64_t n0 = p * kPanel;
  const int64_t cols = std::min(kPanel, j.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bias = j.bias ? _mm512_maskz_loadu_ps(mask, j.bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 out = j.bias ? _mm512_add_ps(acc[r], bias) : acc[r];
    _mm512_mask_storeu_ps(j.y + (m0 + r) * j.N + n0, mask, out);
  }
}

PDD_AVX512 void panel_range(const Job& j, int64_t p0, int64_t p1) {
  const float* stop = j.panels + p1 * j.K * kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m0 = 0; m0 < j.M; m0 += kRowBlock) {
      const bool prefetch = m0 == 0;  // later row blocks find the panel in L1/L2
      switch (std::min(kRowBlock, j.M - m0)) {
#define PDD_ROWS(n)                      \
  case n:                                \
    panel_rows<n>(j, p, m0, prefetch, stop); \
    break;
        PDD_ROWS(1) PDD_ROWS(2) PDD_ROWS(3) PDD_ROWS(4) PDD_ROWS(5) PDD_ROWS(6) PDD_ROWS(7) PDD_ROWS(8)
        PDD_ROWS(9) PDD_ROWS(10) PDD_ROWS(11) PDD_ROWS(12) PDD_ROWS(13) PDD_ROWS(14) PDD_ROWS(15) PDD_ROWS(16)
#undef PDD_ROWS
      }
    }
  }
}

bool supported() { return __builtin_cpu_supports("avx512f"); }
#else
void panel_range(const Job&, int64_t, int64_t) {}
bool supported() { return false; }
#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(supported(), "panel_linear: needs AVX-512F");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x must be a float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "panel_linear: panels must be a contiguous float32 [NP, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), NP = panels.size(0), N = out_features;
  TORCH_CHECK(panels.size(1) == K, "panel_linear: x has ", K, " columns, the panels ", panels.size(1), " rows");
  TORCH_CHECK(N > (NP - 1) * kPanel && N <= NP * kPanel, "panel_linear: ", NP, " panels cannot hold ", N, " columns");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat),
              "panel_linear: bias must be a contiguous float32 [", N, "]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // x transposed, [K, M]: a k's rows side by side, for the broadcasts. NOTE: by hand into this
  // thread's buffer: `x.t().contiguous()` cost ~15 us a call in ATen's copy machinery (0.6 ms of a
  // decode step's 41 calls) for what is a few us of loads and stores.
  static thread_local std::vector<float> xt;
  xt.resize(static_cast<size_t>(K * M));
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = xp[m * K + k];
  const Job job{xt.data(), panels.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                y.data_ptr<float>(), M, K, N};
  // Runs of ~256 KB of panels, taken in turn by whichever thread is free: a thread the kernel
  // preempts (another process on its core) stalls only the run it holds, not the whole matmul.
  const int64_t run = std::max<int64_t>(1, kRunBytes / (K * kPanel * static_cast<int64_t>(sizeof(float))));
  const int64_t runs = (NP + run - 1) / run;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), runs), 1, [&](int64_t, int64_t) {
    for (int64_t r; (r = next.fetch_add(1, std::memory_order_relaxed)) < runs;)
      panel_range(job, r * run, std::min(NP, (r + 1) * run));
  });
  return y;
}

}  // namespace

namespace pdd_ops {
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return ::panel_linear(x, panels, bias, out_features);
}
}  // namespace pdd_ops

TORCH_LIBRARY_FRAGMENT(pdd, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_gemm_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(pdd, CPU, m) { m.impl("panel_linear", &panel_linear); }
