// The AVX2 + FMA tier (and, compiled with -mavxvnni, the AVX-VNNI tier): the 16-lane vector in
// two ymm registers, lanes 0-7 and 8-15. Without VNNI the int8 products go through vpmaddubsw
// (unsigned codes x signed activations, pairs summed in int16) and vpmaddwd (pairs to int32), as
// llama.cpp's Q4 x Q8 path does; with VNNI, vpdpbusd sums four products straight into int32.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace specee::simd {

struct F16 {
  __m256 lo, hi;
};

inline F16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
// minps/maxps are a < b ? a : b and a > b ? a : b, as the portable tier writes them.
inline F16 min(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 abs(F16 a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline __m256 pow2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F16 pow2i(F16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline F16 load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline __m256 f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F16 load_f16(const uint16_t* p) { return {f16x8(p), f16x8(p + 8)}; }
// Lanes holding whole numbers in int8's range, as int8 (packs interleave 128-bit halves: put back).
inline void store_i8(int8_t* p, F16 a) {
  const __m256i words = _mm256_packs_epi32(_mm256_cvttps_epi32(a.lo), _mm256_cvttps_epi32(a.hi));
  const __m256i bytes = _mm256_packs_epi16(words, words);  // [lo 0-3, hi 0-3, same] [lo 4-7, hi 4-7, same]
  const __m256i order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(order));
}

// The halving tree: lane i + lane i + 8, then + 4, + 2, + 1.
inline float reduce_add(F16 a) {
  const __m256 eight = _mm256_add_ps(a.lo, a.hi);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}
// Lane j: reduce_add(a[j]), the same tree for 16 vectors at once: each vector's halves added,
// then quarters of two side by side, and so on. The last step leaves vector 8 l + j + 2 m in lane
// 8 l + 4 j + m, so the vectors go in as a[8 (k / 8) + 4 (k % 2) + (k % 8) / 2].
#define SPECEE_REDUCE_EACH
inline F16 reduce_add_each(const F16* a) {
  auto in = [a](int k) { return a[8 * (k / 8) + 4 * (k % 2) + (k % 8) / 2]; };
  __m256 halves[16], quarters[8], eighths[4], sums[2];
  for (int k = 0; k < 16; ++k) halves[k] = _mm256_add_ps(in(k).lo, in(k).hi);
  for (int m = 0; m < 8; ++m)
    quarters[m] = _mm256_add_ps(_mm256_permute2f128_ps(halves[2 * m], halves[2 * m + 1], 0x20),
                                _mm256_permute2f128_ps(halves[2 * m], halves[2 * m + 1], 0x31));
  for (int m = 0; m < 4; ++m)
    eighths[m] = _mm256_add_ps(_mm256_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], 0x44),
                               _mm256_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], 0xEE));
  for (int l = 0; l < 2; ++l)
    sums[l] = _mm256_add_ps(_mm256_shuffle_ps(eighths[2 * l], eighths[2 * l + 1], 0x88),
                            _mm256_shuffle_ps(eighths[2 * l], eighths[2 * l + 1], 0xDD));
  return {sums[0], sums[1]};
}
inline float reduce_max(F16 a) {
  const __m256 eight = _mm256_max_ps(a.lo, a.hi);
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// The matmuls run on one ymm register, 8 lanes: a tile's two halves one after the other, so the
// accumulators of a few rows stay in the 16 registers (kernels.h, Part).
#define SPECEE_TILE_PARTS
struct Part {
  __m256 v;
};
struct PartI {
  __m256i v;
};
constexpr int64_t PART_LANES = 8;
inline Part part_splat(float x) { return {_mm256_set1_ps(x)}; }
inline Part part_load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Part part_load_bf16(const uint16_t* p) { return {bf16x8(p)}; }
inline Part part_load_f16(const uint16_t* p) { return {f16x8(p)}; }
inline Part part_load_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline void part_store_head(float* p, Part a, int64_t n) {
  if (n >= 8) return _mm256_storeu_ps(p, a.v);
  float lanes[8];
  _mm256_storeu_ps(lanes, a.v);
  std::memcpy(p, lanes, n * sizeof(float));
}
inline Part operator+(Part a, Part b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Part operator-(Part a, Part b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Part operator*(Part a, Part b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Part part_fmadd(Part a, Part b, Part c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Part to_float(PartI a) { return {_mm256_cvtepi32_ps(a.v)}; }

inline __m256i broadcast4(const int8_t* q) {
  int32_t word;
  std::memcpy(&word, q, 4);
  return _mm256_set1_epi32(word);
}

// The dot products of R rows of activations (row r at q + r * K) with one block of 32 inputs of
// one part's 8 features, exact in int32 (8-bit codes: the first STEPS steps only, a half block's
// 16 inputs for STEPS 4). The block's bytes are step j (inputs 4j .. 4j + 3) for lanes 0-15, four
// codes a lane, the part's lanes at 32 * part; 4-bit codes hold steps 0-3 in the low nibbles and
// 4-7 in the high ones. Each weight vector is loaded once for all the rows.
#if defined(__AVXVNNI__)
template <bool INT4>
constexpr int PART_ROWS = 6;

template <int R, bool INT4, int STEPS = 8, bool NARROW = false>
inline void part_dot(const uint8_t* p, int64_t part, const int8_t* q, int64_t K, PartI* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  p += 32 * part;
  if constexpr (INT4) {
    for (int i = 0; i < 4; ++i) {  // steps i and i + 4
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 64));
      const __m256i low = _mm256_and_si256(packed, nibble), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[r], low, broadcast4(q + r * K + 4 * i)), high,
                                         broadcast4(q + r * K + 4 * (i + 4)));
    }
  } else {
    for (int j = 0; j < STEPS; ++j) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_dpbusd_avx_epi32(acc[r], codes, broadcast4(q + r * K + 4 * j));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = {acc[r]};
}
#else
// Codes below 16 times activations in -127..127: a pair is at most 3,810 and eight steps' pairs
// 30,480, so the int16 sums cannot saturate. 8-bit codes would: their low and high nibbles are
// multiplied as two 4-bit codes, code = low + 16 high.
template <bool INT4>
constexpr int PART_ROWS = INT4 ? 4 : 3;

template <int R, bool INT4, int STEPS = 8, bool NARROW = false>
inline void part_dot(const uint8_t* p, int64_t part, const int8_t* q, int64_t K, PartI* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  if constexpr (NARROW && !INT4) {
    // Codes below 64: a pair of products is at most 16,002, two steps' pairs 32,004, so each code
    // multiplies whole and two steps sum in int16 before widening.
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    p += 32 * part;
#pragma GCC unroll 1
    for (int j = 0; j < STEPS; j += 2) {
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (j + 1) * 64));
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, broadcast4(q + r * K + 4 * j)),
                                               _mm256_maddubs_epi16(odd, broadcast4(q + r * K + 4 * (j + 1))));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    for (int r = 0; r < R; ++r) out[r] = {acc[r]};
    return;
  }
  __m256i low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
  p += 32 * part;
#pragma GCC unroll 1
  for (int i = 0; i < (INT4 ? 4 : STEPS); ++i) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 64));
    const __m256i lows = _mm256_and_si256(packed, nibble), highs = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    for (int r = 0; r < R; ++r) {
      if constexpr (INT4) {  // steps i (low nibbles) and i + 4 (high)
        const __m256i a0 = broadcast4(q + r * K + 4 * i), a1 = broadcast4(q + r * K + 4 * (i + 4));
        low[r] = _mm256_add_epi16(low[r], _mm256_add_epi16(_mm256_maddubs_epi16(lows, a0), _mm256_maddubs_epi16(highs, a1)));
      } else {  // step i, its low and high nibbles
        const __m256i a = broadcast4(q + r * K + 4 * i);
        low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(lows, a));
        high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(highs, a));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (INT4)
      out[r] = {_mm256_madd_epi16(low[r], ones)};
    else
      out[r] = {_mm256_add_epi32(_mm256_madd_epi16(low[r], ones), _mm256_madd_epi16(high[r], _mm256_set1_epi16(16)))};
  }
}
#endif

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace specee::simd
