// Batch-invariant bfloat16 linear on AMX tiles (Intel Sapphire Rapids and later): row_linear's contract, a row's
// result never depends on the other rows, at a multiple of vdpbf16ps' speed on many rows.
//
// y^T = w x^T tile by tile: a 16x16 float32 accumulator holds 16 output features x 16 input rows; the A tile is 16
// weight rows x 32 k read straight from w (no packing of the weights), the B tile 16 input rows x 32 k in the
// pair-interleaved (VNNI) layout AMX wants, built once per call from x. Every output element is one accumulation
// over the k blocks in ascending order, each block adding its 32 products through TDPBF16PS: the same arithmetic
// for every row, whichever rows share its tile, however many rows the call has, on whichever thread. Rows past M
// and k past K are zeros; weight rows past O and k past K are copied into a zero-padded block first (reading
// past a row could meet a NaN, and 0 * NaN is NaN).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLP_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace llp_amx {

// Linux hands out AMX tile state only on request (arch_prctl); asked once for the process. If refused, every
// call takes the vdpbf16ps path instead: the choice never changes within a process, so neither does the math.
inline bool available() {
  static const bool ok = [] {
    constexpr int kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes: C (16 x 16 float32), A (16 x 32 bf16), B (16 k pairs x 16 rows x 2 bf16)
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

using bf16 = c10::BFloat16;

// x [M, K] -> blocks of 16 rows x 32 k, each [16 k pairs][16 rows][2]: xp[(mb * KB + kb) * 512 + ...]
inline std::vector<uint16_t> pack_rows(const bf16* x, int64_t M, int64_t K, int64_t MB, int64_t KB) {
  std::vector<uint16_t> xp(static_cast<size_t>(MB * KB * 512), 0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  at::parallel_for(0, MB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb)
      for (int64_t m = 0; m < 16 && mb * 16 + m < M; ++m) {
        const uint16_t* row = xs + (mb * 16 + m) * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t kb = k / 32, kk = k % 32;
          xp[(mb * KB + kb) * 512 + (kk / 2) * 32 + m * 2 + (kk % 2)] = row[k];
        }
      }
  });
  return xp;
}

// NN weight blocks (16 output features each) x MM row blocks (16 input rows each), all of K
template <int NN, int MM>
inline void tile_block(const bf16* w, int64_t K, int64_t O, int64_t n0, const uint16_t* xp, int64_t KB,
                       int64_t mb0, int64_t M, const bf16* bias, bf16* y) {
  _tile_zero(0);
  if constexpr (MM > 1) _tile_zero(1);
  if constexpr (NN > 1) _tile_zero(2);
  if constexpr (NN > 1 && MM > 1) _tile_zero(3);
  alignas(64) uint16_t pad[NN][16 * 32];
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(w);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * 32;
    const void* a[NN];
    int64_t stride[NN];
    for (int i = 0; i < NN; ++i) {
      const int64_t nb = n0 + i * 16;
      if (nb + 16 <= O && k0 + 32 <= K) {
        a[i] = ws + nb * K + k0;
        stride[i] = K * 2;
      } else {  // the last weight rows or k: a zero-padded copy
        std::memset(pad[i], 0, sizeof(pad[i]));
        for (int64_t r = 0; r < 16 && nb + r < O; ++r)
          std::memcpy(pad[i] + r * 32, ws + (nb + r) * K + k0, sizeof(uint16_t) * std::min<int64_t>(32, K - k0));
        a[i] = pad[i];
        stride[i] = 64;
      }
    }
    _tile_loadd(4, a[0], stride[0]);
    if constexpr (NN > 1) _tile_loadd(5, a[1], stride[1]);
    _tile_loadd(6, xp + ((mb0) * KB + kb) * 512, 64);
    if constexpr (MM > 1) _tile_loadd(7, xp + ((mb0 + 1) * KB + kb) * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MM > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NN > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NN > 1 && MM > 1) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64);
  if constexpr (MM > 1) _tile_stored(1, c[1], 64);
  if constexpr (NN > 1) _tile_stored(2, c[2], 64);
  if constexpr (NN > 1 && MM > 1) _tile_stored(3, c[3], 64);
  for (int i = 0; i < NN; ++i)
    for (int j = 0; j < MM; ++j) {
      const float(&t)[16][16] = c[i * 2 + j];
      for (int64_t r = 0; r < 16 && n0 + i * 16 + r < O; ++r) {
        const int64_t n = n0 + i * 16 + r;
        const float b = bias ? static_cast<float>(bias[n]) : 0.f;
        for (int64_t m = 0; m < 16 && (mb0 + j) * 16 + m < M; ++m)
          y[((mb0 + j) * 16 + m) * O + n] = static_cast<bf16>(t[r][m] + b);
      }
    }
}

// y[M, O] = x[M, K] @ w[O, K]^T (+ bias), batch-invariant
inline void linear(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t K, int64_t O) {
  const int64_t MB = (M + 15) / 16, KB = (K + 31) / 32, NB = (O + 15) / 16;
  const std::vector<uint16_t> xp = pack_rows(x, M, K, MB, KB);
  const int64_t pairs = (NB + 1) / 2;  // tasks of two weight blocks (32 output features)
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    configure();  // tile state is per thread
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * 32;
      const bool two_n = n0 + 16 < O;
      int64_t mb = 0;
      for (; mb + 2 <= MB; mb += 2) {
        if (two_n) tile_block<2, 2>(w, K, O, n0, xp.data(), KB, mb, M, bias, y);
        else tile_block<1, 2>(w, K, O, n0, xp.data(), KB, mb, M, bias, y);
      }
      if (mb < MB) {
        if (two_n) tile_block<2, 1>(w, K, O, n0, xp.data(), KB, mb, M, bias, y);
        else tile_block<1, 1>(w, K, O, n0, xp.data(), KB, mb, M, bias, y);
      }
    }
    _tile_release();
  });
}

}  // namespace llp_amx
#else
#define LLP_AMX 0
#endif
