"""The model against Hugging Face on tiny random configs, and its pieces against each other."""
import pytest
import torch

from helpers import TINY_ARCHITECTURES, TINY_GEMMA, specee_from_hf, tiny_hf_model

CONFIGS = {
    "gqa-untied": dict(),
    "gqa-tied": dict(tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "llama3-rope": dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(model_type="qwen2"),
    "qwen3-qk-norms": TINY_ARCHITECTURES["qwen3"],
    "mistral-sliding": TINY_ARCHITECTURES["mistral"],
    "gemma3": TINY_GEMMA,
    "gemma3-tied-odd-window": dict(TINY_GEMMA, sliding_window=11, num_key_value_heads=4),
}


def full_forward(model, ids):
    cache = model.new_cache(len(ids) + 8)
    return model(torch.tensor(ids), torch.arange(len(ids)), cache)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hugging_face(name, pack):
    overrides = dict(CONFIGS[name])
    hf = tiny_hf_model(seed=1, **overrides)
    ours = specee_from_hf(hf, pack=pack)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        got = full_forward(ours, ids)
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_rope_scaling_changes_logits():
    """Guards the llama3 case above against passing because scaling was silently ignored."""
    plain = specee_from_hf(tiny_hf_model(seed=1))
    scaled = specee_from_hf(tiny_hf_model(seed=1, **CONFIGS["llama3-rope"]))
    ids = list(range(60))
    with torch.no_grad():
        assert not torch.allclose(full_forward(plain, ids), full_forward(scaled, ids), atol=1e-3)


def test_logits_rows_equal_columns_of_full_logits():
    model = specee_from_hf(tiny_hf_model(seed=2))
    h = model.norm(torch.randn(5, 64))
    rows = torch.tensor([3, 96, 0, 41])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(h, rows), model.logits(h)[:, rows], atol=1e-5, rtol=1e-5)


def test_forward_is_the_loop_over_the_pieces():
    model = specee_from_hf(tiny_hf_model(seed=3))
    ids = torch.tensor([5, 9, 2, 77])
    positions = torch.arange(4)
    with torch.no_grad():
        by_forward = model(ids, positions, model.new_cache(8))
        cache = model.new_cache(8)
        h = model.embed(ids)
        angles = model.angles(positions)
        for layer in model.layers:
            h = layer(h, angles, cache)
        by_pieces = model.logits(model.norm(h))
    torch.testing.assert_close(by_forward, by_pieces, atol=0, rtol=0)


def test_weight_bytes_counts_every_matrix_once():
    hf = tiny_hf_model(seed=0)
    ours = specee_from_hf(hf, pack=False)
    # HF's parameters minus the embedding table (only one row is read per token).
    expected = sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n) * 4
    assert ours.weight_bytes == expected


def greedy_tokens(model, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding on our model, one token per pass after the prompt's."""
    cache = model.new_cache(len(prompt) + steps)
    with torch.no_grad():
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1]
        tokens = []
        for step in range(steps):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor(tokens[-1:]), torch.tensor([len(prompt) + step]), cache)[-1]
    return tokens


@pytest.mark.parametrize("architecture", list(TINY_ARCHITECTURES))
def test_greedy_tokens_match_hugging_face_generate(architecture):
    """30 greedy tokens, past every sliding window, exactly as transformers' generate picks them."""
    hf = tiny_hf_model(seed=4, **TINY_ARCHITECTURES[architecture])
    ours = specee_from_hf(hf)
    prompt = torch.randint(3, 97, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    got = greedy_tokens(ours, prompt, 30)
    assert len(set(got)) > 3, "a degenerate model would match trivially"
    assert got == expected


@pytest.mark.parametrize("architecture", list(TINY_ARCHITECTURES))
def test_the_cpu_kernels_match_hugging_face(architecture):
    """The same models on specee's CPU kernels (fp32 weights; their own exp and reductions): HF's
    logits to fp32 tolerance."""
    from specee.model.kernel_install import with_kernels
    from specee.model.kernels import cpu_kernels

    hf = tiny_hf_model(seed=6, **TINY_ARCHITECTURES[architecture])
    ours = specee_from_hf(hf)
    ours = with_kernels(ours, cpu_kernels())
    assert ours.uses_kernels
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        got = full_forward(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("setting", ["sliding_window", "rope_local_base_freq", "query_pre_attn_scalar"])
def test_gemmas_differences_change_logits(setting):
    """Guards the Gemma cases above against passing because a setting was silently ignored."""
    changed = {"sliding_window": 1000, "rope_local_base_freq": 5000.0, "query_pre_attn_scalar": 32}[setting]
    ids = list(range(3, 43))
    plain = specee_from_hf(tiny_hf_model(seed=1, **TINY_GEMMA))
    hf = tiny_hf_model(seed=1, **TINY_GEMMA)
    config = hf.config
    if setting == "rope_local_base_freq":
        config.rope_parameters["sliding_attention"]["rope_theta"] = changed
    else:
        setattr(config, setting, changed)
    other = specee_from_hf(hf)
    with torch.no_grad():
        assert not torch.allclose(full_forward(plain, ids), full_forward(other, ids), atol=1e-3)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_a_hugging_face_directory_of_each_new_architecture_loads_as_transformers_runs_it(tmp_path, architecture):
    """config.json and safetensors as save_pretrained writes them (Gemma's norms as w, its four norm
    names): the loaded engine's logits are transformers'."""
    import specee
    from helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer(tmp_path / "model")
    hf = tiny_hf_model(seed=3, **TINY_ARCHITECTURES[architecture], vocab_size=tokenizer.vocab_size)
    hf.save_pretrained(tmp_path / "model")
    engine = specee.load(str(tmp_path / "model"), quantization="none")
    ids = list(range(3, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        got = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.model.new_cache(48))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
