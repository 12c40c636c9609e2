// Row-wise argmax of fp32 logits with torch.argmax's answer: the first index of the largest
// value, or of the first NaN when a row has one. Plain C ABI (ctypes).
//
// Each row is read in blocks of kBlock values: a vectorised pass keeps each block's maximum and
// whether it holds a NaN; the first index is then searched only inside the block that first
// reached the row's maximum. The library is built with -ffast-math, which lets the compiler
// assume no value is NaN: NaNs are found by their bits (integer compares), never by `x != x`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kParallelMinElements = 1 << 16;

inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// The largest value of v[0, n), -inf for none; *has_nan says whether one of them is NaN.
inline float block_max(const float* v, int64_t n, bool* has_nan) {
  float best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  __mmask16 nan_lanes = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), abs_mask);
    nan_lanes |= _mm512_cmpgt_epu32_mask(magnitude, inf_bits);
    lanes = _mm512_max_ps(lanes, x);
  }
  best = _mm512_reduce_max_ps(lanes);
  nan = nan_lanes != 0;
#endif
  for (; i < n; ++i) {
    nan |= is_nan(v[i]);
    best = v[i] > best ? v[i] : best;
  }
  *has_nan = nan;
  return best;
}

int64_t row_argmax(const float* v, int64_t n) {
  float best = -INFINITY;
  int64_t best_block = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    bool has_nan;
    const float m = block_max(v + start, std::min(kBlock, n - start), &has_nan);
    if (has_nan)
      for (int64_t k = start;; ++k)
        if (is_nan(v[k])) return k;
    if (m > best) {
      best = m;
      best_block = start;
    }
  }
  // The block holds `best` (a row of only -inf: block 0, index 0).
  for (int64_t k = best_block;; ++k)
    if (v[k] == best) return k;
}
}  // namespace

// out[r] = argmax(values[r, :vocab]) for r < num_rows; vocab >= 1.
extern "C" void argmax_float32(int64_t* out, const float* values, int64_t num_rows,
                               int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_rows > 1 && num_rows * vocab >= kParallelMinElements)
  for (int64_t r = 0; r < num_rows; ++r) out[r] = row_argmax(values + r * vocab, vocab);
}
