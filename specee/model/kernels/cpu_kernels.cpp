// CPU kernels whose result for one row never depends on the other rows of the call.
//
// 1. Integer matmuls (llama.cpp's Q4 x Q8 scheme): each activation row is quantized to int8 in
//    blocks of 32 with its own scale; weights are unsigned 4- or 8-bit codes with a scale and an
//    offset. AVX-512 VNNI sums code x activation products exactly in int32 per block; the blocks'
//    sums are combined in fp32 in a fixed order. A tile of weights is loaded once for up to
//    MAX_ROWS rows, so a pass over several rows reads the weights once.
// 2. Attention: every (row, head) pair walks its visible keys in order, as a one-row call would.
// 3. The small per-row steps of a layer (RMS norm, SiLU gate), one call each instead of several
//    PyTorch ops.
//
// Built once per machine by specee/model/kernels/__init__.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;    // output features per tile (one zmm of int32 / fp32)
constexpr int64_t BLOCK = 32;    // activation block: one int8 scale per row and block
constexpr int64_t STEPS = 8;     // 4-byte steps per block (VNNI multiplies 4 bytes per lane)
constexpr int MAX_ROWS = 8;      // rows sharing one load of a weight tile
constexpr int64_t INT4_BLOCK_BYTES = 256;  // 16 lanes x 32 codes, two per byte
constexpr int64_t INT8_BLOCK_BYTES = 512;

inline __m512 bf16_to_fp32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// x [T, K] fp32 -> codes [T, K] int8, scales [T, K / 32] fp32, sums [T, K / 32] int32 (sum of codes).
void quantize_rows_into(const float* x, int64_t T, int64_t K, int8_t* codes, float* scales, int32_t* sums) {
  const int64_t B = K / BLOCK;
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const float* src = x + t * K + b * BLOCK;
      __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_mask), _mm512_and_ps(hi, sign_mask)));
      float scale = amax / 127.0f;
      float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      __m512 inv = _mm512_set1_ps(inverse);
      // cvtps_epi32 rounds to nearest even (the default rounding mode).
      __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* dst = codes + t * K + b * BLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      scales[t * B + b] = scale;
      sums[t * B + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  }
}

// One tile of 16 output features for R rows. Weights of block b: 8 zmm of unsigned codes, lane l
// holding codes k = 4j..4j+3 of feature l in step j.
// INT4: w = code * s + (z - 8 s) with bf16 s and z per lane and weight group ([G][s x16, z x16]).
// INT8: w = code * s + m with fp32 s and m per lane for the whole row ([s x16, m x16]), applied last.
template <int R, bool INT4>
void tile_rows(const uint8_t* w, const void* scales_zeros, int64_t blocks, int64_t blocks_per_group,
               const int8_t* codes, const float* scales, const int32_t* sums, int64_t K, float* out,
               int64_t ldo, __mmask16 lanes) {
  const int64_t B = K / BLOCK;
  __m512 acc[R];
  float acc_sums[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    acc_sums[r] = 0.0f;
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  __m512 group_s = _mm512_setzero_ps(), group_m = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i weights[STEPS];
    if constexpr (INT4) {
      const uint8_t* p = w + b * INT4_BLOCK_BYTES;
      for (int i = 0; i < 4; ++i) {
        __m512i packed = _mm512_loadu_si512(p + i * 64);
        weights[i] = _mm512_and_si512(packed, low_nibbles);
        weights[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
      if (b % blocks_per_group == 0) {
        const uint16_t* sz = static_cast<const uint16_t*>(scales_zeros) + (b / blocks_per_group) * 2 * LANES;
        group_s = bf16_to_fp32(sz);
        group_m = _mm512_sub_ps(bf16_to_fp32(sz + LANES), _mm512_mul_ps(_mm512_set1_ps(8.0f), group_s));
      }
    } else {
      const uint8_t* p = w + b * INT8_BLOCK_BYTES;
      for (int j = 0; j < STEPS; ++j) weights[j] = _mm512_loadu_si512(p + j * 64);
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* q = reinterpret_cast<const int32_t*>(codes + r * K + b * BLOCK);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < STEPS; ++j) dot = _mm512_dpbusd_epi32(dot, weights[j], _mm512_set1_epi32(q[j]));
      const float row_scale = scales[r * B + b];
      if constexpr (INT4) {
        // acc += (a * s) * dot + m * (a * sum of codes): the block's exact dot product, scaled.
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(row_scale), group_s), _mm512_cvtepi32_ps(dot), acc[r]);
        acc[r] = _mm512_fmadd_ps(group_m, _mm512_set1_ps(row_scale * static_cast<float>(sums[r * B + b])), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(row_scale), _mm512_cvtepi32_ps(dot), acc[r]);
        acc_sums[r] += row_scale * static_cast<float>(sums[r * B + b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 result = acc[r];
    if constexpr (!INT4) {
      const float* sm = static_cast<const float*>(scales_zeros);
      result = _mm512_fmadd_ps(_mm512_loadu_ps(sm), result, _mm512_mul_ps(_mm512_loadu_ps(sm + LANES), _mm512_set1_ps(acc_sums[r])));
    }
    _mm512_mask_storeu_ps(out + r * ldo, lanes, result);
  }
}

template <bool INT4>
void tile(const uint8_t* w, const void* scales_zeros, int64_t blocks, int64_t blocks_per_group, const int8_t* codes,
          const float* scales, const int32_t* sums, int64_t T, int64_t K, float* out, int64_t ldo, __mmask16 lanes) {
  const int64_t B = K / BLOCK;
  for (int64_t r0 = 0; r0 < T; r0 += MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(MAX_ROWS, T - r0);
    const int8_t* c = codes + r0 * K;
    const float* sc = scales + r0 * B;
    const int32_t* su = sums + r0 * B;
    float* o = out + r0 * ldo;
#define SPECEE_ROWS(R) \
  case R: tile_rows<R, INT4>(w, scales_zeros, blocks, blocks_per_group, c, sc, su, K, o, ldo, lanes); break;
    switch (rows) {
      SPECEE_ROWS(1) SPECEE_ROWS(2) SPECEE_ROWS(3) SPECEE_ROWS(4)
      SPECEE_ROWS(5) SPECEE_ROWS(6) SPECEE_ROWS(7) SPECEE_ROWS(8)
    }
#undef SPECEE_ROWS
  }
}

}  // namespace

// x [T, K] fp32; packed [N / 16, K / 32, block bytes] uint8 (see tile_rows); scales_zeros: bits 4,
// [N / 16, K / group_size, 2, 16] bf16; bits 8, [N / 16, 2, 16] fp32. Returns [T, N] fp32.
at::Tensor integer_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                          int64_t out_features, int64_t bits, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, K] fp32 contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "in_features must be a multiple of 32");
  const int64_t B = K / BLOCK, tiles = packed.size(0);
  auto codes = at::empty({T, K}, x.options().dtype(at::kChar));
  auto scales = at::empty({T, B}, x.options());
  auto sums = at::empty({T, B}, x.options().dtype(at::kInt));
  quantize_rows_into(x.data_ptr<float>(), T, K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<int32_t>());
  auto out = at::empty({T, out_features}, x.options());
  const int64_t blocks_per_group = bits == 4 ? group_size / BLOCK : 1;
  const int64_t tile_bytes = packed.stride(0);
  const int64_t tile_scales = scales_zeros.stride(0) * scales_zeros.element_size();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint8_t* sz = static_cast<const uint8_t*>(scales_zeros.data_ptr());
  float* o = out.data_ptr<float>();
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  const int32_t* su = sums.data_ptr<int32_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min<int64_t>(LANES, out_features - t * LANES);
      const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1u);
      const uint8_t* wt = w + t * tile_bytes;
      // Ask for the next tile now, so it streams in while this one is multiplied.
      if (t + 1 < end)
        for (int64_t byte = 0; byte < tile_bytes; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(wt + tile_bytes + byte), _MM_HINT_T0);
      if (bits == 4) {
        tile<true>(wt, sz + t * tile_scales, B, blocks_per_group, c, sc, su, T, K, o + t * LANES, out_features, lanes);
      } else {
        tile<false>(wt, sz + t * tile_scales, B, 1, c, sc, su, T, K, o + t * LANES, out_features, lanes);
      }
    }
  });
  return out;
}

namespace {

using Vec = at::vec::Vectorized<float>;

// Attention of one query row of one head over `count` keys, key i at row index(i) of k/v.
template <typename Index>
void attend_one(const float* q, const float* k, const float* v, int64_t head_dim, int64_t count, Index index,
                float scale, float* scores, float* out) {
  const int64_t hd = head_dim;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = k + index(i) * hd;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(key + d), acc);
    scores[i] = _mm512_reduce_add_ps(acc) * scale;
  }
  // Softmax with key i in lane i % 16 of the block i / 16, wherever the keys sit in the cache.
  const int64_t full = count / 16 * 16;
  const int64_t tail = count - full;
  const __mmask16 tail_lanes = static_cast<__mmask16>((1u << tail) - 1u);
  const float lowest = -std::numeric_limits<float>::infinity();
  __m512 vmax = _mm512_set1_ps(lowest);
  for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + i));
  if (tail) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(lowest), tail_lanes, scores + full));
  const float max = _mm512_reduce_max_ps(vmax);
  const Vec vm(max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    __m512 p = (Vec::loadu(scores + i) - vm).exp();
    _mm512_storeu_ps(scores + i, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  if (tail) {
    __m512 p = (Vec(_mm512_mask_loadu_ps(_mm512_set1_ps(lowest), tail_lanes, scores + full)) - vm).exp();
    p = _mm512_maskz_mov_ps(tail_lanes, p);
    _mm512_mask_storeu_ps(scores + full, tail_lanes, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  const float inverse = 1.0f / _mm512_reduce_add_ps(vsum);
  for (int64_t d = 0; d < hd; d += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[i]), _mm512_loadu_ps(v + index(i) * hd + d), acc);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(acc, _mm512_set1_ps(inverse)));
  }
}

}  // namespace

namespace {

// One sequence's share of an attention call: its layer of the cache and which keys its rows see.
struct Segment {
  const float* keys;      // [kv_heads, capacity, hd]
  const float* values;
  int64_t capacity;
  const int64_t* visible;  // row t sees keys 0 .. visible[t] - 1 (when mask is null)
  const uint8_t* mask;     // else: keys before `prefix`, and j >= prefix where mask[t, j - prefix] != 0
  int64_t prefix;
  int64_t num_keys;
  int64_t first_row;       // its first row among the call's rows
};

Segment segment_of(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                   const at::Tensor& tail_mask, int64_t prefix, int64_t num_keys, int64_t first_row) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kFloat, "cache must be fp32 contiguous");
  TORCH_CHECK(keys.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  const bool masked = tail_mask.numel() > 0;
  return {keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(1),
          masked ? nullptr : visible.data_ptr<int64_t>(), masked ? tail_mask.data_ptr<uint8_t>() : nullptr,
          prefix, num_keys, first_row};
}

// Rows of q [T, heads, hd], each of segment `row_segment[t]`, over their visible keys: out [T, heads * hd].
void attend_segments(const float* qp, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd,
                     const std::vector<Segment>& segments, const std::vector<int64_t>& row_segment, float* op) {
  const int64_t group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t most_keys = 0;
  for (const Segment& s : segments) most_keys = std::max(most_keys, s.num_keys);
  at::parallel_for(0, T * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(most_keys + 16);
    std::vector<int64_t> order;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads, g = h / group;
      const Segment& s = segments[row_segment[t]];
      const int64_t row = t - s.first_row;
      const float* k = s.keys + g * s.capacity * hd;
      const float* v = s.values + g * s.capacity * hd;
      const float* qrow = qp + (t * heads + h) * hd;
      float* o = op + t * heads * hd + h * hd;
      if (s.mask == nullptr) {
        attend_one(qrow, k, v, hd, s.visible[row], [](int64_t i) { return i; }, scale, scores.data(), o);
      } else {
        const int64_t tail_len = s.num_keys - s.prefix;
        order.clear();
        for (int64_t j = 0; j < s.prefix; ++j) order.push_back(j);
        for (int64_t j = 0; j < tail_len; ++j)
          if (s.mask[row * tail_len + j]) order.push_back(s.prefix + j);
        const int64_t* idx = order.data();
        attend_one(qrow, k, v, hd, static_cast<int64_t>(order.size()), [idx](int64_t i) { return idx[i]; }, scale,
                   scores.data(), o);
      }
    }
  });
}

// Rotates the queries and keys of T rows of qkv [T, (heads + 2 kv_heads) * hd] (x * cos + swapped
// halves * sin, rounded as those separate operations round), writes the queries to qp [T, heads, hd]
// and the keys and values into one layer of a cache at positions start .. start + T - 1.
void rotate_rows(const float* x, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd, const float* c,
                 const float* sn, float* qp, float* kp, float* vp, int64_t capacity, int64_t start) {
  const int64_t half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * width;
    const float* ct = c + t * hd;
    const float* st = sn + t * hd;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* src = row + h * hd;
      float* dst = h < heads ? qp + (t * heads + h) * hd : kp + ((h - heads) * capacity + start + t) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        const float swapped = src[d < half ? d + half : d - half];
        const float rotated_cos = src[d] * ct[d];
        const float rotated_sin = swapped * st[d];
        dst[d] = rotated_cos + rotated_sin;
      }
    }
    for (int64_t g = 0; g < kv_heads; ++g)
      std::copy(row + (heads + kv_heads + g) * hd, row + (heads + kv_heads + g + 1) * hd, vp + (g * capacity + start + t) * hd);
  }
}

}  // namespace

// q [T, heads, hd] fp32; keys, values [kv_heads, capacity, hd] fp32 (one layer of the cache).
// Row t sees keys 0 .. visible[t] - 1 when `tail_mask` is empty; otherwise keys before `prefix`
// and those j >= prefix with tail_mask[t, j - prefix] != 0, up to `num_keys`. Returns [T, heads * hd].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                     const at::Tensor& tail_mask, int64_t prefix, int64_t num_keys) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "q must be [T, heads, hd] fp32 contiguous");
  const int64_t T = q.size(0), heads = q.size(1), hd = q.size(2);
  auto out = at::empty({T, heads * hd}, q.options());
  const std::vector<Segment> segments{segment_of(keys, values, visible, tail_mask, prefix, num_keys, 0)};
  attend_segments(q.data_ptr<float>(), T, heads, keys.size(0), hd, segments, std::vector<int64_t>(T, 0),
                  out.data_ptr<float>());
  return out;
}

// qkv [T, (heads + 2 kv_heads) * hd] fp32 (a pass's fused projections); cos, sin [T, hd] fp32 (sin's
// first half negated). Rotates queries and keys and writes the keys and values of the T new tokens
// into the layer's cache at positions start..start + T - 1. Returns the rotated queries [T, heads, hd].
at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                            at::Tensor& values, int64_t start, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv must be [T, n] fp32 contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  const int64_t T = qkv.size(0), kv_heads = keys.size(0), capacity = keys.size(1), hd = keys.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv width does not match the heads");
  TORCH_CHECK(start + T <= capacity, "cache too small");
  auto q = at::empty({T, heads, hd}, qkv.options());
  rotate_rows(qkv.data_ptr<float>(), T, heads, kv_heads, hd, cos.data_ptr<float>(), sin.data_ptr<float>(),
              q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), capacity, start);
  return q;
}

// The attention of one layer for the rows of several sequences at once, each with its own cache:
// segment s owns the next rows[s] rows of qkv (and of cos, sin), writes its keys and values into
// keys[s], values[s] from starts[s] on, and its rows see keys as `attention`'s arguments say
// (visible[s], tail_masks[s], prefixes[s], num_keys[s]). Returns [T, heads * hd].
at::Tensor rotate_store_attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                               std::vector<int64_t> starts, std::vector<int64_t> rows,
                               std::vector<at::Tensor> visible, std::vector<at::Tensor> tail_masks,
                               std::vector<int64_t> prefixes, std::vector<int64_t> num_keys, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv must be [T, n] fp32 contiguous");
  const size_t n = keys.size();
  TORCH_CHECK(values.size() == n && starts.size() == n && rows.size() == n && visible.size() == n &&
              tail_masks.size() == n && prefixes.size() == n && num_keys.size() == n, "one entry per segment");
  const int64_t T = qkv.size(0), kv_heads = keys[0].size(0), hd = keys[0].size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv width does not match the heads");
  auto q = at::empty({T, heads, hd}, qkv.options());
  auto out = at::empty({T, heads * hd}, qkv.options());
  std::vector<Segment> segments;
  std::vector<int64_t> row_segment;
  int64_t first = 0;
  for (size_t s = 0; s < n; ++s) {
    TORCH_CHECK(starts[s] + rows[s] <= keys[s].size(1), "cache too small");
    segments.push_back(segment_of(keys[s], values[s], visible[s], tail_masks[s], prefixes[s], num_keys[s], first));
    rotate_rows(qkv.data_ptr<float>() + first * qkv.size(1), rows[s], heads, kv_heads, hd,
                cos.data_ptr<float>() + first * hd, sin.data_ptr<float>() + first * hd,
                q.data_ptr<float>() + first * heads * hd, keys[s].data_ptr<float>(), values[s].data_ptr<float>(),
                keys[s].size(1), starts[s]);
    row_segment.insert(row_segment.end(), rows[s], static_cast<int64_t>(s));
    first += rows[s];
  }
  TORCH_CHECK(first == T, "the segments' rows must add up to qkv's");
  attend_segments(q.data_ptr<float>(), T, heads, kv_heads, hd, segments, row_segment, out.data_ptr<float>());
  return out;
}

// x [T, D] fp32, weight [D] fp32: each row times 1 / sqrt(mean(x^2) + eps), then the weight. The
// squares are summed in 16 lanes then across them, per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [T, D] fp32 contiguous");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(D % Vec::size() == 0 && weight.numel() == D, "D must be a multiple of the vector width and match the weight");
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * D;
    Vec squares(0.0f);
    for (int64_t d = 0; d < D; d += Vec::size()) {
      const Vec v = Vec::loadu(row + d);
      squares = squares + v * v;
    }
    const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, squares);
    const Vec inverse(1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps)));
    for (int64_t d = 0; d < D; d += Vec::size())
      ((Vec::loadu(row + d) * inverse) * Vec::loadu(w + d)).store(op + t * D + d);
  }
  return out;
}

// gate_up [T, 2 I] fp32 (gate, then up) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == at::kFloat,
              "gate_up must be [T, 2 I] fp32 contiguous");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % Vec::size() == 0, "I must be a multiple of the vector width");
  auto out = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Vec one(1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; i += Vec::size()) {
      const Vec gate = Vec::loadu(g + t * 2 * I + i);
      ((gate / (one + gate.neg().exp())) * Vec::loadu(g + t * 2 * I + I + i)).store(op + t * I + i);
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is let go while a kernel runs: a server's other threads (its HTTP streams) go on meanwhile.
  const auto free_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rotate_and_store", &rotate_and_store, "rotary embedding of q and k; k and v written into the cache", free_gil);
  m.def("integer_linear", &integer_linear, "int8-activation x 4/8-bit-weight matmul, rows independent", free_gil);
  m.def("attention", &attention, "attention with each row over its visible keys alone", free_gil);
  m.def("rotate_store_attend", &rotate_store_attend, "rotate, store and attend for several sequences' rows at once",
        free_gil);
  m.def("rms_norm", &rms_norm, "RMS norm of each row", free_gil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of each row", free_gil);
}
