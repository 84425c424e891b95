// The ARM NEON tier (AArch64 with the dot-product extension): the 16-lane vector in four q
// registers, lanes 0-3, 4-7, 8-11 and 12-15; sdot sums four signed byte products per lane into
// int32. 4-bit codes are valid signed bytes; 8-bit codes are split into two 4-bit halves.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace specee::simd {

struct F16 {
  float32x4_t v[4];
};
struct I16 {
  int32x4_t v[4];
};

#define SPECEE_QUADS(expr) \
  F16 r;                   \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r

inline F16 splat(float x) { SPECEE_QUADS(vdupq_n_f32(x)); }
inline F16 load(const float* p) { SPECEE_QUADS(vld1q_f32(p + 4 * i)); }
inline void store(float* p, F16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
inline F16 operator+(F16 a, F16 b) { SPECEE_QUADS(vaddq_f32(a.v[i], b.v[i])); }
inline F16 operator-(F16 a, F16 b) { SPECEE_QUADS(vsubq_f32(a.v[i], b.v[i])); }
inline F16 operator*(F16 a, F16 b) { SPECEE_QUADS(vmulq_f32(a.v[i], b.v[i])); }
inline F16 operator/(F16 a, F16 b) { SPECEE_QUADS(vdivq_f32(a.v[i], b.v[i])); }
inline F16 fmadd(F16 a, F16 b, F16 c) { SPECEE_QUADS(vfmaq_f32(c.v[i], a.v[i], b.v[i])); }
// fmin/fmax order signed zeros and NaNs their own way: select as the portable tier writes it.
inline F16 min(F16 a, F16 b) { SPECEE_QUADS(vbslq_f32(vcltq_f32(a.v[i], b.v[i]), a.v[i], b.v[i])); }
inline F16 max(F16 a, F16 b) { SPECEE_QUADS(vbslq_f32(vcgtq_f32(a.v[i], b.v[i]), a.v[i], b.v[i])); }
inline F16 abs(F16 a) { SPECEE_QUADS(vabsq_f32(a.v[i])); }
inline F16 pow2i(F16 n) {
  SPECEE_QUADS(vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.v[i]), vdupq_n_s32(127)), 23)));
}
inline F16 load_bf16(const uint16_t* p) { SPECEE_QUADS(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * i), 16))); }
inline F16 load_f16(const uint16_t* p) {
  SPECEE_QUADS(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i))));
}
inline F16 load_i8(const int8_t* p) {
  const int8x16_t bytes = vld1q_s8(p);
  const int16x8_t low = vmovl_s8(vget_low_s8(bytes)), high = vmovl_s8(vget_high_s8(bytes));
  const int16x4_t quads[4] = {vget_low_s16(low), vget_high_s16(low), vget_low_s16(high), vget_high_s16(high)};
  SPECEE_QUADS(vcvtq_f32_s32(vmovl_s16(quads[i])));
}
inline F16 to_float(I16 a) { SPECEE_QUADS(vcvtq_f32_s32(a.v[i])); }
// Lanes holding whole numbers in int8's range, as int8.
inline void store_i8(int8_t* p, F16 a) {
  const int16x8_t low = vcombine_s16(vmovn_s32(vcvtq_s32_f32(a.v[0])), vmovn_s32(vcvtq_s32_f32(a.v[1])));
  const int16x8_t high = vcombine_s16(vmovn_s32(vcvtq_s32_f32(a.v[2])), vmovn_s32(vcvtq_s32_f32(a.v[3])));
  vst1q_s8(p, vcombine_s8(vmovn_s16(low), vmovn_s16(high)));
}
#undef SPECEE_QUADS

// The halving tree: lane i + lane i + 8, then + 4, + 2, + 1.
inline float reduce_add(F16 a) {
  const float32x4_t four = vaddq_f32(vaddq_f32(a.v[0], a.v[2]), vaddq_f32(a.v[1], a.v[3]));
  const float32x4_t two = vaddq_f32(four, vextq_f32(four, four, 2));
  return vgetq_lane_f32(two, 0) + vgetq_lane_f32(two, 1);
}
inline float reduce_max(F16 a) {
  auto pick = [](float32x4_t x, float32x4_t y) { return vbslq_f32(vcgtq_f32(x, y), x, y); };
  const float32x4_t four = pick(pick(a.v[0], a.v[2]), pick(a.v[1], a.v[3]));
  const float32x4_t two = pick(four, vextq_f32(four, four, 2));
  const float x = vgetq_lane_f32(two, 0), y = vgetq_lane_f32(two, 1);
  return x > y ? x : y;
}

// The dot products of R rows of activations (row r at q + r * K) with one block of 32 inputs of
// 16 features, exact in int32 (8-bit codes: the first STEPS steps only, a half block's 16
// inputs for STEPS 4). The block's bytes are step j (inputs 4j .. 4j + 3) for lanes 0-15,
// four codes a lane (lanes 4k .. 4k + 3 in bytes 16k .. 16k + 15 of the step); 4-bit codes hold
// steps 0-3 in the low nibbles and 4-7 in the high ones. 8-bit codes are not valid signed bytes:
// their low and high nibbles are multiplied apart, code = low + 16 high.
inline int8x16_t broadcast4(const int8_t* q) {
  int32_t word;
  std::memcpy(&word, q, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(word));
}

template <bool INT4>
constexpr int DOT_ROWS = 4;

template <int R, bool INT4, int STEPS = 8>
inline void dot(const uint8_t* p, const int8_t* q, int64_t K, I16* out) {
  const uint8x16_t nibble = vdupq_n_u8(0x0f);
  int32x4_t low[R][4], high[R][4];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) low[r][k] = high[r][k] = vdupq_n_s32(0);
  for (int i = 0; i < (INT4 ? 4 : STEPS); ++i)
    for (int k = 0; k < 4; ++k) {
      const uint8x16_t packed = vld1q_u8(p + i * 64 + k * 16);
      const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(packed, nibble)), hi = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
      for (int r = 0; r < R; ++r) {
        if constexpr (INT4) {  // steps i and i + 4
          low[r][k] = vdotq_s32(vdotq_s32(low[r][k], lo, broadcast4(q + r * K + 4 * i)), hi, broadcast4(q + r * K + 4 * (i + 4)));
        } else {  // step i
          const int8x16_t a = broadcast4(q + r * K + 4 * i);
          low[r][k] = vdotq_s32(low[r][k], lo, a);
          high[r][k] = vdotq_s32(high[r][k], hi, a);
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) out[r].v[k] = INT4 ? low[r][k] : vaddq_s32(low[r][k], vshlq_n_s32(high[r][k], 4));
}

inline void prefetch(const void* p) { __builtin_prefetch(p); }

}  // namespace specee::simd
