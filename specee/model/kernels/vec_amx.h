// The AMX tier: the AVX-512 VNNI tier (vec_avx512.h, so every fp32 step is the same instruction)
// with the int8 products of a pass over AMX_ROWS rows or more on AMX tiles. TDPBSUD multiplies a
// tile A of R rows of activation codes (signed; a row's 32 codes of one block, as quantize_rows
// stores them) by a tile B of one block's weight codes (unsigned; the packed layout's step j, inputs
// 4j .. 4j + 3 for lanes 0-15, four codes a lane, is B's row j) into R rows x 16 lanes of int32: the
// same exact block sums as vpdpbusd's. The sums come back through memory, which a tile load cannot
// read from stores still in flight: so BLOCKS_AHEAD blocks are multiplied back to back before the
// fp32 steps of the first one. The half blocks of 8-bit codes in groups of 16 (Q6_K) take a product
// each, of 16 codes a row, from HALF_BLOCK_ROWS rows on. Up to 8 rows past a tile's 16 join its
// chunk (REST_TILE_ROWS). Fewer than AMX_ROWS rows keep vpdpbusd.
#pragma once

#define SPECEE_AMX  // vec_avx512.h leaves `dot` and DOT_ROWS to this header
#include "vec_avx512.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace specee::simd {

template <bool INT4>
constexpr int DOT_ROWS = 24;  // rows at once: a tile of 16 and the rest, on vpdpbusd or a second tile
constexpr int TILE_ROWS = 16;  // the rows a tile holds
#define SPECEE_CHUNK_ROWS
template <bool INT4>
constexpr int CHUNK_ROWS = TILE_ROWS;  // (kernels.h)
// Rows past a tile's 16 take a second tile from this many on, vpdpbusd on the same block below it
// (the default model: five rows faster on vpdpbusd, six a tie, eight faster on a tile; BENCHMARKS.md,
// "Sixteen cores").
constexpr int REST_TILE_ROWS = 7;
constexpr int AMX_ROWS = 8;  // tiles from 8 rows (BENCHMARKS.md, "Sixteen cores": at 7 vpdpbusd is quicker)

template <int R, bool INT4, int STEPS = 8>
inline void dot(const uint8_t* p, const int8_t* q, int64_t K, I16* out) {
  vnni_dot<R, INT4, STEPS>(p, q, K, out);
}

#define SPECEE_TIER_SETUP
inline const char* tier_unavailable() {
  // Linux gives a process the tile state (8 KiB a thread) only when it asks for it, once.
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) return nullptr;
  static char reason[160];
  std::snprintf(reason, sizeof reason, "Linux refused this process the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, "
                "XFEATURE_XTILEDATA): %s)", std::strerror(errno));
  return reason;
}

// Palette 1 for R rows of CODES codes (a block's 32, or a half block's 16). Up to 16 rows: sums C,
// activation codes A and weight codes B, two of each, which even and odd products take by turns
// so that one product need not wait for the other's store. More rows: the first 16 and the rest
// each have an A, and each of those a C for even and one for odd products; the two share B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 0, 0, 64, 64};  // C0 C1 A0 A1 B0 B1 (more rows: C2 C3 after them)
  uint8_t rows[16] = {};
};

// What this thread's tiles are configured for (rows * 64 + codes); 0: not known to be ours.
inline thread_local int configured = 0;

// The configuration belongs to the thread, and other code on it (oneDNN's AMX kernels in PyTorch)
// may load its own or release the tiles between two of our calls: each call loads ours again
// (about 100 ns) before its first product, and again where a chunk has other rows (16, then the rest).
inline void begin_matmul(int64_t) { configured = 0; }

// Tiles for R rows, the second tile's only where the rows past 16 take one (REST_TILE_ROWS).
template <int R, int CODES>
inline void configure() {
  if constexpr (R > TILE_ROWS && R - TILE_ROWS < REST_TILE_ROWS) {
    configure<TILE_ROWS, CODES>();
    return;
  }
  if (configured == R * 64 + CODES) return;
  TileConfig config;
  constexpr int FIRST = R > TILE_ROWS ? TILE_ROWS : R, REST = R > TILE_ROWS ? R - TILE_ROWS : R;
  config.rows[0] = config.rows[2] = FIRST;  // (up to 16 rows, both parities' C and A are alike)
  config.rows[1] = config.rows[3] = REST;
  if constexpr (R > TILE_ROWS) {  // (a tile unused must have no rows and no bytes)
    config.rows[6] = FIRST;
    config.rows[7] = REST;
    config.bytes_per_row[6] = config.bytes_per_row[7] = 64;
  }
  config.bytes_per_row[2] = config.bytes_per_row[3] = CODES;
  config.rows[4] = config.rows[5] = CODES / 4;
  // Not gcc 12's _tile_loadconfig: it does not tell the compiler that it reads the 64 bytes, which
  // were then never written.
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
  configured = R * 64 + CODES;
}

constexpr int HALF_BLOCK_ROWS = 12;  // half blocks' products: a tie with vpdpbusd at 9 rows, ahead from 12

template <int R, bool HALVES = false>
constexpr int BLOCKS_AHEAD = R >= (HALVES ? HALF_BLOCK_ROWS : AMX_ROWS) ? 4 : 1;

// The dots of R rows with `count` consecutive blocks (out [count][R]), or HALVES (8-bit codes in
// groups of 16) with each of their half blocks (out [count][2][R]); row r's codes at q + r * K.
template <int R, bool INT4, bool HALVES = false>
inline void dots_ahead(const uint8_t* block, int64_t count, const int8_t* q, int64_t K, I16* out) {
  constexpr int64_t CODES = HALVES ? 16 : 32, BYTES = INT4 ? 256 : CODES * 16;  // a product's weight bytes
  configure<R, CODES>();
  alignas(64) uint8_t codes[BLOCKS_AHEAD<R>][8 * 64];
  if constexpr (INT4) {  // a byte per code: steps 0-3 from the low nibbles, 4-7 from the high ones
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int64_t k = 0; k < count; ++k)
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = _mm512_loadu_si512(block + k * BYTES + i * 64);
        _mm512_store_si512(codes[k] + i * 64, _mm512_and_si512(packed, nibble));
        _mm512_store_si512(codes[k] + (i + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble));
      }
    // gcc's tile loads do not tell it that they read memory: these stores must be made first.
    __asm__ volatile("" ::"r"(codes) : "memory");
  }
  for (int64_t k = 0; k < (HALVES ? 2 * count : count); ++k) {
    const uint8_t* b = INT4 ? codes[k] : block + k * BYTES;
    // (gcc's tile intrinsics take a tile's number as written)
    if constexpr (R > TILE_ROWS && R - TILE_ROWS < REST_TILE_ROWS)  // the rows past 16 from the packed block
      vnni_dot<R - TILE_ROWS, INT4, HALVES ? 4 : 8>(block + k * BYTES, q + TILE_ROWS * K + k * CODES, K,
                                                    out + k * R + TILE_ROWS);
    if constexpr (R > TILE_ROWS && R - TILE_ROWS >= REST_TILE_ROWS) {
      const int8_t* rest = q + TILE_ROWS * K + k * CODES;
      if (k % 2 == 0) {
        _tile_loadd(4, b, 64);
        _tile_zero(0); _tile_loadd(2, q + k * CODES, K); _tile_dpbsud(0, 2, 4);
        _tile_zero(1); _tile_loadd(3, rest, K); _tile_dpbsud(1, 3, 4);
        _tile_stored(0, out + k * R, 64); _tile_stored(1, out + k * R + TILE_ROWS, 64);
      } else {
        _tile_loadd(5, b, 64);
        _tile_zero(6); _tile_loadd(2, q + k * CODES, K); _tile_dpbsud(6, 2, 5);
        _tile_zero(7); _tile_loadd(3, rest, K); _tile_dpbsud(7, 3, 5);
        _tile_stored(6, out + k * R, 64); _tile_stored(7, out + k * R + TILE_ROWS, 64);
      }
    } else if (k % 2 == 0) {
      _tile_zero(0); _tile_loadd(2, q + k * CODES, K); _tile_loadd(4, b, 64); _tile_dpbsud(0, 2, 4);
      _tile_stored(0, out + k * R, 64);
    } else {
      _tile_zero(1); _tile_loadd(3, q + k * CODES, K); _tile_loadd(5, b, 64); _tile_dpbsud(1, 3, 5);
      _tile_stored(1, out + k * R, 64);
    }
  }
}

}  // namespace specee::simd
