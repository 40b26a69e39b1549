// Vector helpers shared by the compiled CPU kernels (paged_decode.cpp, fused_ops.cpp).
//
// GCC vector types of 16 floats: one AVX-512 register, two AVX2 or four SSE ones, whichever
// target clone (PDD_CLONES) the including function is built for.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pdd_vec {

typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned access
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

#define PDD_INLINE __attribute__((always_inline)) inline

PDD_INLINE vec16 load16(const float* p) { return *reinterpret_cast<const vec16u*>(p); }
PDD_INLINE void store16(float* p, vec16 v) { *reinterpret_cast<vec16u*>(p) = v; }
PDD_INLINE vec16 splat(float x) { return vec16{} + x; }

PDD_INLINE float hsum(vec16 v) {
  const vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

PDD_INLINE float hmax(vec16 v) {
  float m = v[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, v[j]);
  return m;
}

PDD_INLINE float dot(const float* a, const float* b, int64_t n) {
  vec16 part = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) part += load16(a + d) * load16(b + d);
  float s = hsum(part);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// acc += p * v over n floats
PDD_INLINE void axpy(float* acc, float p, const float* v, int64_t n) {
  int64_t d = 0;
  const vec16 pv = splat(p);
  for (; d + kLanes <= n; d += kLanes) store16(acc + d, load16(acc + d) + pv * load16(v + d));
  for (; d < n; ++d) acc[d] += p * v[d];
}

// exp for x <= 0 (a score minus the running max), within ~2 ulp of expf: Cephes' polynomial on
// x = n ln2 + r. Inputs below -87.3 give ~1e-38 instead of 0: nothing next to the max's own 1.
PDD_INLINE vec16 exp_nonpositive(vec16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const vec16 t = x * 1.44269504088896341f + 0.5f;  // floor(t) = round(x / ln2)
  ivec16 n = __builtin_convertvector(t, ivec16);     // truncates toward zero ...
  n += (__builtin_convertvector(n, vec16) > t);      // ... so step down where t < 0 (true is -1)
  const vec16 nf = __builtin_convertvector(n, vec16);
  const vec16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln2, ln2 in two parts
  vec16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * reinterpret_cast<vec16>((n + 127) << 23);  // * 2^n
}

}  // namespace pdd_vec

// NOTE: on x86-64 each is built for AVX-512, AVX2+FMA and the baseline, picked at load time by
// the CPU, so a build cache shared between machines stays correct (no -march=native).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PDD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PDD_CLONES
#endif
