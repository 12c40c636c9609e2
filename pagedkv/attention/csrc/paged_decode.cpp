// Paged decode attention on CPU: one query token per request, keys and values read in place
// through the block table (no gathered copy). Built at run time by cpu_decode_attention.py.
//
// Work item = (decode request, KV head): its G = num_heads / num_kv_heads query heads share
// each key and value row read. Three passes over the request's keys: scores and their max,
// exp and sum, then the weighted sum of values. Scores are kept in a per-item buffer, so each
// key and each value row is read once.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                   const torch::Tensor& token_indices, const torch::Tensor& block_table,
                   const torch::Tensor& seq_lens, const torch::Tensor& first_keys, double scale) {
  const int64_t num_rows = token_indices.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_size;  // one slot of one cache half
  const int64_t table_stride = block_table.size(1);
  const scalar_t* q_base = query.data_ptr<scalar_t>();
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = k_base + num_blocks * block_size * row_stride;
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int64_t* tokens = token_indices.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* firsts = first_keys.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_size), acc(group * head_size), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t first = firsts[row], num_keys = lens[row] - first;
      const int32_t* row_table = table + row * table_stride;
      const scalar_t* q_row = q_base + (tokens[row] * num_heads + kv_head * group) * head_size;
      for (int64_t i = 0; i < group * head_size; ++i) q[i] = static_cast<float>(q_row[i]) * fscale;
      scores.resize(group * num_keys);
      std::vector<float> max_score(group, -std::numeric_limits<float>::infinity());
      // Walk the keys block by block: one table read and no division per key.
      for (int64_t pos = first; pos < first + num_keys;) {
        const int64_t offset = pos % block_size;
        const int64_t in_block = std::min(block_size - offset, first + num_keys - pos);
        const scalar_t* k_block =
            k_base + (row_table[pos / block_size] * block_size + offset) * row_stride +
            kv_head * head_size;
        for (int64_t j = 0; j < in_block; ++j) {
          const scalar_t* k = k_block + j * row_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + g * head_size;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_size; ++d) s += qg[d] * static_cast<float>(k[d]);
            scores[g * num_keys + pos - first + j] = s;
            max_score[g] = std::max(max_score[g], s);
          }
        }
        pos += in_block;
      }
      std::vector<float> inv_sum(group);
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
      for (int64_t pos = first; pos < first + num_keys;) {
        const int64_t offset = pos % block_size;
        const int64_t in_block = std::min(block_size - offset, first + num_keys - pos);
        const scalar_t* v_block =
            v_base + (row_table[pos / block_size] * block_size + offset) * row_stride +
            kv_head * head_size;
        for (int64_t j = 0; j < in_block; ++j) {
          const scalar_t* v = v_block + j * row_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * num_keys + pos - first + j];
            float* ag = acc.data() + g * head_size;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) ag[d] += p * static_cast<float>(v[d]);
          }
        }
        pos += in_block;
      }
      scalar_t* o = out_base + (tokens[row] * num_heads + kv_head * group) * head_size;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_size; ++d)
          o[g * head_size + d] = static_cast<scalar_t>(acc[g * head_size + d] * inv_sum[g]);
    }
  });
}

}  // namespace

// out, query: [num_tokens, num_heads, head_size]; kv_cache: [2, num_blocks, block_size,
// num_kv_heads, head_size], contiguous; token_indices: int64 [R], the decode rows of out/query;
// block_table: int32 [R, max_blocks]; seq_lens, first_keys: int32 [R]: keys at positions
// [first_keys, seq_lens) are attended to.
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                  torch::Tensor token_indices, torch::Tensor block_table, torch::Tensor seq_lens,
                  torch::Tensor first_keys, double scale) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous(),
              "paged_decode needs contiguous query, out and kv_cache");
  TORCH_CHECK(block_table.is_contiguous() && block_table.scalar_type() == torch::kInt32,
              "paged_decode needs a contiguous int32 block table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode",
                                  [&] {
                                    decode_kernel<scalar_t>(out, query, kv_cache, token_indices,
                                                            block_table, seq_lens, first_keys,
                                                            scale);
                                  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
