// 4-bit weight-only linear for ``layer_ops: cpu_int4``:
//
//   y[M, O] = x[M, K] @ W^T (+ bias[O]),   W[o, k] = n[o, k] * d[o, g] + z[o, g],   g = k / G
//
// n is a 4-bit code in [0, 15]; d the group's scale and z its offset (float16 or bfloat16, one per G weights of a
// row); symmetric groups store no z and use z = -8 d (the code centred on 8). qw packs two codes per byte: in each
// run of 32 weights of a row, byte j holds weight j in its low nibble and weight j + 16 in its high one (the
// layout of llama.cpp's Q4_0 blocks), so 16 bytes unpack into two runs of 16 consecutive weights. G is a multiple
// of 32 and K a multiple of G.
//
// Every weight is widened once (n exact in float32, n * d + z one fma: exact for symmetric groups, where
// (n - 8) * d needs at most 15 bits), then every output is one float32 dot product over k in a fixed lane order,
// scaled by nothing more, biased and rounded once to x's dtype. The order for one output never depends on M or on
// the tile that computed it, so a row's result is the same alone or in any batch (batch-invariant).
//
// AVX-512 (F): tiles of R weight rows x up to 4 input rows, 16 float32 lanes; AVX2 (+FMA, F16C): the same with 8
// lanes. Threads take runs of 8 output rows (at::parallel_for). Other builds run the scalar loop. With int8
// activations (q8, below) steps of many rows run a GEMM whose int32 lanes are weight rows (q8_gemm_tile).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu_math.h"

#if defined(__AVX512F__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLP_Q4_AVX512 1
#else
#define LLP_Q4_AVX512 0
#endif
#if !LLP_Q4_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLP_Q4_AVX2 1
#else
#define LLP_Q4_AVX2 0
#endif
// the 512-bit int8-activation tile (q8_tile512) and its activation layout (Q8Rows::xq4)
#if LLP_Q4_AVX512 && defined(__AVX512BW__)
#define LLP_Q8_512 1
#else
#define LLP_Q8_512 0
#endif

namespace {

using llp::to_f;

// the arguments of one call, shared by every path
template <typename T, typename S>
struct Q4 {
  const T* x;
  const uint8_t* w;  // [O, K / 2]
  const S* d;        // [O, K / G]
  const S* z;        // [O, K / G], or null: symmetric (z = -8 d)
  const T* bias;
  T* y;
  int64_t M, K, O, G;
  int64_t groups() const { return K / G; }
  float scale(int64_t o, int64_t g) const { return to_f(d[o * groups() + g]); }
  float offset(int64_t o, int64_t g, float dg) const { return z ? to_f(z[o * groups() + g]) : -8.f * dg; }
  T finish(float s, int64_t o) const { return llp::from_f<T>(bias ? s + to_f(bias[o]) : s); }
};

// The next tile's R rows (R * K / 2 contiguous bytes after this tile's) asked for in memory order while this tile
// runs: at byte offset `at` of a row (of K / 2), the lines of [R * at, R * (at + step)) of that region. R short
// strided rows stream poorly on their own (int8_linear.cpp measured 20 -> 30 GB/s with the same order).
inline void prefetch_next(const uint8_t* tile, int64_t R, int64_t half, int64_t at, int64_t step) {
  const uint8_t* next = tile + R * half;
  for (int64_t j = (R * at + 63) / 64 * 64; j < R * (at + step); j += 64)
    __builtin_prefetch(next + j, 0, 3);
}

// the 4-bit code of weight k of a row (see the layout above)
inline int code(const uint8_t* row, int64_t k) {
  const uint8_t b = row[k / 32 * 16 + k % 16];
  return (k % 32) < 16 ? (b & 0x0F) : (b >> 4);
}

// ------------------------------------------------------------------------------------------------------ scalar
template <typename T, typename S>
void q4_rows_scalar(const Q4<T, S>& a, int64_t o0, int64_t o1) {
  const int64_t half = a.K / 2;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wr = a.w + o * half;
    for (int64_t m = 0; m < a.M; ++m) {
      const T* xr = a.x + m * a.K;
      float s = 0.f;
      for (int64_t g = 0; g < a.groups(); ++g) {
        const float dg = a.scale(o, g), zg = a.offset(o, g, dg);
        for (int64_t k = g * a.G; k < (g + 1) * a.G; ++k)
          s = std::fma(to_f(xr[k]), std::fma(static_cast<float>(code(wr, k)), dg, zg), s);
      }
      a.y[m * a.O + o] = a.finish(s, o);
    }
  }
}

#if LLP_Q4_AVX512 || LLP_Q4_AVX2
constexpr int64_t kChunk = 64;  // groups whose scales a tile widens at a time

// n scales (or offsets) widened to float32, 8 at a time (F16C / a shift)
inline void widen(const c10::Half* p, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j))));
  for (; j < n; ++j) out[j] = to_f(p[j]);
}
inline void widen(const c10::BFloat16* p, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j))), 16)));
  for (; j < n; ++j) out[j] = to_f(p[j]);
}

// the scales ds and offsets zs (-8 scale for symmetric groups) of weight rows [o, o + R), groups [g0, g0 + gn),
// as float32: a scalar conversion per group and row would cost as much as its 32 weights
template <typename T, typename S, int R>
inline void widen_groups(const Q4<T, S>& a, int64_t o, int64_t g0, int64_t gn, float (&ds)[R][kChunk],
                         float (&zs)[R][kChunk]) {
  const int64_t ng = a.groups();
  for (int r = 0; r < R; ++r) {
    widen(a.d + (o + r) * ng + g0, ds[r], gn);
    if (a.z)
      widen(a.z + (o + r) * ng + g0, zs[r], gn);
    else
      for (int64_t j = 0; j < gn; ++j) zs[r][j] = -8.f * ds[r][j];
  }
}
#endif

#if LLP_Q4_AVX512
// ----------------------------------------------------------------------------------------------------- AVX-512
inline __m512 q4_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 q4_x16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 q4_x16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// MC input rows x R weight rows [o, o + R) over the whole K. Per group and weight row, the 16 weights its codes
// stand for (n * d + z for n = 0..15, one fma each: what every path computes) fill one register; each 32-weight
// run's 16 bytes are widened to 16 lanes once, and a lane's low 4 bits pick weight j's value from the register
// (vpermps reads only those bits), then, shifted by 4, weight j + 16's: two shuffles and no conversion per 16
// weights, each multiplied into every input row's accumulator
template <typename T, typename S, int MC, int R>
inline void q4_tile(const Q4<T, S>& a, int64_t o, int64_t m0) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t half = a.K / 2;
  const uint8_t* w = a.w + o * half;
  const T* x = a.x + m0 * a.K;
  __m512 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  alignas(64) float ds[R][kChunk], zs[R][kChunk];
  const int64_t ng = a.groups();
  for (int64_t g0 = 0; g0 < ng; g0 += kChunk) {
    const int64_t gn = std::min(kChunk, ng - g0);
    widen_groups<T, S, R>(a, o, g0, gn, ds, zs);
    for (int64_t gi = 0; gi < gn; ++gi) {
      __m512 table[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) table[r] = _mm512_fmadd_ps(iota, _mm512_set1_ps(ds[r][gi]), _mm512_set1_ps(zs[r][gi]));
      const int64_t g = g0 + gi;
      for (int64_t k = g * a.G; k < (g + 1) * a.G; k += 32) {
        __m512i v[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          v[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * half + k / 2)));
        }
        prefetch_next(w, R, half, k / 2, 16);
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {  // weights k..k+15 (low nibbles), then k+16..k+31 (high ones)
          __m512 wv[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            wv[r] = _mm512_permutexvar_ps(p == 0 ? v[r] : _mm512_srli_epi32(v[r], 4), table[r]);
#pragma GCC unroll 4
          for (int m = 0; m < MC; ++m) {
            const __m512 xv = q4_x16(x + m * a.K + k + 16 * p);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) a.y[(m0 + m) * a.O + o + r] = a.finish(_mm512_reduce_add_ps(acc[m][r]), o + r);
}
constexpr int kQ4R1 = 4, kQ4R = 4;  // weight rows per tile: one input row / several
#endif

#if LLP_Q4_AVX2
// -------------------------------------------------------------------------------------------------------- AVX2
inline __m256 q4_x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 q4_x8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 q4_x8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float q4_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// as the AVX-512 tile, in four runs of 8 weights per 32 (low nibbles of bytes 0-7, 8-15, then the high ones)
template <typename T, typename S, int MC, int R>
inline void q4_tile(const Q4<T, S>& a, int64_t o, int64_t m0) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t half = a.K / 2;
  const uint8_t* w = a.w + o * half;
  const T* x = a.x + m0 * a.K;
  __m256 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups(); ++g) {
    float dg[R], zg[R];
    for (int r = 0; r < R; ++r) {
      dg[r] = a.scale(o + r, g);
      zg[r] = a.offset(o + r, g, dg[r]);
    }
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += 32) {
      __m128i b[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        b[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * half + k / 2));
      }
      prefetch_next(w, R, half, k / 2, 16);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // weights k + 8p .. k + 8p + 7
        __m256 wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m128i nib = p < 2 ? _mm_and_si128(b[r], low) : _mm_and_si128(_mm_srli_epi16(b[r], 4), low);
          const __m128i n = (p % 2) ? _mm_srli_si128(nib, 8) : nib;
          wv[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n)), _mm256_set1_ps(dg[r]),
                                  _mm256_set1_ps(zg[r]));
        }
#pragma GCC unroll 4
        for (int m = 0; m < MC; ++m) {
          const __m256 xv = q4_x8(x + m * a.K + k + 8 * p);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) a.y[(m0 + m) * a.O + o + r] = a.finish(q4_hsum8(acc[m][r]), o + r);
}
constexpr int kQ4R1 = 4, kQ4R = 4;  // 16 ymm registers: MC x R accumulators, R weight vectors, one input
#endif

#if LLP_Q4_AVX512 || LLP_Q4_AVX2
// output rows [o0, o1) for every input row: R-row tiles, 4 input rows at a time (then the rest), one row tiles
// for the rows left over
template <typename T, typename S>
void q4_rows_vector(const Q4<T, S>& a, int64_t o0, int64_t o1) {
  int64_t o = o0;
  if (a.M == 1) {
    for (; o + kQ4R1 <= o1; o += kQ4R1) q4_tile<T, S, 1, kQ4R1>(a, o, 0);
  } else {
    for (; o + kQ4R <= o1; o += kQ4R) {
      int64_t m = 0;
      for (; m + 4 <= a.M; m += 4) q4_tile<T, S, 4, kQ4R>(a, o, m);
      switch (a.M - m) {
        case 1: q4_tile<T, S, 1, kQ4R>(a, o, m); break;
        case 2: q4_tile<T, S, 2, kQ4R>(a, o, m); break;
        case 3: q4_tile<T, S, 3, kQ4R>(a, o, m); break;
        default: break;
      }
    }
  }
  for (; o < o1; ++o)
    for (int64_t m = 0; m < a.M; ++m) q4_tile<T, S, 1, 1>(a, o, m);
}
#endif


// ------------------------------------------------------------------------------------ int8 activations (q8)
// llama.cpp's Q4_0 x Q8_0 arithmetic: each input row is quantized in blocks of 32 (xq = round(x / dx) in
// [-127, 127], dx = max|x| / 127 of the block, the same bits on every path), the codes times xq summed exactly in
// integers per block, then y = sum_b (d_g * dx_b) * sum_k n_k xq_k + sum_b z_g * (dx_b * sum_k xq_k) in float32,
// z_g = -8 d_g for symmetric groups. Integer products do 4 (VNNI: one instruction) multiply-adds where the float
// path widens every weight: about twice the weights per instruction, at the cost of rounding the activations.
struct Q8Rows {  // M rows of x quantized: xq [M, K], dx and e = dx * sum(xq) per block [M, K / 32]
  std::vector<int8_t> xq;
  std::vector<float> dx, e;
  std::vector<int32_t> sum;  // sum(xq) per block [M, K / 32] (the GEMM's symmetric offsets)
  // the 512-bit tile's layout of xq [M, K]: per four blocks, the first 16 codes of each, then the last 16
  std::vector<int8_t> xq4;
};

template <typename T>
void quantize_q8(const T* x, int64_t M, int64_t K, Q8Rows& q, bool tile_layout = true, bool parallel = false) {
  const int64_t nb = K / 32;
  q.xq.resize(M * K), q.dx.resize(M * nb), q.e.resize(M * nb), q.sum.resize(M * nb);
  auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const T* xb = x + m * K + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(xb[j])));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = q.xq.data() + m * K + b * 32;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
          const int v = static_cast<int>(std::nearbyint(to_f(xb[j]) * inv));
          qb[j] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
          sum += qb[j];
        }
        q.dx[m * nb + b] = d;
        q.e[m * nb + b] = d * static_cast<float>(sum);
        q.sum[m * nb + b] = sum;
      }
  };
  // parallel (the op, not a thread of the decode step's team): rows on the op's threads where there are many (a
  // prompt's rows: as long as a GEMM's share of them)
  if (parallel)
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), rows);
  else
    rows(0, M);
#if LLP_Q8_512
  if (!tile_layout) return;
  q.xq4.resize(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b + 4 <= nb; b += 4)
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h)  // 16 codes of block b + j (its first or its last 16) to quarter j of half h
          std::memcpy(q.xq4.data() + m * K + b * 32 + h * 64 + j * 16, q.xq.data() + m * K + (b + j) * 32 + h * 16, 16);
#else
  (void)tile_layout;
#endif
}

// the weight rows [o0, o1)'s 32-weight blocks against quantized rows: the scalar loop
template <typename T, typename S>
void q8_rows_scalar(const Q4<T, S>& a, const Q8Rows& q, int64_t o0, int64_t o1) {
  const int64_t nb = a.K / 32, per = a.G / 32, half = a.K / 2;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wr = a.w + o * half;
    for (int64_t m = 0; m < a.M; ++m) {
      const int8_t* xq = q.xq.data() + m * a.K;
      float acc = 0.f, off = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          isum += (wr[b * 16 + j] & 0x0F) * xq[b * 32 + j];
          isum += (wr[b * 16 + j] >> 4) * xq[b * 32 + 16 + j];
        }
        const float dg = a.scale(o, b / per);
        acc = std::fma(static_cast<float>(isum), dg * q.dx[m * nb + b], acc);
        off = std::fma(a.offset(o, b / per, dg), q.e[m * nb + b], off);
      }
      a.y[m * a.O + o] = a.finish(acc + off, o);
    }
  }
}

#if LLP_Q4_AVX512 || LLP_Q4_AVX2
// 32 codes of a block, in weight order (the low nibbles are weights 0-15, the high ones 16-31)
inline __m256i q8_codes(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
// 8 lanes of sums of 4 products codes (u8) x xq (s8), exact: VNNI's one instruction, else pairs then quads
inline __m256i q8_dot(__m256i codes, __m256i xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xq);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, xq);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), _mm256_set1_epi16(1));  // |pair| <= 2 * 15 * 127
#endif
}
inline float q8_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// MC quantized input rows x R weight rows: a block's codes unpacked once per weight row, then one integer dot
// product, conversion and scaled accumulation per input row; the offsets' part summed in scalars alongside
template <typename T, typename S, int MC, int R>
inline void q8_tile(const Q4<T, S>& a, const Q8Rows& q, int64_t o, int64_t m0) {
  const int64_t nb = a.K / 32, per = a.G / 32, half = a.K / 2, ng = a.groups();
  alignas(32) float ds[R][kChunk], zs[R][kChunk];
  __m256 acc[MC][R];
  float off[MC][R] = {};
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < ng; g0 += kChunk) {
    const int64_t gn = std::min(kChunk, ng - g0);
    widen_groups<T, S, R>(a, o, g0, gn, ds, zs);
    for (int64_t b = g0 * per; b < (g0 + gn) * per; ++b) {
      const int64_t gi = b / per - g0;
      __m256i codes[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        codes[r] = q8_codes(a.w + (o + r) * half + b * 16);
      }
      prefetch_next(a.w + o * half, R, half, b * 16, 16);
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.xq.data() + (m0 + m) * a.K + b * 32));
        const float dx = q.dx[(m0 + m) * nb + b], e = q.e[(m0 + m) * nb + b];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot(codes[r], xv)), _mm256_set1_ps(ds[r][gi] * dx),
                                      acc[m][r]);
          off[m][r] = std::fma(zs[r][gi], e, off[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) a.y[(m0 + m) * a.O + o + r] = a.finish(q8_hsum8(acc[m][r]) + off[m][r], o + r);
}

#if LLP_Q8_512
// 128 weights (four blocks) per step in 512-bit registers. The 64 code bytes of blocks b..b+3 give two registers,
// their low nibbles (weights 0-15 of each block, one 128-bit quarter per block) and their high ones (weights
// 16-31): an AND, a shift and an AND. The activations are laid out to match once per call (quantize_q8's xq4: per
// four blocks, the first 16 of each, then the last 16), so two vpdpbusd (VNNI; vpmaddubsw + vpmaddwd on AVX-512
// without it) sum each block in the four int32 lanes of its quarter. Each lane is then scaled by its block's d_g
// and dx_b, and the offsets' part z_g * e_b spread over the block's 4 lanes (e_b / 4, exact): two FMAs. About
// eleven instructions per 128 weights and weight row where the 256-bit tile takes about forty. Blocks past the
// last four are summed apart (256-bit).
inline __m512i q8_dot512(__m512i lo, __m512i xlo, __m512i hi, __m512i xhi) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
#else
  const __m512i one = _mm512_set1_epi16(1);  // |pair| <= 2 * 15 * 127
  return _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(lo, xlo), one),
                          _mm512_madd_epi16(_mm512_maddubs_epi16(hi, xhi), one));
#endif
}
// four floats p[0..3] as lanes [p0 x4, p1 x4, p2 x4, p3 x4] (the blocks' quarters, see above)
inline __m512 q8_quad(const float* p, __m512i idx) {
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(p)));
}
// the scales (or offsets) of blocks b..b+3 from p, which holds the groups from g0 on (G = per blocks)
inline __m512 q8_groups(const float* p, int64_t b, int64_t per, int64_t g0, __m512i idx) {
  if (per == 1) return q8_quad(p + b - g0, idx);
  const int64_t g = b / per - g0;
  if (per % 4 == 0) return _mm512_set1_ps(p[g]);  // four blocks of one group
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(p[g], p[(b + 1) / per - g0],
                                                                          p[(b + 2) / per - g0], p[(b + 3) / per - g0])));
}

template <typename T, typename S, int MC, int R>
inline void q8_tile512(const Q4<T, S>& a, const Q8Rows& q, int64_t o, int64_t m0) {
  const int64_t nb = a.K / 32, per = a.G / 32, half = a.K / 2, ng = a.groups();
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const bool sym = a.z == nullptr;
  const __m512 spread = _mm512_set1_ps(sym ? -2.f : 0.25f);  // -8 e / 4 (z = -8 d), or e / 4 per lane
  alignas(64) float ds[R][kChunk], zs[R][kChunk];
  __m512 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint8_t* w = a.w + o * half;
  const int64_t nb4 = nb & ~int64_t(3);
  for (int64_t g0 = 0; g0 < ng && g0 * per < nb4; g0 += kChunk) {
    const int64_t gn = std::min(kChunk, ng - g0);
    widen_groups<T, S, R>(a, o, g0, gn, ds, zs);
    const int64_t b_end = std::min(nb4, (g0 + gn) * per);  // a chunk holds whole fours (64 groups of per blocks)
    for (int64_t b = g0 * per; b < b_end; b += 4) {
      prefetch_next(w, R, half, b * 16, 64);
      __m512 dx[MC], e[MC];
      __m512i xlo[MC], xhi[MC];
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const int64_t row = m0 + m;
        xlo[m] = _mm512_loadu_si512(q.xq4.data() + row * a.K + b * 32);
        xhi[m] = _mm512_loadu_si512(q.xq4.data() + row * a.K + b * 32 + 64);
        dx[m] = q8_quad(q.dx.data() + row * nb + b, idx);
        e[m] = _mm512_mul_ps(q8_quad(q.e.data() + row * nb + b, idx), spread);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_loadu_si512(w + r * half + b * 16);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m512 dw = q8_groups(ds[r], b, per, g0, idx);
        const __m512 zw = sym ? dw : q8_groups(zs[r], b, per, g0, idx);
#pragma GCC unroll 4
        for (int m = 0; m < MC; ++m) {
          const __m512 s = _mm512_cvtepi32_ps(q8_dot512(lo, xlo[m], hi, xhi[m]));
          if (sym) {  // d * (dx * sum n xq - 8 e): z = -8 d
            acc[m][r] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(s, dx[m], e[m]), acc[m][r]);
          } else {
            acc[m][r] = _mm512_fmadd_ps(zw, e[m], _mm512_fmadd_ps(dw, _mm512_mul_ps(s, dx[m]), acc[m][r]));
          }
        }
      }
    }
  }
  float tail[MC][R] = {};
  for (int64_t b = nb4; b < nb; ++b) {  // the last blocks one at a time: integer sums, scaled as the scalar path
    const int64_t g = b / per;
    for (int r = 0; r < R; ++r) {
      const float dg = a.scale(o + r, g), zg = a.offset(o + r, g, dg);
      const __m256i codes = q8_codes(w + r * half + b * 16);
      for (int m = 0; m < MC; ++m) {
        const int64_t row = m0 + m;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.xq.data() + row * a.K + b * 32));
        const __m256i d8 = q8_dot(codes, xq);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(d8), _mm256_extracti128_si256(d8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        tail[m][r] += std::fma(static_cast<float>(_mm_cvtsi128_si32(s4)), dg * q.dx[row * nb + b],
                               zg * q.e[row * nb + b]);
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r)
      a.y[(m0 + m) * a.O + o + r] = a.finish(_mm512_reduce_add_ps(acc[m][r]) + tail[m][r], o + r);
}
#define Q8_TILE q8_tile512
#else
#define Q8_TILE q8_tile
#endif

#if LLP_Q4_AVX512 || LLP_Q4_AVX2
// ------------------------------------------------------------------------------- many input rows: a GEMM
// Steps of many input rows (prompts) with int8 activations, each int32 lane one weight row: a tile of L weight rows
// (16 in 512-bit registers, 8 in 256-bit ones) is laid out once per call (per block b and 4-weight chunk c, 4L
// bytes: row r's codes 4c..4c+3 in lane r), so that one vpdpbusd with 4 codes of an input row broadcast sums L
// rows x 4 products. Eight make a block; the block's float work (the integer sum, its -8 sum(xq) offset folded in
// for symmetric groups, times dx_b, times d_g, added) is then one lane per weight row where the tiles spend four,
// and each chunk's codes serve up to MC input rows. The float32 terms are added in another order than the tiles',
// so the last bits can differ from a step of few rows: steps under int4_gemm_min_rows() (decode, verification)
// and batch-invariant calls keep the tiles.
constexpr int64_t kGemmMinRows = 16;  // input rows from which the GEMM runs (at 8 the decode step ran 0.8x the tiles)

#if LLP_Q8_512
struct GemmVec {  // 16 lanes
  static constexpr int L = 16, MC = 8;
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static I dpbusd(I acc, I u, I s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));  // q8_dot
#endif
  }
  static F zero_f() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F scale_add(I s, float dx, F d, F acc) {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dx)), d, acc);
  }
  static F fma1(F z, float e, F acc) { return _mm512_fmadd_ps(z, _mm512_set1_ps(e), acc); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // block b of rows [o, o + 16): four rows' 16 bytes to a register, their low and high nibbles (chunks 0-3, 4-7
  // of each row), then chunk c of all 16 rows gathered by two two-source permutes and a blend
  static void pack_block(const uint8_t* p, int64_t half, int8_t* out) {
    const __m512i idx[4] = {
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28),
        _mm512_setr_epi32(1, 5, 9, 13, 17, 21, 25, 29, 1, 5, 9, 13, 17, 21, 25, 29),
        _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 2, 6, 10, 14, 18, 22, 26, 30),
        _mm512_setr_epi32(3, 7, 11, 15, 19, 23, 27, 31, 3, 7, 11, 15, 19, 23, 27, 31)};
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = p + 4 * j * half;
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + half)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * half)), 2);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 3 * half)), 3);
      lo[j] = _mm512_and_si512(v, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    for (int c = 0; c < 4; ++c) {  // lane l: row l's dword c, from register l / 4 (lanes 0-7: 0, 1; 8-15: 2, 3)
      _mm512_storeu_si512(out + c * 64, _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(lo[0], idx[c], lo[1]),
                                                                 _mm512_permutex2var_epi32(lo[2], idx[c], lo[3])));
      _mm512_storeu_si512(out + (4 + c) * 64,
                          _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(hi[0], idx[c], hi[1]),
                                                  _mm512_permutex2var_epi32(hi[2], idx[c], hi[3])));
    }
  }
};
#else
struct GemmVec {  // 8 lanes
  static constexpr int L = 8, MC = 4;
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I dpbusd(I acc, I u, I s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));  // q8_dot
#endif
  }
  static F zero_f() { return _mm256_setzero_ps(); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F scale_add(I s, float dx, F d, F acc) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx)), d, acc);
  }
  static F fma1(F z, float e, F acc) { return _mm256_fmadd_ps(z, _mm256_set1_ps(e), acc); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // block b of rows [o, o + 8): rows i and i + 4 in one register's two halves, their nibbles, then a 4 x 4
  // transpose of dwords in each half: chunk c of rows 0-3 in the low half and of rows 4-7 in the high one
  static void pack_block(const uint8_t* p, int64_t half, int8_t* out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i + 4) * half)),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * half)));
      lo[i] = _mm256_and_si256(v, low);
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i* r = h ? hi : lo;
      const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
      __m256i* o = reinterpret_cast<__m256i*>(out + h * 4 * 32);
      _mm256_storeu_si256(o + 0, _mm256_unpacklo_epi64(t0, t2));
      _mm256_storeu_si256(o + 1, _mm256_unpackhi_epi64(t0, t2));
      _mm256_storeu_si256(o + 2, _mm256_unpacklo_epi64(t1, t3));
      _mm256_storeu_si256(o + 3, _mm256_unpackhi_epi64(t1, t3));
    }
  }
};
#endif
constexpr int64_t kGemmRows = GemmVec::L;  // weight rows per tile (one per lane)

struct GemmTile {
  std::vector<int8_t> codes;  // [K / 32][8][L x 4]
  std::vector<float> d, z;    // [K / 32][L]: each block's scale (offset) per row
  std::vector<float> row;     // one row's scales widened
};

// weight rows [o, o + L) in the GEMM's layout, with each block's scale (and offset) per row
template <typename T, typename S>
void gemm_pack(const Q4<T, S>& a, int64_t o, GemmTile& t) {
  constexpr int64_t L = kGemmRows;
  const int64_t nb = a.K / 32, per = a.G / 32, half = a.K / 2, ng = a.groups();
  t.codes.resize(nb * 32 * L), t.d.resize(nb * L), t.z.resize(a.z ? nb * L : 0);
  for (int64_t b = 0; b < nb; ++b) GemmVec::pack_block(a.w + o * half + b * 16, half, t.codes.data() + b * 32 * L);
  t.row.resize(ng);
  for (int64_t r = 0; r < L; ++r)  // each row's scales widened 8 at a time (F16C / a shift), then spread per block
    for (int which = 0; which < (a.z ? 2 : 1); ++which) {
      widen((which ? a.z : a.d) + (o + r) * ng, t.row.data(), ng);
      float* to = which ? t.z.data() : t.d.data();
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t b = g * per; b < (g + 1) * per; ++b) to[b * L + r] = t.row[g];
    }
}

// input rows [m0, m0 + MC) x the tile's L weight rows: y = sum_b d_g (dx_b sum_k n_k xq_k - 8 dx_b sum_k xq_k)
// for symmetric groups (the offset in the integer sum's start), else d_g dx_b sum n xq + z_g e_b
template <typename T, typename S, int MC>
inline void q8_gemm_tile(const Q4<T, S>& a, const Q8Rows& q, const GemmTile& t, int64_t o, int64_t m0, int64_t r0,
                         int64_t r1) {
  using V = GemmVec;
  constexpr int64_t L = kGemmRows;
  const int64_t nb = a.K / 32;
  const bool sym = a.z == nullptr;
  typename V::F acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = V::zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    typename V::I s[MC];
    for (int m = 0; m < MC; ++m) s[m] = sym ? V::set1(-8 * q.sum[(m0 + m) * nb + b]) : V::zero();
    const int8_t* wb = t.codes.data() + b * 32 * L;
    const int8_t* xb = q.xq.data() + m0 * a.K + b * 32;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const typename V::I w = V::load(wb + c * 4 * L);
#pragma GCC unroll 8
      for (int m = 0; m < MC; ++m) {
        int32_t x4;
        std::memcpy(&x4, xb + m * a.K + c * 4, 4);
        s[m] = V::dpbusd(s[m], w, V::set1(x4));
      }
    }
    const typename V::F d = V::loadf(t.d.data() + b * L);
    for (int m = 0; m < MC; ++m) acc[m] = V::scale_add(s[m], q.dx[(m0 + m) * nb + b], d, acc[m]);
    if (!sym) {
      const typename V::F z = V::loadf(t.z.data() + b * L);
      for (int m = 0; m < MC; ++m) acc[m] = V::fma1(z, q.e[(m0 + m) * nb + b], acc[m]);
    }
  }
  for (int m = 0; m < MC; ++m) {
    float out[L];
    V::store(out, acc[m]);
    for (int64_t r = std::max<int64_t>(0, r0 - o); r < std::min<int64_t>(L, r1 - o); ++r)
      a.y[(m0 + m) * a.O + o + r] = a.finish(out[r], o + r);
  }
}

// output rows [r0, r1) by the GEMM: the tiles of L weight rows that hold them (whole tiles only: r1 <= O / L * L),
// against every input row, MC at a time (then halves of it); a tile's rows outside [r0, r1) are not stored, so
// every row comes out the same whichever call or thread's range it fell in
template <typename T, typename S>
void q8_gemm_rows(const Q4<T, S>& a, const Q8Rows& q, int64_t r0, int64_t r1) {
  constexpr int MC = GemmVec::MC;
  thread_local GemmTile t;
  for (int64_t o = r0 / kGemmRows * kGemmRows; o < r1; o += kGemmRows) {
    gemm_pack(a, o, t);
    int64_t m = 0;
    for (; m + MC <= a.M; m += MC) q8_gemm_tile<T, S, MC>(a, q, t, o, m, r0, r1);
    if (MC > 4 && m + 4 <= a.M) q8_gemm_tile<T, S, (MC > 4 ? 4 : 1)>(a, q, t, o, m, r0, r1), m += 4;
    if (m + 2 <= a.M) q8_gemm_tile<T, S, 2>(a, q, t, o, m, r0, r1), m += 2;
    if (m < a.M) q8_gemm_tile<T, S, 1>(a, q, t, o, m, r0, r1);
  }
}
#endif

constexpr int kQ8R1 = LLP_Q4_AVX512 ? 8 : 4;  // weight rows per tile for one input row (registers: 32 / 16)

template <typename T, typename S>
void q8_rows_vector(const Q4<T, S>& a, const Q8Rows& q, int64_t o0, int64_t o1) {
  int64_t o = o0;
  if (a.M == 1) {
    for (; o + kQ8R1 <= o1; o += kQ8R1) Q8_TILE<T, S, 1, kQ8R1>(a, q, o, 0);
  } else {
    for (; o + 2 <= o1; o += 2) {
      int64_t m = 0;
      for (; m + 4 <= a.M; m += 4) Q8_TILE<T, S, 4, 2>(a, q, o, m);
      switch (a.M - m) {
        case 1: Q8_TILE<T, S, 1, 2>(a, q, o, m); break;
        case 2: Q8_TILE<T, S, 2, 2>(a, q, o, m); break;
        case 3: Q8_TILE<T, S, 3, 2>(a, q, o, m); break;
        default: break;
      }
    }
  }
  for (; o < o1; ++o)
    for (int64_t m = 0; m < a.M; ++m) Q8_TILE<T, S, 1, 1>(a, q, o, m);
}
#endif

// rows [o0, o1) with int8 activations (q8) or the float ones, on the vector path where the build has one
template <typename T, typename S>
void q4_rows(const Q4<T, S>& a, const Q8Rows* q, int64_t o0, int64_t o1, bool force_scalar) {
#if LLP_Q4_AVX512 || LLP_Q4_AVX2
  if (!force_scalar) return q ? q8_rows_vector<T, S>(a, *q, o0, o1) : q4_rows_vector<T, S>(a, o0, o1);
#endif
  return q ? q8_rows_scalar<T, S>(a, *q, o0, o1) : q4_rows_scalar<T, S>(a, o0, o1);
}

std::string int4_linear_dot() {
#if (LLP_Q4_AVX512 || LLP_Q4_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
  return "vnni";
#elif LLP_Q4_AVX512 || LLP_Q4_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

std::string int4_linear_isa() { return LLP_Q4_AVX512 ? "avx512" : LLP_Q4_AVX2 ? "avx2" : "scalar"; }

void check_q4(const at::Tensor& qw, const at::Tensor& scale, const c10::optional<at::Tensor>& zero, int64_t group,
              int64_t K, const char* name) {
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              name, ": qw must be a contiguous uint8 [O, K / 2] tensor, got ", qw.scalar_type(), " ", qw.sizes());
  TORCH_CHECK(group > 0 && group % 32 == 0, name, ": group size must be a positive multiple of 32, got ", group);
  TORCH_CHECK(K % group == 0, name, ": K = ", K, " is not a multiple of the group size ", group);
  TORCH_CHECK(qw.size(1) * 2 == K, name, ": qw holds ", qw.size(1) * 2, " weights per row, x has K = ", K);
  const int64_t O = qw.size(0);
  TORCH_CHECK((scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kBFloat16) && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == O && scale.size(1) == K / group,
              name, ": scale must be a contiguous float16 or bfloat16 [O, K / group] = [", O, ", ", K / group,
              "] tensor, got ", scale.scalar_type(), " ", scale.sizes());
  if (zero.has_value() && zero->defined())
    TORCH_CHECK(zero->scalar_type() == scale.scalar_type() && zero->sizes() == scale.sizes() && zero->is_contiguous(),
                name, ": zero must be a contiguous tensor of scale's dtype and shape");
}

at::Tensor int4_linear_impl(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero, int64_t group, const c10::optional<at::Tensor>& bias,
                            bool q8, bool force_scalar, bool invariant = true) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x must be [M, K], got ", x.sizes());
  const int64_t K = x.size(1);
  check_q4(qw, scale, zero, group, K, "int4_linear");
  const int64_t O = qw.size(0);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == O && bias->scalar_type() == x.scalar_type(),
                "int4_linear: bias must be an [O] tensor of x's dtype");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const bool asym = zero.has_value() && zero->defined();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  if (M == 0 || O == 0) return y;
  // output rows per task: a multiple of 8 whose weights are >= ~16 KB
  const int64_t grain = std::max<int64_t>(1, (32768 + K - 1) / std::max<int64_t>(K, 1) / 8);
  llp::dispatch_float_types(x.scalar_type(), "int4_linear", [&](auto tx) {
    using T = decltype(tx);
    auto run = [&](auto ts) {
      using S = decltype(ts);
      const Q4<T, S> a{xc.data_ptr<T>(), qw.data_ptr<uint8_t>(), static_cast<const S*>(scale.data_ptr()),
                       asym ? static_cast<const S*>(zero->data_ptr()) : nullptr,
                       bc.defined() ? bc.data_ptr<T>() : nullptr, y.data_ptr<T>(), M, K, O, group};
      Q8Rows q;
#if LLP_Q4_AVX512 || LLP_Q4_AVX2
      if (q8 && !force_scalar && !invariant && M >= kGemmMinRows && O >= kGemmRows) {  // many rows: the GEMM
        const int64_t tiles = O / kGemmRows, done = tiles * kGemmRows;
        quantize_q8<T>(a.x, M, K, q, /*tile_layout=*/done < O, /*parallel=*/true);
        at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
          q8_gemm_rows<T, S>(a, q, b * kGemmRows, e * kGemmRows);
        });
        if (done < O) q4_rows<T, S>(a, &q, done, O, false);
        return;
      }
#endif
      if (q8) quantize_q8<T>(a.x, M, K, q, true, /*parallel=*/true);
      at::parallel_for(0, (O + 7) / 8, grain, [&](int64_t b, int64_t e) {
        q4_rows<T, S>(a, q8 ? &q : nullptr, b * 8, std::min(O, e * 8), force_scalar);
      });
    };
    if (scale.scalar_type() == at::kHalf)
      run(c10::Half{});
    else
      run(c10::BFloat16{});
  });
  return y;
}

// invariant: every row's arithmetic the same at any row count (no GEMM: see q8_gemm_tile)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& zero, int64_t group, const c10::optional<at::Tensor>& bias,
                       bool q8, bool invariant) {
  return int4_linear_impl(x, qw, scale, zero, group, bias, q8, false, invariant);
}

// the input rows from which int4_linear runs the GEMM (int8 activations, not invariant); 0: this build has none
int64_t int4_gemm_min_rows() {
#if LLP_Q4_AVX512 || LLP_Q4_AVX2
  return kGemmMinRows;
#else
  return 0;
#endif
}

// the scalar loop on any build (what CPUs without AVX2 run): the tests compare it with the vector kernel
at::Tensor int4_linear_scalar(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& zero, int64_t group,
                              const c10::optional<at::Tensor>& bias, bool q8) {
  return int4_linear_impl(x, qw, scale, zero, group, bias, q8, true);
}

// rows [r0, r1) of the float32 weights W (see the top), for the many-row path (then a float32 GEMM)
at::Tensor int4_dequant(const at::Tensor& qw, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                        int64_t group, int64_t r0, int64_t r1) {
  const int64_t K = qw.dim() == 2 ? qw.size(1) * 2 : 0;
  check_q4(qw, scale, zero, group, K, "int4_dequant");
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= qw.size(0), "int4_dequant: rows [", r0, ", ", r1, ") out of ", qw.size(0));
  at::Tensor out = at::empty({r1 - r0, K}, qw.options().dtype(at::kFloat));
  const bool asym = zero.has_value() && zero->defined();
  const int64_t groups = K / group, half = K / 2;
  auto run = [&](auto ts) {
    using S = decltype(ts);
    const S* d = static_cast<const S*>(scale.data_ptr());
    const S* z = asym ? static_cast<const S*>(zero->data_ptr()) : nullptr;
    const uint8_t* w = qw.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(r0, r1, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const uint8_t* wr = w + r * half;
        float* orow = o + (r - r0) * K;
        for (int64_t g = 0; g < groups; ++g) {
          const float dg = to_f(d[r * groups + g]), zg = z ? to_f(z[r * groups + g]) : -8.f * dg;
          for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
            const uint8_t* bytes = wr + k0 / 2;
#pragma omp simd
            for (int j = 0; j < 16; ++j) {
              orow[k0 + j] = std::fma(static_cast<float>(bytes[j] & 0x0F), dg, zg);
              orow[k0 + 16 + j] = std::fma(static_cast<float>(bytes[j] >> 4), dg, zg);
            }
          }
        }
      }
    });
  };
  if (scale.scalar_type() == at::kHalf)
    run(c10::Half{});
  else
    run(c10::BFloat16{});
  return out;
}

}  // namespace

// output rows [o0, o1) of y on the calling thread: what int4_linear runs on each of its threads (S: the scales'
// dtype, float16 or bfloat16; z null for symmetric groups)
namespace {
// this thread's rows quantized by int4_prepare, and which rows they are (x null: none)
thread_local Q8Rows prepared;
thread_local const void* prepared_x = nullptr;
thread_local int64_t prepared_m = 0, prepared_k = 0;
}  // namespace

template <typename T>
void llp::int4_prepare(const T* x, int64_t M, int64_t K) {
  quantize_q8<T>(x, M, K, prepared);
  prepared_x = x, prepared_m = M, prepared_k = K;
}
void llp::int4_release() { prepared_x = nullptr; }
int64_t llp::int4_kernel_max_rows() {
#if LLP_Q8_512
  return 64;  // the 512-bit tile: faster than widening for a GEMM up to 1024 rows measured, 0.2-0.6x its time at 64
#else
  return 16;  // the 256-bit tiles (AVX2): slower than widening past 16-32 rows
#endif
}
template void llp::int4_prepare<float>(const float*, int64_t, int64_t);
template void llp::int4_prepare<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t);
template void llp::int4_prepare<c10::Half>(const c10::Half*, int64_t, int64_t);

template <typename T, typename S>
void llp::int4_rows(const T* x, const uint8_t* w, const S* d, const S* z, int64_t group, const T* bias, T* y,
                    int64_t M, int64_t K, int64_t O, int64_t o0, int64_t o1, bool q8, bool gemm) {
  const Q4<T, S> a{x, w, d, z, bias, y, M, K, O, group};
  if (!q8) return q4_rows<T, S>(a, nullptr, o0, o1, false);
  const Q8Rows* q = &prepared;
  if (prepared_x != x || prepared_m != M || prepared_k != K) {  // not prepared: quantized for this call alone
    thread_local Q8Rows mine;
    quantize_q8<T>(x, M, K, mine);
    q = &mine;
  }
#if LLP_Q4_AVX512 || LLP_Q4_AVX2
  // rows in whole tiles of O by the GEMM, the last O % L by the tiles: each row as int4_linear computes it
  const int64_t done = std::min(o1, O / kGemmRows * kGemmRows);
  if (gemm && M >= kGemmMinRows && O >= kGemmRows && o0 < done) {
    q8_gemm_rows<T, S>(a, *q, o0, done);
    return q4_rows<T, S>(a, q, done, o1, false);
  }
#else
  (void)gemm;
#endif
  q4_rows<T, S>(a, q, o0, o1, false);
}
#define LLP_INT4_ROWS(T, S)                                                                                          \
  template void llp::int4_rows<T, S>(const T*, const uint8_t*, const S*, const S*, int64_t, const T*, T*, int64_t, \
                                     int64_t, int64_t, int64_t, int64_t, bool, bool);
LLP_INT4_ROWS(float, c10::Half)
LLP_INT4_ROWS(float, c10::BFloat16)
LLP_INT4_ROWS(c10::BFloat16, c10::Half)
LLP_INT4_ROWS(c10::BFloat16, c10::BFloat16)
LLP_INT4_ROWS(c10::Half, c10::Half)
LLP_INT4_ROWS(c10::Half, c10::BFloat16)
#undef LLP_INT4_ROWS

TORCH_LIBRARY_FRAGMENT(litellm_pipeline_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor qw, Tensor scale, Tensor? zero, int group, Tensor? bias, bool q8, "
        "bool invariant=False) -> Tensor");
  m.def("int4_linear_scalar(Tensor x, Tensor qw, Tensor scale, Tensor? zero, int group, Tensor? bias, bool q8) -> Tensor");
  m.def("int4_dequant(Tensor qw, Tensor scale, Tensor? zero, int group, int r0, int r1) -> Tensor");
  m.def("int4_linear_isa", &int4_linear_isa);
  m.def("int4_kernel_max_rows", &llp::int4_kernel_max_rows);
  m.def("int4_gemm_min_rows", &int4_gemm_min_rows);
  m.def("int4_linear_dot", &int4_linear_dot);
}

TORCH_LIBRARY_IMPL(litellm_pipeline_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_scalar", &int4_linear_scalar);
  m.impl("int4_dequant", &int4_dequant);
}
