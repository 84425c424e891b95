// The torch side of the CPU kernels: `Kernels(library, symbol)` opens one tier's library (tier.cpp
// built with that tier's flags) and exposes its table to Python, checking each tensor and spreading
// the work over PyTorch's threads. Compiled once, for any x86-64 or AArch64 CPU: no ISA flags here.
#include <torch/extension.h>
#include <pybind11/stl_bind.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <omp.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "api.h"

namespace {

using specee::AttentionArgs;
using specee::KernelTable;
using specee::MatmulArgs;
using specee::Segment;

constexpr int64_t LANES = 16;
constexpr int64_t BLOCK = 32;
constexpr int64_t SUPERBLOCK = 256;

void check_format(int64_t bits, int64_t group_size) {
  TORCH_CHECK((bits == 4 && group_size > 0 && group_size % BLOCK == 0) ||
              (bits == 8 && (group_size == 0 || group_size == 16 || group_size == 32)) ||
              (bits == 6 && (group_size == 16 || group_size == 32)) || (bits == 5 && group_size == 32),
              "bits 4 take groups of a multiple of 32 inputs, bits 8 groups of 16 or 32 or none (0), bits 6 groups "
              "of 16 or 32, bits 5 groups of 32; got bits ", bits, " and group size ", group_size);
}

// Which scales a matrix of K inputs has (api.h): superblock records come as bytes (uint8), with
// 6-bit codes, or 4- and 5-bit codes in groups of 32, the record's size saying whether they are
// centered; 5-bit codes otherwise take one fp16 scale per group of 32 (centered), and 8-bit codes
// in groups of 32 either that (centered) or an fp32 scale and offset.
int64_t superblock_kind(const at::Tensor& scales_zeros, int64_t bits, int64_t group_size, int64_t K) {
  const bool records = scales_zeros.scalar_type() == at::kByte;
  TORCH_CHECK(scales_zeros.is_contiguous(), "scales must be contiguous");
  const int64_t per_tile = scales_zeros.numel() / std::max<int64_t>(1, scales_zeros.size(0));
  if (bits == 5 && !records) {
    TORCH_CHECK(scales_zeros.scalar_type() == at::kHalf && group_size == BLOCK && per_tile == K / BLOCK * LANES,
                "5-bit codes take superblock records (uint8) or one fp16 scale per group of 32 and lane");
    return specee::CENTERED_GROUPS;
  }
  if (bits == 8 && scales_zeros.scalar_type() == at::kHalf) {
    TORCH_CHECK(group_size == BLOCK && per_tile == K / BLOCK * LANES,
                "fp16 scales of 8-bit codes are one per group of 32 and lane (centered)");
    return specee::CENTERED_GROUPS;
  }
  TORCH_CHECK(records || bits != 6, "6-bit codes take superblock records (uint8)");
  TORCH_CHECK(!records || bits == 6 || bits == 5 || (bits == 4 && group_size == BLOCK),
              "superblock scales (uint8) are for 5- and 6-bit codes and 4-bit codes in groups of 32");
  if (!records) {  // pairs: an fp32 centered scale (before packed cache v8) must not be read as pairs
    TORCH_CHECK(bits != 8 || (scales_zeros.scalar_type() == at::kFloat &&
                              per_tile == (group_size ? K / group_size : 1) * 2 * LANES),
                "8-bit codes take an fp32 scale and offset per group (or row) and lane, or one fp16 scale per "
                "group of 32 and lane");
    return specee::NO_SUPERBLOCKS;
  }
  TORCH_CHECK(K % SUPERBLOCK == 0, "superblock scales take a multiple of 256 inputs; got ", K);
  const int64_t groups = SUPERBLOCK / group_size;
  if (per_tile == K / SUPERBLOCK * (2 * LANES * 2 + groups * 2 * LANES)) return specee::SUPERBLOCKS;
  TORCH_CHECK(bits == 6 && group_size == LANES && per_tile == K / SUPERBLOCK * (LANES * 2 + groups * LANES),
              "superblock scales do not match ", K, " inputs");
  return specee::CENTERED_SUPERBLOCKS;
}

void check_rows(const at::Tensor& x, int64_t dims, const char* what) {
  TORCH_CHECK(x.dim() == dims && x.is_contiguous() && x.scalar_type() == at::kFloat, what, " must be ", dims,
              "-D fp32 contiguous");
}

// A cache of fp32 or of IEEE halves (fp16), its keys and values alike.
bool half_cache(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == values.scalar_type() &&
              (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "cache must be fp32 or fp16, contiguous");
  return keys.scalar_type() == at::kHalf;
}

Segment segment_of(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                   const at::Tensor& tail_mask, int64_t prefix, int64_t num_keys, int64_t first_row, int64_t window) {
  const bool half = half_cache(keys, values);
  TORCH_CHECK(keys.size(2) % LANES == 0 && keys.size(2) <= 256, "head_dim must be a multiple of 16, at most 256");
  const bool masked = tail_mask.numel() > 0;
  return {keys.data_ptr(), values.data_ptr(), half, keys.size(1),
          masked ? nullptr : visible.data_ptr<int64_t>(), masked ? tail_mask.data_ptr<uint8_t>() : nullptr,
          prefix, num_keys, first_row, window};
}

void check_norm(const at::Tensor& norm, int64_t width, const char* what) {
  TORCH_CHECK(!norm.defined() || (norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == width),
              what, " must be fp32 and match its rows");
}

// An optional norm's weight (an undefined tensor where the model has none).
at::Tensor optional_norm(const std::optional<at::Tensor>& norm) { return norm.value_or(at::Tensor()); }

// One quantized matrix as `integer_linear` takes it (IntegerLinear's tensors), and its bias (or an
// undefined tensor).
struct Matrix {
  at::Tensor packed, scales_zeros;
  int64_t out_features, bits, group_size;
  at::Tensor bias;
  int64_t superblocks;  // superblock_kind
};

// A decoder layer whose parts all run on the kernels: its norms' weights and its four matrices, and
// what sets its architecture apart (llama.py): q/k norms and Gemma's norms of the attention's and
// the MLP's outputs (undefined where absent), a sliding window (0: none), which set of RoPE angles it
// takes, its attention scale, and a GELU gate instead of SiLU.
struct LayerWeights {
  at::Tensor input_norm;
  Matrix qkv, o;
  at::Tensor post_norm;
  Matrix gate_up, down;
  at::Tensor q_norm, k_norm, attention_output_norm, mlp_output_norm;
  double eps;
  int64_t heads, window, rope_index;
  double scale;
  bool gelu;
};

// A tier whose CPU flags are there but that cannot run in this process (KernelTable::unavailable):
// Python's TierUnavailable, which kernels/__init__.py turns into a fallback to the next tier.
struct TierUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

// A list of LayerWeights handed to C++ by reference, not copied at every call.
PYBIND11_MAKE_OPAQUE(std::vector<LayerWeights>)

namespace {

// The steps of a decoder layer in decoder_layers, each ended by a barrier but the last (its rows are
// the same thread's in the next layer's first step).
const std::vector<std::string> LAYER_STEPS = {"norm, quantize", "qkv", "rope, cache", "attention, quantize", "o",
                                              "residual, norm", "gate_up", "gate", "down", "residual"};

// Where decoder_layers' time goes, when asked (benchmarks/pass_profile.py): each thread's seconds at
// work in each step and waiting at the barrier after it, summed over layers and calls. A benchmark's
// tool: the calls it times must not run at once.
struct StepTimes {
  bool on = false;
  int64_t calls = 0;
  std::vector<double> seconds;  // [thread][step][work, wait]
};

class Kernels {
 public:
  Kernels(const std::string& library, const std::string& symbol) {
    // RTLD_LOCAL: two tiers in one process never resolve each other's symbols.
    handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle_ != nullptr, "cannot open ", library, ": ", dlerror());
    auto entry = reinterpret_cast<const KernelTable* (*)()>(dlsym(handle_, symbol.c_str()));
    TORCH_CHECK(entry != nullptr, library, " has no ", symbol);
    table_ = entry();
    TORCH_CHECK(table_->api_version == specee::KERNEL_API_VERSION, library, " is built for another kernel API");
    if (table_->unavailable != nullptr) throw TierUnavailable(table_->unavailable);
  }
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

  std::string tier() const { return table_->tier; }

  // Starts (or stops) timing decoder_layers' steps, from zero.
  void time_steps(bool on) { steps_ = StepTimes{on}; }

  // The seconds timed since: [threads, steps, 2] (work, then the wait at the barrier after it),
  // summed over layers and calls, and the number of calls.
  std::tuple<at::Tensor, int64_t> step_seconds() const {
    const int64_t steps = static_cast<int64_t>(LAYER_STEPS.size());
    const int64_t threads = static_cast<int64_t>(steps_.seconds.size()) / (2 * steps);
    at::Tensor out = at::empty({threads, steps, 2}, at::kDouble);
    std::copy(steps_.seconds.begin(), steps_.seconds.end(), out.data_ptr<double>());
    return {out, steps_.calls};
  }

  // x [T, K] fp32; packed [N / 16, K / 32 * block bytes] uint8; scales_zeros: bits 4,
  // [N / 16, K / group_size, 2, 16] bf16 or superblock records, uint8; bits 8 and group_size 0,
  // [N / 16, 2, 16] fp32; bits 8 and group_size 16 or 32, [N / 16, K / group_size, 2, 16] fp32;
  // bits 6, superblock records, uint8, or [N / 16, K / 32, 16] fp32 (api.h). Returns [T, N] fp32.
  at::Tensor integer_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                            int64_t out_features, int64_t bits, int64_t group_size) const {
    check_rows(x, 2, "x");
    check_format(bits, group_size);
    const int64_t T = x.size(0), K = x.size(1);
    TORCH_CHECK(K % BLOCK == 0, "in_features must be a multiple of 32");
    const int64_t B = K / BLOCK, tiles = packed.size(0);
    TORCH_CHECK(packed.is_contiguous() && scales_zeros.is_contiguous() && tiles * LANES >= out_features,
                "packed weights do not match out_features");
    const int64_t block_bytes = LANES * BLOCK * bits / 8;
    TORCH_CHECK(packed.size(1) == B * block_bytes, "x has ", K, " features; the matrix takes ",
                packed.size(1) / block_bytes * BLOCK);
    auto codes = at::empty({T, K}, x.options().dtype(at::kChar));
    auto scales = at::empty({T, B}, x.options());
    auto sums = at::empty({T, 2 * B}, x.options().dtype(at::kInt));
    table_->quantize_rows(x.data_ptr<float>(), T, K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                          sums.data_ptr<int32_t>());
    auto out = at::empty({T, out_features}, x.options());
    const int64_t superblocks = superblock_kind(scales_zeros, bits, group_size, K);
    const MatmulArgs args{packed.data_ptr<uint8_t>(), packed.stride(0), static_cast<const uint8_t*>(scales_zeros.data_ptr()),
                          scales_zeros.stride(0) * scales_zeros.element_size(), bits, group_size, superblocks,
                          out_features, T, K,
                          codes.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<int32_t>(),
                          out.data_ptr<float>()};
    std::atomic<int64_t> next{0};
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { tiles_in_runs(args, tiles, threads, next); });
    return out;
  }

  // q [T, heads, hd] fp32; keys, values [kv_heads, capacity, hd] fp32 (one layer of the cache).
  // Row t sees keys 0 .. visible[t] - 1 when `tail_mask` is empty; otherwise keys before `prefix`
  // and those j >= prefix with tail_mask[t, j - prefix] != 0, up to `num_keys`. Returns [T, heads * hd].
  // window > 0: each row sees only the last `window` of those keys. Scores are q . k times `scale`.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                       const at::Tensor& tail_mask, int64_t prefix, int64_t num_keys, int64_t window, double scale) const {
    check_rows(q, 3, "q");
    const int64_t T = q.size(0);
    auto out = at::empty({T, q.size(1) * q.size(2)}, q.options());
    attend({segment_of(keys, values, visible, tail_mask, prefix, num_keys, 0, window)}, std::vector<int64_t>(T, 0), q,
           keys.size(0), scale, out);
    return out;
  }

  // qkv [T, (heads + 2 kv_heads) * hd] fp32 (a pass's fused projections); cos, sin [T, hd] fp32
  // (sin's first half negated). Rotates queries and keys and writes the keys and values of the T
  // new tokens into the layer's cache at start .. start + T - 1. Returns the queries [T, heads, hd].
  at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                              at::Tensor& values, int64_t start, int64_t heads) const {
    check_rows(qkv, 2, "qkv");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
    const int64_t T = qkv.size(0), kv_heads = keys.size(0), hd = keys.size(2);
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv width does not match the heads");
    TORCH_CHECK(start + T <= keys.size(1), "cache too small");
    auto q = at::empty({T, heads, hd}, qkv.options());
    rotate(qkv, 0, T, cos, sin, heads, q, keys, values, start);
    return q;
  }

  // The attention of one layer for the rows of several sequences at once, each with its own cache:
  // segment s owns the next rows[s] rows of qkv (and of cos, sin), writes its keys and values into
  // keys[s], values[s] from starts[s] on, and its rows see keys as `attention`'s arguments say
  // (visible[s], tail_masks[s], prefixes[s], num_keys[s], window, scale). Returns [T, heads * hd].
  at::Tensor rotate_store_attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                                 std::vector<int64_t> starts, std::vector<int64_t> rows,
                                 std::vector<at::Tensor> visible, std::vector<at::Tensor> tail_masks,
                                 std::vector<int64_t> prefixes, std::vector<int64_t> num_keys, int64_t heads,
                                 int64_t window, double scale) const {
    check_rows(qkv, 2, "qkv");
    const size_t n = keys.size();
    TORCH_CHECK(n > 0 && values.size() == n && starts.size() == n && rows.size() == n && visible.size() == n &&
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
      TORCH_CHECK(keys[s].is_contiguous() && values[s].is_contiguous(), "cache must be contiguous");
      TORCH_CHECK(first + rows[s] <= T, "the segments' rows must add up to qkv's");
      segments.push_back(segment_of(keys[s], values[s], visible[s], tail_masks[s], prefixes[s], num_keys[s], first,
                                    window));
      rotate(qkv, first, rows[s], cos, sin, heads, q, keys[s], values[s], starts[s]);
      row_segment.insert(row_segment.end(), rows[s], static_cast<int64_t>(s));
      first += rows[s];
    }
    TORCH_CHECK(first == T, "the segments' rows must add up to qkv's");
    attend(segments, row_segment, q, kv_heads, scale, out);
    return out;
  }

  // x [T, D] fp32, weight [D] fp32: each row times 1 / sqrt(mean(x^2) + eps), then the weight.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) const {
    check_rows(x, 2, "x");
    TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == x.size(1),
                "the weight must be [D] fp32 and match x");
    auto out = at::empty_like(x);
    table_->rms_norm(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), static_cast<float>(eps),
                     out.data_ptr<float>());
    return out;
  }

  // Decoder layers first .. last - 1 of `stack` for the T rows h [T, D] of one or more sequences,
  // each h + attention(norm(h)), then + the MLP of its norm (Gemma: each output normed before its
  // sum), with the kernels and the adds its parts run one by one (so the same bits), all in one
  // parallel region: the threads meet at barriers between steps instead of being woken for each.
  // Sequence s owns the next rows[s] rows of h (and of cos, sin) and its own cache keys[s],
  // values[s] [layers, kv_heads, capacity, hd]; every layer writes its positions starts[s] ..
  // starts[s] + rows[s] - 1, which its rows see as `attention`'s visible, tail_mask, prefix and
  // num_keys say (and the layer's window). cos, sin: [T, R * hd], a layer taking the hd columns of
  // its rope_index. Returns [T, D].
  at::Tensor decoder_layers(const std::vector<LayerWeights>& stack, int64_t first, int64_t last, const at::Tensor& h,
                            const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& rows_of, const std::vector<at::Tensor>& visible,
                            const std::vector<at::Tensor>& tail_masks, const std::vector<int64_t>& prefixes,
                            const std::vector<int64_t>& num_keys) const {
    check_rows(h, 2, "h");
    TORCH_CHECK(0 <= first && first < last && last <= static_cast<int64_t>(stack.size()), "no such layers");
    const size_t n_seq = keys.size();
    TORCH_CHECK(n_seq > 0 && values.size() == n_seq && starts.size() == n_seq && rows_of.size() == n_seq &&
                visible.size() == n_seq && tail_masks.size() == n_seq && prefixes.size() == n_seq &&
                num_keys.size() == n_seq, "one entry per sequence");
    const int64_t T = h.size(0), D = h.size(1), kv_heads = keys[0].size(1), hd = keys[0].size(3);
    // Row t belongs to sequence row_segment[t] and writes its cache at position row_position[t].
    std::vector<int64_t> row_segment, row_position;
    for (size_t s = 0; s < n_seq; ++s) {
      const at::Tensor& k = keys[s];
      TORCH_CHECK(k.dim() == 4 && k.sizes() == values[s].sizes() && half_cache(k, values[s]) == half_cache(keys[0], values[0]) &&
                  last <= k.size(0) && k.size(1) == kv_heads && k.size(3) == hd,
                  "each cache must be [layers, kv, S, hd], all fp32 or all fp16");
      TORCH_CHECK(starts[s] + rows_of[s] <= k.size(2) && num_keys[s] <= k.size(2), "cache too small");
      TORCH_CHECK(tail_masks[s].numel() ? tail_masks[s].size(0) == rows_of[s] : visible[s].numel() == rows_of[s],
                  "one visibility per row");
      for (int64_t r = 0; r < rows_of[s]; ++r) {
        row_segment.push_back(static_cast<int64_t>(s));
        row_position.push_back(starts[s] + r);
      }
    }
    TORCH_CHECK(static_cast<int64_t>(row_segment.size()) == T, "the sequences' rows must add up to h's");
    check_rows(cos, 2, "cos");
    check_rows(sin, 2, "sin");
    TORCH_CHECK(cos.size(0) == T && cos.size(1) % hd == 0 && sin.sizes() == cos.sizes(), "cos and sin must be [T, R * hd]");
    const int64_t angle_sets = cos.size(1) / hd;
    const LayerWeights& w0 = stack[first];
    const int64_t heads = w0.heads, I = w0.gate_up.out_features / 2;
    for (int64_t l = first; l < last; ++l) {
      check_layer(stack[l], D, I, heads, kv_heads, hd);
      TORCH_CHECK(stack[l].rope_index < angle_sets, "layer ", l, " takes RoPE angles set ", stack[l].rope_index);
    }
    const auto f = h.options();
    at::Tensor x = h.clone(), normed = at::empty({T, D}, f), qkv = at::empty({T, w0.qkv.out_features}, f);
    at::Tensor q = at::empty({T, heads, hd}, f), attended = at::empty({T, heads * hd}, f), mixed = at::empty({T, D}, f);
    at::Tensor gate_up = at::empty({T, 2 * I}, f), gated = at::empty({T, I}, f);
    const int64_t widest = std::max({D, heads * hd, I});
    at::Tensor codes = at::empty({T, widest}, f.dtype(at::kChar)), scales = at::empty({T, widest / BLOCK}, f);
    at::Tensor sums = at::empty({T, 2 * widest / BLOCK}, f.dtype(at::kInt));
    // Rows b .. e - 1 of `rows` as int8 blocks, into codes, scales, sums (laid out as for all T rows).
    auto quantized = [&](const at::Tensor& rows, int64_t b, int64_t e) {
      const int64_t K = rows.size(1), B = K / BLOCK;
      table_->quantize_rows(rows.data_ptr<float>() + b * K, e - b, K, codes.data_ptr<int8_t>() + b * K,
                            scales.data_ptr<float>() + b * B, sums.data_ptr<int32_t>() + 2 * b * B);
    };
    // Columns c .. c + width - 1 (whole blocks) of row t of `rows`, quantized (laid out as for all T rows).
    auto quantized_columns = [&](const at::Tensor& rows, int64_t t, int64_t c, int64_t width) {
      const int64_t K = rows.size(1), B = K / BLOCK, block = t * B + c / BLOCK;
      table_->quantize_rows(rows.data_ptr<float>() + t * K + c, 1, width, codes.data_ptr<int8_t>() + t * K + c,
                            scales.data_ptr<float>() + block, sums.data_ptr<int32_t>() + 2 * block);
    };
    // Rows b .. e - 1 normed into `normed`, then quantized.
    auto normalized = [&](const at::Tensor& rows, const at::Tensor& weight, double eps, int64_t b, int64_t e) {
      table_->rms_norm(rows.data_ptr<float>() + b * D, e - b, D, weight.data_ptr<float>(), static_cast<float>(eps),
                       normed.data_ptr<float>() + b * D);
      quantized(normed, b, e);
    };
    auto norm_in_place = [](float* rows, int64_t count, int64_t width, const at::Tensor& weight, double eps,
                            const KernelTable* table) {  // where the layer has this norm
      if (weight.defined()) table->rms_norm(rows, count, width, weight.data_ptr<float>(), static_cast<float>(eps), rows);
    };
    auto matmul = [&](const Matrix& m, int64_t K, at::Tensor& out) {
      return MatmulArgs{m.packed.data_ptr<uint8_t>(), m.packed.stride(0), static_cast<const uint8_t*>(m.scales_zeros.data_ptr()),
                        m.scales_zeros.stride(0) * m.scales_zeros.element_size(), m.bits, m.group_size,
                        m.superblocks, m.out_features, T, K, codes.data_ptr<int8_t>(),
                        scales.data_ptr<float>(), sums.data_ptr<int32_t>(), out.data_ptr<float>()};
    };
    auto add_bias = [](at::Tensor& rows, const Matrix& m, int64_t b, int64_t e) {  // rows b .. e - 1 + bias
      if (!m.bias.defined()) return;
      const int64_t N = m.out_features;
      float* r = rows.data_ptr<float>();
      const float* bias = m.bias.data_ptr<float>();
      for (int64_t i = b * N; i < e * N; ++i) r[i] = r[i] + bias[i % N];
    };
    // Columns c .. c + width - 1 of row t + the bias's.
    auto add_bias_columns = [](at::Tensor& rows, const Matrix& m, int64_t t, int64_t c, int64_t width) {
      if (!m.bias.defined()) return;
      float* r = rows.data_ptr<float>() + t * m.out_features;
      const float* bias = m.bias.data_ptr<float>();
      for (int64_t i = c; i < c + width; ++i) r[i] = r[i] + bias[i];
    };
    // Rows b .. e - 1: into = h + added, as `h + ...` adds (`into` may be either).
    auto residual = [D](const at::Tensor& h, const at::Tensor& added, at::Tensor& into, int64_t b, int64_t e) {
      const float* a = h.data_ptr<float>();
      const float* c = added.data_ptr<float>();
      float* o = into.data_ptr<float>();
      for (int64_t i = b * D; i < e * D; ++i) o[i] = a[i] + c[i];
    };
    auto tiles = [](const MatmulArgs& a) { return (a.out_features + LANES - 1) / LANES; };
    // Each matrix of a layer its own count of the tiles taken (tiles_in_runs).
    const int64_t matrices = 4 * (last - first);
    std::unique_ptr<std::atomic<int64_t>[]> next_tile(new std::atomic<int64_t>[matrices]);
    for (int64_t i = 0; i < matrices; ++i) next_tile[i].store(0, std::memory_order_relaxed);
    // Each layer's view of every sequence's cache.
    const int64_t most_keys = *std::max_element(num_keys.begin(), num_keys.end());
    std::vector<std::vector<Segment>> layer_segments;
    std::vector<void*> layer_keys, layer_values;  // [layer - first][s]: where rotate_rows writes
    for (int64_t l = first; l < last; ++l) {
      std::vector<Segment> segments;
      int64_t first_row = 0;
      for (size_t s = 0; s < n_seq; ++s) {
        const int64_t capacity = keys[s].size(2), offset = l * kv_heads * capacity * hd;
        const bool masked = tail_masks[s].numel() > 0;
        const int64_t bytes = offset * keys[s].element_size();
        void* k = static_cast<char*>(keys[s].data_ptr()) + bytes;
        void* v = static_cast<char*>(values[s].data_ptr()) + bytes;
        layer_keys.push_back(k);
        layer_values.push_back(v);
        segments.push_back({k, v, keys[s].scalar_type() == at::kHalf, capacity, masked ? nullptr : visible[s].data_ptr<int64_t>(),
                            masked ? tail_masks[s].data_ptr<uint8_t>() : nullptr, prefixes[s], num_keys[s], first_row,
                            stack[l].window});
        first_row += rows_of[s];
      }
      layer_segments.push_back(std::move(segments));
    }
    const int threads = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const int64_t width = (heads + 2 * kv_heads) * hd;
    // keys_before[t]: the keys rows 0 .. t - 1 see (a masked row: counted as all its sequence's).
    std::vector<int64_t> keys_before(T + 1, 0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = row_segment[t];
      const Segment& segment = layer_segments[0][s];
      const int64_t seen = segment.mask ? num_keys[s] : segment.visible[t - segment.first_row];
      keys_before[t + 1] = keys_before[t] + std::max<int64_t>(seen, 1);
    }
    const int64_t STEPS = static_cast<int64_t>(LAYER_STEPS.size());
    const bool timing = steps_.on;
    std::vector<double> local_times(timing ? threads * 2 * STEPS : 0);
#pragma omp parallel num_threads(threads)
    {
      const int64_t id = omp_get_thread_num(), n = omp_get_num_threads();
      auto share = [&](int64_t count, auto&& work) {  // this thread's part of count items
        const int64_t chunk = (count + n - 1) / n, begin = std::min(count, id * chunk), end = std::min(count, begin + chunk);
        if (begin < end) work(begin, end);
      };
      // The steps between the matmuls work row by row: each thread takes its own rows, so none of
      // them is serial in rows (a row's bits never depend on which thread computes it).
      auto rows = [&](auto&& work) { share(T, work); };
      // The steps that work block by block of 32 columns split the T rows' `blocks` blocks each over
      // the threads, as work(row, first column, width) runs: a pass of fewer rows than threads
      // leaves none of them idle there.
      auto row_blocks = [&](int64_t blocks, auto&& work) {
        share(T * blocks, [&](int64_t b, int64_t e) {
          for (int64_t t = b / blocks; t * blocks < e; ++t) {
            const int64_t from = std::max(b, t * blocks) - t * blocks, to = std::min(e, (t + 1) * blocks) - t * blocks;
            work(t, from * BLOCK, (to - from) * BLOCK);
          }
        });
      };
      // Matrix `which` (0-3: qkv, o, gate_up, down) of layer l.
      auto matrix_tiles = [&](const MatmulArgs& args, int64_t l, int64_t which) {
        tiles_in_runs(args, tiles(args), n, next_tile[4 * (l - first) + which]);
      };
      // The end of step `step` of a layer (LAYER_STEPS): its barrier, and its times where asked.
      double* timed = timing ? local_times.data() + id * 2 * STEPS : nullptr;
      double mark = timed ? omp_get_wtime() : 0.0;
      auto step_done = [&](int64_t step) {
        if (timed) {
          const double now = omp_get_wtime();
          timed[2 * step] += now - mark;
          mark = now;
        }
        if (step + 1 == STEPS) return;
#pragma omp barrier
        if (timed) {
          const double now = omp_get_wtime();
          timed[2 * step + 1] += now - mark;
          mark = now;
        }
      };
      for (int64_t l = first; l < last; ++l) {
        const LayerWeights& w = stack[l];
        const std::vector<Segment>& segments = layer_segments[l - first];
        void* const* k = layer_keys.data() + (l - first) * n_seq;
        void* const* v = layer_values.data() + (l - first) * n_seq;
        const AttentionArgs attention{q.data_ptr<float>(), T, heads, kv_heads, hd, most_keys,
                                      static_cast<float>(w.scale), segments.data(), row_segment.data(),
                                      attended.data_ptr<float>()};
        const MatmulArgs qkv_args = matmul(w.qkv, D, qkv), o_args = matmul(w.o, heads * hd, mixed);
        const MatmulArgs gate_up_args = matmul(w.gate_up, D, gate_up), down_args = matmul(w.down, I, normed);
        rows([&](int64_t b, int64_t e) { normalized(x, w.input_norm, w.eps, b, e); });
        step_done(0);
        matrix_tiles(qkv_args, l, 0);
        step_done(1);
        rows([&](int64_t b, int64_t e) {
          add_bias(qkv, w.qkv, b, e);
          for (int64_t t = b; t < e; ++t) {  // each query and key head's norm, as Attention.normed_heads
            norm_in_place(qkv.data_ptr<float>() + t * width, heads, hd, w.q_norm, w.eps, table_);
            norm_in_place(qkv.data_ptr<float>() + t * width + heads * hd, kv_heads, hd, w.k_norm, w.eps, table_);
          }
          const int64_t angles = w.rope_index * hd, stride = cos.size(1);
          for (int64_t t = b; t < e; ++t) {  // each row into its own sequence's cache
            const int64_t s = row_segment[t];
            table_->rotate_rows(qkv.data_ptr<float>() + t * width, 1, heads, kv_heads, hd,
                                cos.data_ptr<float>() + t * stride + angles, sin.data_ptr<float>() + t * stride + angles,
                                stride, q.data_ptr<float>() + t * heads * hd, k[s], v[s], segments[s].half,
                                segments[s].capacity, row_position[t]);
          }
        });
        step_done(2);
        // Items b .. e - 1 (item (g T + t) group + j: row t's head g group + j), then, where a head's
        // outputs fill whole blocks, those blocks quantized for the o matmul by the same thread: no
        // barrier between the two (a block's codes are the same whoever quantizes it).
        const int64_t group = heads / kv_heads;
        const bool heads_in_blocks = hd % BLOCK == 0;
        auto attend_items = [&](int64_t b, int64_t e) {
          table_->attend(attention, b, e);
          if (heads_in_blocks)
            for (int64_t i = b; i < e; ++i)
              quantized_columns(attended, i / group % T, (i / (T * group) * group + i % group) * hd, hd);
        };
        if (T < n) {  // fewer rows than threads: the items split evenly
          share(T * heads, attend_items);
        } else {  // the items (kv group first) in runs that see about as many keys (a prefill's row t sees t more than row 0)
          auto item_at = [&](int64_t part) {  // the first item at or after part / n of the keys
            const int64_t target = kv_heads * keys_before[T] * part / n, g = target / keys_before[T];
            const int64_t t = std::lower_bound(keys_before.begin(), keys_before.end(), target % keys_before[T]) -
                              keys_before.begin();
            return std::min(g * T + t, kv_heads * T) * group;
          };
          const int64_t b = id == 0 ? 0 : item_at(id), e = id + 1 == n ? T * heads : item_at(id + 1);
          if (b < e) attend_items(b, e);
        }
        if (!heads_in_blocks) {
#pragma omp barrier
          row_blocks(heads * hd / BLOCK,
                     [&](int64_t t, int64_t c, int64_t width) { quantized_columns(attended, t, c, width); });
        }
        step_done(3);
        matrix_tiles(o_args, l, 1);
        step_done(4);
        rows([&](int64_t b, int64_t e) {
          add_bias(mixed, w.o, b, e);
          norm_in_place(mixed.data_ptr<float>() + b * D, e - b, D, w.attention_output_norm, w.eps, table_);
          residual(x, mixed, mixed, b, e);  // the attention's residual sum
          normalized(mixed, w.post_norm, w.eps, b, e);
        });
        step_done(5);
        matrix_tiles(gate_up_args, l, 2);
        step_done(6);
        row_blocks(I / BLOCK, [&](int64_t t, int64_t c, int64_t width) {
          add_bias_columns(gate_up, w.gate_up, t, c, width);  // the gate's columns
          add_bias_columns(gate_up, w.gate_up, t, I + c, width);  // and the up projection's
          (w.gelu ? table_->gelu_mul : table_->silu_mul)(gate_up.data_ptr<float>() + t * 2 * I, 1, I, c, width,
                                                         gated.data_ptr<float>() + t * I);
          quantized_columns(gated, t, c, width);
        });
        step_done(7);
        matrix_tiles(down_args, l, 3);
        step_done(8);
        rows([&](int64_t b, int64_t e) {
          add_bias(normed, w.down, b, e);
          norm_in_place(normed.data_ptr<float>() + b * D, e - b, D, w.mlp_output_norm, w.eps, table_);
          // The MLP's residual sum, the layer's output, into x: each thread's rows are its own in
          // the next layer's first step too, so no barrier is needed before it.
          residual(mixed, normed, x, b, e);
        });
        step_done(9);
      }
    }
    if (timing) {
      if (steps_.seconds.size() < local_times.size()) steps_.seconds.resize(local_times.size(), 0.0);
      for (size_t i = 0; i < local_times.size(); ++i) steps_.seconds[i] += local_times[i];
      ++steps_.calls;
    }
    return x;
  }

  // gate_up [T, 2 I] fp32 (gate, then up) -> silu(gate) * up [T, I].
  at::Tensor silu_mul(const at::Tensor& gate_up) const { return gated(gate_up, table_->silu_mul); }

  // gate_up [T, 2 I] fp32 (gate, then up) -> gelu(gate) * up [T, I] (GELU's tanh form).
  at::Tensor gelu_mul(const at::Tensor& gate_up) const { return gated(gate_up, table_->gelu_mul); }

 private:
  // The tiles 0 .. count - 1 of a matmul on `threads` threads, each calling this: each thread takes
  // the next run from `next` as it comes, a run half an equal share of the tiles left, down to one
  // tile at the end. So a thread that runs slower (a busier memory channel, a core the system
  // shares) takes fewer, where equal shares had the others wait for it, and the threads end within
  // a tile of each other. A tile's bits never depend on which thread computes it.
  void tiles_in_runs(const MatmulArgs& args, int64_t count, int64_t threads, std::atomic<int64_t>& next) const {
    int64_t b = next.load(std::memory_order_relaxed);
    while (b < count) {
      const int64_t run = std::max<int64_t>(1, (count - b) / (2 * threads));
      if (!next.compare_exchange_weak(b, b + run, std::memory_order_relaxed)) continue;  // (b: the count now)
      table_->matmul_tiles(args, b, std::min(count, b + run));
      b = next.load(std::memory_order_relaxed);
    }
  }

  static void check_layer(const LayerWeights& w, int64_t D, int64_t I, int64_t heads, int64_t kv_heads, int64_t hd) {
    TORCH_CHECK(w.heads == heads && w.qkv.out_features == (heads + 2 * kv_heads) * hd && w.o.out_features == D &&
                w.gate_up.out_features == 2 * I && w.down.out_features == D, "the layer's matrices do not fit together");
    for (const Matrix* m : {&w.qkv, &w.o, &w.gate_up, &w.down})
      TORCH_CHECK(!m->bias.defined() || (m->bias.scalar_type() == at::kFloat && m->bias.is_contiguous() &&
                                         m->bias.numel() == m->out_features), "a bias must be fp32 and match its matrix");
    for (const at::Tensor* norm : {&w.input_norm, &w.post_norm})
      TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == D,
                  "the norms must be fp32 and match h");
    check_norm(w.attention_output_norm, D, "the attention's output norm");
    check_norm(w.mlp_output_norm, D, "the MLP's output norm");
    check_norm(w.q_norm, hd, "the query norm");
    check_norm(w.k_norm, hd, "the key norm");
  }

  at::Tensor gated(const at::Tensor& gate_up,
                   void (*gate)(const float*, int64_t, int64_t, int64_t, int64_t, float*)) const {
    check_rows(gate_up, 2, "gate_up");
    TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
    const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
    auto out = at::empty({T, I}, gate_up.options());
    gate(gate_up.data_ptr<float>(), T, I, 0, I, out.data_ptr<float>());
    return out;
  }

  void rotate(const at::Tensor& qkv, int64_t first, int64_t T, const at::Tensor& cos, const at::Tensor& sin,
              int64_t heads, at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start) const {
    const int64_t kv_heads = keys.size(0), hd = keys.size(2);
    check_rows(cos, 2, "cos");
    check_rows(sin, 2, "sin");
    TORCH_CHECK(cos.size(1) == hd && sin.sizes() == cos.sizes() && cos.size(0) >= first + T, "cos and sin must be [T, hd]");
    table_->rotate_rows(qkv.data_ptr<float>() + first * qkv.size(1), T, heads, kv_heads, hd,
                        cos.data_ptr<float>() + first * hd, sin.data_ptr<float>() + first * hd, hd,
                        q.data_ptr<float>() + first * heads * hd, keys.data_ptr(), values.data_ptr(),
                        half_cache(keys, values), keys.size(1), start);
  }

  void attend(const std::vector<Segment>& segments, const std::vector<int64_t>& row_segment, const at::Tensor& q,
              int64_t kv_heads, double scale, at::Tensor& out) const {
    const int64_t T = q.size(0), heads = q.size(1);
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    int64_t most_keys = 0;
    for (const Segment& s : segments) {
      most_keys = std::max(most_keys, s.num_keys);
      TORCH_CHECK(s.half == segments[0].half, "the caches of one call must be all fp32 or all fp16");
    }
    const AttentionArgs args{q.data_ptr<float>(), T, heads, kv_heads, q.size(2), most_keys, static_cast<float>(scale),
                             segments.data(), row_segment.data(), out.data_ptr<float>()};
    at::parallel_for(0, T * heads, 1, [&](int64_t begin, int64_t end) { table_->attend(args, begin, end); });
  }

  mutable StepTimes steps_;
  void* handle_ = nullptr;  // never closed: tensors' kernels may run until the process ends
  const KernelTable* table_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is let go while a kernel runs: a server's other threads (its HTTP streams) go on meanwhile.
  const auto free_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  pybind11::register_exception<TierUnavailable>(m, "TierUnavailable", PyExc_RuntimeError);
  pybind11::class_<Matrix>(m, "Matrix");
  pybind11::class_<LayerWeights>(m, "LayerWeights");
  pybind11::bind_vector<std::vector<LayerWeights>>(m, "LayerStack");
  pybind11::class_<Kernels>(m, "Kernels")
      .def(pybind11::init<const std::string&, const std::string&>(), "open one tier's kernel library")
      .def_property_readonly("tier", &Kernels::tier)
      .def_property_readonly_static("layer_steps", [](pybind11::object) { return LAYER_STEPS; })
      .def("time_steps", &Kernels::time_steps, "start (or stop) timing decoder_layers' steps, from zero")
      .def("step_seconds", &Kernels::step_seconds,
           "seconds at work and waiting after each step of decoder_layers' layers [threads, steps, 2], and the calls timed")
      .def("rotate_and_store", &Kernels::rotate_and_store, "rotary embedding of q and k; k and v written into the cache",
           free_gil)
      .def("integer_linear", &Kernels::integer_linear, "int8-activation x 4/8-bit-weight matmul, rows independent",
           free_gil)
      .def("attention", &Kernels::attention, "attention with each row over its visible keys alone", free_gil)
      .def("rotate_store_attend", &Kernels::rotate_store_attend,
           "rotate, store and attend for several sequences' rows at once", free_gil)
      .def("rms_norm", &Kernels::rms_norm, "RMS norm of each row", free_gil)
      .def("silu_mul", &Kernels::silu_mul, "silu(gate) * up of each row", free_gil)
      .def("gelu_mul", &Kernels::gelu_mul, "gelu(gate) * up of each row (tanh form)", free_gil)
      .def("decoder_layers", &Kernels::decoder_layers, "consecutive decoder layers for one sequence's rows", free_gil)
      .def("matrix", [](const Kernels&, at::Tensor packed, at::Tensor scales_zeros, int64_t out_features, int64_t bits,
                        int64_t group_size, std::optional<at::Tensor> bias) {
        check_format(bits, group_size);
        const int64_t K = packed.size(1) / (LANES * bits / 8);
        const int64_t superblocks = superblock_kind(scales_zeros, bits, group_size, K);
        return Matrix{packed, scales_zeros, out_features, bits, group_size, bias.value_or(at::Tensor()), superblocks};
      }, "a quantized matrix as decoder_layers takes it")
      .def("layer_weights", [](const Kernels&, at::Tensor input_norm, Matrix qkv, Matrix o, at::Tensor post_norm,
                               Matrix gate_up, Matrix down, std::optional<at::Tensor> q_norm,
                               std::optional<at::Tensor> k_norm, std::optional<at::Tensor> attention_output_norm,
                               std::optional<at::Tensor> mlp_output_norm, double eps, int64_t heads, int64_t window,
                               int64_t rope_index, double scale, bool gelu) {
        return LayerWeights{input_norm, qkv, o, post_norm, gate_up, down, optional_norm(q_norm), optional_norm(k_norm),
                            optional_norm(attention_output_norm), optional_norm(mlp_output_norm), eps, heads, window,
                            rope_index, scale, gelu};
      }, "a decoder layer as decoder_layers takes it")
      .def("layer_stack", [](const Kernels&, const pybind11::list& layers) {
        std::vector<LayerWeights> stack;
        for (const auto& layer : layers) stack.push_back(layer.cast<LayerWeights>());
        return stack;
      }, "the layers decoder_layers runs, in order");
}
