// One decoder layer of a decode step with one request, fp32, in one call: the input norm, the
// fused q/k/v projection, RoPE and the KV cache write, paged decode attention, o_proj, the
// post-attention norm, gate/up, SiLU-and-mul and down. Plain C ABI (ctypes).
//
// It runs the same kernels, in the same order and with the same thread counts, as the layer's
// modules do one call at a time, so its output is bit for bit theirs. What it saves is the
// Python between them: on this project's tiny Llama a one-row step spent more time in module
// calls, operand checks and ctypes than in its layers' kernels.
//
// Under tensor parallelism (a rank's shard of the layer) it runs the group's two all-reduces
// itself, where the modules run TPGroup.all_reduce: after o_proj's GEMV and after down's (each
// GEMV adding this rank's bias, which only rank 0 has), through the shared-memory all-reduce
// (shm_all_reduce.cpp) and the rank's one sequence counter, so they interleave with the Python
// side's collectives as the modules' calls would. A group without shared memory (gloo) has no
// one-call layer (cpu_decode_layer.py).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

// One decoder layer as the Python side lays it out (cpu_decode_layer.py's DecodeLayerStruct:
// the same fields in the same order). Weights are input-major ([in, out]); a null bias is none.
struct DecodeLayer {
  const float* input_norm;  // [hidden]
  const float* qkv;         // [hidden, (num_heads + 2 * num_kv_heads) * head_size]
  const float* qkv_bias;
  const float* o_proj;  // [num_heads * head_size, hidden]
  const float* o_proj_bias;
  const float* post_norm;  // [hidden]
  const float* gate_up;    // [hidden, 2 * intermediate]: gate columns, then up columns
  const float* gate_up_bias;
  const float* down;  // [intermediate, hidden]
  const float* down_bias;
  int64_t hidden, num_heads, num_kv_heads, head_size, intermediate;
  float eps, scale;
};

// hidden_states [hidden]: in, the layer's input (the previous layer's MLP output, or the
// embedding when `first`); out, this layer's MLP output. residual [hidden]: the residual
// stream, updated in place (when `first`, it is set to the input). The decoding token's keys
// and values go to cache slot `*slot` of kv_cache [2, num_blocks, block_size, num_kv_heads,
// head_size]; it attends to the keys at positions [*first_key, *seq_len) through `table` (one
// row of block ids). group: this rank's tensor-parallel group, whose all-reduces take sequence
// numbers from *seq (shm_all_reduce_next); null: one rank, no all-reduce.
// Returns 0; -1 when the slot lies outside the cache (nothing written); or an all-reduce's
// failure status (shm_all_reduce.cpp: 1 timed out, 2 group closed; *who: the rank it names).
extern "C" int64_t decode_layer_one_row_float32(
    float* hidden_states, float* residual, int first, const DecodeLayer* layer, const float* cos,
    const float* signed_sin, float* kv_cache, int64_t num_blocks, int64_t block_size,
    const int64_t* slot, const int32_t* table, int64_t table_stride, const int32_t* seq_len,
    const int32_t* first_key, int num_threads, const ShmGroup* group, int64_t* seq,
    int32_t* who) {
  constexpr int32_t kFloat32 = 0;  // shm_all_reduce.cpp's dtype code
  const DecodeLayer& l = *layer;
  const int64_t q_size = l.num_heads * l.head_size;
  const int64_t qkv_size = q_size + 2 * l.num_kv_heads * l.head_size;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * l.hidden + qkv_size + 2 * q_size + 3 * l.intermediate);
  float* normed = scratch.data();
  float* qkv = normed + l.hidden;
  float* query = qkv + qkv_size;
  float* attended = query + q_size;
  float* projected = attended + q_size;
  float* gate_up = projected + l.hidden;
  float* activated = gate_up + 2 * l.intermediate;

  if (first) {
    std::copy(hidden_states, hidden_states + l.hidden, residual);
    rms_norm_float32(normed, residual, l.input_norm, l.eps, 1, l.hidden, num_threads);
  } else {
    fused_add_rms_norm_float32(hidden_states, residual, l.input_norm, l.eps, 1, l.hidden,
                               num_threads);
    normed = hidden_states;
  }
  gemv_input_major_float32(qkv, l.qkv, normed, l.qkv_bias, l.hidden, qkv_size, num_threads);
  if (rotary_and_cache_float32(query, qkv, cos, signed_sin, kv_cache, slot, 1, l.num_heads,
                               l.num_kv_heads, l.head_size, qkv_size, num_blocks * block_size,
                               num_threads) >= 0)
    return -1;
  const int64_t row = 0;
  paged_decode_float32(attended, query, kv_cache, &row, table, seq_len, first_key, l.scale, 1,
                       l.num_heads, l.head_size, num_blocks, block_size, l.num_kv_heads,
                       table_stride, num_threads);
  gemv_input_major_float32(projected, l.o_proj, attended, l.o_proj_bias, q_size, l.hidden,
                           num_threads);
  if (group != nullptr) {
    const int32_t status = shm_all_reduce_next(group, seq, projected, l.hidden, kFloat32, who);
    if (status != 0) return status;
  }
  fused_add_rms_norm_float32(projected, residual, l.post_norm, l.eps, 1, l.hidden, num_threads);
  gemv_input_major_float32(gate_up, l.gate_up, projected, l.gate_up_bias, l.hidden,
                           2 * l.intermediate, num_threads);
  silu_and_mul_float32(activated, gate_up, 1, l.intermediate, num_threads);
  gemv_input_major_float32(hidden_states, l.down, activated, l.down_bias, l.intermediate,
                           l.hidden, num_threads);
  if (group == nullptr) return 0;
  return shm_all_reduce_next(group, seq, hidden_states, l.hidden, kFloat32, who);
}

// What the Python side checks its struct's size against before the first call.
extern "C" int64_t decode_layer_struct_size() { return sizeof(DecodeLayer); }
