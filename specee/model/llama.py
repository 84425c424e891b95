"""A Llama-family decoder whose pieces strategies can call one by one; the other families it runs
(Qwen 2 and 3, Mistral, Gemma 3) differ by the named fields of `LlamaConfig`.

Parameter names follow Hugging Face (`model.` prefix dropped), except that q/k/v and gate/up
are stored fused (`qkv_proj`, `gate_up_proj`, as in vLLM) so a batch-1 step runs one matmul
where HF runs three: the loader concatenates them. Gemma's four norms of a layer keep Llama's
two names for the norms before attention and before the MLP (`input_layernorm`,
`post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`); its norms of the two outputs are
`attention_output_norm` (Gemma's `post_attention_layernorm`) and `mlp_output_norm`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import weight_bytes as byte_counts
from .attention_bias import AttentionBias
from .cache import KVCache, SpareBuffers
from .config import LlamaConfig
from .passes import LayerRows, PassRows, Segment, fusable, run_fused
from .rope import AngleTable, RopeAngles, angles_rows, apply_rope, inverse_frequencies, rope_angles
from .thread_governor import governed


class RMSNorm(nn.Module):
    kernels = None  # the CPU kernels' one-call norm for fp32 rows; set by `kernel_install.with_kernels`

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and not x.requires_grad:
            return self.kernels.rms_norm(x.contiguous(), self.weight, self.eps)  # no gradient: training uses PyTorch's
        # One fused op; bit-identical to HF's formula in fp32 (bf16 rounds once, not twice).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    # The CPU kernels (`kernels/`): rotary embedding and cache write in one call, then attention in
    # which each row walks its visible keys as a one-row call would. Set by `kernel_install.with_kernels`.
    kernels = None
    # Without the kernels, quantized formats (whose matrices give a row the same bits whatever the
    # rows beside it) attend with each new row alone, at T attention calls a pass.
    rows_alone = False

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.layer_window(layer_index)  # a sliding layer's keys per row; None: all
        self.rope_index = config.rope_index(layer_index)
        self.scale = config.attention_scale
        qkv_dim = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # Qwen 3, Gemma 3: each query and key head RMS-normed before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, angles: RopeAngles, cache: KVCache | list[Segment],
                mask: torch.Tensor | AttentionBias | None = None) -> torch.Tensor:
        """x [T, hidden] are one sequence's new rows (its `cache`, `mask`), or the rows of several
        sequences one after another (`cache`: their segments), each attending to its own keys only."""
        qkv = self.normed_heads(self.qkv_proj(x))  # [T, (nh + 2 nkv) hd]
        angles = angles.for_layer(self.rope_index)
        if isinstance(cache, list):
            return self.o_proj(self._attend_segments(qkv, angles, cache).to(x.dtype))
        T = len(x)
        bias = mask if isinstance(mask, AttentionBias) else AttentionBias(mask, T, self.num_heads // self.num_kv_heads)
        if self.kernels is None:  # a KVCache, or training's growing keys
            return self.o_proj(self._attend_eager(qkv, angles, cache, bias).to(x.dtype))
        start, keys, values = cache.extend(self.layer_index, T)
        q = self.kernels.rotate_and_store(qkv.float().contiguous(), *angles_rows(angles, T), keys, values, start,
                                          self.num_heads)
        return self.o_proj(self.kernels.attention(q, keys, values, *bias.for_kernel(start + T), self.window or 0,
                                                  self.scale).to(x.dtype))

    def normed_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (nh + 2 nkv) hd] with each query and key head RMS-normed (where the model has q/k
        norms): rows of head_dim, so the kernels' norm takes them as it takes a layer's rows."""
        if self.q_norm is None:
            return qkv
        T, nh, nkv, hd = len(qkv), self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, : nh * hd].reshape(T * nh, hd)).reshape(T, nh * hd)
        k = self.k_norm(qkv[:, nh * hd : (nh + nkv) * hd].reshape(T * nkv, hd)).reshape(T, nkv * hd)
        return torch.cat((q, k, qkv[:, (nh + nkv) * hd :]), dim=1)

    def _attend_segments(self, qkv: torch.Tensor, angles: RopeAngles, segments: list[Segment]) -> torch.Tensor:
        """Each sequence attends to its own cache; on the kernels, all in one call. Returns [T, nh * hd]."""
        if self.kernels is not None:
            return self._attend_kernels(qkv, angles, segments)
        out, start = [], 0
        for segment in segments:
            rows = slice(start, start + segment.rows)
            out.append(self._attend_eager(qkv[rows], RopeAngles(angles.cos[rows], angles.sin[rows]), segment.cache,
                                          segment.bias))
            start = rows.stop
        return torch.cat(out)

    def _attend_kernels(self, qkv: torch.Tensor, angles: RopeAngles, segments: list[Segment]) -> torch.Tensor:
        """Every sequence's rotation, cache writes and attention in one kernel call (the same maths as
        rotate_and_store then attention, sequence by sequence): [T, nh * hd]."""
        spans = [segment.cache.extend(self.layer_index, segment.rows) for segment in segments]  # (start, keys, values)
        starts, keys, values = zip(*spans)
        seen = zip(*(segment.bias.for_kernel(start + segment.rows) for segment, start in zip(segments, starts)))
        return self.kernels.rotate_store_attend(qkv.float().contiguous(), *angles_rows(angles, len(qkv)), keys, values,
                                                starts, [segment.rows for segment in segments], *seen, self.num_heads,
                                                self.window or 0, self.scale)

    def _attend_eager(self, qkv: torch.Tensor, angles: RopeAngles, cache: KVCache, bias: AttentionBias) -> torch.Tensor:
        """One sequence's attention on PyTorch's kernels: rotate, store, attend. Returns [T, nh * hd]."""
        T = qkv.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        group = nh // nkv
        qk = apply_rope(qkv[:, : (nh + nkv) * hd].view(T, nh + nkv, hd), angles)
        v = qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
        keys, values = cache.append(self.layer_index, qk[:, nh:], v)  # [nkv, S, hd]
        if (self.rows_alone and T > 1) or (T == 1 and self.window and bias.mask is None):
            return self._rows_alone(qk[:, :nh], keys, values, bias)
        # Query heads sharing a kv head become rows of one matrix: no repeated K/V.
        q = qk[:, :nh].reshape(T, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * T, hd)
        attn_mask = bias.for_keys(keys.shape[1], keys.dtype, qkv.device, self.window)  # [group * T, S] or None
        # 4-D inputs select PyTorch's fused CPU attention kernel (3-D falls back to plain maths).
        out = F.scaled_dot_product_attention(q.to(keys.dtype)[None], keys[None], values[None], attn_mask=attn_mask,
                                             scale=self.scale)
        return out[0].view(nkv, group, T, hd).permute(2, 0, 1, 3).reshape(T, nh * hd)

    def _rows_alone(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: AttentionBias
                    ) -> torch.Tensor:
        """Each row of q [T, nh, hd] attends alone, with the call a one-token pass makes: its visible
        keys as a view of the cache, or gathered in order when a tree hides some (the same values, the
        same result); a sliding layer's row its last `window` visible keys. Returns [T, nh * hd]."""
        nkv, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // nkv
        out = []
        for row, visible in zip(q, bias.visible_keys(keys.shape[1], keys.device)):
            if isinstance(visible, int):
                first = max(0, visible - self.window) if self.window else 0
                k, v = keys[:, first:visible], values[:, first:visible]
            else:
                visible = visible[-self.window :] if self.window else visible
                k, v = keys.index_select(1, visible), values.index_select(1, visible)
            attended = F.scaled_dot_product_attention(row.view(nkv, group, hd).to(keys.dtype)[None], k[None], v[None],
                                                      scale=self.scale)
            out.append(attended.reshape(1, -1))
        return torch.cat(out)

    def write_kv(self, x: torch.Tensor, angles: RopeAngles, cache: KVCache) -> None:
        """Append the keys and values of inputs x [T, hidden] without attending."""
        T = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        angles = angles.for_layer(self.rope_index)
        if self.kernels is not None:  # the keys rotated and rounded exactly as a pass writes them
            start, keys, values = cache.extend(self.layer_index, T)
            self.kernels.rotate_and_store(self.normed_heads(self.qkv_proj(x)).float().contiguous(),
                                          *angles_rows(angles, T), keys, values, start, nh)
            return
        kv = self.normed_heads(self.qkv_proj(x))[:, nh * hd :]
        k = apply_rope(kv[:, : nkv * hd].view(T, nkv, hd), angles)
        cache.append(self.layer_index, k, kv[:, nkv * hd :].view(T, nkv, hd))


class MLP(nn.Module):
    kernels = None  # the CPU kernels' one-call gate for fp32 rows; set by `kernel_install.with_kernels`

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32 and not gate_up.requires_grad:
            return self.down_proj(self.kernels.gelu_mul(gate_up) if self.gelu else self.kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # before the MLP
        self.mlp = MLP(config)
        sandwich = config.sandwich_norms  # Gemma: the attention's and the MLP's outputs normed before their sums
        self.attention_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    # The layer as one kernel call, where every part runs on the kernels (`kernel_install.with_kernels`):
    # (kernels, the model's LayerStack, this layer's index in it).
    fused = None

    def forward(self, h: torch.Tensor, angles: RopeAngles, cache: KVCache | list[Segment],
                mask: torch.Tensor | AttentionBias | None = None) -> torch.Tensor:
        if self.fused is not None and h.dim() == 2 and not h.requires_grad:
            kernels, stack, index = self.fused
            if isinstance(cache, KVCache):
                group = self.self_attn.num_heads // self.self_attn.num_kv_heads
                bias = mask if isinstance(mask, AttentionBias) else AttentionBias(mask, len(h), group)
                return run_fused(kernels, stack, range(index, index + 1), h, angles, [Segment(cache, bias, len(h))])
            if all(isinstance(segment.cache, KVCache) for segment in cache):  # several sequences' rows
                return run_fused(kernels, stack, range(index, index + 1), h, angles, cache)
        attended = self.self_attn(self.input_layernorm(h), angles, cache, mask)
        h = h + (attended if self.attention_output_norm is None else self.attention_output_norm(attended))
        mixed = self.mlp(self.post_attention_layernorm(h))
        return h + (mixed if self.mlp_output_norm is None else self.mlp_output_norm(mixed))

    @property
    def norms(self) -> list[RMSNorm]:
        """The layer's norms of hidden_size, in the order a pass applies them."""
        sandwich = (self.attention_output_norm, self.mlp_output_norm)
        return [n for n in (self.input_layernorm, sandwich[0], self.post_attention_layernorm, sandwich[1]) if n is not None]

    def write_kv(self, h: torch.Tensor, angles: RopeAngles, cache: KVCache) -> None:
        """Append the K/V this layer would compute if `h` were its input, without running it."""
        self.self_attn.write_kv(self.input_layernorm(h), angles, cache)


class Transformer(nn.Module):
    """The pieces: embed(ids), layers[i](h, angles, cache, mask), norm(h), logits(h, rows)."""

    # What one more row of a pass costs, as a fraction of a one-token pass: speculation sizes its
    # drafts by it. Dense weights read once for all rows (BENCHMARKS.md, "Multi-row cost per
    # format"); the quantized formats set their own.
    extra_row_cost = 0.03
    fused_stack = None  # (kernels, LayerStack): every layer as kernel calls (`kernel_install.with_kernels`)
    # The CPU cache's element: fp32, or fp16 on the kernels (`loader.load_parts`'s kv_cache_dtype).
    kv_cache_dtype = torch.float32
    thread_governor = None  # how many threads a pass runs on (thread_governor.py), where several

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Given an (uninitialised) weight, the embedding skips its random init: the loader assigns the
        # real one, and a normal_ on the meta device costs seconds of one-off setup.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.angle_table: AngleTable | None = None  # angles() builds it

    @property
    def kernels(self):
        """specee's compiled CPU kernels where passes run on them (`kernel_install.with_kernels`), else None."""
        return self.layers[0].self_attn.kernels

    @property
    def uses_kernels(self) -> bool:
        return self.kernels is not None

    @property
    def rows_exact(self) -> bool:
        """Whether a row of a multi-row pass has the bits it has alone (the CPU kernels; fp32), so
        greedy speculation gives dense decoding's tokens. bf16 passes round by their row count."""
        return self.uses_kernels or self.dtype == torch.float32

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (norms stay in it when the matrices are quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, max_len: int, capacity: int | None = None, spares: SpareBuffers | None = None) -> KVCache:
        """A cache for up to `max_len` positions, `capacity` of them allocated now (default all), in
        buffers from `spares` where it keeps a pair that fits."""
        c = self.config
        # On CPU attention runs in fp32 even for bf16 weights (PyTorch's CPU bf16 attention kernels
        # are several times slower at batch 1), on a cache of fp32 or, on the kernels, fp16.
        dtype = self.kv_cache_dtype if self.device.type == "cpu" else self.dtype
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, dtype, self.device, capacity,
                       spares)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden]; Gemma's embeddings scaled by sqrt(hidden_size), rounded to the dtype first as HF does."""
        multiplier = self.config.embedding_multiplier
        rows = self.embed_tokens(ids)
        return rows if multiplier == 1.0 else rows * torch.tensor(multiplier, dtype=rows.dtype)

    def angles(self, positions: torch.Tensor) -> RopeAngles:
        """RoPE angles for one pass; `positions` [T] are absolute token positions. On the CPU they
        are read from a table of the positions so far (rebuilt if the frequencies or dtype change)."""
        if positions.device.type != "cpu":
            return rope_angles(self.inv_freq, positions, self.dtype)
        table = self.angle_table
        if table is None or table.inv_freq is not self.inv_freq or table.dtype != self.dtype:
            table = self.angle_table = AngleTable(self.inv_freq, self.dtype)
        return table.angles(positions)

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """h: [T, hidden] (already normed). `rows` picks vocabulary entries: [T, len(rows)]."""
        if rows is None:
            return self.lm_head(h)
        return F.linear(h, self.head_rows(rows))

    def head_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the output head's weight [len(rows), hidden] in the model's dtype. A quantized
        head dequantizes them exactly, so sliced logits skip the kernel's bf16 rounding."""
        dequantize = getattr(self.lm_head, "dequantize", None)
        return self.lm_head.weight[rows] if dequantize is None else dequantize(rows).to(self.dtype)

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Weight bytes one pass streams in, as stored (`weight_bytes.weight_bytes`)."""
        return byte_counts.weight_bytes(self)

    def layers_bytes(self, layers: range) -> int:
        """Weight bytes of the decoder layers `layers` (matrices and norms, as stored)."""
        return byte_counts.layers_bytes(self, layers)

    @property
    def multiply_adds_per_byte(self) -> float:
        """One row's multiply-adds over the weight bytes a pass reads (`quantize.mark_quantized`)."""
        return byte_counts.multiply_adds_per_byte(self)

    @property
    def head_bytes(self) -> int:
        """Weight bytes of the final norm and the output head, read by every pass that scores tokens."""
        return byte_counts.head_bytes(self)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None,
               layers: range | None = None) -> torch.Tensor:
        """Embed `ids` and run them through `layers` (all by default); returns [T, hidden]."""
        return self.run_layers(self.embed(ids), positions, cache, mask, layers)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None,
                   layers: range | None = None) -> torch.Tensor:
        """Run states [T, hidden] (embeddings, or the output of earlier layers) through `layers`."""
        angles = self.angles(positions)
        c = self.config
        bias = AttentionBias(mask, h.shape[0], c.num_attention_heads // c.num_key_value_heads)
        layers = layers if layers is not None else range(len(self.layers))
        if (self.fused_stack is not None and isinstance(cache, KVCache) and h.dim() == 2 and not h.requires_grad
                and len(layers) and layers.step == 1 and fusable(cache, layers)):
            return run_fused(*self.fused_stack, layers, h, angles, [Segment(cache, bias, len(h))])
        for i in layers:
            h = self.layers[i](h, angles, cache, bias)
        return h

    def run_layer(self, rows: LayerRows) -> torch.Tensor:
        """One layer over one sequence's rows (a pass run layer by layer)."""
        return self.layers[rows.layer](rows.h, rows.angles, rows.cache, rows.bias)

    def sharing(self) -> tuple[int, int]:
        """A generation run on the model directly shares its passes with nobody."""
        return 0, 0

    def sharing_next(self) -> tuple[int, int]:
        return 0, 0

    def run_pass(self, part: PassRows) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's pass: its last layer's states [T, hidden] and the logits of its rows from
        `logits_from` on."""
        with governed(self.thread_governor, len(part.ids)):
            hidden = self.hidden(part.ids, part.positions, part.cache, part.mask)
            scored = hidden[part.logits_from :]
            return hidden, self.logits(self.norm(scored)) if len(scored) else hidden.new_empty(0, self.config.vocab_size)

    def prefill(self, ids: list[int], cache: KVCache, shallow_layers: int | None = None, start: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run a prompt (from position `start`, the cache holding the positions before it) through
        the model; returns the logits after its last token [1, vocab], the last layer's states of
        every token run [len(ids), hidden] (feature drafters) and, when `shallow_layers` is given,
        the states after that many layers (self-drafters that share the target's shallow layers),
        taken on the way."""
        positions = torch.arange(start, start + len(ids), device=self.device)
        split = shallow_layers or 0
        shallow = self.hidden(torch.tensor(ids, device=self.device), positions, cache, layers=range(split))
        h = self.run_layers(shallow, positions, cache, layers=range(split, self.config.num_hidden_layers))
        return self.logits(self.norm(h[-1:])), h, shallow if shallow_layers else None

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The default loop over the pieces: logits [T, vocab] for every new token."""
        return self.logits(self.norm(self.hidden(ids, positions, cache, mask)))
