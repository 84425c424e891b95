"""Models and templates we cannot use are refused with one clear line, never a traceback or a
half-loaded model."""
import json
import shutil

import pytest

from helpers import GGUF_SHAPE as SHAPE, tiny_model_directory, write_gguf
from specee.cli import main
from specee.model.loading import ModelLoadError, resolve_model_dir
from specee.tokenizer import Tokenizer


def test_gguf_of_another_architecture_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", SHAPE)
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not one specee runs \(supported: llama, qwen2, mistral, qwen3, "
                                             r"gemma3\)"):
        resolve_model_dir(path)
    assert not list((tmp_path / "cache").glob("gpt2*"))  # nothing half-converted was kept


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma2"}, "unsupported model_type 'gemma2'.*llama, mistral, qwen2, qwen3, gemma3_text"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
    ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
])
def test_a_model_directory_of_another_architecture_is_refused_by_name(tmp_path, capsys, change, message):
    import re

    model = tiny_model_directory(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    code = main(["generate", "hi", "--model", str(model)])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err) and "Traceback" not in err


def test_gguf_missing_required_metadata_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "shapeless.gguf", "llama", {k: v for k, v in SHAPE.items() if k != "block_count"})
    code = main(["generate", "hi", "--model", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "llama.block_count" in err and "Traceback" not in err


def test_config_missing_a_required_field_names_it(tmp_path, capsys):
    model = tiny_model_directory(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    del config["hidden_size"]
    (model / "config.json").write_text(json.dumps(config))
    code = main(["generate", "hi", "--model", str(model)])
    err = capsys.readouterr().err
    assert code == 2 and "hidden_size" in err and "config.json" in err and "Traceback" not in err


def test_a_chat_template_that_raises_is_a_clear_error(tmp_path, tiny_tokenizer):
    shutil.copy(tiny_tokenizer.directory / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = Tokenizer(tmp_path, eos_token_ids=[2])
    assert tokenizer.encode_prompt("hello")  # a user message is fine
    with pytest.raises(ValueError, match="chat template refused these messages: System role not supported"):
        tokenizer.encode_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
