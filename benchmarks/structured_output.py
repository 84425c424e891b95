"""Structured output's speed on the default model and format: dense decoding under a JSON schema
against dense without one (tokens per second: the answers differ), and each lossless speculative
method under the schema against dense under it (time for the same tokens). Three kinds of task:
extraction (the values are in the prompt), records (invented values) and classification (an enum
and a short reason), four prompts each. Modes interleaved per prompt, after a warm-up; geometric
means over prompts, then over kinds. Nothing here was tuned: the methods run with their defaults.
The JSON line at the end says, per mode, the passes each method drafted and the tokens drafted.

    python benchmarks/structured_output.py [--repeats 3] [--methods prompt-lookup,hybrid,eagle,kangaroo]
"""
import argparse
import json
import math
import platform
import statistics
import time

import specee
from specee.grammar import Grammar

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "city": {"type": "string"}, "email": {"type": "string"}},
          "required": ["name", "age", "city", "email"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"],
        "additionalProperties": False}}, "total": {"type": "number"}},
    "required": ["order_id", "items", "total"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                                         "location": {"type": "string"},
                                         "attendees": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "date", "location", "attendees"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                        "year": {"type": "integer"}, "genres": {"type": "array",
                                                                                "items": {"type": "string"}}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}
SENTIMENT = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                             "reason": {"type": "string"}},
             "required": ["sentiment", "reason"], "additionalProperties": False}
TOPIC = {"type": "object", "properties": {"topic": {"enum": ["sports", "politics", "technology", "health",
                                                             "finance"]},
                                         "confidence": {"type": "number"}, "keywords": {"type": "array",
                                                                                        "items": {"type": "string"}}},
         "required": ["topic", "confidence", "keywords"], "additionalProperties": False}

TASKS = {
    "extraction": [
        ("Extract the person as JSON. Text: Maria Gonzalez, 34, lives in Barcelona and can be reached at "
         "maria.gonzalez@example.com.", PERSON),
        ("Extract the order as JSON. Order #A-1093: 2 x USB-C cable, 1 x wireless mouse, 3 x notebook. "
         "Total charged: 47.85 dollars.", ORDER),
        ("Extract the event as JSON. The Annual Robotics Meetup takes place on 2024-05-17 at the Science "
         "Hall in Boston; confirmed attendees are Alice Chen, Bob Smith and Priya Patel.", EVENT),
        ("Extract the book as JSON. 'The Left Hand of Darkness' by Ursula K. Le Guin, published in 1969, is "
         "a science fiction and feminist fiction classic.", BOOK),
    ],
    "records": [
        ("Invent a customer record as JSON with name, age, city and email.", PERSON),
        ("Invent an online order as JSON with an id, three items and the total.", ORDER),
        ("Invent a company event as JSON with a title, date, location and four attendees.", EVENT),
        ("Describe a famous novel as JSON with title, author, year and genres.", BOOK),
    ],
    "classification": [
        ("Classify the sentiment of this review as JSON: 'The battery died after two days and support never "
         "answered my emails.'", SENTIMENT),
        ("Classify the sentiment of this review as JSON: 'Fast shipping, great fit, and the colour is exactly "
         "as pictured.'", SENTIMENT),
        ("Classify the topic of this headline as JSON: 'Central bank raises interest rates for the third time "
         "this year'", TOPIC),
        ("Classify the topic of this headline as JSON: 'New smartphone chip doubles battery life, maker "
         "says'", TOPIC),
    ],
}
METHODS = ("prompt-lookup", "hybrid", "eagle", "kangaroo")


def timed(engine, prompt, spec_method, max_tokens=160, **options):
    began = time.perf_counter()
    result = engine.generate(prompt, max_tokens=max_tokens, spec_method=spec_method, **options)
    return time.perf_counter() - began - result.stats.prefill_s, result


def ran(totals: dict, stats) -> None:
    """Adds a generation's passes by drafting method ("none": dense, "grammar": tokens the schema
    forced) and its draft tokens to a mode's `totals`: what the mode decoded with."""
    for method, passes in stats.method_passes.items():
        totals["method_passes"][method] = totals["method_passes"].get(method, 0) + passes
    totals["drafted"] += stats.draft_tokens_proposed


def geomean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode and prompt (the median counts)")
    parser.add_argument("--methods", default=",".join(METHODS), help="the lossless speculative methods to time")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per kind of task (at most 4)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    engine = specee.load(args.model)
    print(f"{cpu}, {engine.cpu_tier} kernels, {engine.quantization} weights")
    modes = {"free dense": {"spec_method": "none"}, "json dense": {"grammar": None, "spec_method": "none"}} | {
        f"json {m}": {"grammar": None, "spec_method": m} for m in methods}
    totals = {name: {"spec_method": mode["spec_method"], "method_passes": {}, "drafted": 0}
              for name, mode in modes.items()}
    ratios = {kind: {name: [] for name in ("json dense / free dense (tok/s)", *[f"json {m} / json dense" for m in
                                                                                methods])} for kind in TASKS}
    for kind, tasks in TASKS.items():
        for prompt, schema in tasks[:args.prompts]:
            grammar = Grammar.json_schema(schema)
            options = {name: {k: (grammar if k == "grammar" else v) for k, v in mode.items()} | {
                "max_tokens": args.max_tokens} for name, mode in modes.items()}
            for name in modes:  # warm-up, and the answers
                ran(totals[name], timed(engine, prompt, **options[name])[1].stats)
            times = {name: [] for name in modes}
            results = {}
            for _ in range(args.repeats):
                for name in modes:
                    seconds, results[name] = timed(engine, prompt, **options[name])
                    times[name].append(seconds)
                    ran(totals[name], results[name].stats)
            median = {name: statistics.median(values) for name, values in times.items()}
            dense = results["json dense"]
            if dense.finish_reason == "stop":
                json.loads(dense.text)  # the schema held
            for m in methods:
                assert results[f"json {m}"].token_ids == dense.token_ids, (m, prompt)
            free_rate = results["free dense"].completion_tokens / median["free dense"]
            json_rate = dense.completion_tokens / median["json dense"]
            row = ratios[kind]
            row["json dense / free dense (tok/s)"].append(json_rate / free_rate)
            for m in methods:
                row[f"json {m} / json dense"].append(median["json dense"] / median[f"json {m}"])
            print(f"{kind:14s} {dense.completion_tokens:4d} tokens  " + "  ".join(
                f"{name} {values[-1]:.2f}x" for name, values in row.items()), flush=True)
    print("\ngeometric means")
    names = list(next(iter(ratios.values())))
    print(f"{'':16s}" + "".join(f"{name:>34s}" for name in names))
    for kind, row in ratios.items():
        print(f"{kind:16s}" + "".join(f"{geomean(row[name]):33.2f}x" for name in names))
    overall = {name: geomean([geomean(r[name]) for r in ratios.values()]) for name in names}
    print(f"{'all kinds':16s}" + "".join(f"{overall[name]:33.2f}x" for name in names))
    print(json.dumps({"max_tokens": args.max_tokens, "modes": totals, "geomean": overall}))


if __name__ == "__main__":
    main()
