"""Tiny random models and a tiny tokenizer for fast tests, built both as Hugging Face and as specee
models."""
from __future__ import annotations

import json
from contextlib import contextmanager
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


# model_type -> (transformers' config class, its causal LM)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
# Gemma 3's shape in small: sliding layers of a window of 6 keys (five of six layers), their own
# RoPE base, an attention scale that is not 1 / sqrt(head_dim), q/k and sandwich norms, GeGLU.
TINY_GEMMA = dict(model_type="gemma3_text", num_hidden_layers=7, head_dim=32, sliding_window=6,
                  query_pre_attn_scalar=24, pad_token_id=0, eos_token_id=1, bos_token_id=2)
# Every architecture specee runs, as a tiny random config (`tiny_hf_model(**TINY_ARCHITECTURES[name])`).
TINY_ARCHITECTURES = {
    "llama": dict(),
    "qwen2": dict(model_type="qwen2"),  # biases on q, k and v
    "qwen3": dict(model_type="qwen3", head_dim=32),  # q/k norms; head_dim not hidden / heads
    "mistral": dict(model_type="mistral", sliding_window=5),  # every layer sliding
    "gemma3": TINY_GEMMA,
}


def tiny_hf_model(seed: int = 0, model_type: str = "llama", **overrides):
    """A randomly initialised HF causal LM (weights scaled up so logits are far from uniform)."""
    import transformers

    settings = {**TINY, **overrides}
    config_class, cls = HF_CLASSES[model_type]
    hf_config = getattr(transformers, config_class)(**settings)
    cls = getattr(transformers, cls)
    torch.manual_seed(seed)
    model = cls(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        if model_type == "gemma3_text":  # Gemma multiplies its embeddings by sqrt(hidden): real ones are small
            model.model.embed_tokens.weight.div_(hf_config.hidden_size ** 0.25)
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


def tiny_model_directory(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random model in Hugging Face layout (config.json, safetensors, tokenizer files)."""
    tokenizer = tiny_tokenizer(directory)
    tiny_hf_model(seed, vocab_size=tokenizer.vocab_size, **overrides).save_pretrained(directory)
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


def decode(model, strategy, prompt, steps=30, params=None, constraint=None):
    """The first `steps` tokens a strategy commits after `prompt` (prefilled as the engine does,
    with the shallow states a self-drafter asks for, under a grammar's `constraint` if given), the
    run's stats and the target's cache."""
    from specee.sampling import Sampler, SamplingParams
    from specee.stats import GenerationStats
    from specee.strategies.base import DecodeState

    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 80)
        logits, hidden, shallow = model.prefill(prompt, cache, getattr(strategy, "shallow_layers", None))
        state = DecodeState(model, cache, list(prompt), logits, Sampler(params or SamplingParams(), prompt_length=len(prompt), constraint=constraint),
                            GenerationStats(),
                            hidden, shallow)
        out = first_tokens(strategy, state, steps)
    return out, state.stats, cache


def first_tokens(strategy, state, count: int) -> list[int]:
    """The first `count` tokens a strategy commits from a decoding state."""
    out = []
    for step in strategy.decode(state):
        out += step.tokens
        if len(out) >= count:
            break
    return out[:count]


def arithmetic_corpus(path, count: int):
    """A small training text file: `count` blank-line-separated sums with their answers."""
    path.write_text("\n\n".join(f"Question {i}: what is {i} plus {i}? Answer: {2 * i}." for i in range(count)))
    return path


def cpu_tier_params(portable: bool = True):
    """One pytest param per CPU kernel tier (without the portable one where a test compares a tier
    against it); the tiers this CPU cannot run are skipped, saying why."""
    import pytest

    from specee.model.kernels import TIERS, missing_cpu_flags

    return [pytest.param(tier.name, id=tier.name, marks=pytest.mark.skipif(
        bool(missing_cpu_flags(tier)), reason=f"this CPU lacks {', '.join(missing_cpu_flags(tier))}"))
        for tier in TIERS if portable or tier.name != "portable"]


# A tiny Llama GGUF file in any of llama.cpp's block types: K-quants need rows of 256 inputs.
GGUF_LLAMA = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2)
# The fp16 fields of each block type (byte offsets in a block), and a value for them that keeps the
# weights near 0.05 whatever the random codes and sub-scales (d, or d and the minimum; Q5_1's minimum
# not a whole multiple of d, which would make it Q5_0's centered form).
GGUF_FIELDS = {"Q4_0": ((0, 0.01),), "Q4_1": ((0, 0.01), (2, -0.08)), "Q5_0": ((0, 0.005),),
               "Q5_1": ((0, 0.005), (2, -0.07)), "Q8_0": ((0, 0.0005),), "Q4_K": ((0, 0.0003), (2, 0.002)),
               "Q5_K": ((0, 0.00015), (2, 0.002)), "Q6_K": ((208, 0.00003),), "Q2_K": ((80, 0.002), (82, 0.002))}


def gguf_blocks(kind: str, rows: int, columns: int, rng) -> "np.ndarray":
    """Random valid blocks of `kind`, uint8 [rows, bytes per row]: random codes and sub-scales, fp16
    fields from GGUF_FIELDS (F32/F16 types: normal values)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F32", "F16"):
        values = rng.normal(0, 0.05, (rows, columns)).astype(np.float32 if kind == "F32" else np.float16)
        return values.view(np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, columns // block_size * type_size), dtype=np.uint8)
    blocks = data.reshape(rows, -1, type_size)
    for offset, value in GGUF_FIELDS[kind]:
        blocks[..., offset:offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return data


def gguf_writer(path: Path, architecture: str, tokenizer_directory: Path, hidden: int, ffn: int, layers: int,
                heads: int, kv_heads: int, rope_base: float, eps: float, context: int = 512):
    """A GGUFWriter for `architecture` with a model's shape and the tiny tokenizer written."""
    import gguf

    vocab = json.loads((tokenizer_directory / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    return writer


def write_llama_gguf(path: Path, kinds: dict[str, str], tokenizer_directory: Path, rope_freqs: bool = False,
                     seed: int = 0, context: int = 512) -> Path:
    """A tiny random Llama GGUF with the tiny tokenizer: `kinds` maps "default" and any tensor's
    short name ("attn_v", "ffn_down", "token_embd", "output") to a block type; untied when "output"
    is given. With `rope_freqs`, Llama 3.1's frequency factors (a vector of head_dim / 2)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    s = GGUF_LLAMA
    hd = s["hidden"] // s["heads"]
    writer = gguf_writer(path, "llama", tokenizer_directory, s["hidden"], s["ffn"], s["layers"], s["heads"],
                         s["kv_heads"], 10000.0, 1e-5, context)
    writer.add_chat_template(CHATML)
    vocab_size = len(json.loads((tokenizer_directory / "tokenizer.json").read_text())["model"]["vocab"])

    def matrix(name: str, short: str, rows: int, columns: int):
        kind = kinds.get(short, kinds["default"])
        data = gguf_blocks(kind, rows, columns, rng)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    def vector(name: str, size: int):
        writer.add_tensor(name, (1 + rng.normal(0, 0.1, size)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", vocab_size, s["hidden"])
    if "output" in kinds:
        matrix("output.weight", "output", vocab_size, s["hidden"])
    vector("output_norm.weight", s["hidden"])
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, hd // 2).astype(np.float32))
    for i in range(s["layers"]):
        for short, rows, columns in (("attn_q", s["hidden"], s["hidden"]), ("attn_k", s["kv_heads"] * hd, s["hidden"]),
                                     ("attn_v", s["kv_heads"] * hd, s["hidden"]), ("attn_output", s["hidden"], s["hidden"]),
                                     ("ffn_gate", s["ffn"], s["hidden"]), ("ffn_up", s["ffn"], s["hidden"]),
                                     ("ffn_down", s["hidden"], s["ffn"])):
            matrix(f"blk.{i}.{short}.weight", short, rows, columns)
        vector(f"blk.{i}.attn_norm.weight", s["hidden"])
        vector(f"blk.{i}.ffn_norm.weight", s["hidden"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Hugging Face tensor names (after "model.layers.{i}.") -> llama.cpp's, per architecture where they differ.
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
GGUF_GEMMA_LAYER_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_hf_as_gguf(hf_model, path: Path, tokenizer_directory: Path, architecture: str) -> Path:
    """A tiny HF model of Qwen 3 or Gemma 3 (whose q and k rows llama.cpp keeps in HF's order) as
    llama.cpp's converter writes it: its names and metadata, fp32 tensors, Gemma's norms as 1 + w,
    no chat template."""
    import numpy as np

    config = hf_model.config
    gemma = architecture == "gemma3"
    rope = config.rope_parameters["full_attention"] if gemma else config.rope_parameters
    writer = gguf_writer(path, architecture, tokenizer_directory, config.hidden_size, config.intermediate_size,
                         config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                         rope["rope_theta"], config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    names = GGUF_GEMMA_LAYER_NAMES if gemma else GGUF_LAYER_NAMES
    for name, tensor in hf_model.state_dict().items():
        value = tensor.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp's converter folds Gemma's 1 + w into the weights
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, index, *part, kind = name.split(".")
            gguf_name = f"blk.{index}.{names['.'.join(part)]}.{kind}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pass_through_head(config):
    """An EAGLE head that estimates the next state as the current one (its layer adds nothing), so
    it drafts the token the target just chose again: right where the model repeats itself, wrong
    elsewhere, which gives verification accepted and rejected drafts to keep lossless."""
    import torch

    from specee.drafters.eagle import EagleHead

    head = EagleHead(config)
    hidden = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


@contextmanager
def threads(count: int):
    """PyTorch's and the kernels' threads set to `count` for a block (an xdist worker runs on one):
    the fused layers split their rows over them, which one thread never checks."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
