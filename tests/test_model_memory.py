"""The context a generation may hold (--ctx-size) and the memory check before a model loads: a
model that cannot fit is refused with the numbers, never half-loaded."""
import platform
import subprocess
import sys

import pytest
import torch

import specee
import specee.model.cores as cores
import specee.model.memory as memory
from helpers import write_llama_gguf
from specee.cli import main
from specee.model.errors import ModelLoadError

Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


@pytest.fixture
def gguf_path(tmp_path, tiny_tokenizer, model_cache):
    return write_llama_gguf(tmp_path / "tiny.gguf", Q4_K_M, tiny_tokenizer.directory)  # context 512


def test_the_context_defaults_to_the_models_and_can_be_shortened(gguf_path):
    assert specee.load(gguf_path, threads=1).context_length == 512
    engine = specee.load(gguf_path, threads=1, ctx_size=64)
    assert engine.context_length == 64
    prompt_tokens = len(engine.encode("Hello there"))
    result = engine.generate("Hello there", max_tokens=500, ignore_eos=True)
    assert result.completion_tokens == 64 - prompt_tokens and result.finish_reason == "length"
    with pytest.raises(ValueError, match=r"ctx_size 1024 is longer than the model's context \(512\)"):
        specee.load(gguf_path, threads=1, ctx_size=1024)
    with pytest.raises(ValueError, match="ctx_size must be a positive integer"):
        specee.load(gguf_path, threads=1, ctx_size=0)


def test_the_weight_estimate_is_what_the_model_holds(gguf_path):
    engine = specee.load(gguf_path, threads=1)
    estimate, _ = memory.gguf_weight_bytes(gguf_path, "gguf", torch.float32)
    # weight_bytes: what a pass reads (every matrix, the tied head once, the norms).
    assert 0.9 < estimate / engine.model.weight_bytes < 1.1


def test_a_model_that_cannot_fit_is_refused_before_it_loads(gguf_path, monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * 2**20)
    with pytest.raises(ModelLoadError, match=r"tiny.gguf needs about 0.4 GiB of memory \(weights 0.0 GiB, KV cache for "
                                             r"512 tokens 0.0 GiB, working memory 0.4 GiB\) and this machine has 0.1 "
                                             r"GiB available: nothing was loaded"):
        specee.load(gguf_path, threads=1)
    assert not list((tmp_path / "cache").rglob("packed-*.pt"))
    # The KV cache of the whole context counts: room for a short one is not room for a long one.
    from specee.model.loading import read_config, resolve_model_dir

    directory = resolve_model_dir(gguf_path)
    # The file's blocks on the kernels keep an fp16 cache (--kv-cache-dtype auto).
    needed = memory.estimate_memory(gguf_path, directory, True, "gguf", torch.float32, read_config(directory), 512, 2)
    assert needed.kv_cache == 2 * 2 * 2 * 64 * 2 * 512  # keys and values, layers, KV heads, head_dim, fp16
    monkeypatch.setattr(memory, "available_bytes", lambda: needed.total - needed.kv_cache // 2)
    with pytest.raises(ModelLoadError, match=r"KV cache for 512 tokens"):
        specee.load(gguf_path, threads=1)
    assert specee.load(gguf_path, threads=1, ctx_size=8).context_length == 8


def test_the_cli_says_the_context_and_refuses_what_cannot_fit(gguf_path, capsys, monkeypatch):
    code = main(["generate", "Hello", "--model", str(gguf_path), "--ctx-size", "64", "--max-tokens", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0 and "tiny.gguf loaded in" in err and "gguf weights" in err
    assert "context 64 tokens (KV cache fp16 up to 0.00 GiB); 1 threads (--threads)" in err
    monkeypatch.setattr(cores, "physical_cores", lambda: 1)
    assert main(["generate", "Hello", "--model", str(gguf_path), "--ctx-size", "64", "--max-tokens", "2"]) == 0
    assert "; 1 threads (this machine's physical cores; --threads to change)" in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    code = main(["generate", "Hello", "--model", str(gguf_path)])
    err = capsys.readouterr().err
    assert code == 2 and "needs about" in err and "Traceback" not in err


BLOCKS_FREED_INSIDE = """
import os
from pathlib import Path
import torch
from specee.model.memory import blocks_given_back

def resident_mb():
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

raised = torch.ones(16 * 2**20, dtype=torch.uint8)
del raised
with blocks_given_back():
    blocks = [torch.ones(4 * 2**20, dtype=torch.uint8) for _ in range(48)]  # 192 MB, touched
    top = torch.ones(200 * 1024, dtype=torch.uint8)
    before = resident_mb()
    del blocks
    after = resident_mb()
assert top.sum() > 0
print(before - after)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_blocks_freed_while_a_gguf_file_loads_go_back_to_the_system():
    """Outside the block, glibc keeps freed blocks of a few MB in its heap (its threshold raised by
    a freed 16 MB block), and a small block on the heap's top keeps them there; inside, each is
    its own mapping, returned when freed: what keeps a first load's peak near the packed size.
    In a process of its own, as a first load is: a heap already holding free blocks serves these
    from them, and then nothing is mapped or returned."""
    run = subprocess.run([sys.executable, "-c", BLOCKS_FREED_INSIDE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) > 150
