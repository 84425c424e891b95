// The C ABI between one CPU tier's library (tier.cpp compiled with that tier's flags, no torch
// headers) and the torch bindings (bindings.cpp), which validate tensors, pick the threads and
// call a tier's table.
#pragma once

#include <cstdint>

namespace specee {

constexpr int KERNEL_API_VERSION = 13;

// MatmulArgs::superblock_scales: how the scales are stored (see below): as pairs per group, as
// superblock records with offsets or centered ones, or (6-bit codes) as one scale per group, centered.
constexpr int64_t NO_SUPERBLOCKS = 0, SUPERBLOCKS = 1, CENTERED_SUPERBLOCKS = 2, CENTERED_GROUPS = 3;

// One integer matmul: x's rows quantized to int8 blocks (codes, scales, sums) times a packed
// matrix of tiles of 16 output features (see integer_linear.py's pack_codes). Five weight formats:
// - bits 4, group_size 32, 64 or 128: scales_zeros [tiles, K / group, 2, 16] bf16 (s, z), w = (code - 8) s + z;
//   or, group_size 32, SUPERBLOCKS records as below, w = code s + m (a GGUF file's Q4_K);
// - bits 5, group_size 32: 5-bit codes, 320 bytes a block (kernels.h's unpack_five), SUPERBLOCKS
//   records as below (a GGUF file's Q5_K); or, CENTERED_GROUPS, fp16 [tiles, K / 32, 16] (d),
//   w = (code - 16) d (a GGUF file's Q5_0, its own codes);
// - bits 8, group_size 0: one scale and offset per feature, [tiles, 2, 16] fp32, w = code s + m;
// - bits 8, group_size 16 or 32: a scale and offset per feature and group, [tiles, K / group, 2, 16]
//   fp32, w = code s + m (a GGUF file's Q5_1 blocks, exactly); or, CENTERED_GROUPS (group 32), fp16
//   [tiles, K / 32, 16] (d), w = (code - 128) d (a GGUF file's Q8_0, its codes plus 128);
// - bits 6, group_size 16 or 32: 6-bit codes, 384 bytes a block (kernels.h's unpack_six), whose
//   scale and offset are fp16 factors per 256 inputs times int8 multipliers per group, per tile and
//   superblock a record [2 x 16 fp16 (D, M), K / 256 / group x 2 x 16 int8 (sc, mc)], s = D sc and
//   m = M mc (SUPERBLOCKS: a Q5_K fused beside a Q6_K, or a Q4_K beside a Q5_K); or,
//   CENTERED_SUPERBLOCKS (group 16), [16 fp16 (D), K / 256 / 16 x 16 int8 (sc)], s = D sc and
//   m = (-32 D) sc (Q6_K: the file's bytes, its scales a byte each).
struct MatmulArgs {
  const uint8_t* packed;        // [tiles, tile_bytes]
  int64_t tile_bytes;
  const uint8_t* scales_zeros;
  int64_t tile_scale_bytes;
  int64_t bits, group_size, superblock_scales, out_features, rows, in_features;
  const int8_t* codes;          // [rows, K]
  const float* scales;          // [rows, K / 32]
  const int32_t* sums;          // [rows, K / 16]: the sum of the codes of each half block
  float* out;                   // [rows, out_features]
};

// One sequence's share of an attention call: its layer of the cache and which keys its rows see.
struct Segment {
  const void* keys;        // [kv_heads, capacity, hd], fp32, or IEEE half where `half`
  const void* values;
  bool half;
  int64_t capacity;
  const int64_t* visible;  // row t sees keys 0 .. visible[t] - 1 (when mask is null)
  const uint8_t* mask;     // else: keys before `prefix`, and j >= prefix where mask[t, j - prefix] != 0
  int64_t prefix;
  int64_t num_keys;
  int64_t first_row;       // its first row among the call's rows
  int64_t window;          // > 0: each row sees only the last `window` of those keys (a sliding layer)
};

struct AttentionArgs {
  const float* q;              // [rows, heads, hd]
  int64_t rows, heads, kv_heads, head_dim, most_keys;
  float scale;                 // q . k is multiplied by it
  const Segment* segments;
  const int64_t* row_segment;  // [rows]
  float* out;                  // [rows, heads * hd]
};

struct KernelTable {
  int api_version;
  const char* tier;
  // Null, or why this tier cannot run in this process though the CPU has its flags (AMX: Linux
  // refused the tile state); the other entries must not be called then.
  const char* unavailable;
  // x [T, K] fp32 -> codes [T, K] int8, scales [T, K / 32], sums [T, K / 16] (sums of codes).
  void (*quantize_rows)(const float* x, int64_t T, int64_t K, int8_t* codes, float* scales, int32_t* sums);
  // Output tiles begin .. end - 1 of one matmul.
  void (*matmul_tiles)(const MatmulArgs& args, int64_t begin, int64_t end);
  // Items begin .. end - 1 of one attention call, kv group first: item (g rows + t) (heads / kv_heads) + j
  // is row t's query head g (heads / kv_heads) + j.
  void (*attend)(const AttentionArgs& args, int64_t begin, int64_t end);
  // Rotates the queries and keys of T rows of qkv [T, (heads + 2 kv_heads) hd], writes the queries
  // to q [T, heads, hd] and the keys and values into one layer of a cache at start .. start + T - 1.
  // Row t's cos and sin start at t * angle_stride. A cache of IEEE halves (`half`) takes each key
  // and value rounded to the nearest half, ties to even.
  void (*rotate_rows)(const float* qkv, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd, const float* cos,
                      const float* sin, int64_t angle_stride, float* q, void* keys, void* values, bool half,
                      int64_t capacity, int64_t start);
  // out may be x: each row is read whole before it is written.
  void (*rms_norm)(const float* x, int64_t T, int64_t D, const float* weight, float eps, float* out);
  // gate_up [T, 2 I] (gate, then up) -> out [T, I], columns first .. first + width - 1 of each row.
  void (*silu_mul)(const float* gate_up, int64_t T, int64_t I, int64_t first, int64_t width, float* out);
  void (*gelu_mul)(const float* gate_up, int64_t T, int64_t I, int64_t first, int64_t width, float* out);
};

}  // namespace specee
