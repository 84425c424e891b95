"""One declaration of every decoding option: the CLI flags, the server's request schema and the
engine's keywords come from it, with the same names and ranges; defaults are filled for the model."""
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from specee.cli import build_parser
from specee.strategies.builder import (DEAR_CHAIN_LENGTH, DEAR_TREE_NODE_COST, DEFAULTS, QUANTIZED_CHAIN_LENGTH,
                                     QUANTIZED_TREE_NODE_COST, resolve)
from specee.server.schemas import SpecOptions
from specee.strategies.config import SpecConfig, all_fields, flag, from_flags, keyword

RANGED = [f for f in all_fields() if f.metadata["ge"] is not None]


@pytest.mark.parametrize("f", RANGED, ids=[keyword(f) for f in RANGED])
def test_a_value_out_of_range_is_refused_alike_by_flag_keyword_and_request(f):
    below = f.metadata["ge"] - 1
    with pytest.raises(ValueError, match=f"{keyword(f)} must be"):
        SpecConfig.from_keywords({keyword(f): below})
    if flag(f) is not None:
        args = build_parser().parse_args(["generate", "hi", flag(f), str(below)])
        with pytest.raises(ValueError, match=f"{flag(f)} must be"):
            from_flags(args)
    if f.metadata["http"]:
        with pytest.raises(ValidationError, match=keyword(f)):
            SpecOptions.model_validate({keyword(f): below})


def test_every_option_has_one_name_everywhere():
    parser_dests = set(vars(build_parser().parse_args(["generate", "hi"])))
    schema = set(SpecOptions.model_fields)
    for f in all_fields():
        assert (keyword(f) in parser_dests) == (flag(f) is not None), keyword(f)
        assert (keyword(f) in schema) == f.metadata["http"], keyword(f)
    # Files on the server are flags, never a request's.
    assert {"ngram_model", "drafter", "exit_predictors", "draft_model"} <= parser_dests
    assert not {"ngram_model", "drafter", "exit_predictors"} & schema and "draft_model" in schema


def test_keywords_round_trip_and_a_request_adjusts_or_replaces_the_servers_options():
    server = SpecConfig.from_keywords({"spec_method": "hybrid", "tree": "auto", "ngram_model": "t.pt",
                                       "exit": "rule", "exit_kv": "approx"})
    assert SpecConfig.from_keywords(server.keywords()) == server
    adjusted = server.merged({"tree_budget": 6})
    assert (adjusted.method, adjusted.tree, adjusted.tree_budget, adjusted.exit.kv) == ("hybrid", "auto", 6, "approx")
    replaced = server.merged({"spec_method": "prompt-lookup"})
    assert replaced.keywords() == {"spec_method": "prompt-lookup", "ngram_model": "t.pt"}
    assert hash(adjusted) != hash(server)  # configurations key the server's strategy cache


@pytest.mark.parametrize("keywords,message", [
    ({"spec_method": "none", "tree": "auto"}, "tree: no spec_method to read them"),
    ({"tree": "auto"}, "tree: auto sizes its own drafts"),
    ({"tree_budget": 3, "tree_node_cost": 0.5}, "tree_budget, tree_node_cost: auto sizes its own drafts"),
    ({"exit": "rule", "tree_budget": 3}, "tree_budget: no spec_method"),
    ({"exit_kv": "approx"}, "exit_kv need exit specee or exit rule"),
    ({"exit": "warp"}, "unknown exit 'warp'"),
    ({"spec_method": "prompt-lookup", "exit": "rule", "exit_kv": "fuzzy"}, "unknown exit_kv 'fuzzy'"),
])
def test_options_nothing_would_read_are_refused(keywords, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig.from_keywords(keywords)


def test_resolve_sizes_drafts_for_what_a_row_costs_and_leaves_trained_sizes_to_the_artifact():
    cheap, costly, dear = (SimpleNamespace(extra_row_cost=cost) for cost in (0.02, 0.15, 0.3))
    chain = SpecConfig(method="prompt-lookup")
    assert resolve(chain, cheap).num_draft_tokens == DEFAULTS["num_draft_tokens"]
    assert resolve(chain, costly).num_draft_tokens == QUANTIZED_CHAIN_LENGTH
    assert resolve(chain, dear).num_draft_tokens == DEAR_CHAIN_LENGTH
    tree = SpecConfig(method="hybrid", tree="auto")
    assert [resolve(tree, m).tree_node_cost for m in (cheap, costly, dear)] == [
        DEFAULTS["tree_node_cost"], QUANTIZED_TREE_NODE_COST, DEAR_TREE_NODE_COST]
    assert resolve(SpecConfig(method="prompt-lookup", num_draft_tokens=5), costly).num_draft_tokens == 5
    kangaroo = resolve(SpecConfig(method="kangaroo"), costly)
    assert kangaroo.num_draft_tokens is None and kangaroo.confidence_threshold is None
    assert kangaroo.tree_node_cost == DEFAULTS["tree_node_cost"]
