// Fused elementwise ops of a Llama decoder layer on CPU (float32), one pass over memory each:
//
//   rms_norm(x, w, eps)                 -> (x * rsqrt(mean(x^2) + eps)) * w          [N, H]
//   add_rms_norm_(residual, delta, w, eps): residual += delta in place, returns rms_norm(residual)
//   silu_mul(x [N, 2I])                 -> silu(x[:, :I]) * x[:, I:]                 [N, I]
//   rope_(x [N, R, D], cos [N, D], signed_sin [N, D]): in place,
//       x[n, r, d] = x[n, r, d] * cos[n, d] + x[n, r, (d + D/2) % D] * signed_sin[n, d]
//
// Eager PyTorch runs these as ~20 ops a layer (RMSNorm alone decomposes into pow, mean, add,
// rsqrt, mul, mul), each a dispatch and, for prefill, a full pass over a fresh tensor: at a
// decode batch the dispatches cost more than the arithmetic. vLLM's CPU backend fuses the same
// ones (fused_add_rms_norm, silu_and_mul, rotary_embedding).
//
// NOTE: fp-contract is off in this file: rope_ must round as transformers' `x * cos +
// rotate_half(x) * sin` does (two products, then the sum), bit for bit; a fused multiply-add
// would round once. The rest only loses the FMA's speed, and these ops are bound by memory.
// Rows are split between threads only when a call is large (prefill): waking a sleeping OpenMP
// worker costs more than a decode batch's whole norm.
// Registered as torch.ops.pdd.* (no pybind, so Python headers are not needed).

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace {

using namespace pdd_vec;

// Elements per thread below which a call stays on the calling thread.
constexpr int64_t kParallelGrain = 1 << 16;

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(1, row_elems)); }

// One row: r = x (+ delta, stored back into x when delta is given); out = (r * rstd) * w.
PDD_CLONES void norm_row(float* x, const float* delta, const float* w, float* out, int64_t H, float eps) {
  vec16 part = {};
  int64_t d = 0;
  if (delta != nullptr) {
    for (; d + kLanes <= H; d += kLanes) {
      const vec16 r = load16(x + d) + load16(delta + d);
      store16(x + d, r);
      part += r * r;
    }
  } else {
    for (; d + kLanes <= H; d += kLanes) {
      const vec16 r = load16(x + d);
      part += r * r;
    }
  }
  float ss = hsum(part);
  for (; d < H; ++d) {
    const float r = delta != nullptr ? (x[d] = x[d] + delta[d]) : x[d];
    ss += r * r;
  }
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const vec16 rv = splat(rstd);
  d = 0;
  for (; d + kLanes <= H; d += kLanes) store16(out + d, load16(x + d) * rv * load16(w + d));
  for (; d < H; ++d) out[d] = x[d] * rstd * w[d];
}

// silu(g) * u over n floats: silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) (never overflows).
PDD_CLONES void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t d = 0;
  const vec16 one = splat(1.f), zero = {};
  for (; d + kLanes <= n; d += kLanes) {
    const vec16 x = load16(g + d);
    const vec16 neg_abs = x < zero ? x : -x;
    const vec16 e = exp_nonpositive(neg_abs);  // exp(-|x|) in (0, 1]
    const vec16 sig = (x < zero ? e : one) / (one + e);
    store16(out + d, x * sig * load16(u + d));
  }
  for (; d < n; ++d) {
    const float x = g[d];
    out[d] = x / (1.f + std::exp(-x)) * u[d];
  }
}

// One token's rows: x[r, d] = x[r, d] * c[d] + x[r, (d + half) % D] * s[d], r < R.
PDD_CLONES void rope_token(float* x, int64_t row_stride, int64_t R, const float* c, const float* s, int64_t D,
                           float* tmp) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; ++r) {
    float* row = x + r * row_stride;
    for (int64_t d = 0; d < D; ++d) tmp[d] = row[d];
    for (int64_t d = 0; d < half; ++d) row[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
    for (int64_t d = half; d < D; ++d) row[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
  }
}

void check_float_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name, " must be a CPU float32 tensor");
}

at::Tensor norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                const char* op) {
  check_float_cpu(x, op, "x");
  check_float_cpu(weight, op, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [N, H] tensor");
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), op, ": weight must be [", H, "]");
  const float* d_ptr = nullptr;
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    check_float_cpu(d, op, "delta");
    TORCH_CHECK(d.sizes() == x.sizes(), op, ": delta must have x's shape");
    d_ptr = d.data_ptr<float>();
  }
  at::Tensor out = at::empty({N, H}, x.options());
  float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(H), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n)
      norm_row(x_ptr + n * H, d_ptr ? d_ptr + n * H : nullptr, w_ptr, o_ptr + n * H, H, e);
  });
  return out;
}

}  // namespace

namespace pdd_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // NOTE: x is only read here (norm_row writes x only when given a delta).
  return norm(x.contiguous(), c10::nullopt, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm(residual, delta, weight, eps, "add_rms_norm_");
}

at::Tensor silu_mul(const at::Tensor& x_in) {
  check_float_cpu(x_in, "silu_mul", "x");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "silu_mul: x must be [N, 2I]");
  const at::Tensor x = x_in.contiguous();
  const int64_t N = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({N, I}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  at::parallel_for(0, N, grain_rows(3 * I), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) silu_mul_row(x_ptr + n * 2 * I, x_ptr + n * 2 * I + I, o_ptr + n * I, I);
  });
  return out;
}

void rope_(at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_float_cpu(x, "rope_", "x");
  check_float_cpu(cos_in, "rope_", "cos");
  check_float_cpu(sin_in, "rope_", "signed_sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) >= x.size(2), "rope_: x must be [N, R, D] with unit-stride D");
  const int64_t N = x.size(0), R = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && D <= 1024, "rope_: head dim must be even and at most 1024, got ", D);
  const at::Tensor c = cos_in.contiguous(), s = sin_in.contiguous();
  TORCH_CHECK(c.numel() == N * D && s.numel() == N * D, "rope_: cos and signed_sin must hold [N, D] = [", N, ", ", D,
              "]");
  float* x_ptr = x.data_ptr<float>();
  const float* c_ptr = c.data_ptr<float>();
  const float* s_ptr = s.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, N, grain_rows(R * D), [&](int64_t lo, int64_t hi) {
    float tmp[1024];
    for (int64_t n = lo; n < hi; ++n) rope_token(x_ptr + n * s0, s1, R, c_ptr + n * D, s_ptr + n * D, D, tmp);
  });
}

}  // namespace pdd_ops

TORCH_LIBRARY_FRAGMENT(pdd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
}

TORCH_LIBRARY_IMPL(pdd, CPU, m) {
  m.impl("rms_norm", &pdd_ops::rms_norm);
  m.impl("add_rms_norm_", &pdd_ops::add_rms_norm_);
  m.impl("silu_mul", &pdd_ops::silu_mul);
  m.impl("rope_", &pdd_ops::rope_);
}
