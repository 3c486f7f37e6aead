// Paged attention on CPU: each query token reads its request's keys and
// values where they lie in the paged KV cache, up to its own position.
//
// Plays the part of vLLM's csrc/cpu/ attention kernel
// (torch.ops._C.cpu_attention_with_kv_cache, called by
// vllm/v1/attention/backends/cpu_attn.py, which on x86, Arm, s390x, RISC-V and
// PowerPC sends it every request, prompts included). Here it takes the decodes
// (one-token queries) and the queries of more than one token that attend at
// most small_query_limit (query token, key) pairs: a short prompt, a chunk, a
// speculative verify. A query's tokens and query heads share each eight keys
// as they are read (scores_rows), but each walks the values on its own, so
// its time grows with its pairs, where SDPA's matmuls take every token
// against every key, masked or not, at about two thirds of the cost per
// pair: the longer queries are left to the caller, which sends them to SDPA
// one request at a time.
// The plain-PyTorch reference, kernels/unified_attention.py's
// unified_attention_torch, copies every decode's pages into one padded tensor
// first (index_select) and hands it to SDPA with a mask; reading the pages in
// place skips that copy and the padding. Built on first use by
// kernels/cpu_attn.py.
//
// Layout (tracevllm's, as the Triton kernel's):
//   query, output: [num_tokens, num_heads, head_size], float32
//   kv_cache:      [num_blocks, 2, block_size, num_kv_heads, head_size], float32
//   query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32 (this
//   step's token included); block_table: [num_reqs, max_blocks] int32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc0 = {0}, acc1 = {0};  // two chains, so one add need not wait on the last
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    acc0 += load8(a + d) * load8(b + d);
    acc1 += load8(a + d + 8) * load8(b + d + 8);
  }
  for (; d + 8 <= n; d += 8) acc0 += load8(a + d) * load8(b + d);
  acc0 += acc1;
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += acc0[i];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  const v8 av = v8{0} + a;
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(y + d, load8(y + d) + av * load8(x + d));
  for (; d < n; ++d) y[d] += a * x[d];
}

// Lane j of the result: the sum of a[j]'s eight lanes, added in one order,
// ((0+1)+(2+3))+((4+5)+(6+7)), whichever j is. Three rounds of adding
// neighbours (pairs) instead of eight separate horizontal sums.
inline v8 sum8x8(const v8* a) {
  const auto pairs = [](v8 x, v8 y) {  // [x0+x1, x2+x3, x4+x5, x6+x7, y0+y1, ..., y6+y7]
#if defined(__clang__)
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
#else  // GCC before 12 has only its own spelling
    return __builtin_shuffle(x, y, v8i{0, 2, 4, 6, 8, 10, 12, 14}) +
           __builtin_shuffle(x, y, v8i{1, 3, 5, 7, 9, 11, 13, 15});
#endif
  };
  const v8 p0 = pairs(a[0], a[1]), p1 = pairs(a[2], a[3]);
  const v8 p2 = pairs(a[4], a[5]), p3 = pairs(a[6], a[7]);
  return pairs(pairs(p0, p1), pairs(p2, p3));
}

// How far ahead scores_rows asks for keys and values from memory.
constexpr int64_t PREFETCH_KEYS = 16;

// The scores of R query rows (one head of one token each) against keys
// [0, len_max), eight keys at a time: each key is loaded once per row from
// L1 (the eight, 8 * HEAD floats, stay there), and the eight dot products
// run as eight independent chains of fused multiply-adds. A row stops at
// its own length (causal): rows[r]'s scores past rlen[r] within its last
// eight are computed and never read. Where a head size is known when
// compiling (64, 128: most models); any other takes dot() above.
//
// Eight keys in separate slots are eight streams of loads, which the
// hardware's prefetcher does not follow as it follows one key after
// another (measured: 0.8x the one-key-at-a-time walk on a decode step whose
// cache came from memory, 1.2x on one from cache). So each key reached asks
// for the key PREFETCH_KEYS further on, and its value for the weighted sum
// after this, into L2 (prefetcht1: L1 took the prefetches no faster than
// none). c_kv: the values' offset from the keys.
template <int64_t HEAD>
inline void scores_rows(float* S, int64_t s_stride, const float* const* rows,
                        const int64_t* rlen, int64_t R, const float* keys,
                        const int32_t* pages, int64_t len_max, int64_t block_size,
                        int64_t c_block, int64_t c_slot, int64_t c_kv, float scale) {
  constexpr int64_t V = HEAD / 8;
  int64_t page = 0, slot = 0;  // key t sits in page t / block_size, slot t % block_size
  int64_t pf_page = 0, pf_slot = 0, pf_t = 0;  // the same for the prefetches
  const auto prefetch_to = [&](int64_t end) {
    for (; pf_t < std::min(end, len_max); ++pf_t) {
      const float* k = keys + pages[pf_page] * c_block + pf_slot * c_slot;
      for (int64_t i = 0; i < HEAD; i += 16) {  // a 64-byte line at a time
        __builtin_prefetch(k + i, 0, 2);
        __builtin_prefetch(k + c_kv + i, 0, 2);
      }
      if (++pf_slot == block_size) pf_slot = 0, ++pf_page;
    }
  };
  prefetch_to(PREFETCH_KEYS);
  for (int64_t t0 = 0; t0 < len_max; t0 += 8) {
    prefetch_to(t0 + 8 + PREFETCH_KEYS);
    const float* kp[8];
    for (int64_t j = 0; j < 8; ++j) {
      if (t0 + j < len_max) {
        kp[j] = keys + pages[page] * c_block + slot * c_slot;
        if (++slot == block_size) slot = 0, ++page;
      } else {
        kp[j] = kp[j - 1];  // past the end: the last key again, its score never read
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      if (rlen[r] <= t0) continue;
      const float* qr = rows[r];
      v8 acc[8];
      v8 qv = load8(qr);
      for (int64_t j = 0; j < 8; ++j) acc[j] = qv * load8(kp[j]);
      for (int64_t i = 1; i < V; ++i) {
        qv = load8(qr + 8 * i);
        for (int64_t j = 0; j < 8; ++j) acc[j] += qv * load8(kp[j] + 8 * i);
      }
      store8(S + r * s_stride + t0, sum8x8(acc) * scale);
    }
  }
}

template <int64_t HEAD>
inline void weighted_sum_fixed(float* o, const float* p, float inv, const float* values,
                               const int32_t* pages, int64_t len, int64_t block_size,
                               int64_t c_block, int64_t c_slot) {
  constexpr int64_t V = HEAD / 8;
  v8 acc[V] = {};
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const float* v = values + pages[t0 / block_size] * c_block;
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t t = 0; t < n; ++t, v += c_slot) {
      const v8 w = v8{0} + p[t0 + t];
      for (int64_t i = 0; i < V; ++i) acc[i] += w * load8(v + 8 * i);
    }
  }
  for (int64_t i = 0; i < V; ++i) store8(o + 8 * i, acc[i] * inv);
}

void cpu_attention_with_kv_cache(const at::Tensor& query, const at::Tensor& kv_cache,
                                 at::Tensor& output, const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, double scale,
                                 const at::Tensor& block_table, int64_t small_query_limit) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
                  output.scalar_type() == at::kFloat,
              "cpu_attention_with_kv_cache: float32 only");
  TORCH_CHECK(query.stride(2) == 1 && output.stride(2) == 1 && kv_cache.stride(4) == 1,
              "cpu_attention_with_kv_cache: head_size must be the innermost, contiguous dim");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_table.scalar_type() == at::kInt,
              "cpu_attention_with_kv_cache: query_start_loc, seq_lens, block_table: int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.stride(1) == 1,
              "cpu_attention_with_kv_cache: contiguous metadata");
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads must be a positive multiple of num_kv_heads");
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head (GQA)

  const float* q = query.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const float* kv = kv_cache.data_ptr<float>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = output.stride(0), o_head = output.stride(1);
  const int64_t c_block = kv_cache.stride(0), c_kv = kv_cache.stride(1);
  const int64_t c_slot = kv_cache.stride(2), c_head = kv_cache.stride(3);
  const int64_t t_req = block_table.stride(0);
  const float sc = static_cast<float>(scale);

  // The bounds of every query taken, checked before any thread reads the
  // cache: a bad table would otherwise read (or write) arbitrary memory, where
  // the reference's indexing raises.
  TORCH_CHECK(query.dim() == 3 && output.sizes() == query.sizes(),
              "cpu_attention_with_kv_cache: output must be query's shape, "
              "[num_tokens, num_heads, head_size]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(4) == head_size,
              "cpu_attention_with_kv_cache: kv_cache must be "
              "[num_blocks, 2, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_table.size(0) >= num_reqs,
              "cpu_attention_with_kv_cache: query_start_loc and block_table must cover "
              "every request of seq_lens");
  const int64_t num_blocks = kv_cache.size(0), max_pages = block_table.size(1);
  // The work: each request's query cut into tiles of at most TILE tokens (a
  // decode is one tile of one), so that a long prompt is split between
  // threads too.
  constexpr int64_t TILE = 16;
  std::vector<std::array<int32_t, 3>> tiles;  // (request, first token, end)
  tiles.reserve(num_reqs);
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(qsl[r] >= 0 && qsl[r] <= qsl[r + 1] && qsl[r + 1] <= query.size(0),
                "cpu_attention_with_kv_cache: query_start_loc out of order or past the query");
    const int64_t q_len = qsl[r + 1] - qsl[r];
    // The (query token, key) pairs it attends: each token its keys up to its own.
    const int64_t pairs = q_len * (lens[r] - q_len) + q_len * (q_len + 1) / 2;
    if (q_len == 0 || (q_len > 1 && lens[r] >= q_len && pairs > small_query_limit))
      continue;  // the caller's
    const int64_t pages = (static_cast<int64_t>(lens[r]) + block_size - 1) / block_size;
    TORCH_CHECK(lens[r] >= q_len && pages <= max_pages,
                "cpu_attention_with_kv_cache: seq_len ", lens[r], " of request ", r,
                " needs ", q_len, " (its query) to ", max_pages * block_size, " tokens");
    for (int64_t p = 0; p < pages; ++p) {
      const int32_t b = table[r * t_req + p];
      TORCH_CHECK(b >= 0 && b < num_blocks, "cpu_attention_with_kv_cache: block ", b,
                  " of request ", r, " is not in the cache's ", num_blocks, " blocks");
    }
    for (int64_t t = qsl[r]; t < qsl[r + 1]; t += TILE)
      tiles.push_back({static_cast<int32_t>(r), static_cast<int32_t>(t),
                       static_cast<int32_t>(std::min<int64_t>(t + TILE, qsl[r + 1]))});
  }

  // One work item per (tile, KV head): its rows, each token of the tile with
  // each query head of that KV head's group, take the keys eight at a time
  // (scores_rows), then the values one row after another (after the first,
  // from cache). Token tok of request r sits at position
  // lens[r] - (qsl[r + 1] - tok) and sees the keys up to its own (causal).
  // Torch's thread count splits the items.
  // --8<-- [start:decode_items]
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(head_size);
    std::vector<const float*> rows;
    std::vector<int64_t> rlen;
    for (int64_t item = begin; item < end; ++item) {
      const auto& [r, first, last] = tiles[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      const int32_t* pages = table + r * t_req;
      // The item's rows: each token's group of query heads, row (tok - first)
      // * group + g. A token's length: its position + 1.
      const int64_t R = (last - first) * group;
      rows.resize(R);
      rlen.resize(R);
      for (int64_t tok = first; tok < last; ++tok)
        for (int64_t g = 0; g < group; ++g) {
          rows[(tok - first) * group + g] = q + tok * q_tok + (h * group + g) * q_head;
          rlen[(tok - first) * group + g] = lens[r] - (qsl[r + 1] - tok) + 1;
        }
      const int64_t len_max = rlen[R - 1];
      const int64_t s_stride = (len_max + 7) / 8 * 8;
      scores.resize(R * s_stride);
      const float* keys = kv + h * c_head;
      if (head_size == 64) {
        scores_rows<64>(scores.data(), s_stride, rows.data(), rlen.data(), R, keys, pages,
                        len_max, block_size, c_block, c_slot, c_kv, sc);
      } else if (head_size == 128) {
        scores_rows<128>(scores.data(), s_stride, rows.data(), rlen.data(), R, keys, pages,
                         len_max, block_size, c_block, c_slot, c_kv, sc);
      } else {
        for (int64_t i = 0; i < R; ++i)
          for (int64_t t = 0; t < rlen[i]; ++t) {
            const float* k = keys + pages[t / block_size] * c_block + (t % block_size) * c_slot;
            scores[i * s_stride + t] = dot(rows[i], k, head_size) * sc;
          }
      }
      const float* values = kv + c_kv + h * c_head;
      for (int64_t i = 0; i < R; ++i) {
        const int64_t len = rlen[i];
        float* s = scores.data() + i * s_stride;
        // Softmax: subtract the max so exp cannot overflow.
        const float m = *std::max_element(s, s + len);
        v8 sum8 = {0};
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
          const v8 e = exp8(load8(s + t) - m);
          store8(s + t, e);
          sum8 += e;
        }
        float sum = 0.f;
        for (int k = 0; k < 8; ++k) sum += sum8[k];
        for (; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
        const float inv = 1.f / sum;
        // The weighted sum of the values, page by page as the keys.
        const int64_t tok = first + i / group, g = i % group;
        float* o = out + tok * o_tok + (h * group + g) * o_head;
        if (head_size == 64) {
          weighted_sum_fixed<64>(o, s, inv, values, pages, len, block_size, c_block, c_slot);
        } else if (head_size == 128) {
          weighted_sum_fixed<128>(o, s, inv, values, pages, len, block_size, c_block, c_slot);
        } else {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t u = 0; u < len; ++u) {
            const float* v = values + pages[u / block_size] * c_block + (u % block_size) * c_slot;
            axpy(acc.data(), s[u], v, head_size);
          }
          for (int64_t d = 0; d < head_size; ++d) o[d] = acc[d] * inv;
        }
      }
    }
  });
  // --8<-- [end:decode_items]
}

}  // namespace

TORCH_LIBRARY(tracevllm_C, m) {
  m.def(
      "cpu_attention_with_kv_cache(Tensor query, Tensor kv_cache, Tensor(a!) output, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor block_table, "
      "int small_query_limit) -> ()");
}

TORCH_LIBRARY_IMPL(tracevllm_C, CPU, m) {
  m.impl("cpu_attention_with_kv_cache", &cpu_attention_with_kv_cache);
}
