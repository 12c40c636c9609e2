// The shared-memory collectives of a tensor-parallel group on one host (C ABI, ctypes):
// publish a rank's data, wait for the others, and sum every rank's data in rank order.
// The protocol and why it is safe: pagedkv/distributed/shm_all_reduce.py.
//
// Segment layout (bytes; pagedkv/distributed/group_segment.py writes the same numbers):
//   0                  magic and nonce (Python's)
//   64                 closed: 0 while open, else (1 + the closing rank) << 32 | (1 + the rank
//                      it gave up waiting on, 0 for none): one word, set once
//   128 + 64 * r       rank r's sequence counter (its own cache line)
//   4096 + (2r + p) * slot_bytes   rank r's data slot for sequence numbers of parity p
#include <sched.h>
#include <time.h>

#include <cstdint>
#include <cstring>

#include "cpu_dtypes.h"
#include "kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kClosed = 64;
constexpr int64_t kCounters = 128;
constexpr int64_t kLineBytes = 64;
constexpr int64_t kHeaderBytes = 4096;
constexpr int32_t kMaxWorldSize = (kHeaderBytes - kCounters) / kLineBytes;
// Waiting: spin this long, then yield the core, then sleep. Ranks may share a core: a short
// spin lets the peer run sooner (two ranks on one core: 4 KiB in ~25 us with 2 us of spin,
// ~60 us with 20 us), and on a core of its own a yield returns at once, so the polling goes on.
constexpr int64_t kSpinNs = 2'000;
constexpr int64_t kYieldNs = 1'000'000;
constexpr int64_t kSleepNs = 50'000;
// Elements summed per block: kBlock fp32 accumulators stay in registers.
constexpr int64_t kBlock = 64;

enum Status : int32_t { kOk = 0, kTimeout = 1, kGroupClosed = 2 };
enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
}  // namespace

extern "C" {
// One rank's view of its group's segment (mirrored by a ctypes Structure).
struct ShmGroup {
  uint8_t* base;
  int64_t slot_bytes;
  int64_t timeout_ns;
  int32_t world_size;
  int32_t rank;
};
}

namespace {
int64_t* counter(const ShmGroup* g, int32_t rank) {
  return reinterpret_cast<int64_t*>(g->base + kCounters + kLineBytes * rank);
}

int64_t* word(const ShmGroup* g, int64_t offset) {
  return reinterpret_cast<int64_t*>(g->base + offset);
}

uint8_t* slot(const ShmGroup* g, int32_t rank, int64_t seq) {
  return g->base + kHeaderBytes + (2 * rank + (seq & 1)) * g->slot_bytes;
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000 + ts.tv_nsec;
}

void back_off(int64_t waited_ns) {
  if (waited_ns < kSpinNs) {
#if defined(__x86_64__)
    for (int i = 0; i < 16; ++i) _mm_pause();
#endif
  } else if (waited_ns < kYieldNs) {
    sched_yield();
  } else {
    const timespec pause{0, kSleepNs};
    nanosleep(&pause, nullptr);
  }
}

// Until every rank's counter is >= seq (kOk), the group is closed (kGroupClosed, *who = the closer),
// or the timeout passes (kTimeout, *who = the first rank still missing).
int32_t wait_all(const ShmGroup* g, int64_t seq, int32_t* who) {
  const int64_t start = now_ns();
  int32_t r = 0;
  for (;;) {
    while (r < g->world_size && __atomic_load_n(counter(g, r), __ATOMIC_ACQUIRE) >= seq) ++r;
    if (r == g->world_size) return kOk;
    const int64_t closed = __atomic_load_n(word(g, kClosed), __ATOMIC_ACQUIRE);
    if (closed != 0) {
      *who = static_cast<int32_t>((closed >> 32) - 1);
      return kGroupClosed;
    }
    const int64_t waited = now_ns() - start;
    if (waited > g->timeout_ns) {
      *who = r;
      return kTimeout;
    }
    back_off(waited);
  }
}

// out[i] = round(((s_0[i] + s_1[i]) + s_2[i]) + ...), the sum in fp32 in rank order: the same
// operations in the same order on every rank, hence the same bits. (-ffast-math may reassociate,
// but here each rank's addition is its own pass over acc, a chain over a runtime count of ranks;
// tests/distributed checks the bits against the rank-order sum.)
template <typename T>
void sum_slots(const ShmGroup* g, int64_t seq, T* out, int64_t numel) {
  const T* src[kMaxWorldSize];
  for (int32_t r = 0; r < g->world_size; ++r) src[r] = reinterpret_cast<const T*>(slot(g, r, seq));
  float acc[kBlock];
  for (int64_t start = 0; start < numel; start += kBlock) {
    const int64_t n = numel - start < kBlock ? numel - start : kBlock;
    for (int64_t j = 0; j < n; ++j) acc[j] = pagedkv::to_float(src[0][start + j]);
    for (int32_t r = 1; r < g->world_size; ++r)
      for (int64_t j = 0; j < n; ++j) acc[j] += pagedkv::to_float(src[r][start + j]);
    for (int64_t j = 0; j < n; ++j) out[start + j] = pagedkv::from_float<T>(acc[j]);
  }
}

// Sequence number seq: wait until every rank has published seq - 1 (then nobody still reads
// this rank's slot of seq's parity), copy nbytes of src into it (none when src is null), and
// publish seq.
int32_t publish(const ShmGroup* g, int64_t seq, const void* src, int64_t nbytes, int32_t* who) {
  const int32_t status = wait_all(g, seq - 1, who);
  if (status != kOk) return status;
  if (src != nullptr) std::memcpy(slot(g, g->rank, seq), src, nbytes);
  __atomic_store_n(counter(g, g->rank), seq, __ATOMIC_RELEASE);
  return kOk;
}
}  // namespace

extern "C" {
// nbytes of every rank's src into rank 0's dst: rank r's at dst + r * dst_stride (dst is read
// on rank 0 only; its own bytes are copied from src, not through its slot).
int32_t shm_gather(const ShmGroup* g, int64_t seq, const void* src, int64_t nbytes, void* dst,
                   int64_t dst_stride, int32_t* who) {
  int32_t status = publish(g, seq, g->rank == 0 ? nullptr : src, nbytes, who);
  if (status != kOk || g->rank != 0) return status;
  status = wait_all(g, seq, who);
  if (status != kOk) return status;
  uint8_t* out = static_cast<uint8_t*>(dst);
  std::memcpy(out, src, nbytes);
  for (int32_t r = 1; r < g->world_size; ++r)
    std::memcpy(out + r * dst_stride, slot(g, r, seq), nbytes);
  return kOk;
}

// x (numel elements of dtype, at most slot_bytes) = the rank-order sum of every rank's x.
int32_t shm_all_reduce(const ShmGroup* g, int64_t seq, void* x, int64_t numel, int32_t dtype,
                       int32_t* who) {
  const int64_t nbytes = numel * (dtype == kFloat32 ? 4 : 2);
  int32_t status = publish(g, seq, x, nbytes, who);
  if (status == kOk) status = wait_all(g, seq, who);
  if (status != kOk) return status;
  if (dtype == kFloat32) sum_slots(g, seq, static_cast<float*>(x), numel);
  if (dtype == kBFloat16) sum_slots(g, seq, static_cast<pagedkv::bf16*>(x), numel);
  if (dtype == kFloat16) sum_slots(g, seq, static_cast<_Float16*>(x), numel);
  return kOk;
}

// x (numel elements of dtype, any number) = the rank-order sum of every rank's x, in slot-sized
// chunks, one collective each, numbered ++*seq: *seq is the rank's last sequence number, one
// counter for every caller (ShmAllReduce's, and the one-call decode layer's all-reduces).
int32_t shm_all_reduce_next(const ShmGroup* g, int64_t* seq, void* x, int64_t numel,
                            int32_t dtype, int32_t* who) {
  const int64_t itemsize = dtype == kFloat32 ? 4 : 2;
  const int64_t chunk = g->slot_bytes / itemsize;
  uint8_t* bytes = static_cast<uint8_t*>(x);
  for (int64_t start = 0; start < numel; start += chunk) {
    const int64_t count = numel - start < chunk ? numel - start : chunk;
    const int32_t status = shm_all_reduce(g, ++*seq, bytes + start * itemsize, count, dtype, who);
    if (status != kOk) return status;
  }
  return kOk;
}

// This rank closes the group (the first closer wins): every wait returns kGroupClosed at once.
// missing: the rank it gave up waiting on, or -1.
void shm_group_close(const ShmGroup* g, int32_t missing) {
  int64_t open = 0;
  const int64_t closed = (int64_t{g->rank} + 1) << 32 | (int64_t{missing} + 1);
  __atomic_compare_exchange_n(word(g, kClosed), &open, closed, false, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
}
}
