import pytest
import torch

from specee.verification.draft import Draft
from specee.verification.tree import TreeLayout, dynamic_tree, parse_tree_paths, static_tree


def bool_matrix(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_chain_layout():
    layout = TreeLayout.of(Draft.chain([7, 8, 9]))
    assert layout.depths == [1, 2, 3]
    assert torch.equal(
        layout.attention_mask(), bool_matrix(["1000", "1100", "1110", "1111"])
    )
    assert layout.positions(10).tolist() == [10, 11, 12, 13]
    assert layout.path_to(2) == [0, 1, 2]
    assert layout.children(-1) == [0] and layout.children(2) == []


def test_two_branch_tree_layout():
    # root -> 0 -> {2, 3};  root -> 1 -> 4
    layout = TreeLayout([-1, -1, 0, 0, 1])
    assert layout.depths == [1, 1, 2, 2, 2]
    expected = bool_matrix([
        "100000",  # root
        "110000",  # node 0
        "101000",  # node 1
        "110100",  # node 2: root, 0, itself
        "110010",  # node 3: root, 0, itself
        "101001",  # node 4: root, 1, itself
    ])
    assert torch.equal(layout.attention_mask(), expected)
    assert torch.equal(layout.attention_mask(include_root=False), expected[1:, 1:])
    assert layout.positions(4).tolist() == [4, 5, 5, 6, 6, 6]
    assert layout.children(-1) == [0, 1] and layout.children(0) == [2, 3]
    assert layout.path_to(3) == [0, 3] and layout.path_to(4) == [1, 4]


def test_interleaved_deep_tree_layout():
    # root -> 0 -> 1 -> 3;  root -> 2 -> 4, nodes listed out of depth order
    layout = TreeLayout([-1, 0, -1, 1, 2])
    assert layout.depths == [1, 2, 1, 3, 2]
    expected = bool_matrix([
        "100000",
        "110000",
        "111000",
        "100100",
        "111010",
        "100101",
    ])
    assert torch.equal(layout.attention_mask(), expected)
    assert layout.positions(5).tolist() == [5, 6, 7, 6, 8, 7]
    assert layout.path_to(3) == [0, 1, 3]


def test_layout_rejects_parent_after_child():
    with pytest.raises(ValueError, match="parents must come before"):
        TreeLayout([-1, 2, 0])


def test_static_tree_parses_and_orders_paths():
    from_string = parse_tree_paths("0,0;1;0;0,1;1,0")
    from_json = parse_tree_paths("[[0, 0], [1], [0], [0, 1], [1, 0]]")
    assert from_string == from_json
    tree = static_tree(from_string)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.parents == (-1, -1, 0, 0, 1)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "at least one"),
        ([(0,), (0, 0), (1, 1)], "no parent"),
        ([(0,), (0,)], "twice"),
        ([(0,), ()], "empty"),
        ([(0,), (-1,)], "non-negative"),
    ],
)
def test_static_tree_rejects_invalid_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        static_tree(paths)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot read tree paths"):
        parse_tree_paths("0;a,1")


def test_static_tree_fill_takes_ranked_candidates_and_drops_missing_ranks():
    candidates = {
        (): [(10, 0.5), (11, 0.3)],
        (10,): [(20, 0.6), (21, 0.2)],
        (11,): [(30, 0.9)],  # only one guess: rank 1 under (11,) has nothing to fill it
    }
    calls = []

    def expand(path):
        calls.append(path)
        return candidates[path]

    tree = static_tree(parse_tree_paths("0;1;0,0;0,1;1,0;1,1;1,1,0"))
    draft = tree.fill(expand)
    assert draft.tokens == [10, 11, 20, 21, 30]
    assert draft.parents == [-1, -1, 0, 0, 1]
    assert draft.q is None and not draft.sampled
    assert sorted(calls) == [(), (10,), (11,)]  # once per node with children, none for (1, 1)


def fake_expand(table, calls=None):
    def expand(path):
        if calls is not None:
            calls.append(path)
        return table.get(path, [])

    return expand


# Path probabilities: 10: .6, 11: .4, 10-12: .54, 10-13: .06, 11-14: .32, 11-15: .08,
# 10-12-16: .378, 10-12-17: .162, 11-14-18: .288
EXPAND_TABLE = {
    (): [(10, 0.6), (11, 0.4)],
    (10,): [(12, 0.9), (13, 0.1)],
    (11,): [(14, 0.8), (15, 0.2)],
    (10, 12): [(16, 0.7), (17, 0.3)],
    (11, 14): [(18, 0.9)],
}


def test_dynamic_tree_adds_nodes_in_path_probability_order():
    draft = dynamic_tree(fake_expand(EXPAND_TABLE), budget=6, max_depth=3)
    assert draft.tokens == [10, 12, 11, 16, 14, 18]
    assert draft.parents == [-1, 0, -1, 1, 2, 4]


def test_dynamic_tree_respects_max_depth_and_never_expands_past_it():
    calls = []
    draft = dynamic_tree(fake_expand(EXPAND_TABLE, calls), budget=5, max_depth=2)
    # .6, .54, .4, .32, then 11-15 (.08) beats 10-13 (.06)
    assert draft.tokens == [10, 12, 11, 14, 15]
    assert draft.parents == [-1, 0, -1, 2, 2]
    assert all(len(path) < 2 for path in calls)


def test_dynamic_tree_stops_when_candidates_run_out():
    draft = dynamic_tree(fake_expand({(): [(1, 0.5)]}), budget=4, max_depth=4)
    assert draft.tokens == [1] and draft.parents == [-1]


def test_dynamic_tree_stops_when_confidence_runs_out():
    """Paths below min_prob are not drafted, even with budget left."""
    children = {(): [(1, 0.9), (2, 0.1)], (1,): [(3, 0.5), (4, 0.4)], (2,): [(5, 1.0)]}
    draft = dynamic_tree(lambda path: children.get(path, []), budget=10, max_depth=3, min_prob=0.3)
    # path probabilities: 1: 0.9, 1-3: 0.45, 1-4: 0.36, 2: 0.1 (below), 2-5: 0.1 (below)
    assert draft.tokens == [1, 3, 4]
    assert draft.parents == [-1, 0, 0]


def test_dynamic_tree_stops_where_another_node_would_lower_tokens_per_pass_cost():
    # Path probabilities in best-first order: .6 .54 .4 .378 .32 .288 .162 .08 .06
    draft = dynamic_tree(fake_expand(EXPAND_TABLE), budget=10, max_depth=3, node_cost=0.2)
    assert draft.tokens == [10, 12, 11, 16]
    assert draft.parents == [-1, 0, -1, 1]
    ordered = [0.6, 0.54, 0.4, 0.378, 0.32, 0.288, 0.162, 0.08, 0.06]
    value = [(1 + sum(ordered[:n])) / (1 + 0.2 * n) for n in range(len(ordered) + 1)]
    assert max(range(len(value)), key=value.__getitem__) == len(draft.tokens)
    # Free nodes: only the budget limits the tree.
    assert len(dynamic_tree(fake_expand(EXPAND_TABLE), budget=10, max_depth=3, node_cost=0.0)) == 9
