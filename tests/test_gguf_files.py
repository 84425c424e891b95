"""GGUF files as users download them, read straight into our formats: every block type llama.cpp's
Llama files use, a Q4_K_M-like mix (Q4_K beside Q6_K in one fused matrix), Llama 3's rope_freqs,
and no fp32 copy of the weights anywhere on disk."""
from pathlib import Path

import numpy as np
import pytest
import torch

import specee
from helpers import write_llama_gguf
from specee.model.integer_linear import IntegerLinear

# Block type -> (bits, group size) of the kernel format it is read into by --quantization gguf.
FORMATS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q5_0": (5, 32), "Q5_1": (8, 32),
           "Q5_K": (5, 32), "Q6_K": (6, 16), "Q8_0": (8, 32)}
# Bytes a weight of the K-quants as they run, from their layouts: codes, an int8 (or two) per group
# and an fp16 (or two) per 256 weights. The file's: Q4_K 4.5 bits, Q5_K 5.5, Q6_K 6.5625.
K_QUANT_BYTES = {"Q4_K": 4 / 8 + 2 / 32 + 4 / 256, "Q5_K": 5 / 8 + 2 / 32 + 4 / 256, "Q6_K": 6 / 8 + 1 / 16 + 2 / 256}
Q5_0_BYTES = 5 / 8 + 2 / 32  # the file's 5-bit codes and fp16 scale per 32: 5.5 bits, as the file
Q8_0_BYTES = 1 + 2 / 32  # its codes (plus 128) and its fp16 scale per 32: 8.5 bits, as the file
Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


@pytest.fixture
def cache(model_cache):
    return model_cache


def gguf_file(tmp_path, tiny_tokenizer, kinds, **options):
    name = "-".join(f"{k}={v}" for k, v in sorted(kinds.items()))
    return write_llama_gguf(tmp_path / f"{name}.gguf", kinds, tiny_tokenizer.directory, **options)


def dequantized_rows(path, gguf_name, rows):
    from gguf.quants import dequantize

    from specee.model.gguf_reader import GGUFFile

    tensor = next(t for t in GGUFFile(path).tensors if t.name == gguf_name)
    return torch.from_numpy(np.array(dequantize(np.asarray(tensor.data)[rows], tensor.tensor_type)))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_each_block_type_is_read_into_its_format_with_the_files_values(tmp_path, tiny_tokenizer, cache, kind):
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": kind})
    engine = specee.load(path, threads=1)
    assert engine.quantization == "gguf"  # auto: the file's own format
    bits, group = FORMATS[kind]
    down = engine.model.layers[1].mlp.down_proj
    assert isinstance(down, IntegerLinear) and (down.bits, down.group_size) == (bits, group)
    # The K-quants keep their scales factored, in about the file's bytes.
    assert down.superblock_scales == (kind in K_QUANT_BYTES)
    if kind in K_QUANT_BYTES:
        assert down.weight_bytes == down.in_features * down.out_features * K_QUANT_BYTES[kind]
    if kind in ("Q5_0", "Q8_0"):
        assert down.centered and down.weight_bytes == down.in_features * down.out_features * (
            Q5_0_BYTES if kind == "Q5_0" else Q8_0_BYTES)
    # The tied head keeps its rows for the embedding: the file's values, exactly for the 8-bit
    # formats and the K-quants; Q4_0 and Q4_1 round d and the zero point to bf16 (relative 2^-9 of each).
    rows = torch.arange(40)
    ours = engine.model.embed_tokens.dequantize(rows)
    expected = dequantized_rows(path, "token_embd.weight", slice(0, 40))
    if bits != 4 or kind in K_QUANT_BYTES:
        assert torch.equal(ours, expected)
    else:
        step = ours.abs().max()
        assert (ours - expected).abs().max() <= 2**-8 * 16 * step and not torch.equal(ours, torch.zeros_like(ours))
    result = engine.generate("Hello there", max_tokens=6, ignore_eos=True)
    assert result.completion_tokens == 6
    assert not list(cache.glob("*/*.safetensors"))  # no weights copied anywhere


def test_a_q4_k_m_mix_runs_as_the_dequantized_model_does(tmp_path, tiny_tokenizer, cache):
    """q and k (Q4_K) fuse with v (Q6_K) into one matrix of 6-bit codes with superblock scales in
    groups of 16; the result follows the dense model built from gguf-py's dequantization up to the
    activations' int8 rounding."""
    path = gguf_file(tmp_path, tiny_tokenizer, Q4_K_M)
    quantized, dense = specee.load(path, threads=1), specee.load(path, quantization="none", threads=1)
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert (qkv.bits, qkv.group_size, qkv.superblock_scales, qkv.centered) == (6, 16, True, False)
    assert quantized.model.layers[0].mlp.down_proj.centered  # Q6_K alone: its own scales alone
    ids = torch.tensor(quantized.tokenizer.encode_prompt("Hello there, name three colours"))
    with torch.no_grad():
        ours, reference = (e.model.embed(ids) for e in (quantized, dense))
        assert torch.equal(ours, reference)  # Q6_K embedding rows: exact
        ours = qkv(reference)
        theirs = dense.model.layers[0].self_attn.qkv_proj(reference)
    error = (ours - theirs).abs().max() / theirs.abs().max()
    assert 0 < error < 0.05  # int8 activations: about 1%; a wrong block layout: about 100%
    # Speculation is lossless on the file's own blocks too.
    plain = quantized.generate("the cat sat on the mat and the cat sat", max_tokens=16, ignore_eos=True, spec_method="none")
    lookup = quantized.generate("the cat sat on the mat and the cat sat", max_tokens=16, ignore_eos=True,
                                spec_method="prompt-lookup")
    assert lookup.token_ids == plain.token_ids and lookup.text == plain.text


def test_f16_matrices_are_quantized_to_the_default_format_as_they_are_read(tmp_path, tiny_tokenizer, cache):
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "F16"})
    engine = specee.load(path, threads=1)
    assert engine.quantization == "int4"
    down = engine.model.layers[1].mlp.down_proj
    assert isinstance(down, IntegerLinear) and (down.bits, down.group_size) == (4, 32)
    assert engine.model.lm_head.bits == 8  # the head stays int8, as in the int4 format


def test_rope_freqs_divide_the_rotary_frequencies(tmp_path, tiny_tokenizer, cache):
    """Llama 3.x files from llama.cpp's converter carry rope_freqs: theta_i / factor_i, as llama.cpp's rope."""
    plain = specee.load(gguf_file(tmp_path, tiny_tokenizer, {"default": "Q8_0"}), threads=1)
    scaled = specee.load(write_llama_gguf(tmp_path / "freqs.gguf", {"default": "Q8_0"}, tiny_tokenizer.directory,
                                          rope_freqs=True), threads=1)
    factors = torch.linspace(1, 8, 32)
    torch.testing.assert_close(scaled.model.inv_freq, plain.model.inv_freq / factors, rtol=1e-6, atol=0)
    assert scaled.generate("Hello", max_tokens=4, ignore_eos=True).completion_tokens == 4


def test_a_block_type_without_a_kernel_is_requantized_to_int4_and_said(tmp_path, tiny_tokenizer, cache, capsys):
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q4_K", "ffn_down": "Q2_K"})
    engine = specee.load(path, threads=1)
    assert "Q2_K blocks have no kernel: those matrices were re-quantized to int4" in capsys.readouterr().err
    down, up = engine.model.layers[0].mlp.down_proj, engine.model.layers[0].mlp.gate_up_proj
    assert (down.bits, down.group_size) == (4, 32) and (up.bits, up.group_size) == (4, 32)
    expected = dequantized_rows(path, "blk.0.ffn_down.weight", slice(None))
    step = (expected.max() - expected.min()) / 15
    assert (down.dequantize() - expected).abs().max() <= step  # min-max int4 of the file's values


def test_a_second_load_maps_the_packed_weights_cached_by_the_first(tmp_path, tiny_tokenizer, cache, capsys):
    path = gguf_file(tmp_path, tiny_tokenizer, Q4_K_M)
    first = specee.load(path, threads=1)
    assert "caching the packed weights" in capsys.readouterr().err
    [cached] = cache.rglob("packed-*.pt")
    second = specee.load(path, threads=1)
    assert "loading" not in capsys.readouterr().err  # no tensor of the GGUF file decoded again
    assert str(cached) in Path("/proc/self/maps").read_text()  # the tiles are the file's pages
    down = second.model.layers[0].mlp.down_proj
    assert torch.equal(down.packed, first.model.layers[0].mlp.down_proj.packed)
    assert second.model.source_fingerprint == first.model.source_fingerprint
    prompt = "the cat sat on the mat and the cat sat"
    expected = first.generate(prompt, max_tokens=12, ignore_eos=True, spec_method="none")
    for spec_method in (None, "prompt-lookup"):
        result = second.generate(prompt, max_tokens=12, ignore_eos=True, spec_method=spec_method)
        assert result.token_ids == expected.token_ids
    # Another dtype keeps its norms apart: a file of its own.
    specee.load(path, threads=1, dtype="bf16")
    assert len(list(cache.rglob("packed-*.pt"))) == 2


def test_an_untied_quantized_embedding_is_cached_with_its_own_matrix(tmp_path, tiny_tokenizer, cache):
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q8_0", "output": "Q6_K", "token_embd": "Q4_K"})
    first, second = specee.load(path, threads=1), specee.load(path, threads=1)
    rows = torch.tensor([0, 5, 77])
    assert isinstance(second.model.embed_tokens.matrix, IntegerLinear)
    assert torch.equal(second.model.embed_tokens(rows), first.model.embed_tokens(rows))
    expected = dequantized_rows(path, "token_embd.weight", rows.numpy())
    step = expected.abs().max()
    assert (second.model.embed_tokens(rows) - expected).abs().max() <= 2**-8 * 16 * step
    assert not torch.equal(second.model.lm_head.dequantize(rows), second.model.embed_tokens(rows))


def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, tiny_tokenizer, cache, capsys):
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q4_0"})
    expected = specee.load(path, threads=1).generate("Hello", max_tokens=6, ignore_eos=True, spec_method="none")
    [cached] = cache.rglob("packed-*.pt")
    cached.write_bytes(cached.read_bytes()[:1000])
    capsys.readouterr()
    result = specee.load(path, threads=1).generate("Hello", max_tokens=6, ignore_eos=True, spec_method="none")
    err = capsys.readouterr().err
    assert "packed-weights cache" in err and "is damaged" in err and "caching the packed weights" in err
    assert result.token_ids == expected.token_ids
    assert cached.stat().st_size > 1000


def test_a_cache_whose_tiles_do_not_fit_the_kernels_is_rebuilt(tmp_path, tiny_tokenizer, cache, capsys):
    """A packed file of this version whose matrices the kernels refuse (tiles packed another way, by a
    development build, say) is rebuilt from the GGUF file, not a traceback."""
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q4_K"})
    expected = specee.load(path, threads=1).generate("Hello", max_tokens=6, ignore_eos=True, spec_method="none")
    [cached] = cache.rglob("packed-*.pt")
    saved = torch.load(cached, weights_only=True)
    name = next(key for key in saved["tensors"] if key.endswith("mlp.down_proj.scales_zeros"))
    saved["tensors"][name] = saved["tensors"][name][:, : saved["tensors"][name].shape[1] // 2].contiguous()
    torch.save(saved, cached)
    capsys.readouterr()
    result = specee.load(path, threads=1).generate("Hello", max_tokens=6, ignore_eos=True, spec_method="none")
    err = capsys.readouterr().err
    assert "is damaged (RuntimeError" in err and "caching the packed weights" in err
    assert result.token_ids == expected.token_ids


def test_a_new_packed_file_removes_those_of_earlier_versions(tmp_path, tiny_tokenizer, cache, capsys):
    """Packed files an earlier specee wrote beside the model's (nothing reads them now) go when this
    version writes its own; a file of this version in another format or dtype stays."""
    from specee.model.packed_cache import PACKED_VERSION

    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q4_0"})
    specee.load(path, threads=1, dtype="bf16")
    [kept] = cache.rglob("packed-*.pt")
    older = [kept.with_name(f"packed-v{v}-gguf-fp32.pt") for v in (PACKED_VERSION - 1, PACKED_VERSION - 2)]
    for old in older:
        old.write_bytes(b"an earlier layout")
    unrelated = kept.with_name("notes.txt")
    unrelated.write_text("not a packed file")
    capsys.readouterr()
    specee.load(path, threads=1)  # fp32: a new file of this version
    err = capsys.readouterr().err
    assert not any(old.exists() for old in older) and kept.exists() and unrelated.exists()
    assert sorted(p.name for p in cache.rglob("packed-*.pt")) == sorted(
        [kept.name, f"packed-v{PACKED_VERSION}-gguf-fp32.pt"])
    assert f"removed {older[0].name}" in err and "packed by an earlier version" in err


def test_a_smaller_gguf_drafts_for_a_gguf_target_losslessly(tmp_path, tiny_tokenizer, cache):
    target = specee.load(gguf_file(tmp_path, tiny_tokenizer, Q4_K_M), threads=1)
    draft = write_llama_gguf(tmp_path / "draft.gguf", {"default": "Q8_0"}, tiny_tokenizer.directory, seed=3)
    prompt = "the cat sat on the mat and the cat sat"
    dense = target.generate(prompt, max_tokens=16, ignore_eos=True, spec_method="none")
    for tree in (None, "auto"):
        drafted = target.generate(prompt, max_tokens=16, ignore_eos=True, spec_method="draft", draft_model=str(draft),
                                  tree=tree)
        assert drafted.token_ids == dense.token_ids and drafted.text == dense.text
        assert drafted.stats.accept_lengths  # the draft model's proposals were verified


@pytest.mark.parametrize("method", ["eagle", "kangaroo"])
def test_no_bundled_drafter_is_taken_for_another_models_weights(tmp_path, tiny_tokenizer, cache, method):
    engine = specee.load(gguf_file(tmp_path, tiny_tokenizer, Q4_K_M), threads=1)
    with pytest.raises(ValueError, match=f"needs --drafter FILE: specee bundles none for this model.*train {method}"):
        engine.generate("Hello", max_tokens=4, spec_method=method)


def mapped_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_tensor_read_gives_back_its_pages(tmp_path):
    import gguf

    from specee.model.gguf_reader import GGUFFile

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.ones((1024, 2048), np.float32))  # 8 MiB
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(path)
    [tensor] = reader.tensors
    assert int(np.asarray(tensor.data).sum(dtype=np.uint64)) > 0  # touches every page
    assert mapped_rss_kb(path) >= 8 * 1024
    reader.release(tensor)
    assert mapped_rss_kb(path) < 64
    assert np.asarray(tensor.data).view(np.float32)[5, 7] == 1.0  # still readable: back from the page cache


def test_a_cache_that_cannot_be_written_leaves_the_load_whole(tmp_path, tiny_tokenizer, cache, capsys, monkeypatch):
    import specee.model.packed_cache as packed_cache

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_cache.torch, "save", full_disk)
    path = gguf_file(tmp_path, tiny_tokenizer, {"default": "Q4_0"})
    result = specee.load(path, threads=1).generate("Hello", max_tokens=4, ignore_eos=True)
    assert result.completion_tokens == 4
    assert "could not cache the packed weights" in capsys.readouterr().err
    assert not list(cache.rglob("packed-*.pt")) and not list(cache.rglob("partial-*"))


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_files_run_as_transformers_runs_their_weights(tmp_path, tiny_tokenizer, cache, architecture):
    """A file as llama.cpp's converter writes one (its tensor names, Gemma's four norms per layer with
    1 + w folded in, the sliding window in the metadata, the local RoPE base not in it): the same
    logits as transformers' classes on the same weights, and Gemma's turn end and chat template."""
    from helpers import TINY_ARCHITECTURES, tiny_hf_model, write_hf_as_gguf

    # llama.cpp scales Gemma 3's attention by 1 / sqrt(head_dim): its checkpoints' query_pre_attn_scalar.
    settings = {**TINY_ARCHITECTURES[architecture], "vocab_size": tiny_tokenizer.vocab_size}
    if architecture == "gemma3":
        settings["query_pre_attn_scalar"] = settings["head_dim"]
    hf = tiny_hf_model(seed=2, **settings)
    path = write_hf_as_gguf(hf, tmp_path / f"{architecture}.gguf", tiny_tokenizer.directory, architecture)
    engine = specee.load(str(path), quantization="none")
    config = engine.model.config
    assert config.model_type == {"qwen3": "qwen3", "gemma3": "gemma3_text"}[architecture] and config.qk_norm
    ids = list(range(3, 43))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        got = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.model.new_cache(48))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if architecture == "gemma3":
        assert config.layer_window(0) == 6 and config.layer_window(5) is None and config.rope_local_base_freq == 10000
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert rendered.endswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
