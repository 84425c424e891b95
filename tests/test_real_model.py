"""The default model (SmolLM2-135M-Instruct from its GGUF) against Hugging Face transformers,
which reads the same GGUF with its own loader: greedy tokens identical, logits close (fp32)."""
import pytest
import torch

from specee.model.loading import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a python function that checks whether a number is prime.",
    "Describe the water cycle in detail.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a short story about a robot who learns to paint.",
    "Explain what a hash table is to a beginner.",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_greedy_tokens_identical_to_hugging_face_generate(default_engine, hf_model):
    eos = default_engine.tokenizer.eos_token_ids
    full_length = 0
    for prompt in PROMPTS[:3]:  # Hugging Face's generate on one core is slow; the logits test covers the rest
        ids = default_engine.encode(prompt)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=eos[0])
        expected = out[0, len(ids):].tolist()
        got = default_engine.generate(ids, max_tokens=64, spec_method="none").token_ids
        assert got == expected, prompt
        full_length += len(got) == 64
    assert full_length == 3  # every prompt compared over the whole 64 tokens


def test_prompt_logits_close_to_hugging_face(default_engine, hf_model):
    ids = default_engine.encode(PROMPTS[0])
    model = default_engine.model
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
        got = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)


def test_chat_template_matches_hugging_face(default_engine):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(default_engine.tokenizer.directory))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, ünïcode 😀"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert default_engine.tokenizer.apply_chat_template(messages) == expected
    assert default_engine.encode(messages) == tokenizer(expected, add_special_tokens=False)["input_ids"]
