"""What the tree tests share: a tree's paths and scores as a dict, and the structure every draft tree must have."""

from __future__ import annotations

from dart_core import DraftTree


def tree_as_dict(tree: DraftTree) -> dict:
    """{path of tokens: score} of every node but the root."""
    return {path: float(s) for path, s in zip(tree.paths(), tree.scores[1:].tolist())}


def check_structure(tree: DraftTree, root_token):
    """Node 0 is the root; parents precede children; depths follow parents; the node set is prefix-closed."""
    assert int(tree.tokens[0]) == root_token and int(tree.parents[0]) == -1 and int(tree.depths[0]) == 0
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i in range(1, tree.num_nodes):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
    paths = set(tree.paths())
    assert len(paths) == tree.num_nodes - 1
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)
    assert (tree.scores[1:] <= tree.scores[tree.parents[1:]]).all()
