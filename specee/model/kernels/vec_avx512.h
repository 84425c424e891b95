// The AVX-512 VNNI tier: the 16-lane vector in one zmm register; vpdpbusd sums four unsigned
// code x signed activation products per lane straight into int32.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace specee::simd {

struct F16 {
  __m512 v;
};
struct I16 {
  __m512i v;
};

inline F16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// vminps/vmaxps are a < b ? a : b and a > b ? a : b, as the portable tier writes them.
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 abs(F16 a) { return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7fffffff)))}; }
inline F16 pow2i(F16 n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline F16 load_bf16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline F16 load_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16 load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// Lanes holding whole numbers in int8's range, as int8.
inline void store_i8(int8_t* p, F16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(a.v)));
}

// The halving tree: lane i + lane i + 8, then + 4, + 2, + 1 (written out: the compiler's
// _mm512_reduce_add_ps promises no order).
inline float reduce_add(F16 a) {
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}
// Lane j: reduce_add(a[j]), the same tree for 16 vectors at once in 30 shuffles and 15 adds:
// halves of two vectors side by side, then quarters of four, and so on. The last step leaves
// vector j + 4 m in lane 4 j + m, so the vectors go in as a[4 (k % 4) + k / 4].
#define SPECEE_REDUCE_EACH
inline F16 reduce_add_each(const F16* a) {
  auto in = [a](int k) { return a[4 * (k % 4) + k / 4].v; };
  __m512 halves[8], quarters[4], eighths[2];
  for (int m = 0; m < 8; ++m)
    halves[m] = _mm512_add_ps(_mm512_shuffle_f32x4(in(2 * m), in(2 * m + 1), 0x44),
                              _mm512_shuffle_f32x4(in(2 * m), in(2 * m + 1), 0xEE));
  for (int m = 0; m < 4; ++m)
    quarters[m] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * m], halves[2 * m + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * m], halves[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)
    eighths[m] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], 0x44),
                               _mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88), _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD))};
}
inline float reduce_max(F16 a) {
  const __m256 eight = _mm256_max_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
}

inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }

// The dot products of R rows of activations (row r at q + r * K) with one block of 32 inputs of
// 16 features, exact in int32 (8-bit codes: the first STEPS steps only, a half block's 16
// inputs for STEPS 4). The block's bytes are step j (inputs 4j .. 4j + 3) for lanes 0-15,
// four codes a lane; 4-bit codes hold steps 0-3 in the low nibbles and 4-7 in the high ones.
template <int R, bool INT4, int STEPS = 8>
inline void vnni_dot(const uint8_t* p, const int8_t* q, int64_t K, I16* out) {
  __m512i weights[8];
  if constexpr (INT4) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      const __m512i packed = _mm512_loadu_si512(p + i * 64);
      weights[i] = _mm512_and_si512(packed, nibble);
      weights[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
  } else {
    for (int j = 0; j < STEPS; ++j) weights[j] = _mm512_loadu_si512(p + j * 64);
  }
  for (int r = 0; r < R; ++r) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < STEPS; ++j) {
      int32_t word;
      std::memcpy(&word, q + r * K + 4 * j, 4);
      sum = _mm512_dpbusd_epi32(sum, weights[j], _mm512_set1_epi32(word));
    }
    out[r] = {sum};
  }
}

#ifndef SPECEE_AMX  // the AMX tier (vec_amx.h) takes this header with a `dot` of its own
template <bool INT4>
constexpr int DOT_ROWS = 8;

template <int R, bool INT4, int STEPS = 8>
inline void dot(const uint8_t* p, const int8_t* q, int64_t K, I16* out) {
  vnni_dot<R, INT4, STEPS>(p, q, K, out);
}
#endif

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace specee::simd
