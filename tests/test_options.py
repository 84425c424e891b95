"""Loading's options are declared once (`LoadOptions`): every command takes each as a flag,
`specee.load` takes each as a keyword and refuses any other, and a Ray Serve config's replicas load
with each. No model loads here."""
import inspect
from dataclasses import fields, replace

import pytest

from specee.cli import build_parser
from specee.cli.serve import options_from_config
from specee.options import LoadOptions, from_mapping, from_namespace

NAMES = [f.name for f in fields(LoadOptions)]
# Every option away from its default (and valid on this CPU, as a config's options are checked).
GIVEN = LoadOptions(model="m.gguf", dtype="bf16", device="cuda", threads=3, quantization="int8", compile=False,
                    ctx_size=64, prefix_cache_mb=1.5, suffix_cache_tokens=0, kv_cache_dtype="fp16", cpu_tier="portable")
ON_THIS_CPU = replace(GIVEN, device="cpu")
COMMANDS = [["generate"], ["chat"], ["serve"], ["bench"], ["bench-serve"], ["train", "ngram", "--out", "t"],
            ["train", "eagle", "--out", "e"], ["train", "kangaroo", "--out", "k"], ["train", "exits", "--out", "x"],
            ["train", "copy-prior", "--dataset", "d"]]


def test_the_example_sets_every_option():
    assert all(getattr(GIVEN, f.name) != f.default for f in fields(LoadOptions))
    assert len(GIVEN.flags()) == len(NAMES)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_every_load_option_as_a_flag(command):
    parser = build_parser()
    assert from_namespace(LoadOptions, parser.parse_args([*command, *GIVEN.flags()])) == GIVEN
    defaults = from_namespace(LoadOptions, parser.parse_args(command))
    # Trained drafters are made on the dense weights; an n-gram table reads only answers, in the format users run.
    dense = command[0] == "train" and command[1] != "ngram"
    assert defaults == LoadOptions(quantization="none" if dense else "auto")


def test_flags_leave_out_defaults_and_what_is_asked():
    assert LoadOptions().flags() == []
    assert GIVEN.flags(leave_out=("threads", "compile")) == [
        "--model=m.gguf", "--dtype=bf16", "--device=cuda", "--quantization=int8", "--ctx-size=64",
        "--prefix-cache-mb=1.5", "--suffix-cache-tokens=0", "--kv-cache-dtype=fp16", "--cpu-tier=portable"]


def test_specee_load_takes_exactly_the_load_options(monkeypatch):
    import specee.engine

    assert list(inspect.signature(specee.load).parameters) == NAMES
    seen = {}
    monkeypatch.setattr(specee.engine, "load_engine", lambda **options: seen.update(options) or "engine")
    assert specee.load("m.gguf", threads=3) == "engine"
    assert seen == LoadOptions(model="m.gguf", threads=3).keywords()
    assert specee.load(**GIVEN.keywords()) == "engine" and seen == GIVEN.keywords()
    with pytest.raises(TypeError, match=r"specee.load\(\) has no option 'quantisation' \(did you mean "
                                        r"'quantization'\?\); its options: model, dtype, device"):
        specee.load(quantisation="int4")


def test_a_ray_serve_config_takes_every_load_option():
    assert from_mapping(LoadOptions, GIVEN.keywords()) == GIVEN
    assert from_mapping(LoadOptions, {"threads": "3", "compile": False, "model": None}) == \
        LoadOptions(threads=3, compile=False)
    assert from_namespace(LoadOptions, options_from_config(ON_THIS_CPU.keywords())) == ON_THIS_CPU


def test_the_ray_replicas_load_with_the_configs_options():
    pytest.importorskip("ray.serve")
    from specee.deploy import build

    ingress = build(ON_THIS_CPU.keywords() | {"replicas": 2})._bound_deployment
    spec, _ = ingress.init_args[0]._bound_deployment.init_args
    assert spec.load == ON_THIS_CPU
    spec, _ = build({"replicas": 2})._bound_deployment.init_args[0]._bound_deployment.init_args
    assert spec.load == LoadOptions(threads=spec.threads)  # the machine's cores shared among the replicas
