// Paged prefill attention on CPU: causal attention of chunks of several query tokens (a prompt,
// or a piece of one after a prefix-cache hit) over keys and values read in place through the
// block table. Plain C ABI (ctypes), like paged_decode.cpp.
//
// A work item is a run of consecutive tiles of one (chunk, KV head); a tile's rows are its query
// tokens times the G = num_heads / num_kv_heads query heads that share the KV head. An item
// transposes its keys once, in groups of 16 ([head_size][16] each), so that a row's 16 scores
// are head_size broadcast FMAs (no horizontal sums); a group and its V rows then serve every
// row of a tile from L1. Online softmax per row, as flash attention; fp16 and bf16 are widened
// to fp32 as they are loaded; everything accumulates in fp32. Head size 32, 64 or 128 where the
// CPU has AVX-512; elsewhere the caller runs SDPA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_dtypes.h"

namespace {
using namespace pagedkv;

struct PrefillShape {
  int64_t num_chunks, num_heads, head_size, num_blocks, block_size, num_kv_heads, table_stride,
      sliding_window;  // 0: none
};

#ifdef __AVX512F__
constexpr int64_t kKeys = 16;     // keys per group: one vector of scores
constexpr int64_t kMaxRows = 32;  // query rows (token, head) of a work item
constexpr int64_t kRowBlock = 8;  // rows whose scores are computed together
constexpr __mmask16 kRowMask = (1u << kRowBlock) - 1;

struct WorkItem {
  int64_t chunk, kv_head, first_token, num_tokens, cost;
};

// First key position a query at position p sees: p - W + 1 with a window of W, else 0.
inline int64_t first_key(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(p - window + 1, 0) : 0;
}

// Keys read by the tiles of one chunk's tokens [first_token, end) (tile tokens each).
inline int64_t tiles_cost(int64_t first_pos, int64_t first_token, int64_t end, int64_t tile,
                          int64_t window) {
  int64_t cost = 0;
  for (int64_t t = first_token; t < end; t += tile) {
    const int64_t last = first_pos + std::min(t + tile, end) - 1;
    cost += last + 1 - first_key(first_pos + t, window);
  }
  return cost;
}

// Work items: runs of consecutive tiles of one (chunk, KV head), so that its keys and values,
// read from memory by the first tile, stay in the core's cache for the next ones (items of
// single tiles in cost order: 2x slower, every tile reading its keys from L3). A run ends once
// it holds 1/8 of a thread's share of the work, so that one long prompt still spreads over the
// threads; the costliest items go first, so that the dynamic schedule ends with short ones.
std::vector<WorkItem> work_items(const int32_t* query_lens, const int32_t* seq_lens,
                                 const PrefillShape& s, int64_t tile, int num_threads) {
  int64_t total = 0;
  for (int64_t c = 0; c < s.num_chunks; ++c)
    total += tiles_cost(seq_lens[c] - query_lens[c], 0, query_lens[c], tile, s.sliding_window);
  const int64_t target = std::max<int64_t>(1, total / (8 * num_threads));
  std::vector<WorkItem> items;
  for (int64_t c = 0; c < s.num_chunks; ++c) {
    const int64_t first_pos = seq_lens[c] - query_lens[c];
    for (int64_t start = 0, t = 0, cost = 0; t < query_lens[c];) {
      cost += tiles_cost(first_pos, t, std::min<int64_t>(t + tile, query_lens[c]), tile,
                         s.sliding_window);
      t = std::min<int64_t>(t + tile, query_lens[c]);
      if (cost >= target || t == query_lens[c]) {
        for (int64_t h = 0; h < s.num_kv_heads; ++h)
          items.push_back({c, h, start, t - start, cost});
        start = t, cost = 0;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// exp of 16 lanes, without a call (a libmvec call spills every vector register): x = k ln2 + r
// with |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 7 (truncation below 1e-8;
// fp32 rounding adds about an ulp), times 2^k by vscalefps. Inputs are clamped to [-87, 88],
// where the result is a normal float.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f})
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(poly, k);
}

struct Max {
  static __m512 apply(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
};
struct Add {
  static __m512 apply(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
};

// Lane i (i < 8) of the result: d[i]'s 16 lanes reduced by Op, for 8 vectors at once: 8 Ops and
// 16 shuffles in a tree, where 8 separate reductions take about 3 times as many, in 8 chains.
template <typename Op>
inline __m512 reduce_lanes(const __m512 d[8]) {
  __m512 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0 a2 b0 b2] op [a1 a3 b1 b3]
    t[i] = Op::apply(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                     _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit lane: d[4i .. 4i + 3] reduced over it
    u[i] = Op::apply(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                     _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 v =  // 128-bit lanes: u0's halves reduced, then u1's
      Op::apply(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return Op::apply(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 3, 2, 0)),
                   _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 3, 3, 1)));
}

// One group of keys (k_tile: their K rows transposed; v_rows, from j_from: no row sees a key
// before it) for kRowBlock query rows (q, scaled): the rows' scores, then the online-softmax
// update of their running max, sum and accumulators. Lanes outside visible[i] count for
// nothing (a row with none is unchanged).
// Independent rows side by side keep several FMA chains in flight: one row alone waits on the
// latency of one chain (4 cycles per FMA).
template <typename T, int kVecs>
inline void update_rows(const float (*q)[16 * kVecs], const float (*k_tile)[kKeys],
                        const T* const* v_rows, int64_t j_from, int64_t n,
                        const __mmask16* visible,
                        __m512 (*acc)[kVecs], float* running_max, float* running_sum) {
  constexpr int64_t kDim = 16 * kVecs;
  __m512 even[kRowBlock], odd[kRowBlock];
  for (int64_t i = 0; i < kRowBlock; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kDim; d += 2) {
    const __m512 k0 = _mm512_loadu_ps(k_tile[d]), k1 = _mm512_loadu_ps(k_tile[d + 1]);
    for (int64_t i = 0; i < kRowBlock; ++i) {
      even[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), k0, even[i]);
      odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d + 1]), k1, odd[i]);
    }
  }
  // lane i of new_max, alpha and the sums: row i's (lanes from kRowBlock on: unused)
  __m512 masked[kRowBlock], p[kRowBlock];
  for (int64_t i = 0; i < kRowBlock; ++i)
    masked[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), visible[i],
                                   _mm512_add_ps(even[i], odd[i]));
  const __m512 old_max = _mm512_maskz_loadu_ps(kRowMask, running_max);
  const __m512 new_max = _mm512_max_ps(old_max, reduce_lanes<Max>(masked));
  const __m512 alpha = exp16(_mm512_sub_ps(old_max, new_max));  // each row's rescale
  alignas(64) float prob[kRowBlock][kKeys];
#pragma GCC unroll 8
  for (int64_t i = 0; i < kRowBlock; ++i) {
    const __m512 row_max = _mm512_permutexvar_ps(_mm512_set1_epi32(i), new_max);
    p[i] = _mm512_maskz_mov_ps(visible[i], exp16(_mm512_sub_ps(masked[i], row_max)));
    _mm512_store_ps(prob[i], p[i]);
  }
  const __m512 sums = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(kRowMask, running_sum), alpha,
                                      reduce_lanes<Add>(p));
  _mm512_mask_storeu_ps(running_sum, kRowMask, sums);
  _mm512_mask_storeu_ps(running_max, kRowMask, new_max);
  constexpr int kPart = 2;  // accumulators per row at a time
  for (int v0 = 0; v0 < kVecs; v0 += kPart) {
    __m512 a[kRowBlock][kPart];
    for (int64_t i = 0; i < kRowBlock; ++i)
      for (int w = 0; w < kPart; ++w)
        a[i][w] = _mm512_mul_ps(acc[i][v0 + w],
                                _mm512_permutexvar_ps(_mm512_set1_epi32(i), alpha));
    for (int64_t j = j_from; j < n; ++j) {
      for (int w = 0; w < kPart; ++w) {
        const __m512 v = load16(v_rows[j] + 16 * (v0 + w));
        for (int64_t i = 0; i < kRowBlock; ++i)
          a[i][w] = _mm512_fmadd_ps(_mm512_set1_ps(prob[i][j]), v, a[i][w]);
      }
    }
    for (int64_t i = 0; i < kRowBlock; ++i)
      for (int w = 0; w < kPart; ++w) acc[i][v0 + w] = a[i][w];
  }
}

// A work item's operands. Its keys are transposed once per item, in groups of kKeys aligned on
// positions: group g (keys 16 g .. 16 g + 15) is k_groups[g - first_group], [head_size][16],
// zero past the item's last key; v_rows[t] is the V row of key 16 * first_group + t.
template <typename T>
struct TileContext {
  const T* query;
  T* out;
  const float* k_groups;
  const T* const* v_rows;
  int64_t first_group, num_heads, group, kv_head, sliding_window;
};

// The num_tokens query tokens from row token0 of query/out, at positions from p_first, for the
// G query heads of one KV head: num_tokens * G <= kMaxRows rows (row r: token r / G, head r % G).
template <typename T, int kVecs>
void attend_tile(const TileContext<T>& c, int64_t token0, int64_t p_first, int64_t num_tokens,
                 float scale) {
  constexpr int64_t kDim = 16 * kVecs;
  const int64_t num_rows = num_tokens * c.group, p_last = p_first + num_tokens - 1;
  alignas(64) float q[kMaxRows][kDim];
  __m512 acc[kMaxRows][kVecs];
  alignas(64) float running_max[kMaxRows], running_sum[kMaxRows];
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kMaxRows; ++r) {  // rows past num_rows: zero, never written out
    const int64_t head = c.kv_head * c.group + r % c.group;
    const T* q_row = c.query + ((token0 + r / c.group) * c.num_heads + head) * kDim;
    for (int v = 0; v < kVecs; ++v) {
      const __m512 x = r < num_rows ? load16(q_row + 16 * v) : _mm512_setzero_ps();
      _mm512_store_ps(q[r] + 16 * v, _mm512_mul_ps(x, scale_v));
      acc[r][v] = _mm512_setzero_ps();
    }
    running_max[r] = -1e30f;  // finite: -ffast-math assumes no infinities
    running_sum[r] = 0.f;
  }
  int64_t p[kMaxRows], lo[kMaxRows];  // row r's position and first visible key
  for (int64_t r = 0; r < num_rows; ++r) {
    p[r] = p_first + r / c.group;
    lo[r] = first_key(p[r], c.sliding_window);
  }
  for (int64_t g = first_key(p_first, c.sliding_window) / kKeys; g <= p_last / kKeys; ++g) {
    const int64_t pos = g * kKeys, n = std::min(kKeys, p_last + 1 - pos);
    const auto k_tile = reinterpret_cast<const float(*)[kKeys]>(
        c.k_groups + (g - c.first_group) * kDim * kKeys);
    const T* const* v_rows = c.v_rows + (g - c.first_group) * kKeys;
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowBlock) {
      __mmask16 visible[kRowBlock];
      const int64_t last_row = std::min(r0 + kRowBlock, num_rows) - 1;
      if (n == kKeys && pos >= lo[last_row] && pos + kKeys - 1 <= p[r0]) {
        for (int64_t i = 0; i < kRowBlock; ++i) visible[i] = r0 + i <= last_row ? 0xffff : 0;
      } else {  // near the diagonal or the window's edge: lanes j with pos + j in [lo, p]
        bool any = false;
        for (int64_t i = 0; i < kRowBlock; ++i) {
          const int64_t r = std::min(r0 + i, last_row);
          const int64_t from = std::max<int64_t>(lo[r] - pos, 0);
          const int64_t to = std::min(p[r] - pos + 1, n);
          visible[i] = r0 + i <= last_row && from < to
                           ? static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1))
                           : 0;
          any |= visible[i] != 0;
        }
        if (!any) continue;
      }
      update_rows<T, kVecs>(q + r0, k_tile, v_rows, std::max<int64_t>(lo[0] - pos, 0), n,
                            visible, acc + r0, running_max + r0, running_sum + r0);
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t head = c.kv_head * c.group + r % c.group;
    T* o = c.out + ((token0 + r / c.group) * c.num_heads + head) * kDim;
    const __m512 inv = _mm512_set1_ps(1.f / running_sum[r]);
    alignas(64) float values[16];
    for (int v = 0; v < kVecs; ++v) {
      _mm512_store_ps(values, _mm512_mul_ps(acc[r][v], inv));
      for (int e = 0; e < 16; ++e) o[16 * v + e] = from_float<T>(values[e]);
    }
  }
}

template <typename T, int kVecs>
void prefill_avx512(T* out, const T* query, const T* kv_cache, const int32_t* token_starts,
                    const int32_t* query_lens, const int32_t* seq_lens, const int32_t* table,
                    float scale, const PrefillShape s, int num_threads) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kMaxRows / group);  // query tokens per tile
  constexpr int64_t kDim = 16 * kVecs;
  const int64_t row_stride = s.num_kv_heads * kDim;  // one slot of one cache half
  const T* v_base = kv_cache + s.num_blocks * s.block_size * row_stride;
  const std::vector<WorkItem> items = work_items(query_lens, seq_lens, s, tile, num_threads);
  const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> k_groups;
    std::vector<const T*> v_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem item = items[i];
      const int32_t* row_table = table + item.chunk * s.table_stride;
      const int64_t first_pos = seq_lens[item.chunk] - query_lens[item.chunk];
      const int64_t end = item.first_token + item.num_tokens;
      const int64_t last_key = first_pos + end - 1;
      // keys before the item's first visible one stay zero, their V rows unset: never read
      const int64_t item_first_key = first_key(first_pos + item.first_token, s.sliding_window);
      const int64_t first_group = item_first_key / kKeys;
      const int64_t num_keys = (last_key / kKeys + 1 - first_group) * kKeys;
      k_groups.assign(num_keys * kDim, 0.f);
      v_rows.resize(num_keys);
      const int64_t head_offset = item.kv_head * kDim;
      for (int64_t key = item_first_key; key <= last_key; ++key) {
        const int64_t t = key - first_group * kKeys;
        const int64_t slot = row_table[key / s.block_size] * s.block_size + key % s.block_size;
        const T* k = kv_cache + slot * row_stride + head_offset;
        float* k_group = k_groups.data() + (t / kKeys) * kDim * kKeys + t % kKeys;
        for (int64_t d = 0; d < kDim; ++d) k_group[d * kKeys] = to_float(k[d]);
        v_rows[t] = v_base + slot * row_stride + head_offset;
      }
      const TileContext<T> context{query,       out,           k_groups.data(), v_rows.data(),
                                   first_group, s.num_heads,   group,           item.kv_head,
                                   s.sliding_window};
      for (int64_t t = item.first_token; t < end; t += tile)
        attend_tile<T, kVecs>(context, token_starts[item.chunk] + t, first_pos + t,
                              std::min(tile, end - t), scale);
    }
  }
}

template <typename T>
bool prefill(T* out, const T* query, const T* kv_cache, const int32_t* token_starts,
             const int32_t* query_lens, const int32_t* seq_lens, const int32_t* table,
             float scale, const PrefillShape s, int num_threads) {
  if (s.num_heads / s.num_kv_heads > kMaxRows) return false;
  switch (s.head_size) {
    case 32:
      prefill_avx512<T, 2>(out, query, kv_cache, token_starts, query_lens, seq_lens, table,
                           scale, s, num_threads);
      return true;
    case 64:
      prefill_avx512<T, 4>(out, query, kv_cache, token_starts, query_lens, seq_lens, table,
                           scale, s, num_threads);
      return true;
    case 128:
      prefill_avx512<T, 8>(out, query, kv_cache, token_starts, query_lens, seq_lens, table,
                           scale, s, num_threads);
      return true;
    default:
      return false;
  }
}
#else
template <typename T>
bool prefill(T*, const T*, const T*, const int32_t*, const int32_t*, const int32_t*,
             const int32_t*, float, const PrefillShape, int) {
  return false;
}
#endif

}  // namespace

// out, query: [num_tokens, num_heads, head_size]; kv_cache: [2, num_blocks, block_size,
// num_kv_heads, head_size]; all contiguous, of the one dtype the function is named after.
// Chunk c: the query_lens[c] tokens from row token_starts[c] of out/query, at positions
// seq_lens[c] - query_lens[c] .. seq_lens[c] - 1, keys through table[c] (int32, table_stride
// per chunk). A query at position p sees the keys at (p - sliding_window, p] (sliding_window 0:
// all of [0, p]). Returns 0, having written nothing, when this CPU or shape has no kernel.
#define PAGED_PREFILL(NAME, T)                                                                \
  extern "C" int NAME(void* out, const void* query, const void* kv_cache,                     \
                      const int32_t* token_starts, const int32_t* query_lens,                 \
                      const int32_t* seq_lens, const int32_t* table, float scale,             \
                      int64_t num_chunks, int64_t num_heads, int64_t head_size,               \
                      int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,           \
                      int64_t table_stride, int64_t sliding_window, int num_threads) {        \
    const PrefillShape s{num_chunks, num_heads,    head_size,    num_blocks,                  \
                         block_size, num_kv_heads, table_stride, sliding_window};             \
    return prefill<T>(static_cast<T*>(out), static_cast<const T*>(query),                     \
                      static_cast<const T*>(kv_cache), token_starts, query_lens, seq_lens,    \
                      table, scale, s, num_threads);                                          \
  }

PAGED_PREFILL(paged_prefill_float32, float)
PAGED_PREFILL(paged_prefill_float16, _Float16)
PAGED_PREFILL(paged_prefill_bfloat16, bf16)
