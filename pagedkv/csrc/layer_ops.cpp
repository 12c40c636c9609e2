// Fused pointwise ops of a decoder layer on CPU, fp32: residual add + RMSNorm, RMSNorm,
// SiLU-and-mul, and RoPE with the KV cache write. Plain C ABI (ctypes). Rows run in parallel
// only when there are enough elements to pay for waking the OpenMP threads.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace {
// 8192 elements: at batch 64 the SiLU (44k elements) and RoPE (33k) calls already pay for it
// (about 77 -> 58 and 82 -> 63 us per call on this project's 2-core CPU).
constexpr int64_t kParallelMinElements = 1 << 13;

// out = residual * rsqrt(mean(residual^2) + eps) * weight, one row of `hidden`.
inline void normalize_row(float* out, const float* row, const float* weight, int64_t hidden,
                          float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < hidden; ++d) sum += row[d] * row[d];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t d = 0; d < hidden; ++d) out[d] = row[d] * inv * weight[d];
}
}  // namespace

// residual += x; x = rms_norm(residual) * weight. x, residual: [num_rows, hidden].
extern "C" void fused_add_rms_norm_float32(float* x, float* residual, const float* weight,
                                           float eps, int64_t num_rows, int64_t hidden,
                                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_rows * hidden >= kParallelMinElements)
  for (int64_t r = 0; r < num_rows; ++r) {
    float* xr = x + r * hidden;
    float* rr = residual + r * hidden;
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) rr[d] += xr[d];
    normalize_row(xr, rr, weight, hidden, eps);
  }
}

// out = rms_norm(x) * weight. out, x: [num_rows, hidden].
extern "C" void rms_norm_float32(float* out, const float* x, const float* weight, float eps,
                                 int64_t num_rows, int64_t hidden, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_rows * hidden >= kParallelMinElements)
  for (int64_t r = 0; r < num_rows; ++r)
    normalize_row(out + r * hidden, x + r * hidden, weight, hidden, eps);
}

// out = silu(gate) * up, where x = [gate | up]: x [num_rows, 2 * size], out [num_rows, size].
extern "C" void silu_and_mul_float32(float* out, const float* x, int64_t num_rows, int64_t size,
                                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_rows * size >= kParallelMinElements)
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* gate = x + r * 2 * size;
    const float* up = gate + size;
    float* o = out + r * size;
#pragma omp simd
    for (int64_t d = 0; d < size; ++d) o[d] = gate[d] / (1.f + std::exp(-gate[d])) * up[d];
  }
}

// From the fused q/k/v projection qkv [num_tokens, qkv_stride] (q heads, then k heads, then v
// heads, head_size each): query_out [num_tokens, num_heads, head_size] = rope(q); cache slot
// slot_mapping[t] of kv_cache [2, num_slots, num_kv_heads, head_size] gets rope(k) and v.
// rope(x)[d] = x[d] * cos[d] + x[(d + head_size / 2) % head_size] * signed_sin[d], with cos,
// signed_sin [num_tokens, head_size] (signed_sin = [-sin, sin]: rotate-half as one roll).
// Returns -1, or the first token whose slot lies outside the cache (then nothing is written).
extern "C" int64_t rotary_and_cache_float32(float* query_out, const float* qkv, const float* cos,
                                            const float* signed_sin, float* kv_cache,
                                            const int64_t* slot_mapping, int64_t num_tokens,
                                            int64_t num_heads, int64_t num_kv_heads,
                                            int64_t head_size, int64_t qkv_stride,
                                            int64_t num_slots, int num_threads) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return t;
  const int64_t half = head_size / 2, slot_size = num_kv_heads * head_size;
  float* k_cache = kv_cache;
  float* v_cache = kv_cache + num_slots * slot_size;
  auto rope = [=](float* out, const float* x, const float* c, const float* s) {
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + x[d + half] * s[d];
#pragma omp simd
    for (int64_t d = half; d < head_size; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
  };
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * (num_heads + 2 * num_kv_heads) * head_size >= kParallelMinElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    const float* row = qkv + t * qkv_stride;
    const float* c = cos + t * head_size;
    const float* s = signed_sin + t * head_size;
    for (int64_t h = 0; h < num_heads; ++h)
      rope(query_out + (t * num_heads + h) * head_size, row + h * head_size, c, s);
    const float* k = row + num_heads * head_size;
    const float* v = k + slot_size;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      rope(k_cache + slot * slot_size + h * head_size, k + h * head_size, c, s);
    std::copy(v, v + slot_size, v_cache + slot * slot_size);
  }
  return -1;
}
