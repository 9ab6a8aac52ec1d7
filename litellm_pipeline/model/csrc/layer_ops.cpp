// Fused CPU layer ops for the decoder: a skinny-matrix linear and the small per-layer elementwise steps.
//
// small_linear: y[M, O] = x[M, K] @ w[O, K]^T (+ bias) for the few rows of a decode step. A general GEMM
// (MKL) is tuned for big M; at M = 1..32 it leaves memory bandwidth or FMA units idle. Here every thread
// takes a run of output rows; a tile is R weight rows x up to 4 input rows held in 16 zmm accumulators, so
// each weight byte is read from memory once and reused from L1 for the other input rows. Accumulation is
// float32 whatever the dtype; 16-bit values are widened on load (exact), or, for bf16 on a CPU with AVX-512
// BF16, multiplied in pairs by vdpbf16ps; the sum rounds once at the end, as a float32-accumulating GEMM does.
//
// The elementwise ops round where the torch reference rounds (after each product / sum in the activation
// dtype), so bf16 results match it; float32 code is compiled without FMA contraction for the same reason.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "amx_linear.h"
#include "cpu_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLP_AVX512 1
#else
#define LLP_AVX512 0
#endif
// AVX2 + FMA + F16C (most x86 CPUs without AVX-512): the same kernels on 8-lane registers
#if !LLP_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLP_AVX2 1
#else
#define LLP_AVX2 0
#endif
#define LLP_SIMD (LLP_AVX512 || LLP_AVX2)
// native 16-bit products for torch's GEMMs (oneDNN): bfloat16 with AVX-512 BF16 (AMX CPUs have it too), float16
// with AVX-512 FP16. Without them a 16-bit GEMM over many rows runs as float32 on up-converted operands.
#if LLP_AVX512 && defined(__AVX512BF16__)
#define LLP_NATIVE_BF16 1
#else
#define LLP_NATIVE_BF16 0
#endif
#if defined(__AVX512FP16__)
#define LLP_NATIVE_FP16 1
#else
#define LLP_NATIVE_FP16 0
#endif
// AVX-512 BF16 (vdpbf16ps: two bf16 products added into a float32 lane per instruction): every bfloat16 linear
// of the vector kernels (small_linear, row_linear without AMX, the decode team) runs through it where the CPU has
// it, so they all share one arithmetic. Measured on a 2-core Xeon (Sapphire Rapids): a one-row bfloat16 linear
// 1.1-2x faster than widening each value to float32 for an FMA, batch-1 bfloat16 decode 1.2-1.4x faster
// (llama125m, mixtral175m; docs/results/2026-12-04-avx512-bf16.md).
#if LLP_AVX512 && defined(__AVX512BF16__)
#define LLP_DPBF16 1
#else
#define LLP_DPBF16 0
#endif

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define LLP_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

namespace {

using llp::exp_f;
using llp::to_f;

template <typename T>
inline T from_f(float x) { return llp::from_f<T>(x); }  // round to nearest even
// the value a T holds after rounding x (identity for float)
template <typename T>
inline float rnd(float x) { return to_f(from_f<T>(x)); }

// ---------------------------------------------------------------------------------------------- small_linear
// a tile with PF set asks for the next tile's lines itself only for rows shorter than this (see the AVX2 tile),
// and a one-row linear only where its weights are larger than an L2 (they stream from memory)
constexpr int64_t kPrefetchRowBytes = 4096;
constexpr int64_t kCachedBytes = 1 << 20;
#if LLP_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return widen(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
// the two halves of 32 16-bit values as float32
inline __m512 lo16(__m512i raw, const c10::BFloat16*) { return widen(_mm512_castsi512_si256(raw)); }
inline __m512 hi16(__m512i raw, const c10::BFloat16*) { return widen(_mm512_extracti64x4_epi64(raw, 1)); }
inline __m512 lo16(__m512i raw, const c10::Half*) { return _mm512_cvtph_ps(_mm512_castsi512_si256(raw)); }
inline __m512 hi16(__m512i raw, const c10::Half*) { return _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1)); }
constexpr int kTileR = 4, kTileR1 = 8;  // weight rows per tile: several input rows / one input row

// The sums of N <= 16 vectors' lanes, each bit for bit _mm512_reduce_add_ps's (its pairs: lane i with i + 8, then
// i + 4, i + 2, i + 1; float addition commutes, so only the pairing decides the value), but four shuffle-and-add
// levels for all N at once instead of four per vector: at K = 128 (the demo model's widths) one vector's
// reduction costs about what its 8 FMA steps do (measured on a 2-core AMD EPYC, Zen 4: 256 x 128 float32 at 16
// rows 29 -> 19-23 us; the same joint sums in the 8-lane tile and in the int8 / int4 tiles measured 5-18% slower,
// so those keep one reduction per vector). Vector i's sum lands in lane reduced_lane(i) of `out`.
template <int N>
inline void reduce_many(const __m512* v, float* out) {
  static_assert(N >= 1 && N <= 16, "reduce_many: 1 to 16 vectors");
  constexpr int N1 = (N + 1) / 2, N2 = (N1 + 1) / 2, N3 = (N2 + 1) / 2;
  __m512 u[N1], s[N2], g[N3];
#pragma GCC unroll 8
  for (int j = 0; j < N1; ++j) {  // lanes 0-7: v[2j]'s i + (i + 8); lanes 8-15: v[2j + 1]'s
    const __m512 a = v[2 * j], b = 2 * j + 1 < N ? v[2 * j + 1] : a;
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
#pragma GCC unroll 4
  for (int j = 0; j < N2; ++j) {  // quarter q: vector 4j + q's (i, i + 4) sums
    const __m512 a = u[2 * j], b = 2 * j + 1 < N1 ? u[2 * j + 1] : a;
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
#pragma GCC unroll 2
  for (int j = 0; j < N3; ++j) {  // quarter q: vectors 8j + q and 8j + 4 + q, (i, i + 2) sums, two lanes each
    const __m512 a = s[2 * j], b = 2 * j + 1 < N2 ? s[2 * j + 1] : a;
    g[j] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const __m512 a = g[0], b = N3 > 1 ? g[1] : a;  // quarter q, lane t: vector 4t + q's sum
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD)));
}
constexpr int reduced_lane(int i) { return 4 * (i % 4) + i / 4; }

// the R lines of the next tile (the R rows after these, contiguous) that a step over the 64 bytes of each row at
// column k matches, asked for in memory order (see the AVX2 tile's PF)
template <typename T, int R>
inline void ask_next(const T* w, int64_t K, int64_t k) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(w + R * K + k * R + i * (64 / static_cast<int>(sizeof(T)))), _MM_HINT_T0);
}

// MC input rows x R weight rows over the whole K; writes y[m * ldy + r] (+ bias[r]). DP (bf16 only): pairs of
// products through vdpbf16ps instead of widening to float32 and one FMA each (twice the products per
// instruction; denormal inputs count as zero) -- every bfloat16 linear's arithmetic where the CPU has it (kDotBf16).
// PF (16-bit weights, and float32 ones under several input rows): as the AVX2 tile's, the next tile asked for in
// memory order where rows are short; each step over 64 bytes of every row asks for R lines. Measured on a 2-core
// AMD EPYC (Zen 4), one input row: a 768 x 32768 linear bfloat16 22 -> 70 GB/s, float16 18.5 -> 62-65 GB/s
// (768 x 3072: 98-126 -> 125, 60-71 -> 73); float32 rows lost with it (768 x 32768: 29-37 -> 26, 768 x 3072: 152 ->
// 126 GB/s), so one float32 input row streams on the hardware prefetcher alone. Batch-1 decode of llama125m (the
// bench, same run as llama-server): float16 88 -> 134 tok/s, bfloat16 113 -> 120. Four input rows: 768 x 32768
// bfloat16 / float16 2x faster; float32 experts of the demo model (128-wide rows) at 5 rows with cold caches 1241 ->
// 703 us a step, hot unchanged.
template <typename T, int MC, int R, bool DP = false, bool PF = (MC == 1)>
inline void tile(const T* __restrict x, int64_t K, const T* __restrict w, const T* __restrict bias,
                 T* __restrict y, int64_t ldy) {
  __m512 acc[MC][R];
  const bool ask = PF && (sizeof(T) == 2 || MC > 1) && K * static_cast<int64_t>(sizeof(T)) < kPrefetchRowBytes;
#pragma GCC unroll 4
  for (int m = 0; m < MC; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
#if LLP_DPBF16
  if constexpr (DP) {
    static_assert(sizeof(T) == 2, "the dot-product tile is for bfloat16");
    for (; k < K; k += 32) {
      if (ask) ask_next<T, R>(w, K, k);
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (K - k)) - 1);
      __m512bh wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
  }
#endif
  if constexpr (sizeof(T) == 2 && !DP) {
    // 16-bit weights: a whole cache line (32 values) per row per step, or each row streams at half the rate
    for (; k + 32 <= K; k += 32) {
      if (ask) ask_next<T, R>(w, K, k);
      __m512 wlo[R], whi[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i raw = _mm512_loadu_si512(w + r * K + k);
        wlo[r] = lo16(raw, w);
        whi[r] = hi16(raw, w);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m512i raw = _mm512_loadu_si512(x + m * K + k);
        const __m512 xlo = lo16(raw, x), xhi = hi16(raw, x);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xhi, whi[r], _mm512_fmadd_ps(xlo, wlo[r], acc[m][r]));
      }
    }
  }
  for (; !DP && k + 16 <= K; k += 16) {
    if (sizeof(T) == 4 && ask) ask_next<T, R>(w, K, k);
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load16(w + r * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = load16(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (!DP && k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load16(w + r * K + k, mask);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = load16(x + m * K + k, mask);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  float sums[16];
  reduce_many<MC * R>(&acc[0][0], sums);
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      float s = sums[reduced_lane(m * R + r)];
      if (bias) s += to_f(bias[r]);
      y[m * ldy + r] = from_f<T>(s);
    }
}

#elif LLP_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// (the scalar tail uses explicit fma: every instantiation rounds alike, so a row's result never depends on MC)
// 16 ymm registers: MC x R accumulators plus R weight vectors and one input vector must fit
constexpr int kTileR = 2, kTileR1 = 4;

// MC input rows x R weight rows over the whole K, 8 lanes at a time (16-bit values widened exactly on load),
// a scalar float32 tail; each output one float32 sum rounded once. DP is the AVX-512 BF16 variant's flag.
template <typename T, int MC, int R, bool DP = false, bool PF = (MC == 1)>
inline void tile(const T* __restrict x, int64_t K, const T* __restrict w, const T* __restrict bias,
                 T* __restrict y, int64_t ldy) {
  __m256 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m) {
      const __m256 xv = load8(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  };
  int64_t k = 0;
  if constexpr (PF) {
    // PF (one input row, or the first input rows of a weight tile): a block of 32 columns of every row, and as
    // many lines of the next tile (the R rows after these, contiguous) asked for first in memory order, so it
    // arrives as one sequential stream while this tile computes. R short strided rows stream poorly on their
    // own: memory order measured 27 -> 38 GB/s on 768-wide float16 matrices and 28 -> 31 GB/s on 512-wide
    // float32 ones, and a 16-row decode step of llama125m float32 went 69-71 -> 55-62 ms with the first input
    // rows asking too. Prefetching past the end is harmless; the arithmetic is the same 8-lane steps in the same
    // order. Rows of 4 KB and more stream well on the hardware prefetcher alone, and the extra requests then
    // cost bandwidth (float32 768 x 2048: 27.7 -> 30.2 GB/s without them, 512 x 1408: 29.6 -> 30.6; float32
    // 768-wide rows: 27.6 -> 26.2, bfloat16 1408-wide 24.2 -> 21.3 without), so only shorter rows ask. (All on
    // a 2-core AMD EPYC.)
    const bool ask = K * static_cast<int64_t>(sizeof(T)) < kPrefetchRowBytes;
    for (; k + 32 <= K; k += 32) {
      if (ask) {
#pragma GCC unroll 8
        for (int i = 0; i < R * 32 * static_cast<int>(sizeof(T)) / 64; ++i)  // the lines this block reads, ahead
          _mm_prefetch(reinterpret_cast<const char*>(w + R * K + k * R + i * (64 / static_cast<int>(sizeof(T)))), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 32; j += 8) step(k + j);
    }
  }
  for (; k + 8 <= K; k += 8) step(k);
  float tail[MC][R] = {};
  for (; k < K; ++k)
    for (int m = 0; m < MC; ++m)
      for (int r = 0; r < R; ++r) tail[m][r] = std::fma(to_f(x[m * K + k]), to_f(w[r * K + k]), tail[m][r]);
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[m][r]) + tail[m][r];
      if (bias) s += to_f(bias[r]);
      y[m * ldy + r] = from_f<T>(s);
    }
}
#endif  // LLP_AVX512 / LLP_AVX2

#if LLP_SIMD
// the last < R output rows: one at a time
template <typename T, bool DP>
inline void tile_rest(const T* x, int64_t M, int64_t K, const T* w, const T* bias, T* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) tile<T, 1, 1, DP>(x + m * K, K, w, bias, y + m * ldy, ldy);
}

// a tile of mc (1-4) input rows
template <typename T, int R, bool DP, bool PF>
inline void tile_rows(int64_t mc, const T* x, int64_t K, const T* w, const T* bias, T* y, int64_t ldy) {
  switch (mc) {
    case 4: return tile<T, 4, R, DP, PF>(x, K, w, bias, y, ldy);
    case 3: return tile<T, 3, R, DP, PF>(x, K, w, bias, y, ldy);
    case 2: return tile<T, 2, R, DP, PF>(x, K, w, bias, y, ldy);
    default: return tile<T, 1, R, DP, PF>(x, K, w, bias, y, ldy);
  }
}

// y[m, o] for all M rows and output rows [o0, o1): R weight rows x 4 input rows per tile
template <typename T, bool DP>
inline void linear_block(const T* x, int64_t M, int64_t K, const T* w, const T* bias, T* y, int64_t O, int64_t o0,
                         int64_t o1) {
  constexpr int R = kTileR;
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    const T* wt = w + o * K;
    const T* bt = bias ? bias + o : nullptr;
    // the first input rows ask for the next weight tile's lines (see tile); the others find these in cache
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mc = std::min<int64_t>(4, M - m);
      if (m == 0) tile_rows<T, R, DP, true>(mc, x, K, wt, bt, y + o, O);
      else tile_rows<T, R, DP, false>(mc, x + m * K, K, wt, bt, y + m * O + o, O);
    }
  }
  for (; o < o1; ++o) tile_rest<T, DP>(x, M, K, w + o * K, bias ? bias + o : nullptr, y + o, O);
}

// whether T's linears take the vdpbf16ps tile (bfloat16 on a CPU with AVX-512 BF16): decided here once, so every
// kernel that computes a bfloat16 output row computes it alike
template <typename T>
constexpr bool kDotBf16 = LLP_DPBF16 && std::is_same_v<T, c10::BFloat16>;

template <typename T, bool DP = kDotBf16<T>>
void linear_rows(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t O, int64_t o0,
                 int64_t o1) {
  if (M == 1) {  // one input row: 8 weight rows per tile keep more memory streams in flight
    int64_t o = o0;
    // a matrix that fits in the L2 is read from the caches: asking for its lines would only cost issue slots
    if (O * K * static_cast<int64_t>(sizeof(T)) < kCachedBytes)
      for (; o + kTileR1 <= o1; o += kTileR1)
        tile<T, 1, kTileR1, DP, false>(x, K, w + o * K, bias ? bias + o : nullptr, y + o, O);
    for (; o + kTileR1 <= o1; o += kTileR1) tile<T, 1, kTileR1, DP>(x, K, w + o * K, bias ? bias + o : nullptr, y + o, O);
    for (; o < o1; ++o) tile<T, 1, 1, DP>(x, K, w + o * K, bias ? bias + o : nullptr, y + o, O);
    return;
  }
  // Many rows (a prefill in the batch-invariant mode): blocks of kOB weight rows x kMB input rows, so a weight
  // block stays in L2 while the input blocks pass and the inputs are re-read once per weight block rather than
  // once per R weight rows. Every output is still one whole-K dot product in the same order: blocking changes
  // what is cached, never the arithmetic, so a row's result is the same in any batch.
  constexpr int64_t kMB = 48, kOB = 64;
  for (int64_t ob = o0; ob < o1; ob += kOB) {
    const int64_t oe = std::min(o1, ob + kOB);
    for (int64_t mb = 0; mb < M; mb += kMB)
      linear_block<T, DP>(x + mb * K, std::min(kMB, M - mb), K, w, bias, y + mb * O, O, ob, oe);
  }
}
#endif  // LLP_SIMD

bool small_linear_supported() { return LLP_SIMD; }

// The read bandwidth decode sees (the bench's roofline): every thread streams its contiguous share of ``x`` through
// vector loads, the range split across at::parallel_for's threads as the decode kernels split a weight matrix.
// Returns the sum (so the loads cannot be dropped); ``x`` is meant to be far larger than the last-level cache.
double stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "stream_read: a contiguous float32 CPU tensor");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  constexpr int64_t kBlock = 1 << 14;  // floats per task: 64 KiB
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(std::max(1, at::get_num_threads()), 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    constexpr int kLanes = 64;  // independent sums: four 16-float vectors in flight, no reassociation needed
    float acc[kLanes] = {};
    const int64_t lo = b * kBlock, hi = std::min(n, e * kBlock);
    int64_t i = lo;
    for (; i + kLanes <= hi; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += p[i + j];
    double sum = 0.0;
    for (; i < hi; ++i) sum += p[i];
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    partial[at::get_thread_num()] += sum;
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

// the vector code this build runs (the bench and the tests report it)
std::string simd_isa() { return LLP_AVX512 ? "avx512" : LLP_AVX2 ? "avx2" : "none"; }

// whether this CPU has native 16-bit products (else the kernels' many-row 16-bit GEMMs are up-converted)
bool native_bf16_gemm() { return LLP_NATIVE_BF16; }
bool native_fp16_gemm() { return LLP_NATIVE_FP16; }

// which arithmetic row_linear gives bfloat16 on this CPU (the bench and the tests report it); small_linear's is
// the same but for AMX tiles, which only row_linear uses
std::string row_linear_path() {
#if LLP_AMX
  if (llp_amx::available()) return "amx";
#endif
  return LLP_DPBF16 ? "avx512_bf16" : LLP_AVX512 ? "avx512" : LLP_AVX2 ? "avx2" : "none";
}

at::Tensor linear_kernel(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(LLP_SIMD, "small_linear: this build has no AVX-512 or AVX2 kernel (use torch linear)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x [M, K], w [O, K] expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "small_linear: x and w must share a dtype");
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == O && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "small_linear: bias must be a contiguous [O] tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, O}, x.options());
#if LLP_AMX
  // the batch-invariant bf16 linear on AMX tiles where the CPU and the OS allow them (decided once per process)
  if (amx && x.scalar_type() == at::kBFloat16 && llp_amx::available()) {
    llp_amx::linear(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
                    bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), M, K, O);
    return y;
  }
#endif
#if LLP_SIMD
  // output rows per task: a multiple of 8, and enough of them that a task reads >= ~64 KB of weights
  const int64_t grain = std::max<int64_t>(1, (16384 + K - 1) / K / 8);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, (O + 7) / 8, grain, [&](int64_t b, int64_t e) {
      linear_rows<T>(xp, wp, bp, yp, M, K, O, b * 8, std::min(O, e * 8));
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "small_linear: dtype ", x.scalar_type(), " not supported (float32, bfloat16, float16)");
  }
#endif
  return y;
}

// y = x @ w^T (+ bias) for the few rows of a decode step: each output one whole-K float32 dot product.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear_kernel(x, w, bias, false);
}

// The batch-invariant linear: small_linear's row-by-row arithmetic for any number of rows (blocked for cache
// reuse on many), in bfloat16 on AMX tiles where the CPU has them (amx_linear.h), else small_linear's arithmetic.
// A row's result never depends on the other rows; on AMX it may differ in the last bits from small_linear's, and
// everywhere from torch's GEMM.
at::Tensor row_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear_kernel(x, w, bias, true);
}

// whether row_linear runs bfloat16 on AMX tiles in this process (then its arithmetic is not small_linear's)
bool row_linear_amx() {
#if LLP_AMX
  return llp_amx::available();
#else
  return false;
#endif
}

// The first maximum of row[0, n), n > 0, a NaN counting as the maximum (then the first NaN, val NaN):
// torch.max(row, -1).indices, as two vectorised passes (the maximum and whether a NaN occurs, then the first
// place it does) instead of one pass tracking indices.
struct RowMax {
  int64_t idx;
  float val;
  bool nan;
};
inline RowMax first_max(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, row[i]);
    nan |= row[i] != row[i];
  }
  int64_t i = 0;
  if (nan)
    while (row[i] == row[i]) ++i;
  else
    while (row[i] != m) ++i;
  return {i, nan ? std::numeric_limits<float>::quiet_NaN() : m, nan != 0};
}

// the first maximum of two searches (a NaN counts as the largest; the lower index on ties; idx < 0: none)
inline RowMax first_of(const RowMax& a, const RowMax& b) {
  if (a.idx < 0) return b;
  if (b.idx < 0) return a;
  const RowMax& lo = a.idx < b.idx ? a : b;
  const RowMax& hi = a.idx < b.idx ? b : a;
  if (lo.nan) return lo;
  if (hi.nan) return hi;
  return hi.val > lo.val ? hi : lo;
}

// The index of each row's first maximum in a float32 [R, V] tensor (first_max of each row), for the greedy
// sampler.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 && x.device().is_cpu(),
              "argmax_rows: a float32 CPU tensor [rows, n > 0] expected, got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor c = x.contiguous();
  const int64_t R = c.size(0), V = c.size(1);
  at::Tensor out = at::empty({R}, c.options().dtype(at::kLong));
  const float* p = c.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) o[r] = first_max(p + r * V, V).idx;
  return out;
}

// ---------------------------------------------------------------------------------------------- elementwise
// rows per task so that a task touches >= ~16K elements (small steps stay on one thread)
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

template <typename T>
LLP_NO_CONTRACT inline void norm_row(const T* x, const T* w, float eps, T* out, int64_t d) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  // reference: weight * (x.float() * rsqrt(var + eps)).to(dtype), the product rounding in dtype
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(x[i]) * inv));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": the last dim of x must be contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), name, ": weight must be [D] contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), name, ": x and weight must share a dtype");
}

using llp::dispatch_float_types;

// RMSNorm over the last dim of x (any leading shape, rows contiguous after reshape).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  check_rows(x_in, w, "rms_norm");
  const at::Tensor x = x_in.contiguous();
  const int64_t d = x.size(-1), n = x.numel() / std::max<int64_t>(d, 1);
  at::Tensor out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, row_grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row<T>(xp + r * d, wp, static_cast<float>(eps), op + r * d, d);
    });
  });
  return out;
}

// out = a + b, each sum rounded in T (torch's add in T)
template <typename T>
LLP_NO_CONTRACT inline void add_rows(const T* __restrict a, const T* __restrict b, T* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

// s = x + residual (rounded in dtype), and rms_norm(s): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& r_in, const at::Tensor& w,
                                                double eps) {
  check_rows(x_in, w, "add_rms_norm");
  TORCH_CHECK(x_in.sizes() == r_in.sizes() && x_in.scalar_type() == r_in.scalar_type(),
              "add_rms_norm: x and residual must share shape and dtype");
  const at::Tensor x = x_in.contiguous(), res = r_in.contiguous();
  const int64_t d = x.size(-1), n = x.numel() / std::max<int64_t>(d, 1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = res.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, row_grain(d), [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const int64_t o = row * d;
        add_rows<T>(xp + o, rp + o, sp + o, d);
        norm_row<T>(sp + o, wp, static_cast<float>(eps), op + o, d);
      }
    });
  });
  return {sum, out};
}

// o[i] = silu(g[i]) * u[i] for i in [i0, i1), the product rounded in T
template <typename T>
inline void silu_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float a = to_f(g[i]);
    o[i] = from_f<T>(rnd<T>(a / (1.0f + exp_f(-a))) * to_f(u[i]));
  }
}

// silu(gate) * up for gate_up = [..., 2I] (gate first): the SwiGLU activation of a stacked projection.
at::Tensor silu_mul(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.dim() >= 1 && gu_in.size(-1) % 2 == 0, "silu_mul: the last dim must be even (gate, up)");
  const at::Tensor gu = gu_in.contiguous();
  const int64_t two_i = gu.size(-1), inter = two_i / 2, n = gu.numel() / std::max<int64_t>(two_i, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, gu.options());
  dispatch_float_types(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gu.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, row_grain(two_i), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_row<T>(gp + r * two_i, gp + r * two_i + inter, op + r * inter, 0, inter);
    });
  });
  return out;
}

// In place: x[t, h, :] rotated by cos/sin[t, :] (rotate_half form, both halves of cos/sin equal), each product
// and the sum rounded in x's dtype as the reference does.
template <typename T>
LLP_NO_CONTRACT void rotate(T* base, int64_t sh, int64_t heads, const T* c, const T* s, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    T* v = base + h * sh;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = to_f(v[i]), hi = to_f(v[i + half]);
      const float ci = to_f(c[i]), si = to_f(s[i]);
      const float new_lo = rnd<T>(lo * ci) + rnd<T>(-hi * si);
      const float new_hi = rnd<T>(hi * ci) + rnd<T>(lo * si);
      v[i] = from_f<T>(new_lo);
      v[i + half] = from_f<T>(new_hi);
    }
  }
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_: q [T, Hq, D] and k [T, Hk, D] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary_: head dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos_in.scalar_type() == q.scalar_type() &&
                  sin_in.scalar_type() == q.scalar_type(),
              "rotary_: q, k, cos and sin must share a dtype");
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary_: head dim must be even");
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) == t && cos_in.size(1) == d && sin_in.sizes() == cos_in.sizes(),
              "rotary_: cos/sin must be [T, D]");
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  dispatch_float_types(q.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    const T* cp = cs.data_ptr<T>();
    const T* sp = sn.data_ptr<T>();
    const int64_t hq = q.size(1), hk = k.size(1);
    at::parallel_for(0, t, row_grain((hq + hk) * d), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        rotate<T>(qp + i * q.stride(0), q.stride(1), hq, cp + i * d, sp + i * d, d / 2);
        rotate<T>(kp + i * k.stride(0), k.stride(1), hk, cp + i * d, sp + i * d, d / 2);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------- MoE experts
// A 16-bit GEMM over many rows where the CPU has no native 16-bit products: torch's 16-bit GEMM falls back to
// slow paths there, so the operands are widened to float32 (exact) and the float32 GEMM's sums rounded once to
// the 16-bit dtype, as a float32-accumulating 16-bit GEMM rounds. Weights are widened per call, not kept: the
// GEMM over many rows costs far more than reading the weights once more.
inline bool upconverts(at::ScalarType t) {
  return (t == at::kBFloat16 && !LLP_NATIVE_BF16) || (t == at::kHalf && !LLP_NATIVE_FP16);
}
at::Tensor upconvert_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  c10::optional<at::Tensor> b32 = c10::nullopt;
  if (bias.has_value()) b32 = bias->to(at::kFloat);
  return at::linear(x.to(at::kFloat), w.to(at::kFloat), b32).to(x.scalar_type());
}

// x @ w^T through small_linear when it applies (few rows, float32/bf16, AVX-512 build), else torch's GEMM.
// max_rows < 0 is the batch-invariant mode: every row gets the arithmetic it gets alone, whatever the other rows
// are: row_linear computes each output from its own input row only, so it serves any number of rows; without
// it (another dtype, no AVX-512) every row is its own one-row GEMM.
// int8 weights (layer_ops cpu_int8) with their float32 [O] scales: the int8 kernel up to kInt8KernelRows rows or
// at any count in the batch-invariant mode, else the weights widened to float32 and torch's GEMM; the sums scaled
// and rounded once to x's dtype (int8_ops.py's linear, the same two paths).
constexpr int64_t kInt8KernelRows = 64;  // int8_ops.INT8_KERNEL_MAX_ROWS
at::Tensor int8_any(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t max_rows,
                    const c10::optional<at::Tensor>& bias) {
  if (max_rows < 0 || x.size(0) <= kInt8KernelRows) return llp::int8_linear(x, w, scale, bias);
  at::Tensor y = at::linear(x.to(at::kFloat), w.to(at::kFloat));
  y.mul_(scale);
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

at::Tensor linear_any(const at::Tensor& x, const at::Tensor& w, int64_t max_rows,
                      const c10::optional<at::Tensor>& bias = c10::nullopt,
                      const c10::optional<at::Tensor>& w_scale = c10::nullopt) {
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(w_scale.has_value(), "linear: an int8 weight needs its scales");
    return int8_any(x, w, *w_scale, max_rows, bias);
  }
  const auto t = x.scalar_type();
  const bool kernel = LLP_SIMD && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
  if (kernel && max_rows < 0) return row_linear(x, w, bias);
  if (kernel && x.size(0) <= max_rows) return small_linear(x, w, bias);
  if (max_rows >= 0 && upconverts(t)) return upconvert_linear(x, w, bias);
  if (max_rows >= 0 || x.size(0) <= 1) return at::linear(x, w, bias);
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  for (int64_t i = 0; i < x.size(0); ++i) y.narrow(0, i, 1).copy_(at::linear(x.narrow(0, i, 1), w, bias));
  return y;
}

// whether a step of `rows` rows counts as a decode-sized one (max_rows < 0: batch-invariant mode, where
// max_rows no longer says; this only picks how the work is threaded, never the arithmetic)
inline bool few_rows(int64_t rows, int64_t max_rows) { return rows <= (max_rows < 0 ? 32 : max_rows); }

// o += rnd(y * g), rounding in T like torch's (T * float32 -> float32).to(T) then an accumulating index_put_
template <typename T>
LLP_NO_CONTRACT void add_scaled(T* __restrict o, const T* __restrict y, float g, int64_t n) {
  for (int64_t h = 0; h < n; ++h) o[h] = from_f<T>(to_f(o[h]) + rnd<T>(to_f(y[h]) * g));
}

// The packed MoE dispatch of moe.py in one call: the (token, slot) pairs routed to each expert are grouped
// (experts ascending, tokens in order), each expert runs once on its pack (gate_up, SiLU * up, down), and
// out[t] += (y * weight) rounds in x's dtype exactly as the torch version's index_put_ accumulation does.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& idx_in, const at::Tensor& w_in,
                       const at::Tensor& w13, const at::Tensor& w2, int64_t max_rows,
                       const c10::optional<at::Tensor>& w13_s = c10::nullopt,
                       const c10::optional<at::Tensor>& w2_s = c10::nullopt) {
  TORCH_CHECK(x_in.dim() == 2 && idx_in.dim() == 2 && w_in.sizes() == idx_in.sizes() && idx_in.size(0) == x_in.size(0),
              "moe_experts: x [T, H], expert_idx and expert_w [T, K] expected");
  TORCH_CHECK(idx_in.scalar_type() == at::kLong, "moe_experts: expert_idx must be int64");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == x_in.size(1) &&
                  w2.size(1) == x_in.size(1) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I] expected");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "moe_experts: expert weights must be contiguous");
  const bool q8 = w13.scalar_type() == at::kChar;
  TORCH_CHECK(q8 ? (w2.scalar_type() == at::kChar && w13_s.has_value() && w2_s.has_value())
                 : (w13.scalar_type() == x_in.scalar_type() && w2.scalar_type() == x_in.scalar_type()),
              "moe_experts: x and expert weights must share a dtype (or both be int8 with their scales)");
  const at::Tensor x = x_in.contiguous(), idx = idx_in.contiguous(), wts = w_in.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), k = idx.size(1), experts = w13.size(0), hidden = x.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> slots(experts);  // flat (token * k + slot) per expert, tokens ascending
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int64_t e = ip[i];
    if (e < 0) continue;  // an unused slot (a token limited to fewer experts)
    TORCH_CHECK(e < experts, "moe_experts: expert index ", e, " out of range (", experts, " experts)");
    slots[e].push_back(i);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (!slots[e].empty()) active.push_back(e);
  std::vector<at::Tensor> rows(experts), ys(experts);
  auto run_expert = [&](int64_t e) {
    const auto& sl = slots[e];
    const int64_t n = static_cast<int64_t>(sl.size());
    rows[e] = at::empty({n}, idx.options());
    int64_t* rp = rows[e].data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) rp[i] = sl[i] / k;
    const auto s13 = q8 ? c10::optional<at::Tensor>(w13_s->select(0, e)) : c10::nullopt;
    const auto s2 = q8 ? c10::optional<at::Tensor>(w2_s->select(0, e)) : c10::nullopt;
    ys[e] = linear_any(silu_mul(linear_any(x.index_select(0, rows[e]), w13.select(0, e), max_rows, c10::nullopt, s13)),
                       w2.select(0, e), max_rows, c10::nullopt, s2);
  };
  if (few_rows(tokens, max_rows) && static_cast<int64_t>(active.size()) >= at::get_num_threads()) {
    // a decode step: whole experts per thread (each streams its own weights), one fork/join for the block
    // instead of two per expert; ops called inside a parallel region run on the calling thread
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) run_expert(active[i]);
    });
  } else {
    for (int64_t e : active) run_expert(e);
  }
  at::Tensor out = at::zeros_like(x);
  const float* wp = wts.data_ptr<float>();
  for (int64_t e : active) {  // experts ascending: the accumulation order of the torch version
    const auto& sl = slots[e];
    const int64_t* rp = rows[e].data_ptr<int64_t>();
    dispatch_float_types(x.scalar_type(), "moe_experts", [&](auto tag) {
      using T = decltype(tag);
      const T* yp = ys[e].data_ptr<T>();
      T* op = out.data_ptr<T>();
      at::parallel_for(0, static_cast<int64_t>(sl.size()), row_grain(hidden), [&](int64_t b, int64_t end) {
        for (int64_t i = b; i < end; ++i)  // tokens are distinct within one expert: no two tasks share a row
          add_scaled<T>(op + rp[i] * hidden, yp + i * hidden, wp[sl[i]], hidden);
      });
    });
  }
  return out;
}

// moe_route's choice from float32 router logits [tokens, experts]: per token a float32 softmax, then its k most
// probable experts within its allowed set (ap: [tokens, experts] or null; ties to the lower expert), the first
// kp[t] of them used (kp null: all k; the rest index -1, weight 0), weights renormalised over the used ones with
// `normalize`. p, taken: scratch of `experts` entries. Plain loops without framework calls, so the decode region
// routes with it on every thread at once.
inline void route_rows(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool normalize,
                       const int64_t* kp, const bool* ap, int64_t* ip, float* wp, float* p, char* taken) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < experts; ++e) mx = std::max(mx, l[e]);
    float total = 0.f;
    for (int64_t e = 0; e < experts; ++e) total += (p[e] = std::exp(l[e] - mx));
    const float inv = 1.f / total;
    for (int64_t e = 0; e < experts; ++e) p[e] = (ap && !ap[t * experts + e]) ? 0.f : p[e] * inv;
    std::fill(taken, taken + experts, 0);
    const int64_t keep = kp ? kp[t] : k;
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      const bool used = j < keep;
      ip[t * k + j] = used ? best : -1;
      wp[t * k + j] = used ? p[best] : 0.f;
      sum += wp[t * k + j];
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) wp[t * k + j] /= sum;
  }
}

// top_k (one entry per token, long) and allowed ([tokens, experts], bool) as route_rows reads them; undefined
// where absent or empty (no limit)
inline at::Tensor route_top_k(const c10::optional<at::Tensor>& top_k, int64_t tokens) {
  if (!top_k.has_value() || !top_k->defined() || top_k->numel() == 0) return at::Tensor();
  at::Tensor out = top_k->to(at::kLong).contiguous();
  TORCH_CHECK(out.numel() == tokens, "moe_route: top_k needs one entry per token (", tokens, "), got ", out.numel());
  return out;
}
inline at::Tensor route_allowed(const c10::optional<at::Tensor>& allowed, int64_t tokens, int64_t experts) {
  if (!allowed.has_value() || !allowed->defined() || allowed->numel() == 0) return at::Tensor();
  at::Tensor out = allowed->to(at::kBool).contiguous();
  TORCH_CHECK(out.dim() == 2 && out.size(0) == tokens && out.size(1) == experts,
              "moe_route: allowed must be [tokens, experts] = [", tokens, ", ", experts, "]");
  return out;
}

// Router of a MoE block: logits = x @ gate^T, float32 softmax, the k largest per token (ties to the lower expert id,
// as a stable descending sort gives), optionally renormalised to sum to 1 -- moe.route_tokens in one pass (the
// softmax with std::exp: within 1e-6 of torch's).
// TierSet limits (either may be undefined): allowed [T, E] bool zeroes the probabilities of experts outside a
// token's TierSet before the choice; top_k [T] long keeps the first top_k[t] slots of token t and marks the
// others unused (index -1, weight 0).
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& gate_w, int64_t k, bool normalize,
                                             int64_t max_rows, const c10::optional<at::Tensor>& top_k_in,
                                             const c10::optional<at::Tensor>& allowed_in) {
  const at::Tensor logits = linear_any(x, gate_w, max_rows).to(at::kFloat).contiguous();
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  k = std::min(k, experts);
  TORCH_CHECK(k >= 1, "moe_route: k must be >= 1");
  const at::Tensor top_k = route_top_k(top_k_in, tokens), allowed = route_allowed(allowed_in, tokens, experts);
  at::Tensor idx = at::empty({tokens, k}, x.options().dtype(at::kLong));
  at::Tensor w = at::empty({tokens, k}, x.options().dtype(at::kFloat));
  std::vector<float> p(experts);
  std::vector<char> taken(experts);
  route_rows(logits.data_ptr<float>(), tokens, experts, k, normalize,
             top_k.defined() ? top_k.data_ptr<int64_t>() : nullptr, allowed.defined() ? allowed.data_ptr<bool>() : nullptr,
             idx.data_ptr<int64_t>(), w.data_ptr<float>(), p.data(), taken.data());
  return {idx, w};
}

// ---------------------------------------------------------------------------------------------- fused blocks
// The attention half of a decoder layer for a decode-only step (one new token per sequence, no prompt chunk),
// in one call: input RMSNorm, qkv projection (+ bias), optional q/k RMSNorm, RoPE, the K/V write into the
// paged cache, paged attention, o projection (+ bias, Llama/Qwen3 with attention_bias), residual add and the
// post-attention RMSNorm. The same kernels run in the same order as the op-by-op path, so results are
// identical; what goes is the per-op overhead.
// Returns (h + attention, post_attention_norm(h + attention)).
std::tuple<at::Tensor, at::Tensor> decode_attention_block(
    const at::Tensor& h, const at::Tensor& in_norm_w, double eps, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_b, const c10::optional<at::Tensor>& q_norm_w,
    const c10::optional<at::Tensor>& k_norm_w, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& rows,
    const at::Tensor& kv_slots, const at::Tensor& ctx_lens, double scale, int64_t window, const at::Tensor& o_w,
    const c10::optional<at::Tensor>& o_b, const at::Tensor& post_norm_w, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t max_rows, const c10::optional<at::Tensor>& qkv_s = c10::nullopt,
    const c10::optional<at::Tensor>& o_s = c10::nullopt) {
  TORCH_CHECK(h.dim() == 2, "decode_attention_block: h must be [B, H]");
  const int64_t b = h.size(0);
  const at::Tensor x = rms_norm(h, in_norm_w, eps);
  const at::Tensor qkv = linear_any(x, qkv_w, max_rows, qkv_b, qkv_s);
  const at::Tensor heads = qkv.view({b, num_heads + 2 * num_kv_heads, head_dim});
  at::Tensor q = heads.narrow(1, 0, num_heads), k = heads.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  if (q_norm_w.has_value()) {
    q = rms_norm(q, *q_norm_w, qk_eps);
    k = rms_norm(k, *k_norm_w, qk_eps);
  }
  rotary_(q, k, cos, sin);
  k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
  v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
  at::Tensor out = at::empty({b, num_heads, head_dim}, h.options());
  llp::run_paged_attention(out, q, k_cache, v_cache, rows, kv_slots, ctx_lens, 1, scale, window);
  const at::Tensor a = linear_any(out.view({b, num_heads * head_dim}), o_w, max_rows, o_b, o_s);
  return add_rms_norm(h, a, post_norm_w, eps);
}

// h + down(silu(gate) * up)(x): a dense SwiGLU MLP and its residual add in one call.
at::Tensor residual_mlp(const at::Tensor& h, const at::Tensor& x, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                        int64_t max_rows, const c10::optional<at::Tensor>& gate_up_s = c10::nullopt,
                        const c10::optional<at::Tensor>& down_s = c10::nullopt) {
  return h + linear_any(silu_mul(linear_any(x, gate_up_w, max_rows, c10::nullopt, gate_up_s)), down_w, max_rows,
                        c10::nullopt, down_s);
}

// ---------------------------------------------------------------------------------------------- decode team
// A decode step can run all its layers inside one parallel region. Each thread runs its share of every
// projection's output rows (of each expert's, in a MoE block), then helps with the others' (take_rows), and takes
// attention items (a row and a run of its kv heads) from a shared counter until none is left; the threads meet
// at a spin barrier only where a step reads rows another thread wrote (five times per layer, dense or MoE: every
// routed expert's gate_up runs before the one meeting ahead of the downs); the small per-row steps (norms,
// residual adds, a MoE block's routing and weighted sum) run on every thread at once over whole rows, each thread
// on its own copy, so they need no meeting.
// Against the op-by-op calls of decode_layers below this drops, per layer, the fork/joins, the serial steps
// during which the other threads wait, and the framework calls between the kernels (allocations, views,
// index_copy_), all time in which the weight streams stand idle. Every value comes from the same kernels in the
// same order as the op-by-op calls (norm_row, linear_rows / int8_rows, rotate, attend, moe_route, silu_row,
// add_scaled), so results are bit-identical; tests/model/test_layer_ops.py compares the two.

#if LLP_SIMD
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The threads of one parallel region meet here. A thread that fails sets `failed`; the others then leave their
// wait (wait() returns false) and the region ends, and the error is rethrown after it.
struct SpinBarrier {
  std::atomic<int> arrived{0}, phase{0};
  std::atomic<bool> failed{false};
  int team = 1;
  bool wait() {
    const int ph = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
    } else {
      for (int spin = 0; phase.load(std::memory_order_acquire) == ph; ++spin) {
        if (failed.load(std::memory_order_relaxed)) return false;
        if (spin < (1 << 14)) cpu_relax(); else std::this_thread::yield();  // an oversubscribed CPU: let others run
      }
    }
    return !failed.load(std::memory_order_relaxed);
  }
};
#endif  // LLP_SIMD

struct alignas(64) RowShare {  // see take_rows
  std::atomic<uint64_t> fb{0};
};
enum : int64_t { kQkvRows, kORows, kUpRows, kDownRows, kPhases };  // a layer's projections; its experts' follow

struct TeamLinear {
  const void* w = nullptr;
  const float* scale = nullptr;  // int8 weights: their per-row scales
  const void* bias = nullptr;
  int64_t O = 0, K = 0;
  int64_t elt = 0;  // bytes per weight (int4: 0, two a byte)
  // 4-bit weights (int4_linear.cpp): [O, K / 2] codes, their groups' scales d and offsets z ([O, K / group], z null
  // for symmetric groups) in float16 (half) or bfloat16
  const void *q4_d = nullptr, *q4_z = nullptr;
  int64_t group = 0;
  bool half = false;
  bool q8 = false;  // 4-bit weights against int8 activations (int4_linear.cpp's q8 arithmetic)
  bool gemm = false;  // ... and its GEMM for steps of many rows (not in a batch-invariant plan)
  int64_t max_m = std::numeric_limits<int64_t>::max();  // the most input rows its kernel takes in the team
};

struct TeamLayer {
  const void *in_norm, *q_norm, *k_norm, *post_norm;
  TeamLinear qkv, o, gate_up, down;  // MoE: gate_up and down are expert 0's, the others follow at a fixed stride
  at::Tensor k_cache, v_cache;
  int64_t window;
  // MoE layers: the router's weights (held here for gate, which points into them; undefined: a dense MLP) and
  // route_rows' arguments
  at::Tensor router;
  TeamLinear gate;  // the router as a linear (its logits, then route_rows)
  int64_t moe_k = 0, experts = 0;
  at::Tensor top_k, allowed;  // this step's TierSet limits as route_rows reads them (undefined: none)
};

struct TeamJob {
  std::vector<TeamLayer> layers;
  int64_t M = 0, H = 0, D = 0, hq = 0, hk = 0, I = 0, K = 0;  // K: the most experts a MoE layer routes a token to
  int64_t E = 0;  // the most experts a MoE layer has
  int64_t attn_runs = 1;  // a row's kv heads split into this many attention items
  std::atomic<int64_t>* attn_next = nullptr;  // per layer: the next attention item to take (then, chained, the next to attend)
  bool chained = false;  // some row attends the K/V another row of the step writes (see run_tokens)
  // the rows still to run of every projection of the step (see take_rows): row_shares shares each, per layer
  // kPhases + 2 E projections (qkv, o, the dense MLP's gate rows, down, then each expert's gate rows and down),
  // then the LM head's
  RowShare* row_q = nullptr;
  int row_shares = 1;
  RowShare* rows_of(size_t layer, int64_t phase) const {
    return row_q + (static_cast<int64_t>(layer) * (kPhases + 2 * E) + phase) * row_shares;
  }
  RowShare* head_rows() const { return rows_of(layers.size(), 0); }
  float eps = 0, qk_eps = 0, final_eps = 0;
  double scale = 0;
  const void *h_in = nullptr, *cos = nullptr, *sin = nullptr;
  const int64_t* slot_mapping = nullptr;
  at::Tensor q, attn, rows, kv_slots, ctx_lens;  // q: a [M, hq, D] view of qkv; attn: [M, hq, D]
  void *qkv = nullptr, *a = nullptr, *gu = nullptr, *act = nullptr, *d = nullptr, *out = nullptr;
  void* ys = nullptr;  // MoE: every routed (token, slot)'s expert output, experts ascending
  // the final norm and the LM head when the step ends in logits: head_out [M, V] in the activation dtype, and
  // for 16-bit ones logits, its float32 copy (float32 activations write the logits directly)
  const void* final_norm = nullptr;
  TeamLinear head;
  void* head_out = nullptr;
  float* logits = nullptr;
  RowMax* row_max = nullptr;  // with the logits: [threads, M], each thread's first maximum of its vocabulary rows
  bool moe_normalize = false;
  int64_t max_rows = 0;
  at::TensorOptions opts;
};

// expert e's weights of a [E, O, K] stack (and its scales) as one linear
inline TeamLinear expert_linear(const TeamLinear& stack, int64_t e) {
  TeamLinear l = stack;
  if (stack.q4_d) {  // two codes a byte; 2-byte scales
    const int64_t groups = stack.O * (stack.K / stack.group);
    l.w = static_cast<const char*>(stack.w) + e * stack.O * stack.K / 2;
    l.q4_d = static_cast<const char*>(stack.q4_d) + e * groups * 2;
    if (stack.q4_z) l.q4_z = static_cast<const char*>(stack.q4_z) + e * groups * 2;
    return l;
  }
  l.w = static_cast<const char*>(stack.w) + e * stack.O * stack.K * stack.elt;
  if (stack.scale) l.scale = stack.scale + e * stack.O;
  return l;
}

// thread t's starting share [o0, o1) of n (see take_rows): runs of 8 rows (the blocks small_linear's threads take)
inline std::pair<int64_t, int64_t> share(int64_t count, int t, int n) {
  const int64_t blocks = (count + 7) / 8;
  return {std::min(count, blocks * t / n * 8), std::min(count, blocks * (t + 1) / n * 8)};
}

// A projection's output rows, shared by the team. Thread t owns share(count, t, ns) and runs it from the front,
// `run` rows at a time; a thread whose rows are done takes the back half of another's remaining rows as its own
// (which others may then split again) until no share has rows left. On a shared host one core often runs
// slower than the other (a neighbour on its sibling), and with fixed shares the fast one then waits at every
// meeting: on a 2-core AMD EPYC a thread waited 2-10% of a mixtral175m step with fixed shares, 0.7-5% with
// this; time per token 1.00-1.04x faster in float32 (the README has the runs). Which thread computes a row
// changes nothing in its value.
// State per share: front | back << 32 in one word (its own cache line), so the owner's front and a thief's back
// move by compare-and-swap; ranges start at multiples of 8 rows (the kernels' row blocks).
inline uint64_t pack_fb(int64_t front, int64_t back) {
  return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
}
inline int64_t front_of(uint64_t s) { return static_cast<int64_t>(static_cast<uint32_t>(s)); }
inline int64_t back_of(uint64_t s) { return static_cast<int64_t>(s >> 32); }

// the ns shares of `count` rows, as share() splits them
inline void reset_rows(RowShare* q, int64_t count, int ns) {
  for (int t = 0; t < ns; ++t) {
    auto [a, b] = share(count, t, ns);
    q[t].fb.store(pack_fb(a, b), std::memory_order_relaxed);
  }
}

// thread t calls f(r0, r1) on runs of rows until every share of q (ns of them: the threads asked for; fewer may
// have come, and their rows are taken by the others) is empty
template <typename F>
inline void take_rows(RowShare* q, int ns, int t, int64_t run, F&& f) {
  std::atomic<uint64_t>& mine = q[t].fb;
  for (;;) {
    uint64_t s = mine.load(std::memory_order_relaxed);
    while (front_of(s) < back_of(s)) {
      const int64_t a = front_of(s), e = std::min(back_of(s), a + run);
      if (mine.compare_exchange_weak(s, pack_fb(e, back_of(s)), std::memory_order_relaxed)) {
        f(a, e);
        s = mine.load(std::memory_order_relaxed);
      }
    }
    bool took = false;
    for (int j = 1; j < ns && !took; ++j) {
      std::atomic<uint64_t>& other = q[(t + j) % ns].fb;
      uint64_t o = other.load(std::memory_order_relaxed);
      while (front_of(o) < back_of(o)) {
        const int64_t a = front_of(o), b = back_of(o), mid = a + (b - a) / 16 * 8;  // all of it under 16 rows
        if (other.compare_exchange_weak(o, pack_fb(a, mid), std::memory_order_relaxed)) {
          mine.store(pack_fb(mid, b), std::memory_order_relaxed);
          took = true;
          break;
        }
      }
    }
    if (!took) return;
  }
}

#if LLP_SIMD
template <typename T>
inline void team_linear(const T* x, const TeamLinear& l, T* y, int64_t M, int64_t o0, int64_t o1) {
  if (o1 <= o0) return;
  if (l.q4_d) {
    const uint8_t* w = static_cast<const uint8_t*>(l.w);
    if (l.half)
      llp::int4_rows<T, c10::Half>(x, w, static_cast<const c10::Half*>(l.q4_d), static_cast<const c10::Half*>(l.q4_z),
                                   l.group, static_cast<const T*>(l.bias), y, M, l.K, l.O, o0, o1, l.q8, l.gemm);
    else
      llp::int4_rows<T, c10::BFloat16>(x, w, static_cast<const c10::BFloat16*>(l.q4_d),
                                       static_cast<const c10::BFloat16*>(l.q4_z), l.group,
                                       static_cast<const T*>(l.bias), y, M, l.K, l.O, o0, o1, l.q8, l.gemm);
  } else if (l.scale)
    llp::int8_rows<T>(x, static_cast<const int8_t*>(l.w), l.scale, static_cast<const T*>(l.bias), y, M, l.K, l.O, o0, o1);
  else
    linear_rows<T>(x, static_cast<const T*>(l.w), static_cast<const T*>(l.bias), y, M, l.K, l.O, o0, o1);
}

// thread t of n; priv: this thread's [4, M, H] (the residual stream, the post-attention sum, a normed input, and
// a MoE block's gathered tokens, then its output)
template <typename T>
void team_body(const TeamJob& J, int t, int n, SpinBarrier& bar, T* priv) {
  const int64_t M = J.M, H = J.H, D = J.D, hq = J.hq, hk = J.hk, G = hq / hk, QKV = (hq + 2 * hk) * D;
  T* h = priv;
  T* sum = priv + M * H;
  T* x = priv + 2 * M * H;
  T* qkv = static_cast<T*>(J.qkv);
  T* a = static_cast<T*>(J.a);
  T* gu = static_cast<T*>(J.gu);
  T* act = static_cast<T*>(J.act);
  T* d = static_cast<T*>(J.d);
  const T* cs = static_cast<const T*>(J.cos);
  const T* sn = static_cast<const T*>(J.sin);
  std::memcpy(h, J.h_in, sizeof(T) * M * H);
  // the rows a thread claims at a time: for one input row 32 (64 KB of a 512-wide float32 matrix; one
  // compare-and-swap on the thread's own line each), for more the 64-row weight blocks of linear_rows
  auto rows = [&](RowShare* q, int64_t m, auto&& f) { take_rows(q, J.row_shares, t, m == 1 ? 32 : 64, f); };
  // the rows of a projection `l` of the m rows of `in`: for 4-bit weights against int8 activations, `in` is
  // quantized once per thread first (not again for every run of rows it takes), and forgotten after
  auto rows_of = [&](RowShare* q, const TeamLinear& l, const T* in, int64_t m, auto&& f) {
    const bool q8 = l.q4_d && l.q8;
    if (q8) llp::int4_prepare<T>(in, m, l.K);
    rows(q, m, f);
    if (q8) llp::int4_release();
  };
  const int64_t runs = J.attn_runs, nk = hk / runs, nq = nk * G;  // attention items: (row, run of nk kv heads)
  struct {  // this thread's routing of a MoE layer, made once per step
    std::vector<T> logits_t;
    std::vector<float> logits, w, p;
    std::vector<int64_t> idx;
    std::vector<char> taken;
    std::vector<std::vector<int64_t>> slots;
  } route;
  if (J.E > 0) {
    route.logits_t.resize(M * J.E), route.logits.resize(M * J.E), route.p.resize(J.E), route.taken.resize(J.E);
    route.idx.resize(M * J.K), route.w.resize(M * J.K), route.slots.resize(J.E);
  }
  for (const TeamLayer& L : J.layers) {
    const size_t li = &L - J.layers.data();
    for (int64_t m = 0; m < M; ++m) norm_row<T>(h + m * H, static_cast<const T*>(L.in_norm), J.eps, x + m * H, H);
    rows_of(J.rows_of(li, kQkvRows), L.qkv, x, M,
            [&](int64_t r0, int64_t r1) { team_linear<T>(x, L.qkv, qkv, M, r0, r1); });
    if (!bar.wait()) return;
    // a thread takes the next item until none is left: rows' contexts differ in length, and a thread that
    // stalls leaves its work to the others. An item rotates its row's q and k heads, writes their K/V rows and
    // attends them; row m is sequence m's one query (run checks), so no item reads what another writes.
    std::atomic<int64_t>& next = J.attn_next[li];
    void* kc = L.k_cache.data_ptr();
    void* vc = L.v_cache.data_ptr();
    const at::ScalarType ct = L.k_cache.scalar_type();
    auto write_kv = [&](int64_t it) {  // rotate the item's q and k heads, write its K/V rows
      const int64_t m = it / runs, kh0 = it % runs * nk;
      T* qh = qkv + m * QKV + kh0 * G * D;
      T* kh = qkv + m * QKV + (hq + kh0) * D;
      const T* vh = qkv + m * QKV + (hq + hk + kh0) * D;
      if (L.q_norm) {
        for (int64_t j = 0; j < nq; ++j) norm_row<T>(qh + j * D, static_cast<const T*>(L.q_norm), J.qk_eps, qh + j * D, D);
        for (int64_t j = 0; j < nk; ++j) norm_row<T>(kh + j * D, static_cast<const T*>(L.k_norm), J.qk_eps, kh + j * D, D);
      }
      rotate<T>(qh, D, nq, cs + m * D, sn + m * D, D / 2);
      rotate<T>(kh, D, nk, cs + m * D, sn + m * D, D / 2);
      const int64_t slot = J.slot_mapping[m];
      llp::store_kv<T>(kc, ct, (slot * hk + kh0) * D, kh, nk * D);
      llp::store_kv<T>(vc, ct, (slot * hk + kh0) * D, vh, nk * D);
    };
    auto attend = [&](int64_t it) {
      const int64_t m = it / runs, kh0 = it % runs * nk;
      llp::paged_attention_heads(J.attn, J.q, L.k_cache, L.v_cache, J.rows, J.kv_slots, J.ctx_lens, 1, J.scale,
                                 L.window, kh0, kh0 + nk, m, m + 1);
    };
    if (J.chained) {  // rows of one sequence (a speculative draft's positions) read each other's K/V: all first
      for (int64_t it = next.fetch_add(1, std::memory_order_relaxed); it < M * runs;
           it = next.fetch_add(1, std::memory_order_relaxed))
        write_kv(it);
      if (!bar.wait()) return;
      std::atomic<int64_t>& next2 = J.attn_next[J.layers.size() + li];
      for (int64_t it = next2.fetch_add(1, std::memory_order_relaxed); it < M * runs;
           it = next2.fetch_add(1, std::memory_order_relaxed))
        attend(it);
    } else {
      for (int64_t it = next.fetch_add(1, std::memory_order_relaxed); it < M * runs;
           it = next.fetch_add(1, std::memory_order_relaxed)) {
        write_kv(it);
        attend(it);
      }
    }
    if (!bar.wait()) return;
    rows_of(J.rows_of(li, kORows), L.o, static_cast<const T*>(J.attn.data_ptr()), M, [&](int64_t r0, int64_t r1) {
      team_linear<T>(static_cast<const T*>(J.attn.data_ptr()), L.o, a, M, r0, r1);
    });
    if (!bar.wait()) return;
    for (int64_t m = 0; m < M; ++m) {
      add_rows<T>(h + m * H, a + m * H, sum + m * H, H);
      norm_row<T>(sum + m * H, static_cast<const T*>(L.post_norm), J.eps, x + m * H, H);
    }
    const int64_t I = L.down.K;
    // m_in rows of `in` through gate_up and SiLU * up into act_rows (gu_rows: their stacked projection), in runs
    // of gate rows [i0, i1) and the up rows that pair with them: SiLU * up needs nothing from another thread
    auto up = [&](const T* in, int64_t m_in, const TeamLinear& gate_up, T* gu_rows, T* act_rows, RowShare* q) {
      rows_of(q, gate_up, in, m_in, [&](int64_t i0, int64_t i1) {
        team_linear<T>(in, gate_up, gu_rows, m_in, i0, i1);
        team_linear<T>(in, gate_up, gu_rows, m_in, I + i0, I + i1);
        for (int64_t m = 0; m < m_in; ++m)
          silu_row<T>(gu_rows + m * 2 * I, gu_rows + m * 2 * I + I, act_rows + m * I, i0, i1);
      });
    };
    if (!L.router.defined()) {
      up(x, M, L.gate_up, gu, act, J.rows_of(li, kUpRows));
      if (!bar.wait()) return;
      rows_of(J.rows_of(li, kDownRows), L.down, act, M,
              [&](int64_t r0, int64_t r1) { team_linear<T>(act, L.down, d, M, r0, r1); });
      if (!bar.wait()) return;
      for (int64_t m = 0; m < M; ++m) add_rows<T>(sum + m * H, d + m * H, h + m * H, H);
      continue;
    }
    // MoE: every thread routes on its own (the same values everywhere: the router is a few dot products per
    // token), with moe_route's kernel and route_rows on its own buffers (no framework call: at::softmax and
    // allocations here cost ~20 µs a layer on cold caches, every thread at once), then the experts run one after
    // another as moe_experts groups them (experts ascending, their tokens in order), each split over the
    // threads; the weighted sum rounds as moe_experts' does.
    const int64_t k = L.moe_k;
    team_linear<T>(x, L.gate, route.logits_t.data(), M, 0, L.experts);
    for (int64_t i = 0; i < M * L.experts; ++i) route.logits[i] = to_f(route.logits_t[i]);
    route_rows(route.logits.data(), M, L.experts, k, J.moe_normalize,
               L.top_k.defined() ? L.top_k.data_ptr<int64_t>() : nullptr,
               L.allowed.defined() ? L.allowed.data_ptr<bool>() : nullptr, route.idx.data(), route.w.data(),
               route.p.data(), route.taken.data());
    const int64_t* ip = route.idx.data();
    const float* wp = route.w.data();
    auto& slots = route.slots;  // flat (token * k + slot) per expert, tokens ascending
    for (int64_t e = 0; e < L.experts; ++e) slots[e].clear();
    for (int64_t i = 0; i < M * k; ++i)
      if (ip[i] >= 0) slots[ip[i]].push_back(i);
    T* xe = priv + 3 * M * H;  // an expert's tokens, gathered
    T* ys = static_cast<T*>(J.ys);
    // every routed expert's gate_up (each on its own rows of gu / act: no expert waits for another), one
    // meeting, then every expert's down: two meetings per block however many experts the step routes to
    int64_t off = 0;
    for (int64_t e = 0; e < L.experts; ++e) {
      const int64_t ne = static_cast<int64_t>(slots[e].size());
      if (ne == 0) continue;
      for (int64_t i = 0; i < ne; ++i) std::memcpy(xe + i * H, x + slots[e][i] / k * H, sizeof(T) * H);
      up(xe, ne, expert_linear(L.gate_up, e), gu + off * 2 * I, act + off * I, J.rows_of(li, kPhases + e));
      off += ne;
    }
    if (!bar.wait()) return;
    off = 0;
    for (int64_t e = 0; e < L.experts; ++e) {
      const int64_t ne = static_cast<int64_t>(slots[e].size());
      if (ne == 0) continue;
      const TeamLinear down = expert_linear(L.down, e);
      rows_of(J.rows_of(li, kPhases + J.E + e), down, act + off * I, ne, [&](int64_t r0, int64_t r1) {
        team_linear<T>(act + off * I, down, ys + off * H, ne, r0, r1);
      });
      off += ne;
    }
    if (!bar.wait()) return;
    T* moe_out = xe;
    std::fill(moe_out, moe_out + M * H, from_f<T>(0.f));
    off = 0;
    for (int64_t e = 0; e < L.experts; ++e) {
      for (int64_t i = 0; i < static_cast<int64_t>(slots[e].size()); ++i)
        add_scaled<T>(moe_out + slots[e][i] / k * H, ys + (off + i) * H, wp[slots[e][i]], H);
      off += static_cast<int64_t>(slots[e].size());
    }
    for (int64_t m = 0; m < M; ++m) add_rows<T>(sum + m * H, moe_out + m * H, h + m * H, H);
  }
  if (J.head_out == nullptr) {
    if (t == 0) std::memcpy(J.out, h, sizeof(T) * M * H);
    return;
  }
  // the final norm (every thread on its own copy) and this thread's runs of vocabulary rows of the LM head: what
  // compute_logits runs (rms_norm, the linear in T, then float32), without leaving the region
  for (int64_t m = 0; m < M; ++m) norm_row<T>(h + m * H, static_cast<const T*>(J.final_norm), J.final_eps, x + m * H, H);
  const int64_t V = J.head.O;
  T* y = static_cast<T*>(J.head_out);
  if (J.row_max != nullptr)
    for (int64_t m = 0; m < M; ++m) J.row_max[t * M + m] = RowMax{-1, 0.f, false};  // none searched yet
  rows_of(J.head_rows(), J.head, x, M, [&](int64_t v0, int64_t v1) {
    team_linear<T>(x, J.head, y, M, v0, v1);
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t v = v0; v < v1; ++v) J.logits[m * V + v] = to_f(y[m * V + v]);
    }
    // the greedy token's search over these rows while they are in this core's cache (combined after the
    // region); the sampler would otherwise read every logit back from both cores
    if (J.row_max != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        RowMax r = first_max(J.logits + m * V + v0, v1 - v0);
        r.idx += v0;
        J.row_max[t * M + m] = first_of(J.row_max[t * M + m], r);
      }
    }
  });
}

// A linear the team can run: the kernel linear_any would pick for up to out.max_m rows (small_linear's rows,
// or int8_linear's). A 3-D w is a MoE block's stack of experts [E, O, K] (scales [E, O]); `out` is then expert
// 0's. False (and `why` says what) where the team cannot run it.
bool team_linear_of(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                    at::ScalarType t, int64_t max_rows, int64_t K, TeamLinear& out, std::string& why, const char* name, bool q8 = false) {
  auto no = [&](const char* what) {
    why = std::string(name) + ": " + what;
    return false;
  };
  const bool q4 = w.scalar_type() == at::kByte;  // two 4-bit codes a byte
  if (w.dim() < 2 || w.dim() > 3 || w.size(-1) * (q4 ? 2 : 1) != K) return no("unexpected shape");
  if (!w.is_contiguous()) return no("not contiguous");
  const int64_t O = w.size(-2), E = w.dim() == 3 ? w.size(0) : 1;
  if (q4) {
    // the groups' scales [.., O, K / group], or scales and offsets stacked [2, .., O, K / group] (asymmetric)
    if (!scale.has_value() || !scale->defined() || !scale->is_contiguous() ||
        (scale->scalar_type() != at::kHalf && scale->scalar_type() != at::kBFloat16))
      return no("int4 without float16 / bfloat16 group scales");
    const bool asym = scale->dim() == w.dim() + 1;
    const at::Tensor d = asym ? (*scale)[0] : *scale;
    if ((asym && scale->size(0) != 2) || d.dim() != w.dim() || d.size(-2) != O || (E > 1 && d.size(0) != E) ||
        d.size(-1) == 0 || K % d.size(-1) != 0 || (K / d.size(-1)) % 32 != 0)
      return no("int4 group scales of an unexpected shape");
    out.q4_d = d.data_ptr();
    out.q4_z = asym ? (*scale)[1].data_ptr() : nullptr;
    out.group = K / d.size(-1);
    out.half = scale->scalar_type() == at::kHalf;
    out.q8 = q8;
    out.gemm = q8 && max_rows >= 0;  // max_rows < 0: the batch-invariant plan
    if (max_rows >= 0) out.max_m = llp::int4_kernel_max_rows();  // int4_ops' kernel_max_rows
  } else if (w.scalar_type() == at::kChar) {
    if (!scale.has_value() || !scale->defined() || scale->scalar_type() != at::kFloat || scale->numel() != E * O ||
        !scale->is_contiguous())
      return no("int8 without float32 scales per row");
    out.scale = scale->data_ptr<float>();
    if (max_rows >= 0) out.max_m = kInt8KernelRows;
  } else {
    // small_linear's arithmetic: the decode-size path, or row_linear where it is the same kernel (everywhere
    // but bfloat16 on AMX tiles)
    if (w.scalar_type() != t) return no("dtype differs from the activations");
    if (max_rows < 0 && t == at::kBFloat16 && row_linear_amx())
      return no("the batch-invariant bfloat16 kernel runs on AMX tiles, not in the team");
    if (max_rows >= 0) out.max_m = max_rows;
  }
  if (bias.has_value() && bias->defined()) {
    if (bias->scalar_type() != t || bias->numel() != O || !bias->is_contiguous()) return no("unexpected bias");
    out.bias = bias->data_ptr();
  }
  out.w = w.data_ptr();
  out.O = O;
  out.K = K;
  out.elt = static_cast<int64_t>(w.element_size());
  return true;
}

#endif  // LLP_SIMD

std::atomic<int64_t> team_runs{0};  // decode steps the team ran (the tests check that it did)
int64_t decode_team_runs() { return team_runs.load(); }

// take_rows as the team runs it, for the tests: `threads` threads share `count` rows in `shares` shares (more
// shares than threads: threads that never came), claiming `run` rows at a time; with `late`, thread 1 starts only
// once thread 0 has returned (a core that stalls: thread 0 must have run every share). Returns [threads, count]:
// how many times each thread ran each row.
at::Tensor take_rows_trace(int64_t count, int64_t threads, int64_t shares, int64_t run, bool late) {
  TORCH_CHECK(count >= 0 && count < (int64_t{1} << 31) && threads >= 1 && shares >= threads && run > 0 && run % 8 == 0,
              "take_rows_trace: bad arguments");
  std::unique_ptr<RowShare[]> q(new RowShare[shares]);
  reset_rows(q.get(), count, static_cast<int>(shares));
  at::Tensor ran = at::zeros({threads, count}, at::kInt);
  int32_t* r = ran.data_ptr<int32_t>();
  std::atomic<bool> first_done{false};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int t = omp_get_thread_num();
    if (late && t == 1)
      while (!first_done.load(std::memory_order_acquire)) std::this_thread::yield();
    take_rows(q.get(), static_cast<int>(shares), t, run, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) ++r[t * count + i];
    });
    if (t == 0) first_done.store(true, std::memory_order_release);
  }
  return ran;
}

// The part of a decode step that stays the same from step to step -- the model's weights, the KV caches, the
// shapes -- checked once and kept (torch.classes.litellm_pipeline_cpu.DecodePlan): a step then passes only its
// own tensors. Holds references to every tensor it reads, so the weights outlive it.
struct DecodePlan : torch::CustomClassHolder {
  TeamJob job;  // the per-model part; run() copies it and fills in the step
  std::vector<at::Tensor> held;
  at::ScalarType dtype = at::kFloat;
  int64_t num_slots = 0, rows_limit = std::numeric_limits<int64_t>::max(), native_k = 0;
  std::string why;  // why the team cannot run this model ("" when it can)
  std::string head_why;  // why it runs the layers without the LM head given to it

  bool no(const std::string& what) {
    why = what;
    return false;
  }

  bool build(at::TensorList in_norm, at::TensorList qkv_w, at::TensorList qkv_b, at::TensorList q_norm,
             at::TensorList k_norm, at::TensorList k_caches, at::TensorList v_caches, at::TensorList o_w,
             at::TensorList o_b, at::TensorList post_norm, at::TensorList mlp_a, at::TensorList mlp_b,
             at::TensorList router, at::IntArrayRef windows, double eps, double qk_eps, double scale,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t moe_k, bool moe_normalize,
             int64_t max_rows, at::TensorList qkv_s, at::TensorList o_s, at::TensorList mlp_a_s,
             at::TensorList mlp_b_s, const c10::optional<at::Tensor>& final_norm, double final_eps,
             const c10::optional<at::Tensor>& head, const c10::optional<at::Tensor>& head_s, bool int4_q8) {
#if LLP_SIMD
    if (in_norm.empty()) return no("no layers");
    const at::ScalarType t = in_norm[0].scalar_type();
    dtype = t;
    if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return no("not a float dtype");
    const int64_t H = in_norm[0].numel(), D = head_dim, hq = num_heads, hk = num_kv_heads;
    if (hk <= 0 || hq % hk != 0 || D % 2 != 0) return no("head layout");
    auto opt = [](at::TensorList l, size_t i) { return l.empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(l[i]); };
    auto norm_ok = [&](const at::Tensor& w, int64_t n) {
      return w.dim() == 1 && w.size(0) == n && w.scalar_type() == t && w.is_contiguous();
    };
    TeamJob& J = job;
    J.H = H, J.D = D, J.hq = hq, J.hk = hk, J.I = 0, J.K = 0, J.E = 0;
    J.moe_normalize = moe_normalize, J.max_rows = max_rows;
    J.eps = static_cast<float>(eps), J.qk_eps = static_cast<float>(qk_eps), J.scale = scale;
    const int64_t QKV = (hq + 2 * hk) * D;
    num_slots = k_caches[0].size(0);
    native_k = moe_k;
    auto limit = [&](const TeamLinear& l) { rows_limit = std::min(rows_limit, l.max_m); };
    for (size_t i = 0; i < in_norm.size(); ++i) {
      TeamLayer L{};
      const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
      if (!llp::kv_cache_supported(t, kc.scalar_type()) || !kc.is_contiguous() || kc.dim() != 3 ||
          kc.size(0) != num_slots || kc.size(1) != hk || kc.size(2) != D || vc.sizes() != kc.sizes() ||
          vc.scalar_type() != kc.scalar_type() || !vc.is_contiguous())
        return no("KV cache layout or dtype");
      if (!norm_ok(in_norm[i], H) || !norm_ok(post_norm[i], H)) return no("layer norm weights");
      if (!q_norm.empty() && (!norm_ok(q_norm[i], D) || !norm_ok(k_norm[i], D))) return no("q/k norm weights");
      const int64_t mlp_dims = router.empty() ? 2 : 3;  // a MoE block's experts are [E, O, K] stacks
      if (mlp_a[i].dim() != mlp_dims || mlp_b[i].dim() != mlp_dims) return no("MLP weight shapes");
      if (!team_linear_of(qkv_w[i], opt(qkv_s, i), opt(qkv_b, i), t, max_rows, H, L.qkv, why, "qkv", int4_q8) ||
          !team_linear_of(o_w[i], opt(o_s, i), opt(o_b, i), t, max_rows, hq * D, L.o, why, "o", int4_q8) ||
          !team_linear_of(mlp_a[i], opt(mlp_a_s, i), c10::nullopt, t, max_rows, H, L.gate_up, why, "gate_up",
                          int4_q8) ||
          !team_linear_of(mlp_b[i], opt(mlp_b_s, i), c10::nullopt, t, max_rows,
                          mlp_b[i].size(-1) * (mlp_b[i].scalar_type() == at::kByte ? 2 : 1), L.down, why, "down",
                          int4_q8))
        return false;
      if (L.qkv.O != QKV || L.o.O != H || L.down.O != H || L.gate_up.O != 2 * L.down.K) return no("projection shapes");
      for (const TeamLinear* l : {&L.qkv, &L.o, &L.gate_up, &L.down}) limit(*l);
      if (!router.empty()) {
        const int64_t E = mlp_a[i].size(0);
        if (mlp_b[i].size(0) != E || router[i].dim() != 2 || router[i].size(0) != E || router[i].size(1) != H ||
            router[i].scalar_type() != t || !router[i].is_contiguous())
          return no("router");
        if (!team_linear_of(router[i], c10::nullopt, c10::nullopt, t, max_rows, H, L.gate, why, "router")) return false;
        L.router = router[i];
        L.experts = E;
        J.E = std::max(J.E, E);
      }
      L.in_norm = in_norm[i].data_ptr();
      L.post_norm = post_norm[i].data_ptr();
      L.q_norm = q_norm.empty() ? nullptr : q_norm[i].data_ptr();
      L.k_norm = k_norm.empty() ? nullptr : k_norm[i].data_ptr();
      L.k_cache = kc, L.v_cache = vc;
      L.window = windows[i];
      J.I = std::max(J.I, L.down.K);
      J.layers.push_back(std::move(L));
    }
    // a head the region cannot run leaves the plan the layers (the caller then runs compute_logits)
    TeamLinear hl;
    if (head.has_value() && head->defined()) {
      if (!final_norm.has_value() || !norm_ok(*final_norm, H)) {
        head_why = "final norm weight";
      } else if (head->dim() != 2) {
        head_why = "lm_head: unexpected shape";
      } else if (team_linear_of(*head, head_s, c10::nullopt, t, max_rows, H, hl, head_why, "lm_head", int4_q8)) {
        J.head = hl;
      }
    }
    if (J.head.w != nullptr) {
      limit(J.head);
      J.final_norm = final_norm->data_ptr();
      J.final_eps = static_cast<float>(final_eps);
      held.push_back(*final_norm);
      held.push_back(*head);
      if (head_s.has_value()) held.push_back(*head_s);
    }
    for (at::TensorList l : {in_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, mlp_a, mlp_b, router, qkv_s,
                             o_s, mlp_a_s, mlp_b_s})
      held.insert(held.end(), l.begin(), l.end());
    return true;
#else
    return no("this build has no vector kernels");
#endif
  }

  bool has_head() const { return why.empty() && job.head.w != nullptr; }
  std::string reason() const { return why; }
  std::string head_reason() const { return head_why; }

  // One decode-only step through every layer (and, with `logits` and a head, the final norm and LM head ->
  // float32 [M, V]), or nullopt where the step is outside what the team runs (more rows than its kernels take,
  // another dtype...): the caller then runs it op by op. moe_ks: experts per token of each MoE layer (empty:
  // the model's own k); moe_top_k / moe_allowed: empty, or one tensor per layer (an empty one: no limit).
  c10::optional<at::Tensor> run(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& slot_mapping, const at::Tensor& rows, const at::Tensor& kv_slots,
                                const at::Tensor& ctx_lens, at::IntArrayRef moe_ks, at::TensorList moe_top_k,
                                at::TensorList moe_allowed, bool logits) {
#if LLP_SIMD
    if (!why.empty()) return c10::nullopt;
    const at::ScalarType t = h_in.scalar_type();
    if (t != dtype || h_in.dim() != 2 || !h_in.is_contiguous() || h_in.size(0) == 0 || h_in.size(1) != job.H)
      return c10::nullopt;
    const int64_t M = h_in.size(0), D = job.D;
    if (!few_rows(M, job.max_rows) || M > rows_limit) return c10::nullopt;
    const at::Tensor cs = cos.contiguous(), sn = sin.contiguous();
    if (cs.scalar_type() != t || sn.scalar_type() != t || cs.dim() != 2 || cs.size(0) != M || cs.size(1) != D ||
        sn.sizes() != cs.sizes())
      return c10::nullopt;
    if (slot_mapping.scalar_type() != at::kLong || slot_mapping.numel() != M || !slot_mapping.is_contiguous())
      return c10::nullopt;
    // row m is sequence m's one query (a decode-only step's layout): the region's attention items rely on it
    if (rows.scalar_type() != at::kLong || rows.numel() != M || !rows.is_contiguous()) return c10::nullopt;
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      if (rp[m] != m) return c10::nullopt;
    const int64_t* sm = slot_mapping.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(sm[m] >= 0 && sm[m] < num_slots, "decode_layers: slot_mapping[", m, "] = ", sm[m],
                  " out of range [0, ", num_slots, ")");
    std::lock_guard<std::mutex> lock(mu);
    TeamJob J = job;
    if (!setup(J, M, h_in.options(), moe_ks, moe_top_k, moe_allowed)) return c10::nullopt;
    J.h_in = h_in.data_ptr(), J.cos = cs.data_ptr(), J.sin = sn.data_ptr(), J.slot_mapping = sm;
    J.rows = rows, J.kv_slots = kv_slots, J.ctx_lens = ctx_lens;
    return launch(J, logits, false)[0];
#else
    return c10::nullopt;
#endif
  }

  // The same step from its tokens: row m embeds ids[m] (a row of `embed`), sits at position ctx_lens[m] - 1
  // (its rows of the cos / sin tables) and writes its K/V to kv_slots[m, ctx_lens[m] - 1] -- what the decode
  // stage would otherwise gather with a handful of framework calls, each slow right after the weights have
  // streamed through the caches. Returns [] where the team does not take the step (then run / op by op), else
  // [out] and with `argmax` (needs `logits` and the head) [logits, first maximum of each row] (argmax_rows'
  // result, searched by each thread in its share of the vocabulary as it writes it).
  std::vector<at::Tensor> run_tokens(const at::Tensor& ids, const at::Tensor& embed, const at::Tensor& cos_table,
                                     const at::Tensor& sin_table, const at::Tensor& kv_slots,
                                     const at::Tensor& ctx_lens, at::IntArrayRef moe_ks, at::TensorList moe_top_k,
                                     at::TensorList moe_allowed, bool logits, bool argmax) {
#if LLP_SIMD
    if (!why.empty()) return {};
    const at::ScalarType t = dtype;
    const int64_t H = job.H, D = job.D;
    if (ids.scalar_type() != at::kLong || ids.dim() != 1 || !ids.is_contiguous() || ids.numel() == 0) return {};
    const int64_t M = ids.numel();
    if (!few_rows(M, job.max_rows) || M > rows_limit) return {};
    if (embed.scalar_type() != t || embed.dim() != 2 || embed.size(1) != H || !embed.is_contiguous()) return {};
    for (const at::Tensor* tab : {&cos_table, &sin_table})
      if (tab->scalar_type() != t || tab->dim() != 2 || tab->size(1) != D || !tab->is_contiguous()) return {};
    if (sin_table.size(0) != cos_table.size(0)) return {};
    if (ctx_lens.scalar_type() != at::kLong || ctx_lens.numel() != M || !ctx_lens.is_contiguous()) return {};
    if (kv_slots.scalar_type() != at::kLong || kv_slots.dim() != 2 || kv_slots.size(0) != M ||
        !kv_slots.is_contiguous())
      return {};
    const int64_t* ip = ids.data_ptr<int64_t>();
    const int64_t* lp = ctx_lens.data_ptr<int64_t>();
    const int64_t* kp = kv_slots.data_ptr<int64_t>();
    const int64_t V = embed.size(0), P = cos_table.size(0), L = kv_slots.size(1);
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(ip[m] >= 0 && ip[m] < V, "decode_layers: token id ", ip[m], " of row ", m,
                  " out of range [0, ", V, ")");
      TORCH_CHECK(lp[m] >= 1 && lp[m] <= L, "decode_layers: ctx_lens[", m, "] = ", lp[m], " outside [1, ", L, "]");
      if (lp[m] > P) return {};  // past the rotary tables: the caller's path says so
      const int64_t slot = kp[m * L + lp[m] - 1];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "decode_layers: the new K/V slot of row ", m, " = ", slot,
                  " out of range [0, ", num_slots, ")");
    }
    std::lock_guard<std::mutex> lock(mu);
    TeamJob J = job;
    if (!setup(J, M, embed.options(), moe_ks, moe_top_k, moe_allowed)) return {};
    const size_t elt = embed.element_size();
    auto* h = static_cast<char*>(bufs.h_in), *cs = static_cast<char*>(bufs.cos), *sn = static_cast<char*>(bufs.sin);
    const auto* e = static_cast<const char*>(embed.data_ptr());
    const auto* ct = static_cast<const char*>(cos_table.data_ptr());
    const auto* st = static_cast<const char*>(sin_table.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(h + m * H * elt, e + ip[m] * H * elt, H * elt);
      std::memcpy(cs + m * D * elt, ct + (lp[m] - 1) * D * elt, D * elt);
      std::memcpy(sn + m * D * elt, st + (lp[m] - 1) * D * elt, D * elt);
      bufs.slots[m] = kp[m * L + lp[m] - 1];
    }
    J.h_in = h, J.cos = cs, J.sin = sn, J.slot_mapping = bufs.slots;
    // rows m-1 and m of one sequence (a speculative draft verified: its positions in order, on the same slot row)
    // when row m's context holds row m-1's new slot: then every K/V is written before any row attends
    J.chained = false;
    for (int64_t m = 1; m < M && !J.chained; ++m) {
      const int64_t p = lp[m - 1] - 1;
      J.chained = p < lp[m] && kp[m * L + p] == bufs.slots[m - 1];
    }
    if (arange.numel() < M) arange = at::arange(std::max<int64_t>(M, 64), ids.options());
    J.rows = arange.narrow(0, 0, M), J.kv_slots = kv_slots, J.ctx_lens = ctx_lens;
    return launch(J, logits, argmax);
#else
    return {};
#endif
  }

 private:
  // Scratch kept from step to step, grown as steps need more and never shrunk: a step would otherwise allocate
  // a dozen buffers whose first touch, right after the weights have streamed through the caches, costs more
  // than their use. `mu` keeps it to one step at a time.
  std::mutex mu;
  at::Tensor scratch, arange;
  std::vector<RowMax> row_max;
  std::unique_ptr<RowShare[]> row_q;  // every projection's row shares (TeamJob::row_q), kept across steps
  int64_t row_q_size = 0;
  struct Bufs {
    void *qkv, *attn, *a, *d, *gu, *act, *priv, *ys, *h_in, *cos, *sin;
    int64_t* slots;
  } bufs{};

#if LLP_SIMD
  // the MoE limits of this step into J, and J's buffers for M rows; false where the step cannot run
  bool setup(TeamJob& J, int64_t M, const at::TensorOptions& opts, at::IntArrayRef moe_ks, at::TensorList moe_top_k,
             at::TensorList moe_allowed) {
    const size_t n = job.layers.size();
    TORCH_CHECK(moe_ks.empty() || moe_ks.size() == n, "decode_layers: moe_ks needs one entry per MoE layer");
    TORCH_CHECK(moe_top_k.empty() || moe_top_k.size() == n, "decode_layers: moe_top_k is empty or per layer");
    TORCH_CHECK(moe_allowed.empty() || moe_allowed.size() == n, "decode_layers: moe_allowed is empty or per layer");
    J.M = M;
    J.opts = opts;
    if (job.layers[0].router.defined()) {
      for (size_t i = 0; i < n; ++i) {
        TeamLayer& L = J.layers[i];
        L.moe_k = std::min<int64_t>(moe_ks.empty() ? native_k : moe_ks[i], L.experts);
        if (L.moe_k < 1) return false;
        if (!moe_top_k.empty()) L.top_k = route_top_k(moe_top_k[i], M);
        if (!moe_allowed.empty()) L.allowed = route_allowed(moe_allowed[i], M, L.experts);
        J.K = std::max(J.K, L.moe_k);
      }
    }
    const int64_t H = J.H, D = J.D, hq = J.hq, hk = J.hk, QKV = (hq + 2 * hk) * D, I = J.I;
    const int64_t packed = M * std::max<int64_t>(J.K, 1);  // rows of every expert's pack (M for a dense MLP)
    const int nt = std::max(1, at::get_num_threads());
    const int64_t elt = c10::elementSize(dtype);
    size_t off = 0;
    std::vector<size_t> offsets;
    for (int64_t elems : {M * QKV, M * hq * D, M * H, M * H, packed * 2 * I, packed * I, nt * 4 * M * H, packed * H,
                          M * H, M * D, M * D}) {
      offsets.push_back(off);
      off += (static_cast<size_t>(elems * elt) + 63) / 64 * 64;
    }
    offsets.push_back(off);
    off += static_cast<size_t>(M) * sizeof(int64_t);
    if (!scratch.defined() || static_cast<size_t>(scratch.numel()) < off + 64)
      scratch = at::empty({static_cast<int64_t>(off + 64) * 5 / 4}, opts.dtype(at::kByte));  // room to grow
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch.data_ptr()) + 63) / 64 * 64);
    void** slots[] = {&bufs.qkv, &bufs.attn, &bufs.a, &bufs.d, &bufs.gu, &bufs.act, &bufs.priv, &bufs.ys,
                      &bufs.h_in, &bufs.cos, &bufs.sin};
    for (size_t i = 0; i < 11; ++i) *slots[i] = base + offsets[i];
    bufs.slots = reinterpret_cast<int64_t*>(base + offsets[11]);
    const at::TensorOptions o = opts.dtype(dtype);
    J.q = at::from_blob(bufs.qkv, {M, hq + 2 * hk, D}, o).narrow(1, 0, hq);
    J.attn = at::from_blob(bufs.attn, {M, hq, D}, o);
    J.qkv = bufs.qkv, J.a = bufs.a, J.gu = bufs.gu, J.act = bufs.act, J.d = bufs.d, J.ys = bufs.ys;
    return true;
  }

  // the region over J (inputs, rows and buffers set): [out] or, with argmax, [logits, each row's first maximum]
  std::vector<at::Tensor> launch(TeamJob& J, bool logits, bool argmax) {
    const int64_t M = J.M, H = J.H, hk = J.hk;
    const size_t n = J.layers.size();
    // what the op-by-op path checks as it goes, checked before any thread starts (a check that fails inside the
    // region would leave the others waiting)
    for (const TeamLayer& L : J.layers)
      llp::check_paged_attention(J.attn, J.q, L.k_cache, L.v_cache, J.rows, J.kv_slots, J.ctx_lens, 1);
    const bool to_logits = logits && J.head.w != nullptr;
    const int nt = std::max(1, at::get_num_threads());
    at::Tensor out, head_out;
    if (to_logits) {
      out = at::empty({M, J.head.O}, J.opts.dtype(at::kFloat));
      head_out = dtype == at::kFloat ? out : at::empty({M, J.head.O}, J.opts.dtype(dtype));
      J.head_out = head_out.data_ptr();
      J.logits = out.data_ptr<float>();
      if (argmax) {
        row_max.assign(static_cast<size_t>(nt) * M, RowMax{-1, 0.f, false});
        J.row_max = row_max.data();
      }
    } else {
      out = at::empty({M, H}, J.opts.dtype(dtype));
      J.head_out = nullptr;
    }
    // the fewest runs of kv heads per row (the longest contiguous K/V reads) that make two items per thread, so
    // a thread that stalls leaves work to the others; one per thread for a row decoding alone (equal items)
    J.attn_runs = hk;
    for (int64_t r = 1; r <= hk; ++r)
      if (hk % r == 0 && M * r >= nt * std::min<int64_t>(M, 2)) {
        J.attn_runs = r;
        break;
      }
    std::unique_ptr<std::atomic<int64_t>[]> attn_next(new std::atomic<int64_t>[2 * n]());
    J.attn_next = attn_next.get();
    // every projection's rows, one share per thread asked for
    const int64_t shares = (static_cast<int64_t>(n) * (kPhases + 2 * J.E) + 1) * nt;
    if (row_q_size < shares) row_q.reset(new RowShare[shares]), row_q_size = shares;
    J.row_q = row_q.get();
    J.row_shares = nt;
    for (size_t l = 0; l < n; ++l) {
      const TeamLayer& L = J.layers[l];
      reset_rows(J.rows_of(l, kQkvRows), L.qkv.O, nt);
      reset_rows(J.rows_of(l, kORows), H, nt);
      reset_rows(J.rows_of(l, kUpRows), L.down.K, nt);
      reset_rows(J.rows_of(l, kDownRows), H, nt);
      for (int64_t e = 0; e < L.experts; ++e) {
        reset_rows(J.rows_of(l, kPhases + e), L.down.K, nt);
        reset_rows(J.rows_of(l, kPhases + J.E + e), H, nt);
      }
    }
    if (to_logits) reset_rows(J.head_rows(), J.head.O, nt);
    J.out = out.data_ptr();
    SpinBarrier bar;
    std::exception_ptr err;
    std::mutex err_mu;
    int team = nt;
    dispatch_float_types(dtype, "decode_layers", [&](auto tag) {
      using T = decltype(tag);
      T* pp = static_cast<T*>(bufs.priv);
#pragma omp parallel num_threads(nt)
      {
#pragma omp single
        bar.team = omp_get_num_threads();
        const int tid = omp_get_thread_num();
        try {
          team_body<T>(J, tid, bar.team, bar, pp + static_cast<int64_t>(tid) * 4 * M * H);
        } catch (...) {
          {
            std::lock_guard<std::mutex> g(err_mu);
            if (!err) err = std::current_exception();
          }
          bar.failed.store(true);
        }
      }
      team = bar.team;
    });
    if (err) std::rethrow_exception(err);
    team_runs.fetch_add(1);
    if (!to_logits || !argmax) return {out};
    // each row's first maximum over the threads' shares (ascending vocabulary ranges): the first share holding
    // a NaN decides, else the largest value, the earlier share on ties
    at::Tensor idx = at::empty({M}, J.opts.dtype(at::kLong));
    int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      RowMax best{-1, 0.f, false};
      for (int th = 0; th < team; ++th) best = first_of(best, row_max[th * M + m]);
      TORCH_CHECK(best.idx >= 0, "decode_layers: no thread searched row ", m, " of the logits");
      ip[m] = best.idx;
    }
    return {out, idx};
  }
#endif
};

// every per-layer list has one entry per layer (the optional ones: none or one per layer)
void check_layer_lists(size_t n, at::TensorList qkv_w, at::TensorList qkv_b, at::TensorList q_norm,
                       at::TensorList k_norm, at::TensorList k_caches, at::TensorList v_caches, at::TensorList o_w,
                       at::TensorList o_b, at::TensorList post_norm, at::TensorList mlp_a, at::TensorList mlp_b,
                       at::TensorList router, at::IntArrayRef windows, at::TensorList qkv_s, at::TensorList o_s,
                       at::TensorList mlp_a_s, at::TensorList mlp_b_s) {
  for (size_t len : {qkv_s.size(), o_s.size(), mlp_a_s.size(), mlp_b_s.size()})
    TORCH_CHECK(len == 0 || len == n, "decode_layers: the int8 scale lists are empty (float weights) or per layer");
  for (size_t len : {qkv_w.size(), k_caches.size(), v_caches.size(), o_w.size(), post_norm.size(), mlp_a.size(),
                     mlp_b.size(), windows.size()})
    TORCH_CHECK(len == n, "decode_layers: every per-layer list needs one entry per layer");
  TORCH_CHECK(qkv_b.empty() || qkv_b.size() == n, "decode_layers: qkv_b is empty or per layer");
  TORCH_CHECK(o_b.empty() || o_b.size() == n, "decode_layers: o_b is empty or per layer");
  TORCH_CHECK(q_norm.size() == k_norm.size() && (q_norm.empty() || q_norm.size() == n),
              "decode_layers: q_norm/k_norm are empty or per layer");
  TORCH_CHECK(router.empty() || router.size() == n, "decode_layers: router is empty (dense) or per layer (MoE)");
}

c10::intrusive_ptr<DecodePlan> make_decode_plan(
    at::TensorList in_norm, at::TensorList qkv_w, at::TensorList qkv_b, at::TensorList q_norm, at::TensorList k_norm,
    at::TensorList k_caches, at::TensorList v_caches, at::TensorList o_w, at::TensorList o_b, at::TensorList post_norm,
    at::TensorList mlp_a, at::TensorList mlp_b, at::TensorList router, at::IntArrayRef windows, double eps,
    double qk_eps, double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t moe_k,
    bool moe_normalize, int64_t max_rows, at::TensorList qkv_s, at::TensorList o_s, at::TensorList mlp_a_s,
    at::TensorList mlp_b_s, const c10::optional<at::Tensor>& final_norm, double final_eps,
    const c10::optional<at::Tensor>& head, const c10::optional<at::Tensor>& head_s, bool int4_q8) {
  check_layer_lists(in_norm.size(), qkv_w, qkv_b, q_norm, k_norm, k_caches, v_caches, o_w, o_b, post_norm, mlp_a,
                    mlp_b, router, windows, qkv_s, o_s, mlp_a_s, mlp_b_s);
  auto plan = c10::make_intrusive<DecodePlan>();
  plan->build(in_norm, qkv_w, qkv_b, q_norm, k_norm, k_caches, v_caches, o_w, o_b, post_norm, mlp_a, mlp_b, router,
              windows, eps, qk_eps, scale, num_heads, num_kv_heads, head_dim, moe_k, moe_normalize, max_rows, qkv_s,
              o_s, mlp_a_s, mlp_b_s, final_norm, final_eps, head, head_s, int4_q8);
  return plan;
}

// Every decoder layer of a decode-only step in one call: per layer the attention block above, then the dense MLP
// (router empty) or the MoE block (router, then the experts), exactly as the per-layer calls run them. What goes
// is the return to Python between layers, during which the memory streams stand idle. A MoE layer i routes with
// moe_ks[i] experts per token and the TierSet limits moe_top_k[i] / moe_allowed[i] (each list empty, or one
// tensor per layer where an empty tensor means no limit), as moe_route takes them.
at::Tensor decode_layers(const at::Tensor& h_in, at::TensorList in_norm, at::TensorList qkv_w, at::TensorList qkv_b,
                         at::TensorList q_norm, at::TensorList k_norm, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& rows, const at::Tensor& kv_slots, const at::Tensor& ctx_lens,
                         at::TensorList o_w, at::TensorList o_b, at::TensorList post_norm, at::TensorList mlp_a,
                         at::TensorList mlp_b,
                         at::TensorList router, at::IntArrayRef windows, double eps, double qk_eps, double scale,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::IntArrayRef moe_ks,
                         at::TensorList moe_top_k, at::TensorList moe_allowed, bool moe_normalize, int64_t max_rows,
                         at::TensorList qkv_s, at::TensorList o_s, at::TensorList mlp_a_s, at::TensorList mlp_b_s,
                         bool team) {
  const size_t n = in_norm.size();
  TORCH_CHECK(router.empty() || moe_ks.size() == n, "decode_layers: moe_ks needs one entry per MoE layer");
  TORCH_CHECK(moe_top_k.empty() || moe_top_k.size() == n, "decode_layers: moe_top_k is empty or per layer");
  TORCH_CHECK(moe_allowed.empty() || moe_allowed.size() == n, "decode_layers: moe_allowed is empty or per layer");
  if (team) {  // a plan for this one call (the engine keeps its plan: ops.decode_layers)
    const auto plan = make_decode_plan(in_norm, qkv_w, qkv_b, q_norm, k_norm, k_caches, v_caches, o_w, o_b,
                                       post_norm, mlp_a, mlp_b, router, windows, eps, qk_eps, scale, num_heads,
                                       num_kv_heads, head_dim, router.empty() ? 0 : moe_ks[0], moe_normalize,
                                       max_rows, qkv_s, o_s, mlp_a_s, mlp_b_s, c10::nullopt, 0.0, c10::nullopt,
                                       c10::nullopt, false);
    const auto out = plan->run(h_in, cos, sin, slot_mapping, rows, kv_slots, ctx_lens, moe_ks, moe_top_k, moe_allowed,
                               false);
    if (out.has_value()) return *out;
  } else {
    check_layer_lists(n, qkv_w, qkv_b, q_norm, k_norm, k_caches, v_caches, o_w, o_b, post_norm, mlp_a, mlp_b, router,
                      windows, qkv_s, o_s, mlp_a_s, mlp_b_s);
  }
  auto opt = [](at::TensorList l, size_t i) { return l.empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(l[i]); };
  at::Tensor h = h_in;
  for (size_t i = 0; i < n; ++i) {
    auto [s, x] = decode_attention_block(
        h, in_norm[i], eps, qkv_w[i], qkv_b.empty() ? c10::optional<at::Tensor>() : qkv_b[i],
        q_norm.empty() ? c10::optional<at::Tensor>() : q_norm[i], k_norm.empty() ? c10::optional<at::Tensor>() : k_norm[i],
        qk_eps, cos, sin, k_caches[i], v_caches[i], slot_mapping, rows, kv_slots, ctx_lens, scale, windows[i], o_w[i],
        o_b.empty() ? c10::optional<at::Tensor>() : o_b[i], post_norm[i], num_heads, num_kv_heads, head_dim,
        max_rows, opt(qkv_s, i), opt(o_s, i));
    if (router.empty()) {
      h = residual_mlp(s, x, mlp_a[i], mlp_b[i], max_rows, opt(mlp_a_s, i), opt(mlp_b_s, i));
    } else {
      const c10::optional<at::Tensor> top_k = moe_top_k.empty() ? c10::optional<at::Tensor>() : moe_top_k[i];
      const c10::optional<at::Tensor> allowed = moe_allowed.empty() ? c10::optional<at::Tensor>() : moe_allowed[i];
      auto [idx, w] = moe_route(x, router[i], moe_ks[i], moe_normalize, max_rows, top_k, allowed);
      h = s + moe_experts(x, idx, w, mlp_a[i], mlp_b[i], max_rows, opt(mlp_a_s, i), opt(mlp_b_s, i));
    }
  }
  return h;
}

}  // namespace

using Tensors = std::vector<at::Tensor>;
using Ints = std::vector<int64_t>;

TORCH_LIBRARY_FRAGMENT(litellm_pipeline_cpu, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init([](Tensors in_norm, Tensors qkv_w, Tensors qkv_b, Tensors q_norm, Tensors k_norm,
                          Tensors k_caches, Tensors v_caches, Tensors o_w, Tensors o_b, Tensors post_norm,
                          Tensors mlp_a, Tensors mlp_b, Tensors router, Ints windows, double eps, double qk_eps,
                          double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t moe_k,
                          bool moe_normalize, int64_t max_rows, Tensors qkv_s, Tensors o_s, Tensors mlp_a_s,
                          Tensors mlp_b_s, c10::optional<at::Tensor> final_norm, double final_eps,
                          c10::optional<at::Tensor> head, c10::optional<at::Tensor> head_s, bool int4_q8) {
        return make_decode_plan(in_norm, qkv_w, qkv_b, q_norm, k_norm, k_caches, v_caches, o_w, o_b, post_norm, mlp_a,
                                mlp_b, router, windows, eps, qk_eps, scale, num_heads, num_kv_heads, head_dim, moe_k,
                                moe_normalize, max_rows, qkv_s, o_s, mlp_a_s, mlp_b_s, final_norm, final_eps, head,
                                head_s, int4_q8);
      }))
      .def("run",
           [](const c10::intrusive_ptr<DecodePlan>& self, at::Tensor h, at::Tensor cos, at::Tensor sin,
              at::Tensor slot_mapping, at::Tensor rows, at::Tensor kv_slots, at::Tensor ctx_lens, Ints moe_ks,
              Tensors moe_top_k, Tensors moe_allowed, bool logits) {
             return self->run(h, cos, sin, slot_mapping, rows, kv_slots, ctx_lens, moe_ks, moe_top_k, moe_allowed,
                              logits);
           })
      .def("run_tokens",
           [](const c10::intrusive_ptr<DecodePlan>& self, at::Tensor ids, at::Tensor embed, at::Tensor cos_table,
              at::Tensor sin_table, at::Tensor kv_slots, at::Tensor ctx_lens, Ints moe_ks, Tensors moe_top_k,
              Tensors moe_allowed, bool logits, bool argmax) {
             return self->run_tokens(ids, embed, cos_table, sin_table, kv_slots, ctx_lens, moe_ks, moe_top_k,
                                     moe_allowed, logits, argmax);
           })
      .def("has_head", [](const c10::intrusive_ptr<DecodePlan>& self) { return self->has_head(); })
      .def("reason", [](const c10::intrusive_ptr<DecodePlan>& self) { return self->reason(); })
      .def("head_reason", [](const c10::intrusive_ptr<DecodePlan>& self) { return self->head_reason(); });
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("row_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_supported", &small_linear_supported);
  m.def("row_linear_path", &row_linear_path);
  m.def("simd_isa", &simd_isa);
  m.def("stream_read(Tensor x) -> float");
  m.def("native_bf16_gemm", &native_bf16_gemm);
  m.def("native_fp16_gemm", &native_fp16_gemm);
  m.def("decode_team_runs", &decode_team_runs);
  m.def("take_rows_trace", &take_rows_trace);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "decode_attention_block(Tensor h, Tensor in_norm_w, float eps, Tensor qkv_w, Tensor? qkv_b, Tensor? q_norm_w, "
      "Tensor? k_norm_w, float qk_eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor rows, Tensor kv_slots, Tensor ctx_lens, float scale, int window, Tensor o_w, "
      "Tensor? o_b, Tensor post_norm_w, int num_heads, int num_kv_heads, int head_dim, int max_rows, "
      "Tensor? qkv_s=None, Tensor? o_s=None) -> (Tensor, Tensor)");
  m.def(
      "moe_route(Tensor x, Tensor gate_w, int k, bool normalize, int max_rows, Tensor? top_k=None, "
      "Tensor? allowed=None) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor h, Tensor[] in_norm, Tensor[] qkv_w, Tensor[] qkv_b, Tensor[] q_norm, Tensor[] k_norm, "
      "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor rows, "
      "Tensor kv_slots, Tensor ctx_lens, Tensor[] o_w, Tensor[] o_b, Tensor[] post_norm, Tensor[] mlp_a, "
      "Tensor[] mlp_b, "
      "Tensor[] router, int[] windows, float eps, float qk_eps, float scale, int num_heads, int num_kv_heads, "
      "int head_dim, int[] moe_ks, Tensor[] moe_top_k, Tensor[] moe_allowed, bool moe_normalize, int max_rows, "
      "Tensor[] qkv_s, Tensor[] o_s, Tensor[] mlp_a_s, Tensor[] mlp_b_s, bool team=True) -> Tensor");
  m.def("residual_mlp(Tensor h, Tensor x, Tensor gate_up_w, Tensor down_w, int max_rows, Tensor? gate_up_s=None, "
        "Tensor? down_s=None) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor expert_idx, Tensor expert_w, Tensor w13, Tensor w2, int max_rows, "
        "Tensor? w13_s=None, Tensor? w2_s=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(litellm_pipeline_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("stream_read", &stream_read);
  m.impl("row_linear", &row_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
  m.impl("moe_experts", &moe_experts);
  m.impl("decode_attention_block", &decode_attention_block);
  m.impl("residual_mlp", &residual_mlp);
  m.impl("moe_route", &moe_route);
  m.impl("decode_layers", &decode_layers);
}
