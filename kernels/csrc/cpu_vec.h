// What the CPU kernels share: eight floats as one vector, and e^x on them.
// Included by cpu_attn.cpp and cpu_ops.cpp (kernels/csrc/), compiled for the
// instruction set kernels/cpu_attn.py picks.
#pragma once

#include <cstdint>

namespace {

// Eight floats in one register (AVX2's width; the compiler splits it where
// the machine has less). v8u loads and stores at any float's address.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

// e^x for eight floats at once (Cephes' expf): x = n ln2 + r with n whole
// and |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n written straight
// into the exponent bits. Accurate to about a unit in the last place; the
// softmax's inputs are <= 0, and below -87 (e^-87 ~ 1.6e-38) it returns
// e^-87, not a denormal. One call stands for eight of std::exp's.
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8 exp8(v8 x) {
  x = x < -87.f ? v8{0} - 87.f : x;
  x = x > 88.f ? v8{0} + 88.f : x;
  const v8 fx = x * 1.44269504088896341f + 0.5f;  // x / ln2, to round
  v8i n = __builtin_convertvector(fx, v8i);        // toward zero ...
  n += (__builtin_convertvector(n, v8) > fx);      // ... then down: floor (true is -1)
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln2 in two parts
  v8 y = v8{0} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  return y * (v8)((n + 127) << 23);  // the bits of 2^n as a float
}

}  // namespace
