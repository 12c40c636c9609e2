// Fused pointwise ops of a decoder layer on CPU, fp32: residual add + RMSNorm, RMSNorm, and
// SiLU-and-mul. Plain C ABI (ctypes). Rows run in parallel only when there are enough elements
// to pay for waking the OpenMP threads.
#include <cmath>
#include <cstdint>

namespace {
constexpr int64_t kParallelMinElements = 1 << 16;

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
