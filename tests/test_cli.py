"""The command line: bad input gets one clear line and exit code 2; a real run end to end."""
import io
import json
import shutil
import socket
import subprocess
import sys

import pytest

from helpers import GGUF_SHAPE, write_gguf
from specee.cli import main


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["--max-tokens", "-3"], "--max-tokens must be a positive integer"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--tree-node-cost", "-0.1"], "--tree-node-cost must be >= 0"),
        (["--dtype", "fp16"], "unknown dtype 'fp16'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--model", "/no/such/model.gguf"], "does not exist"),
        (["--quantization", "int3"], "unknown quantization 'int3' (choose from auto, none, int8, int4, gguf)"),
        (["--quantization", "gguf", "--model", "/no/such/model.gguf"], "does not exist"),
        (["--regex", "(unclosed"], "the regex cannot be used: "),
        (["--json-schema", "{not json"], "--json-schema is neither a file nor JSON"),
        (["--json-schema", '{"type": "objectx"}'], "the JSON schema cannot be used: Invalid type: objectx"),
        (["--grammar", "/no/such/grammar.lark"], "No such file"),
        (["--regex", "a+", "--ignore-eos"], "drop --ignore-eos"),
        (["--regex", "a+", "--exit", "rule"], "cannot follow a grammar"),
    ],
)
def test_bad_flags_exit_2_with_a_message(capsys, flags, message):
    code, out, err = run_main(capsys, "generate", "hello", *flags)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_the_weight_format_defaults_to_auto_and_training_to_dense_weights():
    from specee.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).quantization == "auto"
    assert parser.parse_args(["serve"]).quantization == "auto"
    for artifact in ("eagle", "kangaroo", "exits"):
        assert parser.parse_args(["train", artifact, "--out", "x.pt"]).quantization == "none"
    # An n-gram table is counted from the model's answers (no gradients): in the format users run.
    assert parser.parse_args(["train", "ngram", "--out", "x.pt"]).quantization == "auto"


@pytest.mark.slow
def test_the_speed_line_names_the_weight_format_and_kernels_that_ran(capsys):
    from specee.model.kernels import requested_tier

    code, out, err = run_main(capsys, "generate", "hello", "--max-tokens", "8", "--json")
    best = requested_tier()  # the best tier, or the one $SPECEE_CPU_TIER names
    assert code == 0 and f"[gguf weights, compiled kernels ({best});" in err  # auto: the file's own blocks
    assert json.loads(out.strip().splitlines()[-1])["cpu_tier"] == best
    code, out, err = run_main(capsys, "generate", "hello", "--max-tokens", "8", "--cpu-tier", "portable", "--json")
    assert code == 0 and "[gguf weights, compiled kernels (portable);" in err
    assert json.loads(out.strip().splitlines()[-1])["cpu_tier"] == "portable"
    code, out, err = run_main(capsys, "generate", "hello", "--max-tokens", "8", "--no-compile")
    assert code == 0 and "[int4 weights, PyTorch kernels;" in err and out.strip()  # auto off the kernels: int4
    code, _, err = run_main(capsys, "generate", "hello", "--max-tokens", "2", "--quantization", "gguf")
    assert code == 0 and f"[gguf weights, compiled kernels ({best});" in err


def test_quantization_on_cuda_says_it_is_cpu_only(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything touches the GPU
    code, out, err = run_main(capsys, "generate", "hello", "--device", "cuda", "--quantization", "int4")
    assert code == 2 and "quantization int4 runs on the CPU only for now" in err and out == ""


def test_gguf_quantization_of_a_model_directory_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path), "--quantization", "gguf")
    assert code == 2 and "is a Hugging Face directory: pass the .gguf file" in err and "Traceback" not in err


def test_a_gguf_file_without_a_tokenizer_is_refused_cleanly(capsys, tmp_path):
    import gguf

    from test_quantize import weights, write_gguf

    write_gguf(tmp_path / "q5.gguf", {"blk.0.ffn_down.weight": (weights(64, 256).numpy(), gguf.GGMLQuantizationType.Q5_1)})
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path / "q5.gguf"))
    assert code == 2 and "cannot read the tokenizer of" in err and "Traceback" not in err


def test_malformed_number_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--max-tokens", "many"])
    assert exit_info.value.code == 2


def test_truncated_gguf_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    whole = write_gguf(tmp_path / "whole.gguf", "llama", GGUF_SHAPE, tensor_values=1_000_000)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole.read_bytes()[:3_000_000])  # 4 MB of tensor data, cut short
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(truncated))
    assert code == 2 and "truncated.gguf" in err and "Traceback" not in err
    assert not list((tmp_path / "cache").glob("truncated*"))  # no half-converted cache left behind


def test_corrupt_gguf_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(corrupt))
    assert code == 2 and "not a readable GGUF file" in err


def test_directory_without_weights_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 2 and "no *.safetensors weights" in err


def test_directory_without_config_is_a_clear_error(capsys, tmp_path):
    code, _, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 2 and "no config.json" in err


@pytest.mark.slow
def test_prompt_longer_than_the_context_is_a_clear_error(capsys):
    code, _, err = run_main(capsys, "generate", "word " * 9000, "--no-chat")
    assert code == 2 and "the context is 4096 (--ctx-size)" in err  # the default: min(8192, 4096)


def test_empty_prompt_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    code, _, err = run_main(capsys, "generate", "-")
    assert code == 2 and "the prompt is empty" in err


@pytest.mark.slow
def test_generate_end_to_end_json():
    exe = shutil.which("specee") or pytest.fail("the specee console script is not installed")
    proc = subprocess.run(
        [exe, "generate", "-", "--max-tokens", "12", "--json", "--ignore-eos"],
        input="Name three colours.", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", "stats"}
    assert result["completion_tokens"] == len(result["token_ids"]) == 12
    assert result["finish_reason"] == "length"
    assert result["prompt_tokens"] > 10
    assert {"prefill_s", "decode_s", "tokens_per_s"} <= set(result["stats"])
    assert result["stats"]["tokens_per_s"] > 0
    assert result["text"] and proc.stdout.startswith(result["text"])  # streamed before the JSON
    assert "tokens/s" in proc.stderr


@pytest.mark.slow
def test_chat_keeps_the_conversation(capsys, monkeypatch, default_engine):
    import builtins

    import specee.cli.loading as loading

    seen = []
    real_stream = default_engine.stream

    def recording_stream(messages, *config, **options):
        seen.append([dict(m) for m in messages])
        return real_stream(messages, *config, **options)

    lines = iter(["My name is Ada.", "What is my name?"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(loading, "load", lambda args: default_engine)
    monkeypatch.setattr(default_engine, "stream", recording_stream)
    monkeypatch.setattr(builtins, "input", fake_input)
    assert main(["chat", "--max-tokens", "12", "--system", "Be brief."]) == 0
    assert len(seen) == 2
    first, second = seen
    assert [m["role"] for m in first] == ["system", "user"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] and second[2]["content"] in capsys.readouterr().out


@pytest.mark.slow
def test_each_chat_turn_prefills_only_what_the_last_turn_did_not(capsys, monkeypatch, default_engine):
    """`specee chat` over four turns: every turn after the first takes the conversation so far from
    the prefix cache (the last turn's prompt and answer, in whole blocks), says so on its speed
    line, and answers exactly as the same turn without the cache."""
    import builtins

    import specee.cli.loading as loading
    from specee.prefix_cache import BLOCK_TOKENS

    results, real_stream = [], default_engine.stream

    def recording_stream(messages, *config, **options):
        stream = real_stream(messages, *config, **options)
        results.append(([dict(m) for m in messages], stream))
        return stream

    lines = iter(["Name three rivers.", "Which is longest?", "Where does it start?", "Thanks, summarise."])
    monkeypatch.setattr(builtins, "input", lambda prompt="": _next_or_eof(lines))
    monkeypatch.setattr(loading, "load", lambda args: default_engine)
    monkeypatch.setattr(default_engine, "stream", recording_stream)
    default_engine.prefix_cache.clear()
    assert main(["chat", "--max-tokens", "24", "--system", "Be brief."]) == 0
    speed_lines = [line for line in capsys.readouterr().err.splitlines() if "prompt tokens" in line]
    assert len(results) == len(speed_lines) == 4
    for turn, ((messages, stream), line) in enumerate(zip(results, speed_lines)):
        cached = stream.result.stats.cached_tokens
        if turn == 0:
            assert cached == 0 and "prefix cache" not in line
            continue
        # The last turn ran its prompt and all its answer but the last token; the cache serves the
        # whole blocks of that which this prompt begins with.
        before = default_engine.encode(results[turn - 1][0]) + results[turn - 1][1].result.token_ids
        now = default_engine.encode(messages)
        common = next((i for i, (a, b) in enumerate(zip(before, now)) if a != b), min(len(before), len(now)))
        assert cached == min(common, len(before) - 1, len(now) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0
        assert f"({cached} from the prefix cache)" in line
        alone = default_engine.generate(messages, max_tokens=24, prefix_cache=False)
        assert alone.token_ids == stream.result.token_ids and alone.finish_reason == stream.result.finish_reason


def _next_or_eof(lines):
    try:
        return next(lines)
    except StopIteration:
        raise EOFError from None


class Terminal:
    """Stands in for stdin on a terminal."""

    def __init__(self, text=""):
        self.text = text

    def isatty(self):
        return True

    def read(self):
        return self.text


def test_no_prompt_on_a_terminal_is_an_error_not_a_silent_wait(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal())
    code, out, err = run_main(capsys, "generate")
    assert code == 2 and "no prompt" in err and '"-"' in err


def test_dash_on_a_terminal_says_it_reads_stdin(capsys, monkeypatch):
    from specee.cli.generate import read_prompt

    monkeypatch.setattr(sys, "stdin", Terminal("Name a river."))
    assert read_prompt("-") == "Name a river."
    assert "reading the prompt from stdin" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["train", "ngram", "--out", "x.pt", "--skip-first", "-5"],
    ["train", "copy-prior", "--dataset", "humaneval", "--skip-first", "-1"],
    ["bench", "--skip-first", "-2"],
    ["generate", "hi", "--top-k", "-3"],
    ["train", "ngram", "--out", "x.pt", "--order", "0"],
])
def test_negative_counts_are_refused_before_anything_loads(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path):
    from specee.cli import loading
    from specee.cli.common import UsageError, writable

    monkeypatch.setattr(loading, "load", lambda args: pytest.fail("loaded the model for an output it cannot write"))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    code, out, err = run_main(capsys, "bench", "--out", str(a_file))  # a folder where a file is
    assert code == 2 and "--out" in err and "cannot write a folder" in err
    code, out, err = run_main(capsys, "bench", "--out", str(a_file / "inside"))
    assert code == 2 and "cannot write" in err
    assert writable(tmp_path / "new" / "deeper", "--out", folder=True) == tmp_path / "new" / "deeper"
    assert writable(a_file, "--out", folder=False) == a_file
    with pytest.raises(UsageError):
        writable(tmp_path, "--out", folder=False)  # a file where a folder is


def test_bench_without_its_extra_says_how_to_install_it(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    code, out, err = run_main(capsys, "bench")
    assert code == 2 and 'pip install "specee[bench]"' in err


def test_serve_without_its_extra_names_the_install_command(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real_find_spec(name, *a))
    code, out, err = run_main(capsys, "serve")
    assert code == 2 and "pip install 'specee[serve]'" in err and out == ""


@pytest.mark.parametrize("flags,message", [
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--port", "70000"], "--port must be at most 65535"),
    (["--spec-method", "magic"], "unknown --spec-method 'magic'"),
])
def test_serve_bad_flags_exit_2_before_loading(capsys, flags, message):
    code, _, err = run_main(capsys, "serve", *flags)
    assert code == 2 and message in err


@pytest.mark.parametrize("host,warned", [("0.0.0.0", True), ("192.168.1.5", True), ("127.0.0.1", False),
                                         ("::1", False), ("localhost", False)])
def test_serve_warns_when_it_binds_beyond_loopback_without_a_key(capsys, monkeypatch, tmp_path, host, warned):
    """Nothing binds here: the model load and the server are replaced."""
    import specee.cli.loading as loading
    import specee.server.app as server_app

    calls, bound = [], []
    source = tmp_path / "fake-model.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(loading, "load", lambda args: type("FakeEngine", (), {"source": source})())
    monkeypatch.setattr(server_app, "bind", lambda host, port: bound.append((host, port)) or socket.socket())
    monkeypatch.setattr(server_app, "serve", lambda engine, config, listening: calls.append(config))
    code, _, err = run_main(capsys, "serve", "--host", host, "--port", "9999", "--temperature", "0.5")
    assert code == 0 and ("without --api-key" in err) == warned
    assert bound == [(host, 9999)] and calls[0].defaults.generation["temperature"] == 0.5
    assert calls[0].model_id == "fake-model"


def test_serve_refuses_an_empty_key_and_a_busy_port_before_loading(capsys, monkeypatch):
    """Both exit 2 at once: loading the default model is refused in this tier, so a load would fail."""
    monkeypatch.setenv("SPECEE_API_KEY", "")
    code, _, err = run_main(capsys, "serve")
    assert code == 2 and "API key is empty" in err
    code, _, err = run_main(capsys, "serve", "--api-key", "  ")
    assert code == 2 and "API key is empty" in err
    monkeypatch.delenv("SPECEE_API_KEY")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run_main(capsys, "serve", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_generate_follows_a_json_schema_with_speculation(capsys, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    (tmp_path / "person.json").write_text(json.dumps(schema))
    code, out, err = run_main(capsys, "generate", "Describe a cat as JSON with its name and age.", "--json-schema",
                              str(tmp_path / "person.json"), "--spec-method", "hybrid", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    answer = json.loads(result["text"])
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    assert result["finish_reason"] == "stop"
