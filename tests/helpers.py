"""Tiny random models and a tiny tokenizer for fast tests, built both as Hugging Face and as specee
models."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specee.model.config import LlamaConfig
from specee.model.cpu_packing import pack_linears
from specee.model.loading import LoadedWeights, build_model
from specee.tokenizer import Tokenizer

TINY = dict(
    hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def tiny_hf_model(seed: int = 0, model_type: str = "llama", **overrides):
    """A randomly initialised HF causal LM (weights scaled up so logits are far from uniform)."""
    import transformers

    settings = {**TINY, **overrides}
    if model_type == "qwen2":
        hf_config = transformers.Qwen2Config(**settings)
        cls = transformers.Qwen2ForCausalLM
    else:
        hf_config = transformers.LlamaConfig(**settings)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def specee_from_hf(hf_model, pack: bool = True, dtype=torch.float32):
    config = LlamaConfig.from_dict(hf_model.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    model = build_model(LoadedWeights(config, state, None), dtype, "cpu")
    return pack_linears(model) if pack else model


def tiny_model(seed: int = 0, pack: bool = True, **overrides):
    """A specee model with random weights (no HF model needed afterwards)."""
    return specee_from_hf(tiny_hf_model(seed, **overrides), pack=pack)


TINY_TOKENIZER_TEXT = [
    "the cat sat on the mat and looked at the dog. " * 3,
    "Hello there, name three colours: red, green, blue. Count from one to ten in words.",
    "one two three four five six seven eight nine ten. Repeat exactly: the red fox.",
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE of 300 tokens with a ChatML template and <|im_end|> as end of sequence:
    the real tokenizer's kind (any text, multi-byte characters split across tokens) at no cost."""
    from tokenizers import Tokenizer as FastTokenizer, decoders, models, pre_tokenizers, trainers

    fast = FastTokenizer(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.train_from_iterator(TINY_TOKENIZER_TEXT, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    fast.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return Tokenizer(directory, eos_token_ids=[])


def tiny_model_directory(directory: Path, seed: int = 0) -> Path:
    """A tiny random model in Hugging Face layout (config.json, safetensors, tokenizer files)."""
    tokenizer = tiny_tokenizer(directory)
    tiny_hf_model(seed, vocab_size=tokenizer.vocab_size).save_pretrained(directory)
    return directory


GGUF_SHAPE = {"embedding_length": 8, "feed_forward_length": 16, "block_count": 1, "attention.head_count": 2}


def write_gguf(path, architecture, metadata, tensor_values: int = 32):
    """A GGUF file with `metadata` (uint32 values under the architecture's prefix) and one tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((tensor_values // 8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test of observed `counts` against `probs`. Cells with probability 0
    must be empty; cells expecting fewer than `min_expected` are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    counts, probs = counts[support], probs[support]
    expected = probs * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(degrees, statistic / 2).item()  # chi-square survival function


def decode(model, strategy, prompt, steps=30, params=None):
    """The first `steps` tokens a strategy commits after `prompt` (prefilled as the engine does,
    with the shallow states a self-drafter asks for), the run's stats and the target's cache."""
    from specee.decoding.base import DecodeState
    from specee.sampling import Sampler, SamplingParams
    from specee.stats import GenerationStats

    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 80)
        logits, hidden, shallow = model.prefill(prompt, cache, getattr(strategy, "shallow_layers", None))
        state = DecodeState(model, cache, list(prompt), logits, Sampler(params or SamplingParams()), GenerationStats(),
                            hidden, shallow)
        out = []
        for step in strategy.decode(state):
            out += step.tokens
            if len(out) >= steps:
                break
    return out[:steps], state.stats, cache


def arithmetic_corpus(path, count: int):
    """A small training text file: `count` blank-line-separated sums with their answers."""
    path.write_text("\n\n".join(f"Question {i}: what is {i} plus {i}? Answer: {2 * i}." for i in range(count)))
    return path


def cpu_tier_params():
    """One pytest param per CPU kernel tier; the tiers this CPU cannot run are skipped, saying why."""
    import pytest

    from specee.model.kernels import TIERS, missing_cpu_flags

    return [pytest.param(tier.name, id=tier.name, marks=pytest.mark.skipif(
        bool(missing_cpu_flags(tier)), reason=f"this CPU lacks {', '.join(missing_cpu_flags(tier))}")) for tier in TIERS]
