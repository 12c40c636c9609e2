// Paged decode attention on CPU: one query token per request, keys and values read in place
// through the block table (no gathered copy). Plain C ABI, no torch headers: built in about a
// second by cpu_kernels.py and called through ctypes with the tensors' data pointers.
//
// Two implementations, one answer (up to fp32 rounding):
// - decode_generic, any dtype and shape: work item = (decode request, KV head), whose
//   G = num_heads / num_kv_heads query heads share each key and value row read. Three passes
//   over the request's keys: scores and their max, exp and sum, then the weighted sum of values.
//   Scores are kept in a per-item buffer, so each key and each value row is read once.
// - decode_avx512, head size 32, 64 or 128 where the CPU has AVX-512: one pass, vectorised by
//   hand (below); fp16 and bf16 are widened to fp32 as they are loaded.
// Everything accumulates in fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_dtypes.h"
#include "kernels.h"

namespace {
using namespace pagedkv;

struct Shape {
  int64_t num_rows, num_heads, head_size, num_blocks, block_size, num_kv_heads, table_stride;
};

// Calls visit(row, t) for the cache rows of keys t = 0 .. num_keys - 1 (positions first + t) of
// one KV head, walking the table block by block: one table read and no division per key.
// Blocks lie anywhere in the cache, where no hardware prefetcher looks, so the next block's rows
// (head_bytes each, from head_offset) are prefetched while this block's are visited: 64 decodes
// of 350 tokens, head size 32, 2.2 instead of 2.8 ms on 2 threads, 3.7 instead of 5.4 on 1.
template <typename T, typename Visit>
inline void for_each_key(const T* half, const int32_t* row_table, int64_t first, int64_t num_keys,
                         int64_t block_size, int64_t row_stride, int64_t head_offset,
                         int64_t head_bytes, Visit visit) {
  const int64_t end = first + num_keys;
  for (int64_t pos = first; pos < end;) {
    const int64_t offset = pos % block_size;
    const int64_t in_block = std::min(block_size - offset, end - pos);
    const T* block =
        half + (row_table[pos / block_size] * block_size + offset) * row_stride + head_offset;
    const int64_t next = pos + in_block;  // the start of a block, or the end
    if (next < end) {
      const char* next_block = reinterpret_cast<const char*>(
          half + row_table[next / block_size] * block_size * row_stride + head_offset);
      const int64_t rows = std::min(block_size, end - next);
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t byte = 0; byte < head_bytes; byte += 64)
          __builtin_prefetch(next_block + j * row_stride * static_cast<int64_t>(sizeof(T)) + byte);
    }
    for (int64_t j = 0; j < in_block; ++j) visit(block + j * row_stride, pos - first + j);
    pos = next;
  }
}

template <typename T>
void decode_generic(T* out, const T* query, const T* kv_cache, const int64_t* tokens,
                    const int32_t* table, const int32_t* lens, const int32_t* firsts, float scale,
                    const Shape s, int num_threads) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t row_stride = s.num_kv_heads * s.head_size;  // one slot of one cache half
  const T* k_base = kv_cache;
  const T* v_base = kv_cache + s.num_blocks * s.block_size * row_stride;
  const int64_t head_bytes = s.head_size * static_cast<int64_t>(sizeof(T));

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(group * s.head_size), acc(group * s.head_size), scores;
    std::vector<float> max_score(group), inv_sum(group);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.num_rows * s.num_kv_heads; ++item) {
      const int64_t row = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      const int64_t first = firsts[row], num_keys = lens[row] - first;
      const int32_t* row_table = table + row * s.table_stride;
      const T* q_row = query + (tokens[row] * s.num_heads + kv_head * group) * s.head_size;
      for (int64_t i = 0; i < group * s.head_size; ++i) q[i] = to_float(q_row[i]) * scale;
      scores.resize(group * num_keys);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      const int64_t head_offset = kv_head * s.head_size;
      for_each_key(k_base, row_table, first, num_keys, s.block_size, row_stride, head_offset,
                   head_bytes,
                   [&](const T* k, int64_t t) {
                     for (int64_t g = 0; g < group; ++g) {
                       const float* qg = q.data() + g * s.head_size;
                       float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                       for (int64_t d = 0; d < s.head_size; ++d) dot += qg[d] * to_float(k[d]);
                       scores[g * num_keys + t] = dot;
                       max_score[g] = std::max(max_score[g], dot);
                     }
                   });
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * num_keys;
        const float m = max_score[g];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < num_keys; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_key(v_base, row_table, first, num_keys, s.block_size, row_stride, head_offset,
                   head_bytes,
                   [&](const T* v, int64_t t) {
                     for (int64_t g = 0; g < group; ++g) {
                       const float p = scores[g * num_keys + t];
                       float* ag = acc.data() + g * s.head_size;
#pragma omp simd
                       for (int64_t d = 0; d < s.head_size; ++d) ag[d] += p * to_float(v[d]);
                     }
                   });
      T* o = out + (tokens[row] * s.num_heads + kv_head * group) * s.head_size;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < s.head_size; ++d)
          o[g * s.head_size + d] = from_float<T>(acc[g * s.head_size + d] * inv_sum[g]);
    }
  }
}

#ifdef __AVX512F__
// head_size = 16 * kVecs, in one pass over each work item's keys (online softmax, as
// flash attention): the K and V rows of a chunk of up to kChunk keys are read once, for every
// query head they serve; the chunk's probabilities come from one vectorised exp and rescale the
// accumulators; a chunk's 16 dot products are summed across lanes together (sum_lanes). A work
// item is a request (whole cache rows, read front to back) when there are enough requests to
// keep the threads busy, else a (request, KV head). 64 decodes of <= 350 tokens, head size 32,
// 2 threads: 1.3 ms instead of 2.2 (decode_generic); the same bytes merely summed: 1.1 ms.
constexpr int64_t kMaxHeads = 32;
constexpr int64_t kChunk = 16;

// The 16 horizontal sums of d[0..15] as one vector (lane j: the sum of d[j]'s lanes), by
// pairwise unpack/shuffle and add: 15 adds and 30 shuffles instead of 16 full reductions.
inline __m512 sum_lanes(const __m512 d[16]) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                         _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of 4 consecutive d
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Prefetches the next block's rows (K and V) in step with the work done on the current block:
// spread over it, not in one burst at its start that stalls on the core's limit of outstanding
// misses (64 decodes of <= 350 tokens, head size 32, 2 threads: 1.3 vs 1.7 ms). Non-temporal:
// each key and value is read once per step, so they should not evict what is read again (the
// layers' weights): the HF-peer run 2 % faster on a Zen 5, the kernel alone the same. Further
// ahead is slower there: two blocks 4-8 % (into L1 or L2), three 11-17 %.
template <typename T>
struct SpreadPrefetch {
  const T *k_base, *v_base;
  int64_t row_stride, row_bytes, first_slot, head_offset, num_rows;
  int64_t done = 0;

  void rows_upto(int64_t rows) {
    for (; done < std::min(rows, num_rows); ++done) {
      const int64_t at = (first_slot + done) * row_stride + head_offset;
      const char* k = reinterpret_cast<const char*>(k_base + at);
      const char* v = reinterpret_cast<const char*>(v_base + at);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(k + byte, 0, 0);
        __builtin_prefetch(v + byte, 0, 0);
      }
    }
  }
};

template <typename T, int kVecs>
void decode_avx512(T* out, const T* query, const T* kv_cache, const int64_t* tokens,
                   const int32_t* table, const int32_t* lens, const int32_t* firsts, float scale,
                   const Shape s, int num_threads) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t row_stride = s.num_kv_heads * s.head_size;
  const T* k_base = kv_cache;
  const T* v_base = kv_cache + s.num_blocks * s.block_size * row_stride;
  const bool whole_rows = s.num_rows >= 4 * num_threads && s.num_heads <= kMaxHeads;
  const int64_t heads = whole_rows ? s.num_kv_heads : 1;  // KV heads per work item
  const int64_t items_per_row = s.num_kv_heads / heads;
  const int64_t qh = heads * group;
  const int64_t item_bytes = heads * s.head_size * static_cast<int64_t>(sizeof(T));

#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t item = 0; item < s.num_rows * items_per_row; ++item) {
    const int64_t row = item / items_per_row, kv0 = (item % items_per_row) * heads;
    const int64_t first = firsts[row], end = lens[row];
    const int32_t* row_table = table + row * s.table_stride;
    const T* q_row = query + (tokens[row] * s.num_heads + kv0 * group) * s.head_size;
    const int64_t head_offset = kv0 * s.head_size;
    __m512 q[kMaxHeads][kVecs], acc[kMaxHeads][kVecs];
    float running_max[kMaxHeads], running_sum[kMaxHeads];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < qh; ++g) {
      for (int v = 0; v < kVecs; ++v) {
        q[g][v] = _mm512_mul_ps(load16(q_row + g * s.head_size + 16 * v), scale_v);
        acc[g][v] = _mm512_setzero_ps();
      }
      running_sum[g] = 0.f;
    }
    bool started = false;
    for (int64_t pos = first; pos < end;) {
      const int64_t offset = pos % s.block_size;
      const int64_t in_block = std::min(s.block_size - offset, end - pos);
      const int64_t slot = row_table[pos / s.block_size] * s.block_size + offset;
      const T* k_rows = k_base + slot * row_stride + head_offset;
      const T* v_rows = v_base + slot * row_stride + head_offset;
      const int64_t next = pos + in_block;
      const int64_t next_rows = next < end ? std::min(s.block_size, end - next) : 0;
      SpreadPrefetch<T> prefetch{k_base, v_base, row_stride, item_bytes,
                                 next < end ? row_table[next / s.block_size] * s.block_size : 0,
                                 head_offset, next_rows};
      for (int64_t c = 0; c < in_block; c += kChunk) {
        const int64_t n = std::min(kChunk, in_block - c);
        const T* kc = k_rows + c * row_stride;
        const T* vc = v_rows + c * row_stride;
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t g = 0; g < qh; ++g) {
          prefetch.rows_upto((c * qh + (g + 1) * n) * next_rows / (in_block * qh) + 1);
          const T* kg = kc + (g / group) * s.head_size;
          __m512 dots[kChunk];
          for (int64_t j = 0; j < kChunk; ++j) {
            if (j < n) {
              const T* k = kg + j * row_stride;
              __m512 dot = _mm512_mul_ps(q[g][0], load16(k));
              for (int v = 1; v < kVecs; ++v)
                dot = _mm512_fmadd_ps(q[g][v], load16(k + 16 * v), dot);
              dots[j] = dot;
            } else {
              dots[j] = _mm512_setzero_ps();
            }
          }
          const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), valid, sum_lanes(dots));
          const float chunk_max = _mm512_reduce_max_ps(scores);
          const float new_max = started ? std::max(running_max[g], chunk_max) : chunk_max;
          const float alpha = started ? std::exp(running_max[g] - new_max) : 0.f;
          alignas(64) float p[kChunk];
          _mm512_store_ps(p, _mm512_sub_ps(scores, _mm512_set1_ps(new_max)));
#pragma omp simd
          for (int64_t j = 0; j < kChunk; ++j) p[j] = std::exp(p[j]);  // 0 past n
          running_sum[g] = running_sum[g] * alpha + _mm512_reduce_add_ps(_mm512_load_ps(p));
          running_max[g] = new_max;
          const __m512 alpha_v = _mm512_set1_ps(alpha);
          __m512 a[kVecs];
          for (int v = 0; v < kVecs; ++v) a[v] = _mm512_mul_ps(acc[g][v], alpha_v);
          const T* vg = vc + (g / group) * s.head_size;
          for (int64_t j = 0; j < n; ++j) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int v = 0; v < kVecs; ++v)
              a[v] = _mm512_fmadd_ps(pj, load16(vg + j * row_stride + 16 * v), a[v]);
          }
          for (int v = 0; v < kVecs; ++v) acc[g][v] = a[v];
        }
        started = true;
      }
      prefetch.rows_upto(next_rows);
      pos = next;
    }
    T* o = out + (tokens[row] * s.num_heads + kv0 * group) * s.head_size;
    for (int64_t g = 0; g < qh; ++g) {
      const __m512 inv = _mm512_set1_ps(1.f / running_sum[g]);
      alignas(64) float values[16];
      for (int v = 0; v < kVecs; ++v) {
        _mm512_store_ps(values, _mm512_mul_ps(acc[g][v], inv));
        for (int i = 0; i < 16; ++i) o[g * s.head_size + 16 * v + i] = from_float<T>(values[i]);
      }
    }
  }
}

// The one-pass kernel when the shape has one; false: the caller runs the generic one.
template <typename T>
bool decode_fast(T* out, const T* query, const T* kv_cache, const int64_t* tokens,
                 const int32_t* table, const int32_t* lens, const int32_t* firsts, float scale,
                 const Shape s, int num_threads) {
  if (s.num_heads / s.num_kv_heads > kMaxHeads) return false;
  switch (s.head_size) {
    case 32:
      decode_avx512<T, 2>(out, query, kv_cache, tokens, table, lens, firsts, scale, s,
                          num_threads);
      return true;
    case 64:
      decode_avx512<T, 4>(out, query, kv_cache, tokens, table, lens, firsts, scale, s,
                          num_threads);
      return true;
    case 128:
      decode_avx512<T, 8>(out, query, kv_cache, tokens, table, lens, firsts, scale, s,
                          num_threads);
      return true;
    default:
      return false;
  }
}
#else
template <typename T>
bool decode_fast(T*, const T*, const T*, const int64_t*, const int32_t*, const int32_t*,
                 const int32_t*, float, const Shape, int) {
  return false;
}
#endif

template <typename T>
void decode(T* out, const T* query, const T* kv_cache, const int64_t* tokens, const int32_t* table,
            const int32_t* lens, const int32_t* firsts, float scale, const Shape s,
            int num_threads) {
  if (!decode_fast(out, query, kv_cache, tokens, table, lens, firsts, scale, s, num_threads))
    decode_generic(out, query, kv_cache, tokens, table, lens, firsts, scale, s, num_threads);
}

}  // namespace

// out, query: [num_tokens, num_heads, head_size]; kv_cache: [2, num_blocks, block_size,
// num_kv_heads, head_size]; all contiguous, of the one dtype the function is named after.
// tokens: int64 [num_rows], the decode rows of out/query; table: int32 [num_rows, table_stride];
// lens, firsts: int32 [num_rows]: row r attends to the keys at positions [firsts[r], lens[r]).
#define PAGED_DECODE(NAME, T)                                                                 \
  extern "C" void NAME(void* out, const void* query, const void* kv_cache,                    \
                       const int64_t* tokens, const int32_t* table, const int32_t* lens,      \
                       const int32_t* firsts, float scale, int64_t num_rows,                  \
                       int64_t num_heads, int64_t head_size, int64_t num_blocks,              \
                       int64_t block_size, int64_t num_kv_heads, int64_t table_stride,        \
                       int num_threads) {                                                     \
    const Shape s{num_rows,   num_heads,    head_size,   num_blocks,                          \
                  block_size, num_kv_heads, table_stride};                                    \
    decode<T>(static_cast<T*>(out), static_cast<const T*>(query),                             \
              static_cast<const T*>(kv_cache), tokens, table, lens, firsts, scale, s,         \
              num_threads);                                                                   \
  }

PAGED_DECODE(paged_decode_float32, float)
PAGED_DECODE(paged_decode_float16, _Float16)
PAGED_DECODE(paged_decode_bfloat16, bf16)
