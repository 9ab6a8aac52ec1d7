// Paged attention for CPU: every query reads its sequence's K/V rows straight out of the flat cache through
// the slot table, so nothing is gathered into a dense [B, L, H, D] copy first (that copy, not the math, is
// what bounds decode on a machine with ~10-20 GB/s).
//
// One work item = (sequence, a run of kv heads, one query of that sequence). A run is as many kv heads as
// still leaves every thread a few items: with many sequences it is all of them, so each token's K (and V)
// row is one contiguous read; with one sequence it is one head, so the heads spread over the threads. The
// G = Hq / Hk query heads of a kv head share each K/V row (GQA / MQA). Keys go in chunks of kChunk: scores,
// one online-softmax rescale, the weighted V sum; all arithmetic in float32 whatever the cache dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;  // keys per online-softmax step: amortises the rescale of the accumulators
constexpr int64_t kPrefetch = 2;  // tokens ahead whose K/V rows are prefetched (slots scatter, so hardware can't)
constexpr int64_t kItemsPerThread = 4;  // split the kv heads until every thread has this many items

using llp::to_f;
// scores minus their running max are <= 0
inline float exp_neg(float x) { return llp::exp_f(x); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLP_PA_AVX2 1
// 16-bit K/V: 8 values widened at once (vcvtph2ps for float16; a shift into the top half for bfloat16, exact),
// where the portable loop converts one value at a time and leaves the kernel compute-bound.
// 8 lanes of float32 partial sums, then a fixed horizontal sum: a query row's result does not depend on others.
inline __m256 load8h(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8h(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512F__)
// AVX-512: 16 values a load, half the 256-bit path's instructions (decode is bound by the K/V reads either way;
// a 512-query fresh prompt over a float16 cache measured 10.05 ms against 10.09 with 8 lanes)
inline __m512 load16h(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16h(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename T>
inline float dot16_64(const float* __restrict q, const T* __restrict k) {
  const __m512 a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q), load16h(k), _mm512_mul_ps(_mm512_loadu_ps(q + 32), load16h(k + 32)));
  const __m512 a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), load16h(k + 16),
                                    _mm512_mul_ps(_mm512_loadu_ps(q + 48), load16h(k + 48)));
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
template <typename T>
inline void axpy16_64(float* __restrict acc, float p, const T* __restrict v) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t i = 0; i < 64; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16h(v + i), _mm512_loadu_ps(acc + i)));
}
#else
template <typename T>
inline float dot16_64(const float* __restrict q, const T* __restrict k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < 64; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8h(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8h(k + i + 8), a1);
  }
  const __m256 a = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
template <typename T>
inline void axpy16_64(float* __restrict acc, float p, const T* __restrict v) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < 64; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8h(v + i), _mm256_loadu_ps(acc + i)));
}
#endif
#else
#define LLP_PA_AVX2 0
#endif

// the vector path: 16-bit K/V with a head dim that is a compile-time multiple of 64 (64 and 128)
template <typename T, int64_t DC>
constexpr bool kVec16 = LLP_PA_AVX2 && DC > 0 && DC % 64 == 0 &&
                        (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>);

template <typename T, int64_t DC>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
#if LLP_PA_AVX2
  if constexpr (kVec16<T, DC>) {
    float s = dot16_64(q, k);
    for (int64_t i = 64; i < DC; i += 64) s += dot16_64(q + i, k + i);
    return s;
  }
#endif
  if (DC) d = DC;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  return s;
}

template <typename T, int64_t DC>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t d) {
#if LLP_PA_AVX2
  if constexpr (kVec16<T, DC>) {
    for (int64_t i = 0; i < DC; i += 64) axpy16_64(acc + i, p, v + i);
    return;
  }
#endif
  if (DC) d = DC;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * to_f(v[i]);
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 1);
}

struct Shape {
  int64_t hk, g, d;  // kv heads, query heads per kv head, head dim
  int64_t nh;  // kv heads per work item
  int64_t num_slots;
  int64_t q_s0, q_s1, o_s0, o_s1;  // row / head strides of q and out (last dim contiguous)
};

// One query row, kv heads [h0, h0 + nh) and their G query heads each, over context keys [begin, end).
// DC: the head dim as a compile-time constant (0: use sh.d), so the common sizes get unrolled loops.
template <typename T, typename C, int64_t DC>
void attend(const T* q, T* out, const C* kc, const C* vc, const int64_t* slots, int64_t begin, int64_t end,
            int64_t h0, float scale, const Shape& sh, float* ws) {
  const int64_t G = sh.g, D = DC ? DC : sh.d, NQ = sh.nh * sh.g, row = sh.hk * D;
  float* qf = ws;             // [NQ, D] scaled queries
  float* acc = qf + NQ * D;   // [NQ, D]
  float* s = acc + NQ * D;    // [NQ, kChunk] scores, then probabilities
  float* m = s + NQ * kChunk; // [NQ] running max
  float* l = m + NQ;          // [NQ] running denominator
  for (int64_t qi = 0; qi < NQ; ++qi) {
    const T* qh = q + (h0 * G + qi) * sh.q_s1;
    for (int64_t i = 0; i < D; ++i) qf[qi * D + i] = to_f(qh[i]) * scale;
    m[qi] = -std::numeric_limits<float>::infinity();
    l[qi] = 0.f;
  }
  std::fill(acc, acc + NQ * D, 0.f);
  const int64_t span = sh.nh * D;  // this item's contiguous part of one token's row
  const int64_t span_bytes = span * static_cast<int64_t>(sizeof(C));
  const C* kbase = kc + h0 * D;
  const C* vbase = vc + h0 * D;
  for (int64_t i = 0; i < kPrefetch && begin + i < end; ++i) {
    const int64_t ps = slots[begin + i];
    if (ps >= 0 && ps < sh.num_slots) prefetch(kbase + ps * row, span_bytes), prefetch(vbase + ps * row, span_bytes);
  }
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, end - c0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = slots[c0 + j];
      TORCH_CHECK(slot >= 0 && slot < sh.num_slots, "paged_attention: kv slot ", slot, " out of range [0, ",
                  sh.num_slots, ")");
      if (c0 + j + kPrefetch < end) {  // V is prefetched here too: it is read right after this chunk
        const int64_t ps = slots[c0 + j + kPrefetch];
        if (ps >= 0 && ps < sh.num_slots) prefetch(kbase + ps * row, span_bytes), prefetch(vbase + ps * row, span_bytes);
      }
      const C* kp = kbase + slot * row;
      for (int64_t hh = 0, qi = 0; hh < sh.nh; ++hh)
        for (int64_t g = 0; g < G; ++g, ++qi) s[qi * kChunk + j] = dot<C, DC>(qf + qi * D, kp + hh * D, D);
    }
    for (int64_t qi = 0; qi < NQ; ++qi) {
      float* sq = s + qi * kChunk;
      float cm = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : cm)
      for (int64_t j = 0; j < n; ++j) cm = std::max(cm, sq[j]);
      const float mn = std::max(m[qi], cm);
      if (mn > m[qi]) {  // first chunk: exp(-inf) = 0 leaves the zero accumulators zero
        const float f = std::exp(m[qi] - mn);
        l[qi] *= f;
        float* aq = acc + qi * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) aq[i] *= f;
        m[qi] = mn;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float p = exp_neg(sq[j] - mn);
        sq[j] = p;
        sum += p;
      }
      l[qi] += sum;
    }
    for (int64_t j = 0; j < n; ++j) {
      const C* vp = vbase + slots[c0 + j] * row;
      for (int64_t hh = 0, qi = 0; hh < sh.nh; ++hh)
        for (int64_t g = 0; g < G; ++g, ++qi) axpy<C, DC>(acc + qi * D, s[qi * kChunk + j], vp + hh * D, D);
    }
  }
  for (int64_t qi = 0; qi < NQ; ++qi) {
    T* oq = out + (h0 * G + qi) * sh.o_s1;
    const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;  // an empty context gives zeros, not NaN
    for (int64_t i = 0; i < D; ++i) oq[i] = llp::from_f<T>(acc[qi * D + i] * inv);
  }
}

struct Job {
  const void* q;
  void* out;
  const void *kc, *vc;
  const int64_t *rows, *slots, *lens;
  int64_t slot_stride, max_len, num_rows, num_seqs, q_len;
  float scale;
  int64_t window;
  Shape sh;
};

// Query i of sequence s over kv heads [h0, h0 + nh): one work item. ws: the item's scratch (item_scratch floats).
template <typename T, typename C>
void attend_item(const Job& jb, int64_t s, int64_t i, int64_t h0, float* ws) {
  const Shape& sh = jb.sh;
  const int64_t ctx = jb.lens[s], row = jb.rows[s] + i, pos = ctx - jb.q_len + i;
  TORCH_CHECK(ctx >= jb.q_len && ctx <= jb.max_len, "paged_attention: ctx_len ", ctx, " outside [q_len, ",
              jb.max_len, "]");
  TORCH_CHECK(row >= 0 && row < jb.num_rows, "paged_attention: row ", row, " out of range");
  const int64_t begin = jb.window > 0 ? std::max<int64_t>(0, pos - jb.window + 1) : 0;
  auto attend_fn = sh.d == 64 ? attend<T, C, 64> : sh.d == 128 ? attend<T, C, 128> : attend<T, C, 0>;
  attend_fn(static_cast<const T*>(jb.q) + row * sh.q_s0, static_cast<T*>(jb.out) + row * sh.o_s0,
            static_cast<const C*>(jb.kc), static_cast<const C*>(jb.vc), jb.slots + s * jb.slot_stride, begin, pos + 1,
            h0, jb.scale, sh, ws);
}

inline size_t item_scratch(const Shape& sh) { return static_cast<size_t>(sh.nh * sh.g * (2 * sh.d + kChunk + 2)); }

template <typename T, typename C>
void run(const Job& jb) {
  const Shape& sh = jb.sh;
  const int64_t splits = sh.hk / sh.nh, items = jb.num_seqs * splits * jb.q_len;
  // items differ in cost (context lengths differ), so threads pull them from a shared counter instead of
  // taking parallel_for's equal contiguous ranges
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(items, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> ws(item_scratch(sh));
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      const int64_t i = it % jb.q_len, part = (it / jb.q_len) % splits, s = it / (jb.q_len * splits);
      attend_item<T, C>(jb, s, i, part * sh.nh, ws.data());
    }
  });
}

// Fewest kv-head runs (so the longest contiguous reads) that still give every thread kItemsPerThread items.
int64_t heads_per_item(int64_t hk, int64_t units) {
  const int64_t want = kItemsPerThread * at::get_num_threads();
  for (int64_t splits = 1; splits <= hk; ++splits)
    if (hk % splits == 0 && units * splits >= want) return hk / splits;
  return 1;
}

// The checks of paged_attention below, which a caller running attention inside its own threads makes first.
void check_paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& slots,
                           const at::Tensor& ctx_lens, int64_t q_len) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3, "paged_attention: q, out and caches are 3-D");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_cache, &v_cache, &rows, &slots, &ctx_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache and v_cache shapes differ");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and out must share one dtype, and so must the two caches");
  TORCH_CHECK(llp::kv_cache_supported(q.scalar_type(), k_cache.scalar_type()), "paged_attention: a ",
              k_cache.scalar_type(), " cache with ", q.scalar_type(),
              " queries is not supported (the queries' dtype, or float16 / bfloat16 under float32 queries)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(q.sizes() == out.sizes(), "paged_attention: out must have q's shape");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong,
              "paged_attention: rows, slots and ctx_lens must be int64");
  TORCH_CHECK(slots.dim() == 2 && slots.stride(1) == 1, "paged_attention: slots must be [S, L], rows contiguous");
  TORCH_CHECK(rows.is_contiguous() && ctx_lens.is_contiguous(), "paged_attention: rows, ctx_lens contiguous");
  const int64_t S = slots.size(0), L = slots.size(1);
  TORCH_CHECK(rows.numel() == S && ctx_lens.numel() == S, "paged_attention: rows / ctx_lens must have S entries");
  TORCH_CHECK(q_len >= 1, "paged_attention: q_len must be >= 1");
  const int64_t hq = q.size(1), hk = k_cache.size(1), d = q.size(2);
  TORCH_CHECK(k_cache.size(2) == d && hk > 0 && hq % hk == 0, "paged_attention: head shapes do not match");
}

// (query type, cache type): the cache in the queries' dtype, or a 16-bit cache under float32 queries
template <typename F>
void dispatch_kv(at::ScalarType t, at::ScalarType c, F&& f) {
  if (t == at::kFloat && c == at::kHalf) return f(float{}, c10::Half{});
  if (t == at::kFloat && c == at::kBFloat16) return f(float{}, c10::BFloat16{});
  llp::dispatch_float_types(t, "paged_attention", [&](auto tag) { f(tag, tag); });
}

Job make_job(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len, double scale,
             int64_t window, int64_t heads_per_item) {
  const int64_t S = slots.size(0), L = slots.size(1), hq = q.size(1), hk = k_cache.size(1), d = q.size(2);
  const Shape sh{hk, hq / hk, d, heads_per_item, k_cache.size(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1)};
  return Job{q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr<int64_t>(),
             slots.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), slots.stride(0), L, q.size(0), S, q_len,
             static_cast<float>(scale), window, sh};
}

// out[rows[s] + i] for i < q_len: query i of sequence s sits at position ctx_lens[s] - q_len + i and attends the
// keys at positions (pos - window, pos] (window <= 0: all of [0, pos]) through slots[s, :ctx_lens[s]].
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                     double scale, int64_t window) {
  check_paged_attention(out, q, k_cache, v_cache, rows, slots, ctx_lens, q_len);
  const int64_t S = slots.size(0);
  if (S == 0) return;
  const Job job = make_job(out, q, k_cache, v_cache, rows, slots, ctx_lens, q_len, scale, window,
                           heads_per_item(k_cache.size(1), S * q_len));
  dispatch_kv(q.scalar_type(), k_cache.scalar_type(), [&](auto t, auto c) { run<decltype(t), decltype(c)>(job); });
}

// the queries of sequences [s0, s1) over the job's kv heads from h0 (jb.sh.nh of them), all on the calling
// thread: paged_attention's arithmetic (a query head's result does not depend on which heads share its work
// item), for callers that split sequences and heads over their own threads
template <typename T, typename C>
void run_heads(const Job& jb, int64_t h0, int64_t s0, int64_t s1) {
  thread_local std::vector<float> ws;
  ws.resize(item_scratch(jb.sh));
  for (int64_t s = s0; s < s1; ++s)
    for (int64_t i = 0; i < jb.q_len; ++i) attend_item<T, C>(jb, s, i, h0, ws.data());
}

}  // namespace

namespace llp {
void check_paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& slots,
                           const at::Tensor& ctx_lens, int64_t q_len) {
  ::check_paged_attention(out, q, k_cache, v_cache, rows, slots, ctx_lens, q_len);
}

void paged_attention_heads(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                           double scale, int64_t window, int64_t h0, int64_t h1, int64_t s0, int64_t s1) {
  s1 = std::min(s1, slots.size(0));
  if (h1 <= h0 || s1 <= s0) return;
  const Job job = make_job(out, q, k_cache, v_cache, rows, slots, ctx_lens, q_len, scale, window, h1 - h0);
  dispatch_kv(q.scalar_type(), k_cache.scalar_type(), [&](auto t, auto c) {
    run_heads<decltype(t), decltype(c)>(job, h0, s0, s1);
  });
}

void run_paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t q_len,
                         double scale, int64_t window) {
  paged_attention(out, q, k_cache, v_cache, rows, slots, ctx_lens, q_len, scale, window);
}
}  // namespace llp

TORCH_LIBRARY(litellm_pipeline_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor slots, "
      "Tensor ctx_lens, int q_len, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(litellm_pipeline_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
