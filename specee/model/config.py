"""Model configuration, with fields named exactly like Hugging Face `config.json` keys."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


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
    extra: dict = field(default_factory=dict, repr=False)  # keys we keep but do not use

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

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
                f"unsupported model_type {model_type!r}: specee runs Llama-family models "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type == "qwen2":
            d.setdefault("attention_bias", True)
        # Newer transformers versions nest rope settings under rope_parameters.
        rope = d.pop("rope_parameters", None)
        if rope:
            d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", rope)
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
