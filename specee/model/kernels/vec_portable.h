// The portable tier: the 16-lane vector as an array, plain C++ that any compiler vectorizes for
// its own target. Every operation is the lane-wise IEEE one, so its results are the reference
// every other tier reproduces bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specee::simd {

struct F16 {
  float v[16];
};
struct I16 {
  int32_t v[16];
};

#define SPECEE_LANEWISE(expr) \
  F16 r;                      \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r

inline F16 splat(float x) { SPECEE_LANEWISE(x); }
inline F16 load(const float* p) { SPECEE_LANEWISE(p[i]); }
inline void store(float* p, F16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline F16 operator+(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] + b.v[i]); }
inline F16 operator-(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] - b.v[i]); }
inline F16 operator*(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] * b.v[i]); }
inline F16 operator/(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] / b.v[i]); }
// a * b + c rounded once, as every tier's fused instruction (std::fma: a libm call where the
// target has no such instruction, exact either way).
inline F16 fmadd(F16 a, F16 b, F16 c) { SPECEE_LANEWISE(std::fma(a.v[i], b.v[i], c.v[i])); }
inline F16 min(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline F16 max(F16 a, F16 b) { SPECEE_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline F16 abs(F16 a) {
  F16 r;
  for (int i = 0; i < 16; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &a.v[i], 4);
    bits &= 0x7fffffffu;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
// 2^n for integral n in [-127, 127]; n = -127 gives 0.
inline F16 pow2i(F16 n) {
  F16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline F16 load_bf16(const uint16_t* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
// IEEE half-precision values, exactly (every one is a float): normal, subnormal, zero, inf and NaN.
inline F16 load_f16(const uint16_t* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t sign = static_cast<uint32_t>(p[i] & 0x8000u) << 16, exponent = (p[i] >> 10) & 31u;
    const uint32_t mantissa = p[i] & 0x3ffu;
    uint32_t bits;
    if (exponent == 31) {
      bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
      bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa x 2^-24, exact in a float
      const float value = std::ldexp(static_cast<float>(mantissa), -24);
      std::memcpy(&bits, &value, 4);
      bits |= sign;
    }
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline F16 load_i8(const int8_t* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
// Lanes holding whole numbers in int8's range, as int8.
inline void store_i8(int8_t* p, F16 a) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(a.v[i]);
}
#undef SPECEE_LANEWISE

// The halving tree every tier uses: lane i + lane i + 8, then + 4, + 2, + 1.
inline float reduce_add(F16 a) {
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) a.v[i] = a.v[i] + a.v[i + width];
  return a.v[0];
}
inline float reduce_max(F16 a) {
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) a.v[i] = a.v[i] > a.v[i + width] ? a.v[i] : a.v[i + width];
  return a.v[0];
}

inline F16 to_float(I16 a) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}

// The dot products of R rows of activations (row r at q + r * K) with one block of 32 inputs of
// 16 features, exact in int32 (8-bit codes: the first STEPS steps only, a half block's 16
// inputs for STEPS 4). The block's bytes are step j (inputs 4j .. 4j + 3) for lanes 0-15,
// four codes a lane; 4-bit codes hold steps 0-3 in the low nibbles and 4-7 in the high ones.
template <bool INT4>
constexpr int DOT_ROWS = 8;

template <int R, bool INT4, int STEPS = 8>
inline void dot(const uint8_t* p, const int8_t* q, int64_t K, I16* out) {
  uint8_t codes[8][16][4];  // [step][lane][input]
  if constexpr (INT4) {
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 16; ++l)
        for (int b = 0; b < 4; ++b) {
          const uint8_t byte = p[j * 64 + l * 4 + b];
          codes[j][l][b] = byte & 0x0f;
          codes[j + 4][l][b] = byte >> 4;
        }
  } else {
    std::memcpy(codes, p, STEPS * sizeof codes[0]);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* a = q + r * K;
    I16 sum{};
    for (int j = 0; j < STEPS; ++j)
      for (int l = 0; l < 16; ++l)
        for (int b = 0; b < 4; ++b) sum.v[l] += static_cast<int32_t>(codes[j][l][b]) * a[4 * j + b];
    out[r] = sum;
  }
}

inline void prefetch(const void* p) { __builtin_prefetch(p); }

}  // namespace specee::simd
