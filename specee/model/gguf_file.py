"""What a GGUF file says besides its weights: the model's config (Hugging Face fields), its tensors'
Hugging Face names, and its tokenizer, written once as a small Hugging Face layout directory
(config.json and tokenizer files; the weights are read from the file itself: `gguf_weights.py`)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from .config import LlamaConfig
from .errors import ModelLoadError

# GGUF tensor names -> Hugging Face names ("{i}" is the layer index).
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# Where an architecture's names differ: Gemma's four norms of a layer (its ffn_norm is the norm
# before the MLP, and the names of HF's Gemma classes differ from Llama's).
_ARCHITECTURE_TENSOR_NAMES = {
    "gemma3_text": {
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}
# GGUF architecture -> Hugging Face model type
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# llama.cpp's own settings for Gemma 3, which its files do not store: the sliding layers' RoPE base.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma's chat template (Hugging Face's, for text), for files that carry none: llama.cpp has it built in.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Metadata (under "<architecture>.") without which the model's shape is unknown.
REQUIRED_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")


@functools.cache
def _tensor_names(model_type: str) -> dict[str, str]:
    return {**_TENSOR_NAMES, **_ARCHITECTURE_TENSOR_NAMES.get(model_type, {})}


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """A tensor's Hugging Face name in a file of `model_type` (None: one specee does not read)."""
    names = _tensor_names(model_type)
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = "blk.{i}." + ".".join(parts[2:])
        return names[key].format(i=parts[1]) if key in names else None
    return names.get(gguf_name)


def _field(reader, key: str, default=None):
    return reader.fields.get(key, default)


def read_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ModelLoadError("the GGUF file has no general.architecture: cannot tell what model it holds")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not one specee runs (supported: "
                             f"{', '.join(_ARCHITECTURES)}); nothing was loaded")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    missing = [f"{arch}.{key}" for key in REQUIRED_KEYS if a(key) is None]
    if missing:
        raise ModelLoadError(f"the GGUF file lacks required metadata: {', '.join(missing)}")
    names = {t.name for t in reader.tensors}
    vocab_size = a("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    heads = a("attention.head_count")
    config = {
        "model_type": _ARCHITECTURES[arch],
        "hidden_size": a("embedding_length"),
        "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": a("attention.key_length") or a("rope.dimension_count"),
        "max_position_embeddings": a("context_length", 2048),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": a("rope.freq_base", 10000.0),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if a("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": a("rope.scaling.factor")}
    if arch == "gemma3":
        config["sliding_window"] = a("attention.sliding_window")
        config["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
        # As llama.cpp: 1 / sqrt(head_dim), but for the 27B model's 1 / sqrt(hidden / heads).
        config["query_pre_attn_scalar"] = (config["hidden_size"] // heads if config["num_hidden_layers"] == 62
                                           else config["head_dim"])
    if "rope_freqs.weight" in names:
        # Llama 3.x: llama.cpp's converter bakes the RoPE scaling into one divisor per frequency.
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config["rope_scaling"] = {"rope_type": "frequency_factors",
                                  "factors": np.asarray(factors.data).view(np.float32).tolist()}
    return LlamaConfig.from_dict(config)


def _gemma_turns(reader, config: LlamaConfig, out_dir: Path) -> None:
    """Gemma's chat turns end with <end_of_turn>, which its files do not name as an end token (llama.cpp
    knows it), and some files carry no chat template: both as Hugging Face's Gemma checkpoints have them."""
    from tokenizers import Tokenizer

    end_of_turn = Tokenizer.from_file(str(out_dir / "tokenizer.json")).token_to_id("<end_of_turn>")
    if end_of_turn is not None and end_of_turn not in config.eos_token_ids:
        config.eos_token_id = [*config.eos_token_ids, end_of_turn]
    if _field(reader, "tokenizer.chat_template") is None:
        (out_dir / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head; undo it.
    dim = weight.shape[0] // heads // 2
    return weight.reshape(heads, dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rows(weight, gguf_name: str, config: LlamaConfig):
    """Undo llama.cpp's interleaving of the rotary halves of each q/k head (a row permutation:
    `weight` is any array or tensor whose first axis is the output rows)."""
    if config.model_type == "llama" and ".attn_q." in gguf_name:
        return _unpermute(weight, config.num_attention_heads)
    if config.model_type == "llama" and ".attn_k." in gguf_name:
        return _unpermute(weight, config.num_key_value_heads)
    return weight


def convert_tokenizer(path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))


def open_gguf(path: Path):
    """(reader, config) of a GGUF file, or a ModelLoadError that names the file."""
    from .gguf_reader import GGUFFile

    try:
        reader = GGUFFile(path)
    except Exception as e:  # assorted errors on truncated or corrupt files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    try:
        return reader, read_config(reader)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def write_metadata_directory(path: Path, reader, config: LlamaConfig, out_dir: Path) -> None:
    """config.json and the tokenizer's files of the GGUF file at `path`, in `out_dir`."""
    try:
        convert_tokenizer(path, out_dir)
    except Exception as e:  # a truncated vocabulary surfaces only when it is read
        raise ModelLoadError(f"cannot read the tokenizer of {path} ({type(e).__name__}: {e})") from None
    if config.model_type == "gemma3_text":
        _gemma_turns(reader, config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
