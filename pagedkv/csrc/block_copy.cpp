// Whole-block copies between a paged KV cache and a packed message: the P2P data path's gather
// (P packs a message's blocks, in wire order, into staging) and scatter (D writes a received
// message into its blocks). Plain C ABI (ctypes), no torch headers.
//
// Block i of the copy goes from src block src_ids[i] to dst block dst_ids[i] (a null id array
// stands for 0, 1, 2, ...), each block `block_bytes` bytes, blocks `src_stride` / `dst_stride`
// bytes apart. Blocks consecutive on both sides are copied as one run. Every id is checked
// against its side's block count before a byte moves: a bad id copies nothing.
//
// The stores are plain, or non-temporal (`streaming`) when the destination will not be read
// soon (D's cache blocks, read by attention steps later; a packed message, read once by the
// socket after a few MiB of others): they bypass the caches, so the lines are not read before
// being written and what the socket is reading stays cached.
// One thread by default: on a small machine the gloo thread and the peer need the other cores.
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {
// A run this short is copied by memcpy even when streaming (the fences would cost more).
constexpr int64_t kStreamMinBytes = 4096;

inline int64_t at(const int64_t* ids, int64_t i) { return ids == nullptr ? i : ids[i]; }

// The first index in [0, n) whose id is outside [0, num_blocks), or -1.
int64_t first_bad(const int64_t* ids, int64_t n, int64_t num_blocks) {
  if (ids == nullptr) return n <= num_blocks ? -1 : num_blocks;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= num_blocks) return i;
  return -1;
}

void copy_run(char* dst, const char* src, int64_t bytes, bool streaming) {
#ifdef __AVX512F__
  if (streaming && bytes >= kStreamMinBytes) {
    // Align the destination to 64 bytes, stream whole lines, memcpy the tail.
    const int64_t head = static_cast<int64_t>((64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
    std::memcpy(dst, src, head);
    int64_t i = head;
    for (; i + 256 <= bytes; i += 256) {
      const __m512i a = _mm512_loadu_si512(src + i);
      const __m512i b = _mm512_loadu_si512(src + i + 64);
      const __m512i c = _mm512_loadu_si512(src + i + 128);
      const __m512i d = _mm512_loadu_si512(src + i + 192);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
    }
    for (; i + 64 <= bytes; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
    std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, src, bytes);
}

// Copies blocks [begin, end) of the copy, runs of consecutive blocks at once.
void copy_range(char* dst, const int64_t* dst_ids, int64_t dst_stride, const char* src,
                const int64_t* src_ids, int64_t src_stride, int64_t begin, int64_t end,
                int64_t block_bytes, bool streaming) {
  int64_t i = begin;
  while (i < end) {
    const int64_t d = at(dst_ids, i), s = at(src_ids, i);
    int64_t n = 1;
    // A run continues while both sides' ids go up by one and blocks are packed back to back.
    if (dst_stride == block_bytes && src_stride == block_bytes)
      while (i + n < end && at(dst_ids, i + n) == d + n && at(src_ids, i + n) == s + n) ++n;
    copy_run(dst + d * dst_stride, src + s * src_stride, n * block_bytes, streaming);
    i += n;
  }
#ifdef __AVX512F__
  if (streaming) _mm_sfence();  // this thread's streamed stores land before the copy returns
#endif
}
}  // namespace

// dst block dst_ids[i] <- src block src_ids[i] for i in [0, n). Returns -1 when done, else the
// first i whose destination id (or, past n + i, source id: returns n + i) is out of range, and
// nothing is copied. `num_threads` > 1 splits the blocks between threads.
extern "C" int64_t copy_blocks(void* dst, const int64_t* dst_ids, int64_t dst_blocks,
                               int64_t dst_stride, const void* src, const int64_t* src_ids,
                               int64_t src_blocks, int64_t src_stride, int64_t n,
                               int64_t block_bytes, int streaming, int num_threads) {
  const int64_t bad_dst = first_bad(dst_ids, n, dst_blocks);
  if (bad_dst >= 0) return bad_dst;
  const int64_t bad_src = first_bad(src_ids, n, src_blocks);
  if (bad_src >= 0) return n + bad_src;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const bool stream = streaming != 0;
  if (num_threads <= 1 || n < 2) {
    copy_range(d, dst_ids, dst_stride, s, src_ids, src_stride, 0, n, block_bytes, stream);
  } else {
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
      const int64_t threads = 1, t = 0;
#endif
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      copy_range(d, dst_ids, dst_stride, s, src_ids, src_stride, begin, end, block_bytes, stream);
    }
  }
  return -1;
}
