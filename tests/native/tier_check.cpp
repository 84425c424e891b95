// Checks one CPU tier of specee's kernels against the portable tier, bit for bit: the same random
// inputs (a fixed seed) through both tables, every output compared with memcmp, and the bytes after
// each output left as they were. No torch, no dependencies: the NEON tier builds with a cross
// compiler and runs under qemu (tests/test_kernel_tiers_native.py builds and runs it).
//
// Both tiers are tier.cpp compiled to an object with that tier's flags, and linked statically into
// this program with it:
//
//   c++ -c <tier.cpp's flags, -c for -shared> -DSPECEE_TIER=neon '-DSPECEE_VEC_HEADER="vec_neon.h"'
//       -Dspecee=specee_neon -I specee/model/kernels specee/model/kernels/tier.cpp -o neon.o
//   (the same for portable, -Dspecee=specee_portable)
//   c++ -std=c++17 -DTIER_UNDER_TEST=neon -I specee/model/kernels tests/native/tier_check.cpp
//       neon.o portable.o -o tier_check
//
// -Dspecee=specee_<tier> matters: kernels.h and the vector headers are inline functions, emitted
// once per object as COMDAT (weak) symbols named after their namespace; two objects in one static
// link would share one copy of each (table() included, whose function-local static table is then
// the first caller's), and the tier under test would run the portable code, or the other way round.
// The renamed namespaces keep two copies; the table functions are extern "C", so their names stay
// specee_kernel_table_<tier>. The check "tables" fails when the two tables are one.
//
// Prints one line per failed case, then `N passed, M failed`; exits 0 iff none failed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api.h"

#ifndef TIER_UNDER_TEST
#error "build with -DTIER_UNDER_TEST=<tier> (neon, avx2, avxvnni, avx512, amx)"
#endif

#define CHECK_PASTE(a, b) a##b
#define CHECK_TABLE(tier) CHECK_PASTE(specee_kernel_table_, tier)
#define CHECK_STRING(x) #x
#define CHECK_NAME(x) CHECK_STRING(x)

extern "C" const specee::KernelTable* CHECK_TABLE(TIER_UNDER_TEST)();
extern "C" const specee::KernelTable* specee_kernel_table_portable();

namespace {

using specee::AttentionArgs;
using specee::KernelTable;
using specee::MatmulArgs;
using specee::Segment;

const KernelTable* tested = nullptr;
const KernelTable* portable = nullptr;
int passed = 0, failed = 0;

// ---- inputs -------------------------------------------------------------------------------------

struct Random {
  std::mt19937 engine;
  explicit Random(uint32_t seed) : engine(seed) {}
  // [0, 1) in steps of 2^-24, from the engine's bits alone (no library distribution).
  float unit() { return static_cast<float>(engine() >> 8) * (1.0f / 16777216.0f); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * unit(); }
  // Roughly normal: the sum of four uniforms, centred, times `scale`.
  float normal(float scale = 1.0f) { return (unit() + unit() + unit() + unit() - 2.0f) * 1.7320508f * scale; }
  // Magnitudes 2^lo .. 2^hi, either sign.
  float wide(int lo, int hi) {
    const int e = lo + static_cast<int>(engine() % static_cast<uint32_t>(hi - lo + 1));
    const float m = std::ldexp(1.0f + unit(), e);
    return engine() & 1 ? -m : m;
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(engine() % static_cast<uint32_t>(n)); }
  uint8_t byte() { return static_cast<uint8_t>(engine() >> 24); }
};

std::vector<float> normals(Random& rng, int64_t n, float scale) {
  std::vector<float> v(n);
  for (float& x : v) x = rng.normal(scale);
  return v;
}

// IEEE halves of either sign, magnitudes 2^-6 .. 2^4 (a cache of halves' keys and values).
std::vector<uint16_t> halves(Random& rng, int64_t n) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v)
    x = static_cast<uint16_t>((rng.engine() & 1u) << 15 | (9u + rng.engine() % 11u) << 10 | (rng.engine() & 0x3ffu));
  return v;
}

// ---- comparing ----------------------------------------------------------------------------------

constexpr int64_t GUARD = 64;         // elements after each output that no kernel may write
constexpr uint8_t SENTINEL = 0x5b;    // their bytes, and every output's before the call

// An output of n elements and its guard, every byte SENTINEL.
template <typename T>
std::vector<T> output(int64_t n) {
  std::vector<T> v(n + GUARD);
  std::memset(v.data(), SENTINEL, v.size() * sizeof(T));
  return v;
}

std::string hex_bits(const void* p, size_t size) {
  uint64_t bits = 0;
  std::memcpy(&bits, p, size);
  char text[32];
  std::snprintf(text, sizeof text, "0x%0*llx", static_cast<int>(2 * size), static_cast<unsigned long long>(bits));
  return text;
}

std::string describe(float x) {
  char text[48];
  std::snprintf(text, sizeof text, "%.9g (%s)", x, hex_bits(&x, 4).c_str());
  return text;
}
std::string describe(int8_t x) { return std::to_string(x); }
std::string describe(uint16_t x) { return hex_bits(&x, 2); }
std::string describe(int32_t x) { return std::to_string(x); }

// One case: its outputs compared; the first difference of each named.
struct Case {
  std::string name;
  std::string problems;

  explicit Case(std::string case_name) : name(std::move(case_name)) {}

  void fail(const std::string& problem) { problems += (problems.empty() ? "" : "; ") + problem; }

  // `a` from the tier under test, `b` from the portable one, n elements each plus their guards.
  template <typename T>
  void same(const char* what, const std::vector<T>& a, const std::vector<T>& b, int64_t n) {
    if (static_cast<int64_t>(a.size()) != n + GUARD || static_cast<int64_t>(b.size()) != n + GUARD) {
      fail(std::string(what) + ": the harness sized its buffers wrong");
      return;
    }
    if (std::memcmp(a.data(), b.data(), n * sizeof(T)) != 0) {
      int64_t i = 0, differ = 0;
      while (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) ++i;
      for (int64_t j = 0; j < n; ++j) differ += std::memcmp(&a[j], &b[j], sizeof(T)) != 0;
      fail(std::string(what) + ": " + std::to_string(differ) + " of " + std::to_string(n) + " differ, first [" +
           std::to_string(i) + "] " + CHECK_NAME(TIER_UNDER_TEST) + " " + describe(a[i]) + " portable " +
           describe(b[i]));
    }
    std::vector<uint8_t> untouched(GUARD * sizeof(T), SENTINEL);
    if (std::memcmp(a.data() + n, untouched.data(), untouched.size()) != 0)
      fail(std::string(what) + ": " + CHECK_NAME(TIER_UNDER_TEST) + " wrote past the end");
    if (std::memcmp(b.data() + n, untouched.data(), untouched.size()) != 0)
      fail(std::string(what) + ": portable wrote past the end");
  }

  void finish() {
    if (problems.empty()) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED %s: %s\n", name.c_str(), problems.c_str());
    }
  }
};

// ---- the tables ---------------------------------------------------------------------------------

void check_tables() {
  Case c("tables");
  if (tested == portable || tested->quantize_rows == portable->quantize_rows ||
      tested->matmul_tiles == portable->matmul_tiles || tested->attend == portable->attend ||
      tested->silu_mul == portable->silu_mul)
    c.fail("the two tables share code: both tiers' kernels were linked as one (see the build note at the top)");
  if (tested->api_version != specee::KERNEL_API_VERSION || portable->api_version != specee::KERNEL_API_VERSION)
    c.fail("api_version is not KERNEL_API_VERSION");
  if (std::string(tested->tier) != CHECK_NAME(TIER_UNDER_TEST))
    c.fail(std::string("the table under test names itself ") + tested->tier);
  if (std::string(portable->tier) != "portable") c.fail(std::string("the portable table names itself ") + portable->tier);
  c.finish();
}

// ---- quantize_rows ------------------------------------------------------------------------------

void check_quantize(const std::string& name, const std::vector<float>& x, int64_t T, int64_t K) {
  Case c("quantize_rows " + name + " T=" + std::to_string(T) + " K=" + std::to_string(K));
  const int64_t B = K / 32;
  auto codes_a = output<int8_t>(T * K), codes_b = output<int8_t>(T * K);
  auto scales_a = output<float>(T * B), scales_b = output<float>(T * B);
  auto sums_a = output<int32_t>(2 * T * B), sums_b = output<int32_t>(2 * T * B);
  tested->quantize_rows(x.data(), T, K, codes_a.data(), scales_a.data(), sums_a.data());
  portable->quantize_rows(x.data(), T, K, codes_b.data(), scales_b.data(), sums_b.data());
  c.same("codes", codes_a, codes_b, T * K);
  c.same("scales", scales_a, scales_b, T * B);
  c.same("sums", sums_a, sums_b, 2 * T * B);
  c.finish();
}

void check_quantize_all(Random& rng) {
  const int64_t shapes[][2] = {{1, 32}, {3, 64}, {4, 576}, {9, 1536}};
  for (const auto& shape : shapes) {
    const int64_t T = shape[0], K = shape[1];
    std::vector<float> x;
    x = normals(rng, T * K, 3.0f);
    check_quantize("normal", x, T, K);
    // Each block its own magnitude, 2^-20 .. 2^20, one row of zeros, and one zero block.
    for (int64_t b = 0; b < T * K / 32; ++b) {
      const float scale = std::ldexp(1.0f, static_cast<int>(rng.below(41)) - 20);
      for (int64_t i = 0; i < 32; ++i) x[b * 32 + i] = rng.normal(scale);
    }
    std::fill(x.begin(), x.begin() + K, 0.0f);
    if (T > 1) std::fill(x.begin() + K, x.begin() + K + 32, 0.0f);
    check_quantize("mixed magnitudes and zeros", x, T, K);
    std::fill(x.begin(), x.end(), 0.0f);
    check_quantize("zeros", x, T, K);
    for (float& v : x) v = rng.wide(100, 127);
    check_quantize("large (2^100 .. 2^127)", x, T, K);
    for (float& v : x) v = rng.wide(-149, -120);
    check_quantize("small and subnormal (2^-149 .. 2^-120)", x, T, K);
    for (float& v : x) v = rng.wide(-140, 127);
    check_quantize("any magnitude (2^-140 .. 2^127)", x, T, K);
    // Integers up to 254 with 254 in each block: scale 2, so every odd one is a tie to round to even.
    for (int64_t i = 0; i < T * K; ++i) x[i] = static_cast<float>(rng.below(509) - 254);
    for (int64_t b = 0; b < T * K / 32; ++b) x[b * 32 + rng.below(32)] = b % 2 ? 254.0f : -254.0f;
    check_quantize("ties", x, T, K);
    x = normals(rng, T * K, 1.0f);
    x[0] = INFINITY;
    x[T * K - 1] = -INFINITY;
    check_quantize("infinities", x, T, K);
  }
}

// ---- matmul_tiles -------------------------------------------------------------------------------

uint16_t bf16_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}

void check_matmul(Random& rng, int64_t bits, int64_t group, int64_t superblocks, int64_t K, int64_t N, int64_t T) {
  Case c("matmul_tiles bits=" + std::to_string(bits) + " group=" + std::to_string(group) +
         (superblocks == 3 ? " centered scales" : superblocks == 2 ? " centered superblock scales"
                           : superblocks ? " superblock scales" : "") +
         " K=" + std::to_string(K) + " N=" + std::to_string(N) + " T=" + std::to_string(T));
  const int64_t B = K / 32, tiles = (N + 15) / 16;
  const int64_t tile_bytes = B * 16 * 32 * bits / 8;
  // bf16 pairs per group (bits 4), fp32 pairs per group (bits 8, grouped) or per row (bits 8, group 0);
  // superblocks (bits 6, or 4 or 5 in groups of 32): per 256 inputs an fp16 pair x16, then an int8 pair
  // x16 per group (centered: one of each).
  // Centered scales (3, bits 5 or 8): one fp32 per group of 32 and lane.
  const bool records = superblocks == 1 || superblocks == 2;
  const int64_t groups_per_superblock = records ? 256 / group : 0, pairs = superblocks == 2 ? 1 : 2;
  const int64_t record = pairs * (16 * 2 + groups_per_superblock * 16);
  const int64_t tile_scale_bytes = superblocks == 3 ? (K / 32) * 16 * 4
                                   : records ? (K / 256) * record
                                   : bits == 4 ? (K / group) * 2 * 16 * 2
                                               : (group ? K / group : 1) * 2 * 16 * 4;
  std::vector<uint8_t> packed(tiles * tile_bytes);
  for (uint8_t& byte : packed) byte = rng.byte();  // any bytes are valid codes
  std::vector<uint8_t> scales_zeros(tiles * tile_scale_bytes);
  if (superblocks == 3) {
    std::vector<float> d(scales_zeros.size() / 4);
    for (float& f : d) f = std::ldexp(1.0f + rng.unit(), -8 - static_cast<int>(rng.below(4)));
    std::memcpy(scales_zeros.data(), d.data(), scales_zeros.size());
  } else if (records) {
    for (int64_t r = 0; r < tiles * K / 256; ++r) {  // [D x16 | M x16] fp16, then [sc x16 | mc x16] int8 per group
      uint8_t* at = scales_zeros.data() + r * record;
      for (int64_t i = 0; i < 16 * pairs; ++i) {
        // D: 2^-12 .. 2^-16, subnormal fp16 below 2^-14; M: either sign, 2^-5 .. 2^-9, or zero.
        const uint16_t mantissa = static_cast<uint16_t>(rng.below(1024));
        const uint16_t half = i < 16 ? static_cast<uint16_t>(rng.below(4) << 10 | mantissa)
                              : rng.below(16) == 0 ? 0
                                                   : static_cast<uint16_t>(rng.below(2) << 15 | (6 + rng.below(5)) << 10 | mantissa);
        std::memcpy(at + 2 * i, &half, 2);
      }
      for (int64_t i = 32 * pairs; i < record; ++i) at[i] = rng.byte();  // any int8 multiplier
    }
  } else if (bits == 4) {
    std::vector<uint16_t> sz(scales_zeros.size() / 2);
    for (int64_t i = 0; i < static_cast<int64_t>(sz.size()); ++i)  // [tile, group, s x16 | z x16]
      sz[i] = bf16_of((i / 16) % 2 == 0 ? std::ldexp(1.0f + rng.unit(), -4 - static_cast<int>(rng.below(8)))
                                         : rng.normal(0.1f));
    std::memcpy(scales_zeros.data(), sz.data(), scales_zeros.size());
  } else {
    std::vector<float> sm(scales_zeros.size() / 4);
    for (int64_t i = 0; i < static_cast<int64_t>(sm.size()); ++i)  // [tile, s x16 | m x16]
      sm[i] = (i / 16) % 2 == 0 ? std::ldexp(1.0f + rng.unit(), -8 - static_cast<int>(rng.below(4))) : rng.normal(0.1f);
    std::memcpy(scales_zeros.data(), sm.data(), scales_zeros.size());
  }
  // Activations: each block its own magnitude, one block of zeros; quantized by the portable tier,
  // so only the matmul differs.
  std::vector<float> x(T * K);
  for (int64_t b = 0; b < T * B; ++b) {
    const float scale = std::ldexp(1.0f, static_cast<int>(rng.below(13)) - 6);
    for (int64_t i = 0; i < 32; ++i) x[b * 32 + i] = rng.normal(scale);
  }
  std::fill(x.end() - 32, x.end(), 0.0f);
  std::vector<int8_t> codes(T * K);
  std::vector<float> scales(T * B);
  std::vector<int32_t> sums(2 * T * B);
  portable->quantize_rows(x.data(), T, K, codes.data(), scales.data(), sums.data());

  auto out_a = output<float>(T * N), out_b = output<float>(T * N);
  MatmulArgs args{packed.data(), tile_bytes, scales_zeros.data(), tile_scale_bytes, bits,
                  group, superblocks, N, T, K, codes.data(), scales.data(), sums.data(), out_a.data()};
  tested->matmul_tiles(args, 0, tiles);
  args.out = out_b.data();
  portable->matmul_tiles(args, 0, tiles);
  c.same("out", out_a, out_b, T * N);
  // Tile by tile, last first (as threads split the work): the same bits again.
  if (tiles > 1) {
    auto out_split = output<float>(T * N);
    args.out = out_split.data();
    for (int64_t t = tiles - 1; t >= 0; --t) tested->matmul_tiles(args, t, t + 1);
    c.same("out, one tile a call", out_split, out_b, T * N);
  }
  c.finish();
}

void check_matmul_all(Random& rng) {
  // bits, group, scales (api.h: 0 pairs per group, 1 and 2 superblock records, 3 centered per group)
  const int64_t configs[][3] = {{4, 32, 0}, {4, 64, 0}, {8, 0, 0}, {8, 32, 0}, {8, 16, 0}, {8, 32, 3},
                                {4, 32, 1}, {5, 32, 1}, {6, 32, 1}, {6, 16, 1}, {6, 16, 2}, {5, 32, 3}};
  for (const auto& config : configs) {
    const bool records = config[2] == 1 || config[2] == 2;  // superblock records span 256 inputs
    for (int64_t K : records ? std::vector<int64_t>{256, 512} : std::vector<int64_t>{32, 64, 576}) {
      if (config[1] && K % config[1] != 0) continue;  // a group must divide K
      for (int64_t N : {8, 40, 48})  // one partial tile; two whole and a half; three whole
        for (int64_t T = 1; T <= 9; ++T) check_matmul(rng, config[0], config[1], config[2], K, N, T);
      // The first rows whose half blocks AMX multiplies (HALF_BLOCK_ROWS), a whole tile of rows, a
      // tile and the rows past it on vpdpbusd or on a second tile (REST_TILE_ROWS), AMX's most rows
      // at once, and chunks of them.
      for (int64_t T : {12, 16, 17, 22, 23, 24, 40, 41}) check_matmul(rng, config[0], config[1], config[2], K, 40, T);
    }
  }
}

// ---- attend -------------------------------------------------------------------------------------

struct SegmentSpec {
  bool tree;         // a mask over the last `rows` keys, else causal
  int64_t past;      // keys before the segment's rows (the tree's prefix)
  int64_t rows;
  int64_t window = 0;  // a sliding layer's: each row sees its last `window` visible keys
};

struct SegmentData {
  std::vector<float> keys, values;
  std::vector<uint16_t> half_keys, half_values;  // a cache of halves instead
  std::vector<int64_t> visible;
  std::vector<uint8_t> mask;
  Segment segment;
};

void check_attend(Random& rng, const std::string& name, int64_t hd, int64_t heads, int64_t kv_heads,
                  const std::vector<SegmentSpec>& specs, float q_scale, bool half = false) {
  Case c("attend " + name + " hd=" + std::to_string(hd) + " heads=" + std::to_string(heads) + "/" +
         std::to_string(kv_heads) + (half ? ", a cache of halves" : ""));
  std::vector<SegmentData> data(specs.size());
  std::vector<Segment> segments;
  std::vector<int64_t> row_segment;
  int64_t rows = 0, most_keys = 0;
  for (size_t s = 0; s < specs.size(); ++s) {
    const SegmentSpec& spec = specs[s];
    SegmentData& d = data[s];
    const int64_t num_keys = spec.past + spec.rows, capacity = num_keys + 5;  // slots past the keys: never read
    d.keys = normals(rng, kv_heads * capacity * hd, 1.0f);
    d.values = normals(rng, kv_heads * capacity * hd, 2.0f);
    if (half) {
      d.half_keys = halves(rng, kv_heads * capacity * hd);
      d.half_values = halves(rng, kv_heads * capacity * hd);
    }
    if (spec.tree) {
      // Each node sees itself and its ancestors (a random tree), and a few other tail keys at random.
      std::vector<int64_t> parent(spec.rows);
      d.mask.assign(spec.rows * spec.rows, 0);
      for (int64_t i = 0; i < spec.rows; ++i) {
        parent[i] = i == 0 ? -1 : rng.below(i + 1) - 1;
        for (int64_t node = i; node >= 0; node = parent[node]) d.mask[i * spec.rows + node] = 1;
        if (rng.below(4) == 0) d.mask[i * spec.rows + rng.below(spec.rows)] = 1;
      }
    } else {
      for (int64_t t = 0; t < spec.rows; ++t) d.visible.push_back(spec.past + t + 1);
    }
    const void* keys = half ? static_cast<const void*>(d.half_keys.data()) : d.keys.data();
    const void* values = half ? static_cast<const void*>(d.half_values.data()) : d.values.data();
    d.segment = {keys, values, half, capacity, spec.tree ? nullptr : d.visible.data(),
                 spec.tree ? d.mask.data() : nullptr, spec.tree ? spec.past : 0, num_keys, rows, spec.window};
    segments.push_back(d.segment);
    row_segment.insert(row_segment.end(), spec.rows, static_cast<int64_t>(s));
    rows += spec.rows;
    most_keys = std::max(most_keys, num_keys);
  }
  const std::vector<float> q = normals(rng, rows * heads * hd, q_scale);
  auto out_a = output<float>(rows * heads * hd), out_b = output<float>(rows * heads * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  AttentionArgs args{q.data(), rows, heads, kv_heads, hd, most_keys, scale, segments.data(), row_segment.data(),
                     out_a.data()};
  tested->attend(args, 0, rows * heads);
  args.out = out_b.data();
  portable->attend(args, 0, rows * heads);
  c.same("out", out_a, out_b, rows * heads * hd);
  // In two calls split mid-row (as threads split the items): the same bits again.
  auto out_split = output<float>(rows * heads * hd);
  args.out = out_split.data();
  const int64_t middle = rows * heads / 2 + 1;
  tested->attend(args, middle, rows * heads);
  tested->attend(args, 0, middle);
  c.same("out, in two calls", out_split, out_b, rows * heads * hd);
  c.finish();
}

void check_attend_all(Random& rng) {
  for (int64_t hd : {64, 128})
    for (int64_t kv_heads : {2, 3}) {
      check_attend(rng, "causal", hd, 6, kv_heads, {{false, 37, 5}}, 1.0f);                   // 38 .. 42 keys
      check_attend(rng, "causal from the first key", hd, 6, kv_heads, {{false, 0, 4}}, 1.0f);  // 1 .. 4 keys
      check_attend(rng, "causal across 16 and 32", hd, 6, kv_heads, {{false, 15, 18}}, 1.0f);  // 16 .. 33 keys
      check_attend(rng, "tree", hd, 6, kv_heads, {{true, 21, 11}}, 1.0f);
      check_attend(rng, "causal and tree", hd, 6, kv_heads, {{false, 29, 3}, {true, 13, 6}}, 1.0f);
      check_attend(rng, "tree and causal, sharp scores", hd, 6, kv_heads, {{true, 40, 7}, {false, 50, 2}}, 12.0f);
      check_attend(rng, "sliding, causal and tree", hd, 6, kv_heads, {{false, 29, 5, 20}, {true, 13, 6, 9}}, 1.0f);
      // More queries of a kv group than one batch takes, over several blocks of 16 keys.
      check_attend(rng, "causal, many rows", hd, 6, kv_heads, {{false, 70, 21}}, 1.0f);
      check_attend(rng, "sliding across blocks", hd, 6, kv_heads, {{false, 60, 9, 37}}, 1.0f);
    }
  check_attend(rng, "causal, one kv head", 256, 4, 1, {{false, 40, 6}, {true, 33, 5}}, 1.0f);  // Gemma 3's shape
  // A cache of halves, widened a block at a time (a block of values is 64 keys at hd 64): causal
  // and tree rows, several segments, a sliding layer, more queries than a batch.
  for (int64_t hd : {64, 256}) {
    check_attend(rng, "causal and tree", hd, 6, 3, {{false, 29, 3}, {true, 13, 6}}, 1.0f, true);
    check_attend(rng, "sliding, causal and tree", hd, 6, 2, {{false, 70, 5, 20}, {true, 13, 6, 9}}, 1.0f, true);
    check_attend(rng, "causal, many rows", hd, 6, 3, {{false, 130, 21}}, 1.0f, true);
  }
}

// ---- rotate_rows, rms_norm, silu_mul, gelu_mul --------------------------------------------------

template <typename E>  // the cache's element: float, or uint16_t (IEEE halves)
void check_rotate(Random& rng, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd) {
  constexpr bool half = sizeof(E) == 2;
  Case c("rotate_rows T=" + std::to_string(T) + " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
         " hd=" + std::to_string(hd) + (half ? ", a cache of halves" : ""));
  const int64_t capacity = 16, start = 7;
  const std::vector<float> qkv = normals(rng, T * (heads + 2 * kv_heads) * hd, 3.0f);
  const int64_t stride = 2 * hd;  // two sets of angles per row (Gemma 3's), the second one taken
  std::vector<float> cos(T * stride), sin(T * stride);
  for (int64_t i = 0; i < T * stride; ++i) {
    const float angle = rng.uniform(-50.0f, 50.0f);
    cos[i] = std::cos(angle);
    sin[i] = (i % hd) < hd / 2 ? -std::sin(angle) : std::sin(angle);
  }
  auto q_a = output<float>(T * heads * hd), q_b = output<float>(T * heads * hd);
  auto k_a = output<E>(kv_heads * capacity * hd), k_b = output<E>(kv_heads * capacity * hd);
  auto v_a = output<E>(kv_heads * capacity * hd), v_b = output<E>(kv_heads * capacity * hd);
  tested->rotate_rows(qkv.data(), T, heads, kv_heads, hd, cos.data() + hd, sin.data() + hd, stride, q_a.data(),
                      k_a.data(), v_a.data(), half, capacity, start);
  portable->rotate_rows(qkv.data(), T, heads, kv_heads, hd, cos.data() + hd, sin.data() + hd, stride, q_b.data(),
                        k_b.data(), v_b.data(), half, capacity, start);
  c.same("q", q_a, q_b, T * heads * hd);
  c.same("keys", k_a, k_b, kv_heads * capacity * hd);
  c.same("values", v_a, v_b, kv_heads * capacity * hd);
  c.finish();
}

void check_rms_norm(const std::string& name, const std::vector<float>& x, const std::vector<float>& weight, int64_t T,
                    int64_t D) {
  Case c("rms_norm " + name + " T=" + std::to_string(T) + " D=" + std::to_string(D));
  auto out_a = output<float>(T * D), out_b = output<float>(T * D);
  tested->rms_norm(x.data(), T, D, weight.data(), 1e-5f, out_a.data());
  portable->rms_norm(x.data(), T, D, weight.data(), 1e-5f, out_b.data());
  c.same("out", out_a, out_b, T * D);
  c.finish();
}

void check_rms_norm_all(Random& rng) {
  for (int64_t D : {576, 72, 8}) {
    const int64_t T = 4;
    const std::vector<float> weight = normals(rng, D, 1.0f);
    std::vector<float> x = normals(rng, T * D, 3.0f);
    std::fill(x.begin() + D, x.begin() + 2 * D, 0.0f);  // a row of zeros: 1 / sqrt(eps)
    check_rms_norm("normal, a row of zeros", x, weight, T, D);
    for (float& v : x) v = rng.wide(-140, 70);  // squares from 0 to infinity
    check_rms_norm("any magnitude (2^-140 .. 2^70)", x, weight, T, D);
  }
}

void check_gate(Random& rng, const std::string& name,
                void (*KernelTable::*gate)(const float*, int64_t, int64_t, int64_t, int64_t, float*), int64_t T,
                int64_t I) {
  Case c(name + " T=" + std::to_string(T) + " I=" + std::to_string(I));
  std::vector<float> gate_up(T * 2 * I);
  for (float& v : gate_up) v = rng.uniform(-100.0f, 100.0f);  // exp's clamps at both ends
  for (int64_t i = 0; i < std::min<int64_t>(I, 8); ++i) gate_up[i] = rng.normal(1.0f);
  auto out_a = output<float>(T * I), out_b = output<float>(T * I);
  (tested->*gate)(gate_up.data(), T, I, 0, I, out_a.data());
  (portable->*gate)(gate_up.data(), T, I, 0, I, out_b.data());
  c.same("out", out_a, out_b, T * I);
  // Some columns of each row (a start and a width off the vector's lanes): those alone, the same bits.
  const int64_t first = I / 5, width = I - I / 5 - I / 7;
  auto part = output<float>(T * I), expected = output<float>(T * I);
  (tested->*gate)(gate_up.data(), T, I, first, width, part.data());
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(expected.data() + t * I + first, out_b.data() + t * I + first, width * sizeof(float));
  const std::string columns = "columns " + std::to_string(first) + " on, " + std::to_string(width) + " of them";
  c.same(columns.c_str(), part, expected, T * I);
  c.finish();
}

}  // namespace

int main() {
  tested = CHECK_TABLE(TIER_UNDER_TEST)();
  portable = specee_kernel_table_portable();
  std::printf("checking the %s tier against the portable one\n", CHECK_NAME(TIER_UNDER_TEST));
  for (const KernelTable* table : {tested, portable})
    if (table->unavailable != nullptr) {  // its other entries must not be called
      std::printf("FAILED the %s tier cannot run here: %s\n0 passed, 1 failed\n", table->tier, table->unavailable);
      return 1;
    }
  check_tables();
  Random rng(20240607);
  check_quantize_all(rng);
  check_matmul_all(rng);
  check_attend_all(rng);
  for (int64_t hd : {64, 128})
    for (int64_t kv_heads : {2, 3}) {
      check_rotate<float>(rng, 5, 6, kv_heads, hd);
      check_rotate<uint16_t>(rng, 5, 6, kv_heads, hd);
    }
  check_rms_norm_all(rng);
  for (int64_t I : {1536, 40, 8}) {
    check_gate(rng, "silu_mul", &KernelTable::silu_mul, 3, I);
    check_gate(rng, "gelu_mul", &KernelTable::gelu_mul, 3, I);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
