"""lm-evaluation-harness against `specee serve`: its own `local-completions` model runs a
log-likelihood task (multiple choice, a local task shipped here: nothing is downloaded) over the
server, tokenizing through the server's vLLM-style /tokenizer_info and /tokenize routes (no local
copy of the tokenizer), and every choice's log-likelihood, its greedy flag and the accuracy it
computes equal specee's own in-process scoring of the same questions."""
import json

import pytest

pytestmark = pytest.mark.slow  # a server process, and lm-eval's imports take seconds

QUESTIONS = [  # multiple choice: lm-eval scores " " + each choice after the question
    {"question": "The cat sat on the", "choices": ["mat", "sky", "number seven"], "answer": 0},
    {"question": "Name three colours: red, green,", "choices": ["blue", "Tuesday"], "answer": 0},
    {"question": "Hello there, how are", "choices": ["you?", "the mountains of the moon", "it"], "answer": 0},
    {"question": "One, two, three,", "choices": ["four", "banana", "cat sat"], "answer": 0},
    {"question": "The dog looked at the", "choices": ["cat", "naïve café 😀", "three"], "answer": 1},
    {"question": "Question: what is 2 + 2?\nAnswer:  ", "choices": ["4", "22", "four"], "answer": 0},
]
TASK = """task: specee_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model's directory and a server of it (fp32, as the in-process engine runs it)."""
    from helpers import tiny_model_directory
    from serve_helpers import running_server

    directory = tiny_model_directory(tmp_path_factory.mktemp("model"), seed=5)
    server = running_server("--model", str(directory), "--quantization", "none")
    yield directory, server
    assert server.stop() == 0, server.output()


def encode_pair(engine, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's tokens as lm-eval splits them (its `_encode_pair`:
    the context's trailing spaces go to the continuation; the whole is tokenized, then cut)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = engine.tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = engine.tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def in_process_score(engine, context: str, continuation: str) -> tuple[float, bool]:
    """specee's own scoring: the prompt's token log-probabilities from one prefill in this process,
    summed over the continuation's tokens; greedy when each is its row's likeliest token."""
    context_ids, continuation_ids = encode_pair(engine, context, continuation)
    result = engine.generate(context_ids + continuation_ids, max_tokens=0, prompt_logprobs=1, spec_method="none")
    scored = result.prompt_logprobs[len(context_ids) - 1:]  # entry i scores token i + 1
    assert [entry.token for entry in scored] == continuation_ids
    return sum(entry.logprob for entry in scored), all(entry.top[0][0] == entry.token for entry in scored)


def test_lm_eval_local_completions_scores_a_choice_task_as_specee_does_in_process(served, tmp_path, monkeypatch):
    import httpx
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import specee

    directory, server = served
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "specee_tiny_choice.yaml").write_text(TASK.format(data=data))
    model_id = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

    # tokenizer_backend "auto" finds the server's /tokenizer_info and /tokenize: the remote tokenizer.
    model_args = {"base_url": server.url + "/v1/completions", "model": model_id, "max_retries": 1,
                  "tokenizer_backend": "auto", "batch_size": 1, "num_concurrent": 1}
    model = get_model("local-completions")(**model_args)
    assert model.tokenizer_backend == "remote"  # it tokenizes through the server
    evaluated = lm_eval.simple_evaluate(
        model=model, tasks=["specee_tiny_choice"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))

    engine = specee.load(str(directory), quantization="none")
    samples = sorted(evaluated["samples"]["specee_tiny_choice"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample, question in zip(samples, QUESTIONS):
        served_scores = [tuple(response[0]) for response in sample["resps"]]  # (log-likelihood, greedy)
        assert len(served_scores) == len(question["choices"])
        own = [in_process_score(engine, question["question"], " " + choice) for choice in question["choices"]]
        for (served_value, served_greedy), (own_value, own_greedy) in zip(served_scores, own):
            assert served_value == pytest.approx(own_value, rel=1e-5, abs=1e-5), (question, served_scores, own)
            assert served_greedy == own_greedy
        best = max(range(len(own)), key=lambda i: own[i][0])
        correct += best == question["answer"]
        assert sample["acc"] == float(best == question["answer"])
    assert evaluated["results"]["specee_tiny_choice"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
