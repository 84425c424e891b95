"""Model configuration, with fields named exactly like Hugging Face `config.json` keys.

One decoder runs every supported architecture; what sets the families apart is a few named fields
(as in Hugging Face's and mlx-lm's per-family classes):
- Qwen 2: biases on q, k and v (`attention_bias`);
- Qwen 3: an RMS norm of each query and key head before RoPE (`qk_norm`);
- Mistral: sliding-window attention on every layer (`sliding_window`);
- Gemma 3: q/k norms, norms on the attention's and the MLP's outputs too (`sandwich_norms`), a GELU
  gate (`hidden_act`), embeddings times sqrt(hidden_size) (`embedding_multiplier`), attention scaled
  by `query_pre_attn_scalar`, sliding-window attention on five layers of six with their own RoPE
  base (`layer_types`, `rope_local_base_freq`), and norm weights used as 1 + w (the loader folds the 1
  into the weights: `norm_offset`).
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

# Hugging Face model types (Gemma 3's text-only checkpoints: 270M and 1B).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
GEMMA_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v bias, as in Qwen2
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"
    qk_norm: bool = False  # Qwen 3, Gemma 3
    sandwich_norms: bool = False  # Gemma
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0
    query_pre_attn_scalar: float | None = None  # None: head_dim
    sliding_window: int | None = None  # keys a sliding layer's row sees, itself included
    layer_types: list[str] | None = None  # per layer, SLIDING or FULL; None: every layer FULL
    rope_local_base_freq: float | None = None  # the sliding layers' RoPE base, where it differs (Gemma 3)
    extra: dict = field(default_factory=dict, repr=False)  # keys we keep but do not use

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                                 f"{self.num_hidden_layers} layers")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")

    @property
    def norm_offset(self) -> float:
        """What Hugging Face's weights of every RMS norm lack: Gemma multiplies by 1 + w."""
        return 1.0 if self.model_type in GEMMA_TYPES else 0.0

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q . k by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """How many keys (the last ones, itself included) a row of `layer` sees; None: all."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def rope_bases(self) -> int:
        """How many sets of RoPE frequencies the layers use (Gemma 3: global and local)."""
        return 2 if self.rope_local_base_freq is not None else 1

    def rope_index(self, layer: int) -> int:
        """Which set of RoPE frequencies `layer` rotates by (`rope.inverse_frequencies`)."""
        return 1 if self.rope_bases == 2 and self.layer_window(layer) is not None else 0

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(key) is not None:
                raise ValueError(f"{key} is not supported")
        if model_type == "qwen2":
            d.setdefault("attention_bias", True)
        if model_type in ("qwen3", *GEMMA_TYPES):
            d.setdefault("qk_norm", True)
        if model_type in GEMMA_TYPES:
            d.setdefault("sandwich_norms", True)
            d.setdefault("hidden_act", d.pop("hidden_activation", "gelu_pytorch_tanh"))
            if d.get("hidden_size"):
                d.setdefault("embedding_multiplier", math.sqrt(d["hidden_size"]))
            d.setdefault("query_pre_attn_scalar", 256)
        _read_rope_parameters(d)
        _read_layer_types(d, model_type)
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if d.get(name) is None]
        if missing:
            raise ValueError(f"the model config lacks required field(s) {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**{k: v for k, v in d.items() if k in known}, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        try:
            config = json.loads(Path(path).read_text())
            if not isinstance(config, dict):
                raise ValueError("expected a JSON object")
            return cls.from_dict(config)
        except ValueError as e:  # bad JSON too
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def _read_rope_parameters(d: dict) -> None:
    """Newer transformers versions nest rope settings under rope_parameters, per layer type where
    the types differ (Gemma 3)."""
    rope = d.pop("rope_parameters", None)
    if not rope:
        return
    if FULL in rope:
        local = rope.get(SLIDING, {})
        rope = rope[FULL]
        if local.get("rope_theta") not in (None, rope.get("rope_theta")):
            d.setdefault("rope_local_base_freq", local["rope_theta"])
    d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        d.setdefault("rope_scaling", rope)


def _read_layer_types(d: dict, model_type: str) -> None:
    """Which layers slide, where config.json says so only in older keys."""
    if d.get("layer_types") is not None or not d.get("num_hidden_layers"):
        return
    layers = d["num_hidden_layers"]
    if model_type == "mistral" and d.get("sliding_window"):
        d["layer_types"] = [SLIDING] * layers
    elif model_type in ("qwen2", "qwen3") and d.get("use_sliding_window") and d.get("sliding_window"):
        first = d.get("max_window_layers", layers)
        d["layer_types"] = [SLIDING if i >= first else FULL for i in range(layers)]
    elif model_type in GEMMA_TYPES:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        d["layer_types"] = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
