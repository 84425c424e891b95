// The kernels, written once on a 16-lane vector (`specee::simd`, one header per tier) and compiled
// once per tier by tier.cpp. Integer block sums are exact in every tier; everything after them is
// the same sequence of lane-wise IEEE fp32 operations, with reductions in one fixed tree and one exp
// of our own, fused only where written (`fmadd`: one rounding, which every tier's fused instruction
// and the portable tier's std::fma give alike; built with -ffp-contract=off, so the compiler fuses
// nothing else). So a row's result has the same bits on every CPU, and never depends on the other
// rows of the call.
//
// 1. Integer matmuls (llama.cpp's Q4 x Q8 scheme): each activation row is quantized to int8 in
//    blocks of 32 with its own scale; weights are unsigned 4- or 8-bit codes with a scale and an
//    offset. A tile of weights is loaded once for a few rows (PART_ROWS), so a pass over several
//    rows reads the weights from memory once.
// 2. Attention: every (row, head) pair walks its visible keys in order, as a one-row call would; the
//    rows and heads that read the same keys walk them together, so each key is loaded once for them.
// 3. The small per-row steps of a layer (RMS norm, SiLU or GELU gate), one call each.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "api.h"

namespace specee::kernels {

using namespace specee::simd;

constexpr int64_t LANES = 16;  // output features per tile
constexpr int64_t BLOCK = 32;  // activation block: one int8 scale per row and block
constexpr int64_t INT4_BLOCK_BYTES = 256;  // 16 lanes x 32 codes, two per byte
constexpr int64_t INT8_BLOCK_BYTES = 512;
constexpr int64_t INT6_BLOCK_BYTES = 384;  // 256 bytes of low nibbles, 128 of 2-bit high parts
constexpr int64_t INT5_BLOCK_BYTES = 320;  // 256 bytes of low nibbles, 64 of high bits
constexpr int64_t SUPERBLOCK = 256;  // inputs under one pair of scale factors (SUPER formats)
// A superblock's record of scales per tile: factors [D x16, M x16] fp16 (a GGUF file's K-quants
// store them so) and per group [sc x16, mc x16] int8; CENTERED (w = (code - 32) s, a GGUF file's
// Q6_K): [D x16] fp16 and per group [sc x16].
constexpr int64_t FACTOR_BYTES = 2;
constexpr int64_t superblock_bytes(int64_t groups, bool centered) {
  return centered ? LANES * FACTOR_BYTES + groups * LANES : 2 * LANES * FACTOR_BYTES + groups * 2 * LANES;
}
constexpr int64_t PREFETCH_BYTES = 8192;

// a * b + c, rounded twice (exp's polynomial; the hot loops take fmadd, rounded once).
inline F16 madd(F16 a, F16 b, F16 c) { return a * b + c; }

// Round to the nearest integer, ties to even, for |x| < 2^22.
inline F16 round_nearest(F16 x) {
  const F16 magic = splat(12582912.0f);  // 1.5 * 2^23
  return (x + magic) - magic;
}

// The first `n` lanes of p, the others `fill`; and the first `n` lanes of a stored.
inline F16 load_head(const float* p, int64_t n, float fill) {
  if (n >= LANES) return load(p);
  float lanes[LANES];
  std::fill(lanes, lanes + LANES, fill);
  std::memcpy(lanes, p, n * sizeof(float));
  return load(lanes);
}
inline void store_head(float* p, F16 a, int64_t n) {
  if (n >= LANES) return store(p, a);
  float lanes[LANES];
  store(lanes, a);
  std::memcpy(p, lanes, n * sizeof(float));
}

// exp(x) as Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r, times 2^n.
// Below about -87.3 it gives 0, above about 88.7 infinity.
inline F16 exp(F16 x) {
  x = max(min(x, splat(88.7f)), splat(-104.0f));
  F16 n = round_nearest(x * splat(1.44269504088896341f));
  n = max(min(n, splat(127.0f)), splat(-127.0f));
  const F16 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  F16 p = splat(1.9875691500e-4f);
  p = madd(p, r, splat(1.3981999507e-3f));
  p = madd(p, r, splat(8.3334519073e-3f));
  p = madd(p, r, splat(4.1665795894e-2f));
  p = madd(p, r, splat(1.6666665459e-1f));
  p = madd(p, r, splat(5.0000001201e-1f));
  const F16 e = (p * (r * r) + r) + splat(1.0f);
  return e * pow2i(n);
}

inline void quantize_rows(const float* x, int64_t T, int64_t K, int8_t* codes, float* scales, int32_t* sums) {
  const int64_t B = K / BLOCK;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b) {
      const float* src = x + t * K + b * BLOCK;
      const F16 lo = load(src), hi = load(src + LANES);
      const float amax = reduce_max(max(abs(lo), abs(hi)));
      const float scale = amax / 127.0f;
      const F16 inverse = splat(scale > 0.0f ? 1.0f / scale : 0.0f);
      // |x| / scale <= 127 up to rounding: the clamp only guards the int8 range.
      const F16 top = splat(127.0f), bottom = splat(-128.0f);
      const F16 q_lo = max(min(round_nearest(lo * inverse), top), bottom);
      const F16 q_hi = max(min(round_nearest(hi * inverse), top), bottom);
      store_i8(codes + t * K + b * BLOCK, q_lo);
      store_i8(codes + t * K + b * BLOCK + LANES, q_hi);
      scales[t * B + b] = scale;
      // Each half block's sum of codes: whole numbers under 2^11 in size, so exact in any order.
      sums[2 * (t * B + b)] = static_cast<int32_t>(reduce_add(q_lo));
      sums[2 * (t * B + b) + 1] = static_cast<int32_t>(reduce_add(q_hi));
    }
}

// The weight formats of MatmulArgs: 4-bit codes with bf16 scales and zeros per group; 8-bit codes
// with fp32 scales and offsets per row or group; 4-, 5- or 6-bit codes (SUPER) whose scales and offsets
// are fp16 factors per superblock times int8 multipliers per group (CENTERED16: the offset is -32
// times the scale); or 5- or 8-bit codes with an fp16 scale per group of 32 and the offset -16 or
// -128 times it (CENTERED32).
enum class Format {
  INT4, INT4_SUPER32, INT5_SUPER32, INT5_CENTERED32, INT8_ROW, INT8_GROUP32, INT8_GROUP16, INT8_CENTERED32,
  INT6_SUPER32, INT6_SUPER16, INT6_CENTERED16
};

constexpr bool four_bit(Format f) { return f == Format::INT4 || f == Format::INT4_SUPER32; }

constexpr bool five_bit(Format f) { return f == Format::INT5_SUPER32 || f == Format::INT5_CENTERED32; }

constexpr bool six_bit(Format f) {
  return f == Format::INT6_SUPER32 || f == Format::INT6_SUPER16 || f == Format::INT6_CENTERED16;
}

// 5- and 6-bit codes: packed, unpacked to a byte a code a block at a time, and below 64.
constexpr bool narrow(Format f) { return five_bit(f) || six_bit(f); }

constexpr int64_t packed_block_bytes(Format f) {
  return four_bit(f) ? INT4_BLOCK_BYTES : five_bit(f) ? INT5_BLOCK_BYTES : six_bit(f) ? INT6_BLOCK_BYTES
                                                                                      : INT8_BLOCK_BYTES;
}

// A block of 5-bit codes as the 8-bit block the dots take: byte i of the first 256 holds code i's
// low 4 bits in its low nibble and code 256 + i's in its high one; bit k of byte i of the last 64 is
// bit 4 of code 64 k + i. Integers only, as unpack_six.
inline void unpack_five(const uint8_t* p, uint8_t* out) {
  const uint8_t* low = p;
  const uint8_t* high = p + 256;
  for (int i = 0; i < 64; ++i) {
    const unsigned h = high[i];
    for (int k = 0; k < 4; ++k) {
      const unsigned a = low[64 * k + i];
      out[64 * k + i] = static_cast<uint8_t>((a & 15u) | ((h << (4 - k)) & 16u));
      out[256 + 64 * k + i] = static_cast<uint8_t>((a >> 4) | ((h >> k) & 16u));
    }
  }
}

// A block of 6-bit codes as the 8-bit block the dots take (512 bytes, one code a byte): byte i of
// the first 256 holds code i's low 4 bits in its low nibble and code 256 + i's in its high one; byte
// i of the last 128 holds bits 4-5 of codes i, 128 + i, 256 + i and 384 + i, two bits each from
// the bottom. Integers only: every tier unpacks the same codes.
inline void unpack_six(const uint8_t* p, uint8_t* out) {
  const uint8_t* low = p;
  const uint8_t* high = p + 256;
  for (int i = 0; i < 128; ++i) {
    const unsigned h = high[i], a = low[i], b = low[128 + i];
    out[i] = static_cast<uint8_t>((a & 15u) | ((h << 4) & 0x30u));
    out[128 + i] = static_cast<uint8_t>((b & 15u) | ((h << 2) & 0x30u));
    out[256 + i] = static_cast<uint8_t>((a >> 4) | (h & 0x30u));
    out[384 + i] = static_cast<uint8_t>((b >> 4) | ((h >> 2) & 0x30u));
  }
}

template <Format FORMAT>
inline void unpack_narrow(const uint8_t* p, uint8_t* out) {
  if constexpr (five_bit(FORMAT))
    unpack_five(p, out);
  else
    unpack_six(p, out);
}

// The matmuls run on the tier's `Part` vector: a tile's 16 lanes at once (Part = F16), or, where
// F16 spans several registers (AVX2), one part of PART_LANES lanes at a time, so that the
// accumulators of PART_ROWS rows stay in registers. Each lane's arithmetic is the same either way.
#ifndef SPECEE_TILE_PARTS
using Part = F16;
using PartI = I16;
constexpr int64_t PART_LANES = LANES;
// At least 8 rows at once, more where the tier's `dot` takes more (AMX: a tile of 16).
template <bool INT4>
constexpr int PART_ROWS = DOT_ROWS<INT4> > 8 ? DOT_ROWS<INT4> : 8;
inline Part part_splat(float x) { return splat(x); }
inline Part part_load(const float* p) { return load(p); }
inline Part part_load_bf16(const uint16_t* p) { return load_bf16(p); }
inline Part part_load_f16(const uint16_t* p) { return load_f16(p); }
inline Part part_load_i8(const int8_t* p) { return load_i8(p); }
inline Part part_fmadd(Part a, Part b, Part c) { return fmadd(a, b, c); }
inline void part_store_head(float* p, Part a, int64_t n) { store_head(p, a, n); }

// The dot products of R rows, in chunks of the rows the tier's `dot` keeps in registers at once.
// NARROW: 8-bit codes known to be below 64, which a tier may multiply without splitting them.
template <int R, bool INT4, int STEPS = 8, bool NARROW = false>
inline void part_dot(const uint8_t* block, int64_t part, const int8_t* q, int64_t K, PartI* out) {
  constexpr int N = R < DOT_ROWS<INT4> ? R : DOT_ROWS<INT4>;
  dot<N, INT4, STEPS>(block, q, K, out);
  if constexpr (R > N) part_dot<R - N, INT4, STEPS>(block, part, q + N * K, K, out + N);
}
#endif

// A call's rows go in chunks of CHUNK_ROWS, the last one shorter; a tier that takes more rows at
// once (PART_ROWS; AMX: the rows past a tile's 16 on the same block, which a prefill's every chunk
// would pay for) lets the rest join the last whole chunk where it fits.
#ifndef SPECEE_CHUNK_ROWS
template <bool INT4>
constexpr int CHUNK_ROWS = PART_ROWS<INT4>;
#endif

// A tier with state of its own (AMX: the process's permission for the tile state, each thread's
// tile configuration) defines SPECEE_TIER_SETUP and these; the others need none of them.
#ifndef SPECEE_TIER_SETUP
// Null, or why the tier cannot run in this process (KernelTable::unavailable).
inline const char* tier_unavailable() { return nullptr; }
// Called by each thread before its share of a matmul over `rows` rows.
inline void begin_matmul(int64_t) {}
// How many blocks' dots of R rows the tier computes before their fp32 steps: 1, each block's as it
// comes. More (AMX: tile products back to back, their sums back through memory) calls
// dots_ahead(first block, count, codes, K, out [count][R], or [count][2][R] for half blocks) every
// BLOCKS_AHEAD blocks.
template <int R, bool HALVES = false>
constexpr int BLOCKS_AHEAD = 1;
template <int R, bool INT4, bool HALVES = false>
void dots_ahead(const uint8_t* block, int64_t count, const int8_t* q, int64_t K, PartI* out);  // never called here
#endif

// The scale and offset of group g at lanes lane .. lane + PART_LANES - 1 of a tile, for the grouped
// formats: fp32 ([G][s x16, m x16]; CENTERED32: fp16 [G][d x16]), or SUPER: per superblock of 256 inputs a record
// (superblock_bytes), s = D sc and m = M mc (CENTERED: m = (-32 D) sc), exact products (a GGUF
// file's Q6_K and Q5_K scales: an fp16 times a small integer).
template <Format FORMAT>
inline void grouped_scale_offset(const uint8_t* scales_zeros, int64_t group, int64_t lane, Part& s, Part& m) {
  if constexpr (FORMAT == Format::INT5_CENTERED32 || FORMAT == Format::INT8_CENTERED32) {  // [G][d x16]
    s = part_load_f16(reinterpret_cast<const uint16_t*>(scales_zeros) + group * LANES + lane);
    m = part_splat(FORMAT == Format::INT8_CENTERED32 ? -128.0f : -16.0f) * s;
  } else if constexpr (FORMAT == Format::INT6_CENTERED16) {
    constexpr int64_t GROUPS = SUPERBLOCK / LANES;
    const uint8_t* record = scales_zeros + (group / GROUPS) * superblock_bytes(GROUPS, true);
    const Part d = part_load_f16(reinterpret_cast<const uint16_t*>(record) + lane);
    const int8_t* multipliers = reinterpret_cast<const int8_t*>(record + LANES * FACTOR_BYTES);
    const Part sc = part_load_i8(multipliers + (group % GROUPS) * LANES + lane);
    s = d * sc;
    m = (part_splat(-32.0f) * d) * sc;
  } else if constexpr (six_bit(FORMAT) || FORMAT == Format::INT4_SUPER32 || FORMAT == Format::INT5_SUPER32) {
    constexpr int64_t GROUPS = SUPERBLOCK / (FORMAT == Format::INT6_SUPER16 ? LANES : BLOCK);
    const uint8_t* record = scales_zeros + (group / GROUPS) * superblock_bytes(GROUPS, false);
    const uint16_t* factors = reinterpret_cast<const uint16_t*>(record) + lane;
    const int8_t* multipliers =
        reinterpret_cast<const int8_t*>(record + 2 * LANES * FACTOR_BYTES) + (group % GROUPS) * 2 * LANES + lane;
    s = part_load_f16(factors) * part_load_i8(multipliers);
    m = part_load_f16(factors + LANES) * part_load_i8(multipliers + LANES);
  } else {
    const float* floats = reinterpret_cast<const float*>(scales_zeros) + group * 2 * LANES + lane;
    s = part_load(floats);
    m = part_load(floats + LANES);
  }
}

// Parts first_part .. first_part + P - 1 of a tile of 16 output features, for R rows. `row_sums`:
// each row's activation scale times the sum of its codes, per block (per half block for INT8_GROUP16).
// INT4: w = code * s + (z - 8 s) with bf16 s and z per lane and weight group ([G][s x16, z x16]).
// INT8_ROW: w = code * s + m with fp32 s and m per lane for the whole row ([s x16, m x16]), applied last.
// INT8_GROUP32/16, INT8_CENTERED32, INT4_SUPER32, INT5_*, INT6_*: w = code * s + m with s and m per lane and
// group of 32 or 16 inputs (grouped_scale_offset); 5- and 6-bit codes unpacked a block at a time
// (unpack_narrow), unless `w` holds them unpacked already (PACKED false: a byte a code).
template <int R, int P, Format FORMAT, bool PACKED = narrow(FORMAT)>
void tile_rows(const uint8_t* w, const uint8_t* scales_zeros, int64_t first_part, int64_t blocks,
               int64_t blocks_per_group, const int8_t* codes, const float* scales, const float* row_sums, int64_t K,
               float* out, int64_t ldo, int64_t valid) {
  constexpr bool INT4 = four_bit(FORMAT), UNPACK = narrow(FORMAT) && PACKED, NARROW = narrow(FORMAT);
  const int64_t B = K / BLOCK, lane0 = first_part * PART_LANES;
  constexpr int64_t BLOCK_BYTES = INT4 || UNPACK ? packed_block_bytes(FORMAT) : INT8_BLOCK_BYTES;
  Part acc[P][R];
  float acc_sums[R];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[p][r] = part_splat(0.0f);
    acc_sums[r] = 0.0f;
  }
  constexpr bool HALVES = FORMAT == Format::INT8_GROUP16 || FORMAT == Format::INT6_SUPER16 ||
                          FORMAT == Format::INT6_CENTERED16;
  Part group_s[P], group_m[P];
  const uint16_t* int4_scales = reinterpret_cast<const uint16_t*>(scales_zeros) + lane0;
  constexpr int AHEAD = BLOCKS_AHEAD<R, HALVES>;
  PartI ahead[AHEAD * R * (HALVES ? 2 : 1)];  // AHEAD > 1: the dots of blocks b - b % AHEAD on, R a (half) block
  alignas(64) uint8_t unpacked[UNPACK ? AHEAD : 1][UNPACK ? INT8_BLOCK_BYTES : 1];  // 5- or 6-bit blocks as 8-bit ones
  for (int64_t b = 0, in_group = 0; b < blocks; ++b) {
    PartI dots[R];
    const uint8_t* block = w + b * BLOCK_BYTES;
    // Ask for the weights PREFETCH_BYTES ahead (this tile's or the next ones'): they stream in from
    // memory while this block is multiplied.
    if (first_part == 0)
      for (int64_t byte = 0; byte < BLOCK_BYTES; byte += 64) prefetch(block + PREFETCH_BYTES + byte);
    if constexpr (UNPACK) {  // the block (AHEAD > 1: the next AHEAD) with a byte a code
      if (b % AHEAD == 0) {
        for (int64_t k = 0; k < std::min<int64_t>(AHEAD, blocks - b); ++k)
          unpack_narrow<FORMAT>(block + k * BLOCK_BYTES, unpacked[k]);
        // A tier's products may read them where the compiler cannot see it (AMX's tile loads).
        __asm__ volatile("" ::"r"(unpacked) : "memory");
      }
      block = unpacked[b % AHEAD];
    }
    if constexpr (HALVES) {
      // Each half block has its own scale and offset: two half-block dots, each scaled alone.
      if constexpr (AHEAD > 1) {  // (P is 1)
        if (b % AHEAD == 0)
          dots_ahead<R, false, true>(UNPACK ? unpacked[0] : block, std::min<int64_t>(AHEAD, blocks - b),
                                     codes + b * BLOCK, K, ahead);
      }
      for (int h = 0; h < 2; ++h) {
        for (int p = 0; p < P; ++p) {
          const PartI* sums = dots;  // the sums read where they are (a copy would need R more registers)
          if constexpr (AHEAD > 1)
            sums = ahead + (b % AHEAD * 2 + h) * R;
          else
            part_dot<R, false, 4, NARROW>(block + h * INT8_BLOCK_BYTES / 2, first_part + p,
                                          codes + b * BLOCK + h * LANES, K, dots);
          Part s, m;
          grouped_scale_offset<FORMAT>(scales_zeros, 2 * b + h, lane0 + p * PART_LANES, s, m);
          for (int r = 0; r < R; ++r) {
            acc[p][r] = part_fmadd(part_splat(scales[r * B + b]) * s, to_float(sums[r]), acc[p][r]);
            acc[p][r] = part_fmadd(m, part_splat(row_sums[r * 2 * B + 2 * b + h]), acc[p][r]);
          }
        }
      }
      continue;
    }
    if constexpr (FORMAT == Format::INT4) {
      if (in_group == 0) {
        for (int p = 0; p < P; ++p) {
          group_s[p] = part_load_bf16(int4_scales + p * PART_LANES);
          group_m[p] = part_load_bf16(int4_scales + LANES + p * PART_LANES) - part_splat(8.0f) * group_s[p];
        }
        int4_scales += 2 * LANES;
      }
      in_group = in_group + 1 == blocks_per_group ? 0 : in_group + 1;
    } else if constexpr (FORMAT != Format::INT8_ROW) {
      for (int p = 0; p < P; ++p) grouped_scale_offset<FORMAT>(scales_zeros, b, lane0 + p * PART_LANES, group_s[p], group_m[p]);
    }
    for (int p = 0; p < P; ++p) {
      const PartI* sums = dots;  // the sums read where they are (a copy would need R more registers)
      if constexpr (AHEAD > 1) {  // (P is 1: the tier's vector holds a tile's 16 lanes)
        if (b % AHEAD == 0)
          dots_ahead<R, INT4>(UNPACK ? unpacked[0] : block, std::min<int64_t>(AHEAD, blocks - b), codes + b * BLOCK, K,
                              ahead);
        sums = ahead + b % AHEAD * R;
      } else {
        part_dot<R, INT4, 8, NARROW>(block, first_part + p, codes + b * BLOCK, K, dots);
      }
      for (int r = 0; r < R; ++r) {
        const Part products = to_float(sums[r]);
        const float row_scale = scales[r * B + b], row_sum = row_sums[r * B + b];
        if constexpr (FORMAT == Format::INT8_ROW) {
          acc[p][r] = part_fmadd(part_splat(row_scale), products, acc[p][r]);
          if (p == 0) acc_sums[r] = acc_sums[r] + row_sum;
        } else {
          // acc += (a * s) * dot + m * (a * sum of codes): the block's exact dot product, scaled.
          acc[p][r] = part_fmadd(part_splat(row_scale) * group_s[p], products, acc[p][r]);
          acc[p][r] = part_fmadd(group_m[p], part_splat(row_sum), acc[p][r]);
        }
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      Part result = acc[p][r];
      const int64_t lane = lane0 + p * PART_LANES;
      if constexpr (FORMAT == Format::INT8_ROW) {
        const float* sm = reinterpret_cast<const float*>(scales_zeros) + lane;
        result = part_fmadd(part_load(sm), result, part_load(sm + LANES) * part_splat(acc_sums[r]));
      }
      if (lane < valid) part_store_head(out + r * ldo + lane, result, valid - lane);
    }
}

// Rows r0 .. r0 + R - 1 of a tile, for R up to ROWS picked at run time: a few rows take the whole
// tile at once, more rows one part at a time.
template <Format FORMAT, bool PACKED, int ROWS = PART_ROWS<four_bit(FORMAT)>>
void rows_of_tile(int64_t R, const uint8_t* w, const uint8_t* sz, int64_t blocks, int64_t blocks_per_group,
                  const int8_t* codes, const float* scales, const float* row_sums, int64_t K, float* out, int64_t ldo,
                  int64_t valid) {
  constexpr int PARTS = LANES / PART_LANES;
  if (R == ROWS) {
    if constexpr (ROWS * PARTS <= PART_ROWS<four_bit(FORMAT)>) {
      tile_rows<ROWS, PARTS, FORMAT, PACKED>(w, sz, 0, blocks, blocks_per_group, codes, scales, row_sums, K, out, ldo,
                                             valid);
    } else {
      for (int64_t part = 0; part * PART_LANES < valid; ++part)
        tile_rows<ROWS, 1, FORMAT, PACKED>(w, sz, part, blocks, blocks_per_group, codes, scales, row_sums, K, out, ldo,
                                           valid);
    }
  } else if constexpr (ROWS > 1) {
    rows_of_tile<FORMAT, PACKED, ROWS - 1>(R, w, sz, blocks, blocks_per_group, codes, scales, row_sums, K, out, ldo,
                                           valid);
  }
}

// Tiles begin .. end - 1, every row of the call. Where several chunks of rows read a tile of 6-bit
// codes (a prefill), the tile is unpacked once for all of them.
template <Format FORMAT>
void tiles(const MatmulArgs& a, const float* row_sums, int64_t sums_per_row, int64_t begin, int64_t end) {
  constexpr int ROWS = PART_ROWS<four_bit(FORMAT)>, CHUNK = CHUNK_ROWS<four_bit(FORMAT)>;
  const int64_t K = a.in_features, B = K / BLOCK, blocks_per_group = a.group_size / BLOCK;
  const int64_t rest = a.rows % CHUNK;
  const bool joins = a.rows > CHUNK && CHUNK + rest <= ROWS;
  const int64_t chunks = a.rows / CHUNK + (rest > 0 && !joins);
  std::vector<uint8_t> unpacked(narrow(FORMAT) && chunks > 1 ? B * INT8_BLOCK_BYTES : 0);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t valid = std::min<int64_t>(LANES, a.out_features - t * LANES);
    const uint8_t* w = a.packed + t * a.tile_bytes;
    const uint8_t* sz = a.scales_zeros + t * a.tile_scale_bytes;
    float* out = a.out + t * LANES;
    if (!unpacked.empty()) {
      for (int64_t b = 0; b < B; ++b)
        unpack_narrow<FORMAT>(w + b * packed_block_bytes(FORMAT), unpacked.data() + b * INT8_BLOCK_BYTES);
      __asm__ volatile("" ::"r"(unpacked.data()) : "memory");  // (AMX's tile loads read them unseen)
    }
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t r0 = chunk * CHUNK, R = chunk + 1 == chunks ? a.rows - r0 : CHUNK;
      const int8_t* codes = a.codes + r0 * K;
      const float *scales = a.scales + r0 * B, *sums = row_sums + r0 * sums_per_row;
      float* rows_out = out + r0 * a.out_features;
      if (unpacked.empty())
        rows_of_tile<FORMAT, true>(R, w, sz, B, blocks_per_group, codes, scales, sums, K, rows_out, a.out_features,
                                   valid);
      else
        rows_of_tile<FORMAT, false>(R, unpacked.data(), sz, B, blocks_per_group, codes, scales, sums, K, rows_out,
                                    a.out_features, valid);
    }
  }
}

// The format of a matmul's weights (api.h).
inline Format format_of(const MatmulArgs& a) {
  if (a.bits == 4) return a.superblock_scales ? Format::INT4_SUPER32 : Format::INT4;
  if (a.bits == 5) return a.superblock_scales == CENTERED_GROUPS ? Format::INT5_CENTERED32 : Format::INT5_SUPER32;
  if (a.bits == 6) {
    if (a.superblock_scales == CENTERED_SUPERBLOCKS) return Format::INT6_CENTERED16;
    return a.group_size == BLOCK ? Format::INT6_SUPER32 : Format::INT6_SUPER16;
  }
  if (a.group_size == 0) return Format::INT8_ROW;
  if (a.superblock_scales == CENTERED_GROUPS) return Format::INT8_CENTERED32;
  return a.group_size == BLOCK ? Format::INT8_GROUP32 : Format::INT8_GROUP16;
}

inline void matmul_tiles(const MatmulArgs& a, int64_t begin, int64_t end) {
  // Each row's activation scale times its codes' sums, per half block (groups of 16) or block.
  const int64_t B = a.in_features / BLOCK, T = a.rows;
  const bool halves = a.bits != 4 && a.group_size == LANES;
  const int64_t per_row = halves ? 2 * B : B;
  std::vector<float> row_sums(T * per_row);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b) {
      const float scale = a.scales[t * B + b];
      const int32_t* s = a.sums + 2 * (t * B + b);
      if (halves) {
        row_sums[t * per_row + 2 * b] = scale * static_cast<float>(s[0]);
        row_sums[t * per_row + 2 * b + 1] = scale * static_cast<float>(s[1]);
      } else {
        row_sums[t * per_row + b] = scale * static_cast<float>(s[0] + s[1]);
      }
    }
  begin_matmul(T);
  // The blocks' own prefetches run PREFETCH_BYTES ahead: ask for the first ones now.
  const uint8_t* first = a.packed + begin * a.tile_bytes;
  for (int64_t byte = 0; byte < std::min(PREFETCH_BYTES, (end - begin) * a.tile_bytes); byte += 64) prefetch(first + byte);
  const float* sums = row_sums.data();
  switch (format_of(a)) {
    case Format::INT4: return tiles<Format::INT4>(a, sums, per_row, begin, end);
    case Format::INT4_SUPER32: return tiles<Format::INT4_SUPER32>(a, sums, per_row, begin, end);
    case Format::INT5_SUPER32: return tiles<Format::INT5_SUPER32>(a, sums, per_row, begin, end);
    case Format::INT5_CENTERED32: return tiles<Format::INT5_CENTERED32>(a, sums, per_row, begin, end);
    case Format::INT8_ROW: return tiles<Format::INT8_ROW>(a, sums, per_row, begin, end);
    case Format::INT8_GROUP32: return tiles<Format::INT8_GROUP32>(a, sums, per_row, begin, end);
    case Format::INT8_GROUP16: return tiles<Format::INT8_GROUP16>(a, sums, per_row, begin, end);
    case Format::INT8_CENTERED32: return tiles<Format::INT8_CENTERED32>(a, sums, per_row, begin, end);
    case Format::INT6_SUPER32: return tiles<Format::INT6_SUPER32>(a, sums, per_row, begin, end);
    case Format::INT6_SUPER16: return tiles<Format::INT6_SUPER16>(a, sums, per_row, begin, end);
    case Format::INT6_CENTERED16: return tiles<Format::INT6_CENTERED16>(a, sums, per_row, begin, end);
  }
}

constexpr int64_t MAX_HEAD_CHUNKS = 16;  // head_dim up to 256
// Attention asks for the keys and values this many bytes ahead of those it reads: a step at a long
// context streams the cache from memory, and the hardware's prefetch alone leaves it waiting.
constexpr int64_t PREFETCH_KV_BYTES = 4096;
constexpr int64_t WIDENED_FLOATS = 4096;  // a cache of halves' keys or values widened at once: 16 KB
constexpr int64_t ATTEND_BATCH = 24;     // queries that walk the keys together (their scores: 24 x keys floats)
// Queries whose value sums share one load of each value (as many as the registers allow), and the
// vectors of value sums a tier's registers hold at once (32 AVX-512 registers; 16 AVX2 halves): a
// sweep over the keys takes that many over the M queries (weigh_values). An fp32 cache's rows are
// read where they lie, and a sweep reads only its chunks' cache lines: on AVX2 two sweeps over a
// row of 64 read it from L2 twice, slower than the one spilled sum of a single sweep, so its sweeps
// may take twice as many.
#if defined(__AVX512F__)
constexpr int64_t VALUE_QUERIES = 4;
constexpr int64_t SUM_VECTORS = 16, FP32_SUM_VECTORS = 16;
#else
constexpr int64_t VALUE_QUERIES = 2;
constexpr int64_t SUM_VECTORS = 4, FP32_SUM_VECTORS = 8;
#endif
// Chunks of a value row summed in one sweep for M queries: a power of two, M of them at most `budget`.
constexpr int64_t sweep_chunks(int64_t m, int64_t budget) {
  int64_t width = 1;
  while (2 * width * m <= budget) width *= 2;
  return width;
}

#ifndef SPECEE_REDUCE_EACH
// Lane j: reduce_add(a[j]), the halving tree of each vector (tiers with shuffles have their own).
inline F16 reduce_add_each(const F16* a) {
  float sums[LANES];
  for (int64_t j = 0; j < LANES; ++j) sums[j] = reduce_add(a[j]);
  return load(sums);
}
#endif

// One (row, head) of an attention call: key p of the keys it sees, in order, is row
// index[p] (or first + p) of keys/values, which hold fp32 (E = float) or IEEE halves (E = uint16_t).
template <typename E>
struct Query {
  const float* q;
  float* out;
  float* scores;
  const E* keys;
  const E* values;
  int64_t count, first;
  const int64_t* index;
  int64_t slot(int64_t p) const { return index ? index[p] : first + p; }
  const E* key(int64_t p, int64_t hd) const { return keys + slot(p) * hd; }
  const E* value(int64_t p, int64_t hd) const { return values + slot(p) * hd; }
  bool same_keys(const Query& o) const { return keys == o.keys && first == o.first && index == o.index; }
};

// Keys or values `hd` wide, PREFETCH_KV_BYTES ahead: how many positions.
template <typename E>
constexpr int64_t positions_ahead(int64_t hd) {
  return std::max<int64_t>(1, PREFETCH_KV_BYTES / (hd * static_cast<int64_t>(sizeof(E))));
}

template <typename E>
inline void prefetch_row(const E* row, int64_t hd) {
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(E)); byte += 64)
    prefetch(reinterpret_cast<const char*>(row) + byte);
}

// q . key before its scale, a chunk of 16 features at a time (each key's own sum, as a one-key call makes it).
inline F16 key_products(const F16* qv, const float* key, int64_t chunks) {
  F16 a = splat(0.0f);
  for (int64_t c = 0; c < chunks; ++c) a = fmadd(qv[c], load(key + c * LANES), a);
  return a;
}

// sums[j hd + c LANES ...] += query j's weight for key i times chunk c of key i's value row
// (`value_row(i)`, fp32), for the W chunks c0 .. c0 + W - 1 of the row and the keys from .. to - 1,
// for M queries at once: each value loaded once for all M, the sums held in registers over the keys.
template <int M, int64_t W, typename E, typename ValueRow>
inline void weigh_sweep(const Query<E>* qs, int64_t hd, int64_t c0, int64_t from, int64_t to, ValueRow value_row,
                        float* sums) {
  F16 acc[M][W];
  for (int j = 0; j < M; ++j)
    for (int64_t c = 0; c < W; ++c) acc[j][c] = load(sums + j * hd + (c0 + c) * LANES);
  for (int64_t i = from; i < to; ++i) {
    const float* value = value_row(i) + c0 * LANES;
    F16 weights[M];
    for (int j = 0; j < M; ++j) weights[j] = splat(qs[j].scores[i]);
    for (int64_t c = 0; c < W; ++c) {
      const F16 v = load(value + c * LANES);
      for (int j = 0; j < M; ++j) acc[j][c] = fmadd(weights[j], v, acc[j][c]);
    }
  }
  for (int j = 0; j < M; ++j)
    for (int64_t c = 0; c < W; ++c) store(sums + j * hd + (c0 + c) * LANES, acc[j][c]);
}

// weigh_sweep over the chunks c0 .. of the row, W at a time, then what is left in narrower sweeps.
template <int M, int64_t W, typename E, typename ValueRow>
inline void weigh_sweeps(const Query<E>* qs, int64_t hd, int64_t c0, int64_t from, int64_t to, ValueRow value_row,
                         float* sums) {
  const int64_t chunks = hd / LANES;
  for (; c0 + W <= chunks; c0 += W) weigh_sweep<M, W>(qs, hd, c0, from, to, value_row, sums);
  if constexpr (W > 1)
    if (c0 < chunks) weigh_sweeps<M, W / 2>(qs, hd, c0, from, to, value_row, sums);
}

// The value sums of M queries over the keys from .. to - 1, sweep_chunks(M, ...) chunks of the row at a
// time: as many sums as the registers hold, and enough of them that a key's multiply-adds need not
// wait for the last key's (more, or held in an array indexed through a pointer, they went to
// memory and back on every key: twice the time). The keys go by as many as 16 KB of values hold,
// so a widened block's later sweeps find them in L1.
template <int M, typename E, typename ValueRow>
inline void weigh_values(const Query<E>* qs, int64_t hd, int64_t from, int64_t to, ValueRow value_row, float* sums) {
  constexpr int64_t SWEEP = sweep_chunks(M, std::is_same_v<E, float> ? FP32_SUM_VECTORS : SUM_VECTORS);
  const int64_t span = WIDENED_FLOATS / hd;
  for (int64_t first = from; first < to; first += span)
    weigh_sweeps<M, SWEEP>(qs, hd, 0, first, std::min(to, first + span), value_row, sums);
}

// The outputs of M queries that see the same keys: each query's values summed key by key, a
// value loaded once for all M over the keys they all see, then each alone over the rest of its own.
template <int M>
void sum_values(const Query<float>* qs, int64_t hd, const float* inverse, bool lead) {
  const int64_t chunks = hd / LANES;
  int64_t common = qs[0].count;
  for (int j = 1; j < M; ++j) common = std::min(common, qs[j].count);
  alignas(64) float sums[M * MAX_HEAD_CHUNKS * LANES];
  std::fill(sums, sums + M * hd, 0.0f);
  const int64_t ahead = positions_ahead<float>(hd);
  // The call's first run on these values asks for them ahead (the others find them in cache); a
  // masked order is not worth predicting.
  const bool ask = lead && qs[0].index == nullptr;
  weigh_values<M>(qs, hd, 0, common, [&](int64_t i) {
    if (ask && i + ahead < common) prefetch_row(qs[0].value(i + ahead, hd), hd);
    return qs[0].value(i, hd);
  }, sums);
  for (int j = 0; j < M; ++j) {
    const Query<float>& query = qs[j];
    weigh_values<1>(qs + j, hd, common, query.count, [&](int64_t i) { return query.value(i, hd); }, sums + j * hd);
    const F16 factor = splat(inverse[j]);
    for (int64_t c = 0; c < chunks; ++c) store(query.out + c * LANES, load(sums + j * hd + c * LANES) * factor);
  }
}

// Each query's scores replaced by exp(score - the highest), its 1 / (their sum) in inverse[j]; key
// i in lane i % 16 of the block i / 16.
template <typename E>
void softmax(const Query<E>* qs, int64_t n, float* inverse) {
  const float lowest = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float* scores = qs[j].scores;
    const int64_t count = qs[j].count;
    F16 highest = splat(lowest);
    for (int64_t i = 0; i < count; i += LANES) highest = max(highest, load_head(scores + i, count - i, lowest));
    const F16 top = splat(reduce_max(highest));
    F16 total = splat(0.0f);
    for (int64_t i = 0; i < count; i += LANES) {
      const F16 e = exp(load_head(scores + i, count - i, lowest) - top);  // exp(-inf) lanes are 0
      store_head(scores + i, e, count - i);
      total = total + e;
    }
    inverse[j] = 1.0f / reduce_add(total);
  }
}

// Every query's arithmetic is that of a one-query call: scores of 16 keys at a time as each
// key's halving tree (reduce_add_each), the rest one by one; a softmax; the values summed key
// by key. The queries only share the loads: keys and values are read once for the batch while
// they sit in L1 (which is why a pass over several rows, or the heads of one kv group, costs
// little more than one).
template <int CHUNKS>  // hd / LANES, or 0: hd / LANES at run time
void attend_batch(Query<float>* qs, int64_t n, int64_t hd, float scale, bool lead) {
  // hd known when compiled: the loads of a block's keys take fixed offsets from one pointer (at run
  // time the compiler kept sixteen pointers on the stack and loaded one for every multiply-add).
  if (CHUNKS > 0) hd = CHUNKS * LANES;
  const int64_t chunks = hd / LANES;
  int64_t longest = 0;
  for (int64_t j = 0; j < n; ++j) longest = std::max(longest, qs[j].count);
  const F16 scaled = splat(scale);
  const int64_t ahead = positions_ahead<float>(hd);
  for (int64_t p = 0; p < longest; p += LANES)
    for (int64_t j = 0; j < n; ++j) {
      const Query<float>& query = qs[j];
      if (p >= query.count) continue;
      F16 qv[MAX_HEAD_CHUNKS];
      for (int64_t c = 0; c < chunks; ++c) qv[c] = load(query.q + c * LANES);
      if (p + LANES <= query.count) {
        if (lead && j == 0 && query.index == nullptr && p + ahead + LANES <= query.count)  // the first reader
          for (int64_t k = 0; k < LANES; ++k) prefetch_row(query.key(p + ahead + k, hd), hd);
        F16 acc[LANES];
        if (query.index == nullptr) {  // rows hd apart: fixed offsets from one pointer
          const float* keys = query.key(p, hd);
          for (int64_t k = 0; k < LANES; ++k) acc[k] = key_products(qv, keys + k * hd, chunks);
        } else {
          for (int64_t k = 0; k < LANES; ++k) acc[k] = key_products(qv, query.key(p + k, hd), chunks);
        }
        store(query.scores + p, reduce_add_each(acc) * scaled);
      } else {
        for (int64_t i = p; i < query.count; ++i)
          query.scores[i] = reduce_add(key_products(qv, query.key(i, hd), chunks)) * scale;
      }
    }
  float inverse[ATTEND_BATCH];
  softmax(qs, n, inverse);
  for (int64_t j0 = 0; j0 < n;) {  // runs of up to VALUE_QUERIES queries that see the same keys
    int64_t m = 1;
    while (m < VALUE_QUERIES && j0 + m < n && qs[j0 + m].same_keys(qs[j0])) ++m;
    switch (m) {
      case 1: sum_values<1>(qs + j0, hd, inverse + j0, lead && j0 == 0); break;
      case 2: sum_values<2>(qs + j0, hd, inverse + j0, lead && j0 == 0); break;
      case 3: sum_values<3>(qs + j0, hd, inverse + j0, lead && j0 == 0); break;
      default: sum_values<4>(qs + j0, hd, inverse + j0, lead && j0 == 0); break;
    }
    j0 += m;
  }
}

// Keys or values first .. first + count - 1 of `query` (from base: its keys or its values) as
// fp32 rows of `into` [count][hd]: every half widens exactly.
// lead: ask for the next ones ahead (the first batch on these keys).
inline void widen(const Query<uint16_t>& query, const uint16_t* base, int64_t first, int64_t count, int64_t hd,
                  float* into, bool lead) {
  const int64_t ahead = positions_ahead<uint16_t>(hd);
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t* row = base + query.slot(first + i) * hd;
    if (lead && query.index == nullptr && first + i + ahead < query.count) prefetch_row(row + ahead * hd, hd);
    for (int64_t d = 0; d < hd; d += LANES) store(into + i * hd + d, load_f16(row + d));
  }
}

// sum_values over the keys begin .. end - 1 only, their values in `block` (the row of key i at
// (i - begin) hd), the sums carried in `sums` [M][hd] from one block of keys to the next.
template <int M>
void sum_values_block(const Query<uint16_t>* qs, int64_t hd, const float* block, int64_t begin, int64_t end,
                      float* sums) {
  int64_t common = qs[0].count;
  for (int j = 1; j < M; ++j) common = std::min(common, qs[j].count);
  auto row = [&](int64_t i) { return block + (i - begin) * hd; };
  weigh_values<M>(qs, hd, begin, std::min(end, common), row, sums);
  for (int j = 0; j < M; ++j)
    weigh_values<1>(qs + j, hd, std::max(begin, common), std::min(end, qs[j].count), row, sums + j * hd);
}

// A cache of halves: attend_batch's arithmetic, key for key, on the keys and values widened to
// fp32 (so the bits of an fp32 cache holding the same halves). They are widened a block at a time
// into L1, once for all the queries of the batch that see them: a pass of several rows pays for
// the widening once, and reads half the bytes of an fp32 cache.
template <int CHUNKS>
void attend_batch_half(Query<uint16_t>* qs, int64_t n, int64_t hd, float scale, bool lead) {
  if (CHUNKS > 0) hd = CHUNKS * LANES;  // known when compiled (attend_batch)
  const int64_t chunks = hd / LANES;
  const int64_t span = WIDENED_FLOATS / hd / LANES * LANES;  // keys widened at once for the values (16 or more)
  // Aligned to cache lines: a vector load that straddled two would cost two.
  alignas(64) float block[WIDENED_FLOATS];
  alignas(64) float sums[ATTEND_BATCH * MAX_HEAD_CHUNKS * LANES];
  std::fill(sums, sums + n * hd, 0.0f);
  int64_t longest = 0;
  for (int64_t j = 0; j < n; ++j) longest = std::max(longest, qs[j].count);
  const F16 scaled = splat(scale);
  for (int64_t p = 0; p < longest; p += LANES) {
    const Query<uint16_t>* held = nullptr;  // whose keys p .. p + held_count - 1 the block holds
    int64_t held_count = 0;
    for (int64_t j = 0; j < n; ++j) {
      const Query<uint16_t>& query = qs[j];
      if (p >= query.count) continue;
      const int64_t m = std::min(LANES, query.count - p);
      if (held == nullptr || !held->same_keys(query) || held_count < m) {
        widen(query, query.keys, p, m, hd, block, lead);
        held = &query;
        held_count = m;
      }
      F16 qv[MAX_HEAD_CHUNKS];
      for (int64_t c = 0; c < chunks; ++c) qv[c] = load(query.q + c * LANES);
      if (m == LANES) {
        F16 acc[LANES];
        for (int64_t k = 0; k < LANES; ++k) acc[k] = key_products(qv, block + k * hd, chunks);
        store(query.scores + p, reduce_add_each(acc) * scaled);
      } else {
        for (int64_t i = 0; i < m; ++i)
          query.scores[p + i] = reduce_add(key_products(qv, block + i * hd, chunks)) * scale;
      }
    }
  }
  float inverse[ATTEND_BATCH];
  softmax(qs, n, inverse);
  for (int64_t begin = 0; begin < longest; begin += span) {
    const Query<uint16_t>* held = nullptr;
    int64_t held_count = 0;
    for (int64_t j0 = 0; j0 < n;) {  // runs of up to VALUE_QUERIES queries that see the same keys
      int64_t m = 1;
      while (m < VALUE_QUERIES && j0 + m < n && qs[j0 + m].same_keys(qs[j0])) ++m;
      int64_t need = 0;
      for (int64_t j = j0; j < j0 + m; ++j) need = std::max(need, std::min(span, qs[j].count - begin));
      if (need > 0) {
        if (held == nullptr || !held->same_keys(qs[j0]) || held_count < need) {
          widen(qs[j0], qs[j0].values, begin, need, hd, block, lead);
          held = qs + j0;
          held_count = need;
        }
        const int64_t end = begin + need;
        float* carried = sums + j0 * hd;
        switch (m) {
          case 1: sum_values_block<1>(qs + j0, hd, block, begin, end, carried); break;
          case 2: sum_values_block<2>(qs + j0, hd, block, begin, end, carried); break;
          case 3: sum_values_block<3>(qs + j0, hd, block, begin, end, carried); break;
          default: sum_values_block<4>(qs + j0, hd, block, begin, end, carried); break;
        }
      }
      j0 += m;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const F16 factor = splat(inverse[j]);
    for (int64_t c = 0; c < chunks; ++c) store(qs[j].out + c * LANES, load(sums + j * hd + c * LANES) * factor);
  }
}

template <int CHUNKS>
void attend_batch_of(Query<float>* qs, int64_t n, int64_t hd, float scale, bool lead) {
  attend_batch<CHUNKS>(qs, n, hd, scale, lead);
}
template <int CHUNKS>
void attend_batch_of(Query<uint16_t>* qs, int64_t n, int64_t hd, float scale, bool lead) {
  attend_batch_half<CHUNKS>(qs, n, hd, scale, lead);
}

// lead: the first batch of the call on these keys (the later ones find them in cache).
template <typename E>
inline void attend_queries(Query<E>* qs, int64_t n, int64_t hd, float scale, bool lead) {
  switch (hd / LANES) {
    case 4: return attend_batch_of<4>(qs, n, hd, scale, lead);
    case 8: return attend_batch_of<8>(qs, n, hd, scale, lead);
    case 16: return attend_batch_of<16>(qs, n, hd, scale, lead);
    default: return attend_batch_of<0>(qs, n, hd, scale, lead);
  }
}

// Items begin .. end - 1, numbered kv group first: item (g T + t) group + j is row t's query head
// g group + j. So a thread's share of the items reads the keys and values of as few kv groups as
// its share allows, each of them once for all its rows (a pass of several rows streams each layer's
// cache once over the threads, not once a thread). Those of one kv group in consecutive rows of one
// segment make a batch (up to ATTEND_BATCH), heads before rows. E: the cache's element (every
// segment's alike).
template <typename E>
void attend_cache(const AttentionArgs& a, int64_t begin, int64_t end) {
  const int64_t heads = a.heads, hd = a.head_dim, group = heads / a.kv_heads, T = a.rows;
  const float scale = a.scale;
  if (begin >= end) return;
  const int64_t per_group = T * group, first_group = begin / per_group, last_group = (end - 1) / per_group;
  // Kept from call to call (a pass calls this once a layer): the batch's scores, and each row's keys,
  // contiguous (first, count) or through its masked order.
  thread_local std::vector<float> scores;
  thread_local std::vector<std::vector<int64_t>> orders;
  thread_local std::vector<int64_t> firsts, counts;
  thread_local std::vector<const int64_t*> indices;
  // The rows some item of the range has (all of them where it spans two groups).
  const int64_t first_row = first_group == last_group ? begin % per_group / group : 0;
  const int64_t last_row = first_group == last_group ? (end - 1) % per_group / group : T - 1;
  const int64_t row_count = last_row - first_row + 1;
  scores.resize(ATTEND_BATCH * (a.most_keys + LANES));
  if (static_cast<int64_t>(orders.size()) < row_count) orders.resize(row_count);
  firsts.resize(row_count);
  counts.resize(row_count);
  indices.assign(row_count, nullptr);
  for (int64_t t = first_row; t <= last_row; ++t) {
    const Segment& s = a.segments[a.row_segment[t]];
    const int64_t row = t - s.first_row, r = t - first_row;
    if (s.mask == nullptr) {
      const int64_t count = s.visible[row], first = s.window > 0 ? std::max<int64_t>(0, count - s.window) : 0;
      firsts[r] = first;
      counts[r] = count - first;
    } else {
      std::vector<int64_t>& order = orders[r];
      const int64_t tail_len = s.num_keys - s.prefix;
      order.resize(s.prefix);  // the prefix in order (a thread whose items span two kv groups orders every row)
      std::iota(order.begin(), order.end(), int64_t{0});
      for (int64_t j = 0; j < tail_len; ++j)
        if (s.mask[row * tail_len + j]) order.push_back(s.prefix + j);
      const int64_t count = static_cast<int64_t>(order.size());
      const int64_t skip = s.window > 0 ? std::max<int64_t>(0, count - s.window) : 0;
      firsts[r] = 0;
      counts[r] = count - skip;
      indices[r] = order.data() + skip;
    }
  }
  Query<E> batch[ATTEND_BATCH];
  for (int64_t g = first_group; g <= last_group; ++g) {
    int64_t n = 0, segment = -1;
    bool lead = true;  // the first batch on these keys: it asks for them ahead
    for (int64_t t = first_row; t <= last_row; ++t) {
      if (a.row_segment[t] != segment) {  // another sequence's keys
        if (n > 0) attend_queries(batch, n, hd, scale, lead);
        n = 0;
        lead = true;
      }
      segment = a.row_segment[t];
      const Segment& s = a.segments[segment];
      const int64_t r = t - first_row;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t item = (g * T + t) * group + h - g * group;
        if (item < begin || item >= end) continue;
        batch[n] = {a.q + (t * heads + h) * hd, a.out + t * heads * hd + h * hd, scores.data() + n * (a.most_keys + LANES),
                    static_cast<const E*>(s.keys) + g * s.capacity * hd,
                    static_cast<const E*>(s.values) + g * s.capacity * hd, counts[r], firsts[r], indices[r]};
        if (++n == ATTEND_BATCH) {
          attend_queries(batch, n, hd, scale, lead);
          n = 0;
          lead = false;
        }
      }
    }
    if (n > 0) attend_queries(batch, n, hd, scale, lead);
  }
}

inline void attend(const AttentionArgs& a, int64_t begin, int64_t end) {
  if (a.segments[0].half)
    attend_cache<uint16_t>(a, begin, end);
  else
    attend_cache<float>(a, begin, end);
}

// x as an IEEE half, to nearest, ties to even (beyond the largest half: infinity; NaN: a quiet
// NaN of its sign), in integers: every tier stores the same bits.
inline uint16_t to_half(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return sign | 0x7e00u;
  if (bits >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round past 65504
  uint32_t kept, rest, tie;
  if (bits >= 0x38800000u) {  // 2^-14 and up: a normal half
    kept = (bits >> 13) - (112u << 10);
    rest = bits & 0x1fffu;
    tie = 0x1000u;
  } else {  // a subnormal half (or zero): m 2^-24 with m = the 24-bit significand >> (126 - exponent)
    if (bits < 0x33000000u) return sign;  // below 2^-25 (2^-25 itself ties to the even zero)
    const uint32_t shift = 126u - (bits >> 23), significand = (bits & 0x7fffffu) | 0x800000u;
    kept = significand >> shift;
    rest = significand & ((1u << shift) - 1u);
    tie = 1u << (shift - 1u);
  }
  if (rest > tie || (rest == tie && (kept & 1u))) ++kept;  // a carry into the exponent is right
  return sign | static_cast<uint16_t>(kept);
}

template <typename E>
inline void store_kv(E* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<E, float>) {
    std::copy(src, src + n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_half(src[i]);
  }
}

// x * cos + (swapped halves) * sin, rounded as those separate operations round (PyTorch's rope).
template <typename E>
void rotate_into(const float* x, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd, const float* c,
                 const float* sn, int64_t angle_stride, float* qp, E* kp, E* vp, int64_t capacity, int64_t start) {
  const int64_t half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  float rotated[256];
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * width;
    const float* ct = c + t * angle_stride;
    const float* st = sn + t * angle_stride;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* src = row + h * hd;
      float* dst = h < heads ? qp + (t * heads + h) * hd : rotated;
      for (int64_t d = 0; d < hd; ++d) {
        const float swapped = src[d < half ? d + half : d - half];
        dst[d] = src[d] * ct[d] + swapped * st[d];
      }
      if (h >= heads) store_kv(kp + ((h - heads) * capacity + start + t) * hd, rotated, hd);
    }
    for (int64_t g = 0; g < kv_heads; ++g)
      store_kv(vp + (g * capacity + start + t) * hd, row + (heads + kv_heads + g) * hd, hd);
  }
}

inline void rotate_rows(const float* x, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd, const float* c,
                        const float* sn, int64_t angle_stride, float* qp, void* kp, void* vp, bool half,
                        int64_t capacity, int64_t start) {
  if (half)
    rotate_into(x, T, heads, kv_heads, hd, c, sn, angle_stride, qp, static_cast<uint16_t*>(kp),
                static_cast<uint16_t*>(vp), capacity, start);
  else
    rotate_into(x, T, heads, kv_heads, hd, c, sn, angle_stride, qp, static_cast<float*>(kp), static_cast<float*>(vp),
                capacity, start);
}

// Each row times 1 / sqrt(mean(x^2) + eps), then the weight; squares summed in 16 lanes, then across.
inline void rms_norm(const float* x, int64_t T, int64_t D, const float* weight, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * D;
    F16 squares = splat(0.0f);
    for (int64_t d = 0; d < D; d += LANES) {
      const F16 v = load_head(row + d, D - d, 0.0f);
      squares = squares + v * v;
    }
    const F16 inverse = splat(1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(D) + eps));
    for (int64_t d = 0; d < D; d += LANES)
      store_head(out + t * D + d, (load_head(row + d, D - d, 0.0f) * inverse) * load_head(weight + d, D - d, 0.0f), D - d);
  }
}

// gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I].
inline void silu_mul(const float* gate_up, int64_t T, int64_t I, int64_t first, int64_t width, float* out) {
  const F16 one = splat(1.0f), zero = splat(0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = first; i < first + width; i += LANES) {
      const int64_t n = first + width - i;
      const F16 gate = load_head(gate_up + t * 2 * I + i, n, 0.0f);
      const F16 up = load_head(gate_up + t * 2 * I + I + i, n, 0.0f);
      store_head(out + t * I + i, (gate / (one + exp(zero - gate))) * up, n);
    }
}

// gate_up [T, 2 I] -> gelu(gate) * up [T, I], GELU's tanh form (PyTorch's approximate="tanh"), with
// tanh(u) = 1 - 2 / (exp(2u) + 1) on our exp.
inline void gelu_mul(const float* gate_up, int64_t T, int64_t I, int64_t first, int64_t width, float* out) {
  const F16 one = splat(1.0f), two = splat(2.0f), half = splat(0.5f);
  const F16 root = splat(0.7978845608028654f), cubic = splat(0.044715f);  // sqrt(2 / pi)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = first; i < first + width; i += LANES) {
      const int64_t n = first + width - i;
      const F16 gate = load_head(gate_up + t * 2 * I + i, n, 0.0f);
      const F16 up = load_head(gate_up + t * 2 * I + I + i, n, 0.0f);
      const F16 u = root * (gate + cubic * ((gate * gate) * gate));
      const F16 tanh = one - two / (exp(two * u) + one);
      store_head(out + t * I + i, ((half * gate) * (one + tanh)) * up, n);
    }
}

inline const KernelTable* table(const char* tier) {
  static const KernelTable kernel_table{KERNEL_API_VERSION, tier, tier_unavailable(), quantize_rows, matmul_tiles,
                                        attend, rotate_rows, rms_norm, silu_mul, gelu_mul};
  return &kernel_table;
}

}  // namespace specee::kernels
