// The element types of the CPU kernels (fp32, fp16, bf16) and their conversions to and from
// fp32, shared by the attention kernels. Included by each source: the functions are inline.
#pragma once
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace pagedkv {

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
struct bf16 {
  uint16_t bits;
};
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does for finite values
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fff + ((u >> 16) & 1);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

#ifdef __AVX512F__
// 16 values from T to fp32: bf16 and fp16 widen exactly.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

}  // namespace pagedkv
