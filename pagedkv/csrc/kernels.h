// The C ABI of the compiled CPU kernels that other kernels call: each defining source includes
// this header, so a signature that drifts from its declaration fails to compile.
#pragma once
#include <cstdint>

extern "C" {
// layer_ops.cpp
void fused_add_rms_norm_float32(float* x, float* residual, const float* weight, float eps,
                                int64_t num_rows, int64_t hidden, int num_threads);
void rms_norm_float32(float* out, const float* x, const float* weight, float eps,
                      int64_t num_rows, int64_t hidden, int num_threads);
void silu_and_mul_float32(float* out, const float* x, int64_t num_rows, int64_t size,
                          int num_threads);
int64_t rotary_and_cache_float32(float* query_out, const float* qkv, const float* cos,
                                 const float* signed_sin, float* kv_cache,
                                 const int64_t* slot_mapping, int64_t num_tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                 int64_t qkv_stride, int64_t num_slots, int num_threads);
// gemv.cpp
void gemv_input_major_float32(float* y, const float* w, const float* x, const float* bias,
                              int64_t K, int64_t N, int num_threads);
// paged_decode.cpp
void paged_decode_float32(void* out, const void* query, const void* kv_cache,
                          const int64_t* tokens, const int32_t* table, const int32_t* lens,
                          const int32_t* firsts, float scale, int64_t num_rows,
                          int64_t num_heads, int64_t head_size, int64_t num_blocks,
                          int64_t block_size, int64_t num_kv_heads, int64_t table_stride,
                          int num_threads);
// shm_all_reduce.cpp
struct ShmGroup;
int32_t shm_all_reduce_next(const ShmGroup* g, int64_t* seq, void* x, int64_t numel,
                            int32_t dtype, int32_t* who);
}
