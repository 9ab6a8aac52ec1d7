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
#include <type_traits>

namespace llp {

inline float f_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float to_f(float x) { return x; }
// Exact float16 -> float32 in integer and float ops that `omp simd` loops vectorise (c10's conversion is one
// scalar vcvtph2ps per value where F16C is on, which stops the loop from vectorising): the branch-free
// algorithm of the FP16 library, bit-identical to vcvtph2ps on all 65536 inputs (NaN payloads included).
inline float to_f(c10::Half x) {
  const uint32_t w = static_cast<uint32_t>(x.x) << 16;
  const uint32_t two_w = w + w;
  const float normalized = f_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = f_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t sub = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones for zeros and subnormals
  return f_from_bits((w & 0x80000000u) | (f_bits(denormalized) & sub) | (f_bits(normalized) & ~sub));
}
// float32 -> float16, round to nearest even, in vectorisable ops (the FP16 library's branch-free algorithm; the
// same bits as vcvtps2ph / c10's conversion, NaN -> the canonical quiet NaN 0x7E00 with the sign)
inline c10::Half half_from_f(float f) {
  const float base0 = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  const uint32_t bits = f_bits(f_from_bits((bias >> 1) + 0x07800000u) + base0);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
  return c10::Half(static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan)), c10::Half::from_bits());
}
// float32 -> bfloat16, round to nearest even, NaN -> 0x7FC0: c10's conversion without its branch, so loops
// that write bfloat16 vectorise
inline c10::BFloat16 bf16_from_f(float f) {
  const uint32_t u = f_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = 0u - static_cast<uint32_t>(f != f);
  return c10::BFloat16(static_cast<uint16_t>((0x7FC0u & nan) | (rounded & ~nan)), c10::BFloat16::from_bits());
}
// float -> T rounded to nearest even, the same bits as c10's conversions (NaN payloads aside)
template <typename T>
inline T from_f(float x) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return half_from_f(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_from_f(x);
  } else {
    return x;
  }
}
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

// f(T{}) for the float dtype t of a kernel's tensors; any other dtype is an error naming the kernel
template <typename F>
void dispatch_float_types(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype ", t, " not supported (float32, bfloat16, float16)");
  }
}

// int8_linear.cpp's kernel: (x @ qw^T) * scale (+ bias), for the fused ops of layer_ops.cpp over int8 weights
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);

// int8_linear's rows [o0, o1) of y = (x @ w^T) * scale (+ bias) on the calling thread (float32, bfloat16, float16)
template <typename T>
void int8_rows(const T* x, const int8_t* w, const float* scale, const T* bias, T* y, int64_t M, int64_t K, int64_t O,
               int64_t o0, int64_t o1);

// int4_linear.cpp's rows [o0, o1) of y = x @ W^T (+ bias), W = code * d + z in groups of `group` weights of a row
// (z null: symmetric, z = -8 d), on the calling thread; S is the scales' dtype (float16 or bfloat16); q8: x's rows
// quantized to int8 in blocks of 32 first (llama.cpp's Q4_0 x Q8_0 arithmetic); gemm: with q8, from 16 rows on
// the rows in O's whole tiles of 16 (AVX2: 8) run the GEMM, each row as int4_linear computes it (not
// batch-invariant: see int4_linear.cpp)
template <typename T, typename S>
void int4_rows(const T* x, const uint8_t* w, const S* d, const S* z, int64_t group, const T* bias, T* y, int64_t M,
               int64_t K, int64_t O, int64_t o0, int64_t o1, bool q8, bool gemm = false);
// q8: x's M rows quantized once on this thread for the int4_rows calls that follow with this x (until
// int4_release; without it each call quantizes x itself)
template <typename T>
void int4_prepare(const T* x, int64_t M, int64_t K);
void int4_release();
// the most rows for which int4_rows beats widening the weights for a GEMM in this build: 64 with the 512-bit int4
// tile, else 16 (measured: docs/results/2026-12-07-avx512-streaming.md)
int64_t int4_kernel_max_rows();

// The KV caches the kernels take: the activations' dtype, or float16 / bfloat16 under float32 activations (half
// the bytes a decode step streams per cached token; attention still runs in float32)
inline bool kv_cache_supported(at::ScalarType act, at::ScalarType cache) {
  return cache == act || (act == at::kFloat && (cache == at::kHalf || cache == at::kBFloat16));
}
// n values from src into a cache of dtype `cache` at element offset `at` (rounded to nearest even when it is
// narrower: what at::Tensor::to and index_copy_ of the converted rows give)
template <typename T>
inline void store_kv(void* cache, at::ScalarType cache_type, int64_t at, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (cache_type == at::kHalf) {
      c10::Half* d = static_cast<c10::Half*>(cache) + at;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) d[i] = half_from_f(src[i]);
      return;
    }
    if (cache_type == at::kBFloat16) {
      c10::BFloat16* d = static_cast<c10::BFloat16*>(cache) + at;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) d[i] = bf16_from_f(src[i]);
      return;
    }
  }
  std::memcpy(static_cast<T*>(cache) + at, src, sizeof(T) * n);
}

// paged_attention.cpp: its argument checks, and kv heads [h0, h1) of the queries of sequences [s0, s1) on the
// calling thread
void check_paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& slots,
                           const at::Tensor& ctx_lens, int64_t q_len);
void paged_attention_heads(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                           double scale, int64_t window, int64_t h0, int64_t h1, int64_t s0, int64_t s1);

// paged_attention.cpp's kernel, for ops that run attention inside a larger fused step
void run_paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                         double scale, int64_t window);

}  // namespace llp
