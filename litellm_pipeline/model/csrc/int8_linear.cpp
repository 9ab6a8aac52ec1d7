// int8 weight-only linear for ``layer_ops: cpu_int8``:
//
//   y[M, O] = (x[M, K] @ qw[O, K]^T) * scale[O] (+ bias[O])
//
// x is float32, bfloat16 or float16; qw int8 (symmetric, one scale per output channel, see int8_ops.py); scale
// float32 [O]; y in x's dtype. Every output is one whole-K float32 dot product of the exactly widened operands
// (int8 -> int32 -> float32 and 16-bit -> float32 are exact), then scaled, biased and rounded once to x's dtype.
// The order of the arithmetic for one output never depends on M or on which tile computed it, so a row's result
// is the same alone or in any batch (batch-invariant).
//
// AVX2 (+FMA, F16C; also what AVX-512 CPUs run here): a tile is R weight rows x up to 4 input rows of 8-lane
// float32 accumulators, so each weight byte is read from memory once per tile and widened once, then reused from
// registers for the other input rows (the structure of small_linear in layer_ops.cpp). Threads take runs of
// output rows (at::parallel_for). Other CPUs (or a generic build) run the scalar loop, same arithmetic contract.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cpu_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLP_I8_AVX2 1
#else
#define LLP_I8_AVX2 0
#endif

namespace {

using llp::to_f;

template <typename T>
inline T i8_from_f(float x) { return llp::from_f<T>(x); }  // round to nearest even

// one output: the float32 sum scaled and biased (one fma) and rounded once to T
template <typename T>
inline T i8_finish(float s, float scale, const T* bias, int64_t o) {
  // explicit fma: every instantiation rounds alike, whatever contraction the compiler would choose
  return i8_from_f<T>(bias ? std::fma(s, scale, to_f(bias[o])) : s * scale);
}

// ------------------------------------------------------------------------------------------------------ scalar
// y[m, o] for all M rows and output rows [o0, o1); fma in the same per-output order as the vector path's tail
template <typename T>
void i8_rows_scalar(const T* x, const int8_t* w, const float* scale, const T* bias, T* y, int64_t M, int64_t K,
                    int64_t O, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wr = w + o * K;
    for (int64_t m = 0; m < M; ++m) {
      const T* xr = x + m * K;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(to_f(xr[k]), static_cast<float>(wr[k]), s);
      y[m * O + o] = i8_finish<T>(s, scale[o], bias, o);
    }
  }
}

#if LLP_I8_AVX2
// ------------------------------------------------------------------------------------------------------- AVX2
inline __m256 i8_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 i8_load8(const c10::BFloat16* p) {  // exact: a bf16 is the top half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 i8_load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 int8 weights as float32 (exact)
inline __m256 i8_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float i8_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 16 ymm registers: MC x R accumulators, R widened weight vectors and one input vector
constexpr int kI8TileR = 2, kI8TileR1 = 8;  // weight rows per tile: several input rows / one input row

// MC input rows x R weight rows over the whole K: 8 lanes at a time, a scalar fma tail; each output's sum is
// hsum8(lanes) + tail whatever MC and R are (so a row's result does not depend on its batch)
template <typename T, int MC, int R>
inline void i8_tile(const T* __restrict x, int64_t K, const int8_t* __restrict w, const float* __restrict scale,
                    const T* __restrict bias, int64_t o, T* __restrict y, int64_t ldy) {
  __m256 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  // 8 lanes of every (input row, weight row) pair into its accumulator, in ascending k
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    if constexpr (MC == 1) {
      const __m256 xv = i8_load8(x + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[0][r] = _mm256_fmadd_ps(xv, i8_w8(w + r * K + k), acc[0][r]);
    } else {
      __m256 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = i8_w8(w + r * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m256 xv = i8_load8(x + m * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
  };
  int64_t k = 0;
  // a cache line of every weight row per block, and as many lines of the next tile (the R rows after these,
  // contiguous in memory) asked for first, in memory order: each block asks for the next R lines of that run, so
  // the next tile arrives as one sequential stream while this one computes. An int8 row advances 4x slower than a
  // float32 one, and R short strided rows (a 768-wide row is 12 lines) stream poorly on their own: memory order
  // measured 20 -> 30 GB/s on 768-wide matrices (2-core AMD EPYC). Prefetching past the tensor's end is harmless.
  for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + R * K + k * R + r * 64), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int j = 0; j < 64; j += 8) step(k + j);
  }
  for (; k + 8 <= K; k += 8) step(k);
  float tail[MC][R] = {};
  for (; k < K; ++k)
    for (int m = 0; m < MC; ++m)
      for (int r = 0; r < R; ++r)
        tail[m][r] = std::fma(to_f(x[m * K + k]), static_cast<float>(w[r * K + k]), tail[m][r]);
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = i8_finish<T>(i8_hsum8(acc[m][r]) + tail[m][r], scale[o + r], bias, o + r);
}

// y[m, o] for M rows (M <= kMB) and output rows [o0, o1): kI8TileR weight rows x 4 input rows per tile
template <typename T>
inline void i8_block(const T* x, int64_t M, int64_t K, const int8_t* w, const float* scale, const T* bias, T* y,
                     int64_t O, int64_t o0, int64_t o1) {
  constexpr int R = kI8TileR;
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    const int8_t* wt = w + o * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) i8_tile<T, 4, R>(x + m * K, K, wt, scale, bias, o, y + m * O + o, O);
    switch (M - m) {
      case 1: i8_tile<T, 1, R>(x + m * K, K, wt, scale, bias, o, y + m * O + o, O); break;
      case 2: i8_tile<T, 2, R>(x + m * K, K, wt, scale, bias, o, y + m * O + o, O); break;
      case 3: i8_tile<T, 3, R>(x + m * K, K, wt, scale, bias, o, y + m * O + o, O); break;
      default: break;
    }
  }
  for (; o < o1; ++o)
    for (int64_t m = 0; m < M; ++m) i8_tile<T, 1, 1>(x + m * K, K, w + o * K, scale, bias, o, y + m * O + o, O);
}

template <typename T>
void i8_rows_avx2(const T* x, const int8_t* w, const float* scale, const T* bias, T* y, int64_t M, int64_t K,
                  int64_t O, int64_t o0, int64_t o1) {
  if (M == 1) {  // one input row: 8 weight rows per tile keep more memory streams and FMA chains in flight
    int64_t o = o0;
    for (; o + kI8TileR1 <= o1; o += kI8TileR1) i8_tile<T, 1, kI8TileR1>(x, K, w + o * K, scale, bias, o, y + o, O);
    for (; o < o1; ++o) i8_tile<T, 1, 1>(x, K, w + o * K, scale, bias, o, y + o, O);
    return;
  }
  // many rows: blocks of kOB weight rows x kMB input rows, so a weight block stays in cache while the input
  // blocks pass; blocking changes what is cached, never the arithmetic of an output
  constexpr int64_t kMB = 48, kOB = 64;
  for (int64_t ob = o0; ob < o1; ob += kOB) {
    const int64_t oe = std::min(o1, ob + kOB);
    for (int64_t mb = 0; mb < M; mb += kMB)
      i8_block<T>(x + mb * K, std::min(kMB, M - mb), K, w, scale, bias, y + mb * O, O, ob, oe);
  }
}
#endif  // LLP_I8_AVX2

std::string int8_linear_isa() { return LLP_I8_AVX2 ? "avx2" : "scalar"; }

at::Tensor int8_linear_impl(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias, bool force_scalar) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2 && x.size(1) == qw.size(1), "int8_linear: x [M, K], qw [O, K] expected");
  TORCH_CHECK(qw.scalar_type() == at::kChar, "int8_linear: qw must be int8, got ", qw.scalar_type());
  TORCH_CHECK(qw.is_contiguous(), "int8_linear: qw must be contiguous");
  const int64_t O = qw.size(0), K = qw.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == O && scale.is_contiguous(),
              "int8_linear: scale must be a contiguous float32 [O] tensor");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == O && bias->scalar_type() == x.scalar_type(),
                "int8_linear: bias must be an [O] tensor of x's dtype");
  }
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  if (M == 0 || O == 0) return y;
  // output rows per task: a multiple of 8, and enough of them that a task reads >= ~32 KB of weights
  const int64_t grain = std::max<int64_t>(1, (32768 + K - 1) / std::max<int64_t>(K, 1) / 8);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const int8_t* wp = qw.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    const T* bp = bc.defined() ? bc.data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, (O + 7) / 8, grain, [&](int64_t b, int64_t e) {
      const int64_t o0 = b * 8, o1 = std::min(O, e * 8);
#if LLP_I8_AVX2
      if (!force_scalar) return i8_rows_avx2<T>(xp, wp, sp, bp, yp, M, K, O, o0, o1);
#endif
      i8_rows_scalar<T>(xp, wp, sp, bp, yp, M, K, O, o0, o1);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "int8_linear: x dtype ", x.scalar_type(), " not supported (float32, bfloat16, float16)");
  }
  return y;
}


// the scalar loop on any build (what CPUs without AVX2 run): the tests compare it with the vector kernel
at::Tensor int8_linear_scalar(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& bias) {
  return int8_linear_impl(x, qw, scale, bias, true);
}

}  // namespace

// y = (x @ qw^T) * scale (+ bias): the vector kernel where the build has one, else the scalar loop
at::Tensor llp::int8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  return int8_linear_impl(x, qw, scale, bias, false);
}

// output rows [o0, o1) of y on the calling thread: what int8_linear runs on each of its threads
template <typename T>
void llp::int8_rows(const T* x, const int8_t* w, const float* scale, const T* bias, T* y, int64_t M, int64_t K,
                    int64_t O, int64_t o0, int64_t o1) {
#if LLP_I8_AVX2
  i8_rows_avx2<T>(x, w, scale, bias, y, M, K, O, o0, o1);
#else
  i8_rows_scalar<T>(x, w, scale, bias, y, M, K, O, o0, o1);
#endif
}
template void llp::int8_rows<float>(const float*, const int8_t*, const float*, const float*, float*, int64_t,
                                    int64_t, int64_t, int64_t, int64_t);
template void llp::int8_rows<c10::BFloat16>(const c10::BFloat16*, const int8_t*, const float*, const c10::BFloat16*,
                                            c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void llp::int8_rows<c10::Half>(const c10::Half*, const int8_t*, const float*, const c10::Half*, c10::Half*,
                                        int64_t, int64_t, int64_t, int64_t, int64_t);

TORCH_LIBRARY_FRAGMENT(litellm_pipeline_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qw, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_linear_scalar(Tensor x, Tensor qw, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_linear_isa", &int8_linear_isa);
}

TORCH_LIBRARY_IMPL(litellm_pipeline_cpu, CPU, m) {
  m.impl("int8_linear", &llp::int8_linear);
  m.impl("int8_linear_scalar", &int8_linear_scalar);
}
