// Structured output's token mask (constraints/masking.py): logits[r, t] = -inf wherever bit t of bitmask[r] is 0,
// for the rows r listed, in place; returns the listed rows whose mask allows no token at all (left as they are:
// the engine fails those requests instead of sampling from nothing). The bitmask is xgrammar's layout: int32 words, bit t % 32 of word t / 32 set
// when token t is allowed. Whole words are taken at once: all-ones (inside a string most tokens are allowed) is
// skipped, all-zero (between JSON tokens nearly everything is banned) is a plain fill the compiler vectorises.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// T is the logits' storage as an unsigned integer of its width, neg the bits of its -inf: plain integer stores,
// which the compiler vectorises for every dtype alike (c10::BFloat16 / Half assignments it does not)
template <typename T>
void mask_row(T* row, const int32_t* bits, int64_t vocab, T neg) {
  const int64_t words = (vocab + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t word = static_cast<uint32_t>(bits[w]);
    if (word == 0xFFFFFFFFu) continue;
    T* out = row + w * 32;
    const int64_t n = std::min<int64_t>(32, vocab - w * 32);
    if (word == 0) {
      std::fill(out, out + n, neg);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      out[j] = ((word >> j) & 1u) ? out[j] : neg;
    }
  }
}

bool allows_any(const int32_t* bits, int64_t vocab) {
  const int64_t full = vocab / 32;
  for (int64_t w = 0; w < full; ++w) {
    if (bits[w] != 0) return true;
  }
  const int64_t tail = vocab % 32;
  return tail && (static_cast<uint32_t>(bits[full]) & ((1u << tail) - 1u)) != 0;
}

std::vector<int64_t> apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_token_bitmask_: logits must be [R, V], rows contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "apply_token_bitmask_: bitmask must be int32 [R, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "apply_token_bitmask_: rows must be int64 [n]");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "apply_token_bitmask_: the bitmask covers ", bitmask.size(1) * 32,
              " tokens, the logits ", vocab);
  const auto r = rows.contiguous();
  const int64_t* idx = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < logits.size(0) && idx[i] < bitmask.size(0),
                "apply_token_bitmask_: row ", idx[i], " out of range");
  }
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  std::vector<int64_t> dead;
  const auto each_row = [&](auto* base, auto neg) {
    for (int64_t i = 0; i < r.numel(); ++i) {
      const int32_t* row_bits = bits + idx[i] * bitmask.stride(0);
      if (!allows_any(row_bits, vocab)) {
        dead.push_back(idx[i]);
        continue;
      }
      mask_row(base + idx[i] * logits.stride(0), row_bits, vocab, neg);
    }
  };
  switch (logits.scalar_type()) {
    case at::kFloat:
      each_row(static_cast<uint32_t*>(logits.data_ptr()), static_cast<uint32_t>(0xFF800000u));
      break;
    case at::kBFloat16:
      each_row(static_cast<uint16_t*>(logits.data_ptr()), static_cast<uint16_t>(0xFF80u));
      break;
    case at::kHalf:
      each_row(static_cast<uint16_t*>(logits.data_ptr()), static_cast<uint16_t>(0xFC00u));
      break;
    default:
      TORCH_CHECK(false, "apply_token_bitmask_: logits must be float32, bfloat16 or float16 (got ",
                  logits.scalar_type(), ")");
  }
  return dead;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(litellm_pipeline_cpu, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> int[]");
}

TORCH_LIBRARY_IMPL(litellm_pipeline_cpu, CPU, m) {
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
}
