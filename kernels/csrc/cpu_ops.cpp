// The small ops between the matmuls, each one pass over its rows on CPU.
//
// Plays the part of vLLM's csrc/cpu/ layer kernels, under vLLM's op names and
// argument orders (vllm/_custom_ops.py): rms_norm, fused_add_rms_norm,
// silu_and_mul, rotary_embedding, and the K/V write reshape_and_cache_flash
// (vLLM's CPU backend has its own, cpu_attn_reshape_and_cache, for its split
// key and value caches; tracevllm's cache is one tensor). Each replaces a
// handful of PyTorch ops that each walk the whole tensor and allocate their
// result (an RMSNorm with its residual add is seven; a neox RoPE, fifteen):
// on a decode step the rows are few, and those calls' fixed costs were most
// of the time. The layers call these through tracevllm/_custom_ops.py when
// their ``forward_cpu`` is chosen (tracevllm/model_executor/custom_op.py);
// each layer's ``forward_native`` is the reference the tests hold them to.
//
// Every tensor is float32 except positions and slot_mapping (int64). A
// tensor of rows may be strided between rows; within a row the floats are
// contiguous. Rows are split over torch's threads in chunks of at least
// kGrain floats, so a decode step's few rows run on one thread without
// waking the others.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "cpu_vec.h"

namespace {

constexpr int64_t kGrain = 16384;  // floats per chunk of a parallel_for, at least

int64_t grain_rows(int64_t row_floats) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_floats));
}

// A tensor of rows: float32, 2-D, each row contiguous and at least one float
// wide. One the kernel writes must not overlap itself (an expanded view
// would have two threads write one float).
void check_rows(const at::Tensor& t, const char* op, const char* name, bool written = false) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.size(1) > 0, op, ": ", name,
              " must be 2-D, [num_tokens, n] with n > 0, each row contiguous");
  if (written) at::assert_no_internal_overlap(t);
}

// 1 / sqrt(mean(x^2) + eps) of one row: the sum in two chains of eight lanes.
inline float inv_rms(const float* x, int64_t n, float eps) {
  v8 a0 = {0}, a1 = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const v8 x0 = load8(x + d), x1 = load8(x + d + 8);
    a0 += x0 * x0;
    a1 += x1 * x1;
  }
  for (; d + 8 <= n; d += 8) {
    const v8 x0 = load8(x + d);
    a0 += x0 * x0;
  }
  a0 += a1;
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a0[i];
  for (; d < n; ++d) s += x[d] * x[d];
  return 1.f / std::sqrt(s / static_cast<float>(n) + eps);
}

// out = w * (x * inv), HF's LlamaRMSNorm order: normalise, then scale.
inline void scale_row(float* out, const float* x, const float* w, float inv, int64_t n) {
  const v8 iv = v8{0} + inv;
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(out + d, load8(w + d) * (load8(x + d) * iv));
  for (; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

// --8<-- [start:rms_norm]
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  check_rows(input, "rms_norm", "input");
  check_rows(out, "rms_norm", "out", true);
  at::assert_no_overlap(out, input);
  const int64_t rows = input.size(0), n = input.size(1);
  TORCH_CHECK(out.sizes() == input.sizes(), "rms_norm: out must be input's shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == n &&
                  weight.is_contiguous(),
              "rms_norm: weight must be float32 [", n, "], contiguous");
  const float* x = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t xs = input.stride(0), os = out.stride(0);
  const float eps = static_cast<float>(epsilon);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * xs;
      scale_row(o + r * os, xr, w, inv_rms(xr, n, eps), n);
    }
  });
}

// In place, as vLLM's: residual <- input + residual, then input <- rms_norm(residual).
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  check_rows(input, "fused_add_rms_norm", "input", true);
  check_rows(residual, "fused_add_rms_norm", "residual", true);
  at::assert_no_overlap(input, residual);
  const int64_t rows = input.size(0), n = input.size(1);
  TORCH_CHECK(residual.sizes() == input.sizes(),
              "fused_add_rms_norm: residual must be input's shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == n &&
                  weight.is_contiguous(),
              "fused_add_rms_norm: weight must be float32 [", n, "], contiguous");
  float* x = input.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = input.stride(0), rs = residual.stride(0);
  const float eps = static_cast<float>(epsilon);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * xs;
      float* rr = res + r * rs;
      int64_t d = 0;
      for (; d + 8 <= n; d += 8) store8(rr + d, load8(xr + d) + load8(rr + d));
      for (; d < n; ++d) rr[d] = xr[d] + rr[d];
      scale_row(xr, rr, w, inv_rms(rr, n, eps), n);
    }
  });
}
// --8<-- [end:rms_norm]

// out = silu(x[:, :d]) * x[:, d:], silu(g) = g / (1 + e^-g).
void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_rows(input, "silu_and_mul", "input");
  check_rows(out, "silu_and_mul", "out", true);
  at::assert_no_overlap(out, input);
  const int64_t rows = input.size(0), d = input.size(1) / 2;
  TORCH_CHECK(input.size(1) % 2 == 0 && out.size(0) == rows && out.size(1) == d,
              "silu_and_mul: input must be [num_tokens, 2 * d] and out [num_tokens, d]");
  const float* x = input.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t xs = input.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = x + r * xs;
      const float* u = g + d;
      float* orow = o + r * os;
      int64_t i = 0;
      for (; i + 8 <= d; i += 8) {
        const v8 gv = load8(g + i);
        store8(orow + i, gv / (1.f + exp8(v8{0} - gv)) * load8(u + i));
      }
      for (; i < d; ++i) orow[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

// Rotate the first rot_dim floats of each head of one token. Neox style: the
// halves of those floats are the pairs' (real, imaginary) parts; GPT-J
// style: neighbours are.
inline void rotate_heads(float* t, int64_t num_heads, int64_t head_size, const float* cos,
                         const float* sin, int64_t half, bool is_neox) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x = t + h * head_size;
    if (is_neox) {
      float* x2 = x + half;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        const v8 a = load8(x + i), b = load8(x2 + i), c = load8(cos + i), s = load8(sin + i);
        store8(x + i, a * c - b * s);
        store8(x2 + i, b * c + a * s);
      }
      for (; i < half; ++i) {
        const float a = x[i], b = x2[i];
        x[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * cos[i] - b * sin[i];
        x[2 * i + 1] = b * cos[i] + a * sin[i];
      }
    }
  }
}

// --8<-- [start:rotary_embedding]
// In place, as vLLM's: token t's query and key heads turned by the angles of
// row positions[t] of cos_sin_cache ([max_position, rot_dim]: the cosines,
// then the sines). Floats past rot_dim in a head are left as they are.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query,
                      const std::optional<at::Tensor>& key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rows(query, "rotary_embedding", "query", true);
  const int64_t num_tokens = query.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == num_tokens && positions.is_contiguous(),
              "rotary_embedding: positions must be int64 [num_tokens], contiguous");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.is_contiguous(),
              "rotary_embedding: cos_sin_cache must be float32 [max_position, rot_dim]");
  const int64_t rot_dim = cos_sin_cache.size(1), half = rot_dim / 2;
  TORCH_CHECK(head_size > 0 && rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_size &&
                  query.size(1) % head_size == 0,
              "rotary_embedding: rot_dim ", rot_dim, " must be even, positive and at most head_size ",
              head_size, ", and query's width a multiple of head_size");
  if (key.has_value()) {
    check_rows(*key, "rotary_embedding", "key", true);
    at::assert_no_overlap(query, *key);
    TORCH_CHECK(key->size(0) == num_tokens && key->size(1) % head_size == 0,
                "rotary_embedding: key must be [num_tokens, num_kv_heads * head_size]");
  }
  // Every position checked before any thread reads the table: a bad one
  // would read past it, where the reference's indexing raises.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_sin_cache.size(0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "rotary_embedding: position ", pos[t],
                " of token ", t, " is outside the table's ", max_position, " rows");
  }
  const float* table = cos_sin_cache.data_ptr<float>();
  float* q = query.data_ptr<float>();
  const int64_t qs = query.stride(0), q_heads = query.size(1) / head_size;
  float* k = key.has_value() ? key->data_ptr<float>() : nullptr;
  const int64_t ks = k ? key->stride(0) : 0, k_heads = k ? key->size(1) / head_size : 0;
  at::parallel_for(0, num_tokens, grain_rows((q_heads + k_heads) * rot_dim),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       const float* cos = table + pos[t] * rot_dim;
                       const float* sin = cos + half;
                       rotate_heads(q + t * qs, q_heads, head_size, cos, sin, half, is_neox);
                       if (k) rotate_heads(k + t * ks, k_heads, head_size, cos, sin, half, is_neox);
                     }
                   });
}
// --8<-- [end:rotary_embedding]

// Token t's key and value rows copied into slot slot_mapping[t] of the paged
// cache: block slot / block_size, row slot % block_size. Slot -1 (a padded
// token) is skipped.
void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
                  kv_cache.scalar_type() == at::kFloat,
              "reshape_and_cache_flash: float32 only");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                  value.stride(2) == 1 && key.size(1) > 0 && key.size(2) > 0,
              "reshape_and_cache_flash: key and value must be [num_tokens, num_kv_heads, "
              "head_size], head_size contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(3) == key.size(1) &&
                  kv_cache.size(4) == key.size(2) && kv_cache.stride(4) == 1,
              "reshape_and_cache_flash: kv_cache must be [num_blocks, 2, block_size, "
              "num_kv_heads, head_size] for this key");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) <= key.size(0),
              "reshape_and_cache_flash: slot_mapping must be int64 [num_tokens], contiguous");
  at::assert_no_internal_overlap(kv_cache);
  at::assert_no_overlap(kv_cache, key);
  at::assert_no_overlap(kv_cache, value);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_slots = kv_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "reshape_and_cache_flash: slot ",
                slots[t], " of token ", t, " is not in the cache's ", num_slots, " slots");
  }
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* c = kv_cache.data_ptr<float>();
  const int64_t kt = key.stride(0), kh = key.stride(1), vt = value.stride(0), vh = value.stride(1);
  const int64_t c_block = kv_cache.stride(0), c_kv = kv_cache.stride(1);
  const int64_t c_slot = kv_cache.stride(2), c_head = kv_cache.stride(3);
  const size_t bytes = head_size * sizeof(float);
  at::parallel_for(0, num_tokens, grain_rows(2 * heads * head_size), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      float* dst = c + (slots[t] / block_size) * c_block + (slots[t] % block_size) * c_slot;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + h * c_head, k + t * kt + h * kh, bytes);
        std::memcpy(dst + c_kv + h * c_head, v + t * vt + h * vh, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tracevllm_C, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
      "float epsilon) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tracevllm_C, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("reshape_and_cache_flash", &reshape_and_cache_flash);
}
