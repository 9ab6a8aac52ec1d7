// Helpers shared by the CPU kernels: scalar math written so that `omp simd` loops vectorise it, and the
// entry points one kernel file calls in another.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace llp {

inline float to_f(float x) { return x; }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(c10::BFloat16 x) {  // exact: a bf16 is the top half of a float32
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// exp: Cody-Waite range reduction and a degree-6 polynomial (Cephes expf, ~1 ulp). Below -87 it returns ~1e-38
// instead of 0; 2^n is applied in two halves so that it overflows to inf exactly where float32 does (x > ~88.72).
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.0f), 100.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t n1 = static_cast<int32_t>(n) / 2, n2 = static_cast<int32_t>(n) - n1;
  const int32_t e1 = (n1 + 127) << 23, e2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &e1, sizeof(s1));
  std::memcpy(&s2, &e2, sizeof(s2));
  return p * s1 * s2;
}

// paged_attention.cpp's kernel, for ops that run attention inside a larger fused step
void run_paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                         double scale, int64_t window);

}  // namespace llp
