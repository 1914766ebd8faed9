"""The layout rules of ShardedStrategy (strategies/layout_rules.py): the default, the user's rules, what
they refuse and warn about, and the table `describe_layout` prints."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, SequenceKey

from jaxstrategy._src.strategies.layout_rules import LayoutDescription, LayoutRules, follow_spec


def _path(*keys):
    return tuple(SequenceKey(k) if isinstance(k, int) else DictKey(k) for k in keys)


def _rules(layout=None, shards=4, min_shard_bytes=1024):
    return LayoutRules(layout, shards=shards, min_shard_bytes=min_shard_bytes, caller="ShardedStrategy()")


def test_the_default_splits_the_largest_dimension_the_shards_divide():
    rules = _rules()
    assert rules.leaf(_path("w"), (512, 1024), np.float32).spec == P(None, "shard")
    # 1026 does not divide by 4; 512 does.
    assert rules.leaf(_path("w"), (512, 1026), np.float32).spec == P("shard", None)
    assert rules.leaf(_path("w"), (512, 512), np.float32).spec == P("shard", None)  # The first of equals.


def test_the_default_replicates_small_leaves_and_one_device_replicas():
    leaf = _rules().leaf(_path("b"), (255,), np.float32)  # 1020 bytes, under 1024.
    assert leaf.spec == P() and "under min_shard_bytes" in leaf.reason
    assert _rules(shards=1).leaf(_path("w"), (4096, 4096), np.float32).spec == P()


def test_a_large_leaf_no_dimension_of_which_divides_is_replicated_with_one_warning():
    rules = _rules()
    with pytest.warns(
        UserWarning, match=r"the leaf 'odd' of shape \(3, 1023\) .* no dimension of it divides over 4"
    ):
        assert rules.leaf(_path("odd"), (3, 1023), np.float32).spec == P()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rules.leaf(_path("odd"), (3, 1023), np.float32)  # Once per leaf.


def test_a_rule_matches_the_whole_path_or_trailing_keys():
    rules = _rules([("dense/kernel", P("shard", None))])
    for path in (_path("dense", "kernel"), _path(0, "dense", "kernel"), _path(1, 0, "mu", "dense", "kernel")):
        leaf = rules.leaf(path, (8, 8), np.float32)
        assert leaf.spec == P("shard", None) and leaf.reason == "rule 'dense/kernel'"
    # Not part of a key: 'ense/kernel' is no whole key.
    assert (
        _rules([("ense/kernel", P("shard"))]).leaf(_path("dense", "kernel"), (8, 8), np.float32).spec == P()
    )


def test_two_matching_rules_are_an_error_naming_both():
    rules = _rules([(".*kernel", P("shard")), ("dense/.*", P(None, "shard"))])
    with pytest.raises(
        ValueError, match=r"'dense/kernel' matches more than one layout rule:\n  '\.\*kernel'\n  'dense/\.\*'"
    ):
        rules.leaf(_path("dense", "kernel"), (8, 8), np.float32)


def test_a_declared_spec_comes_before_the_rules_and_a_followed_one_after():
    rules = _rules([("w", P("shard", None))])
    declared = rules.leaf(
        _path("w"), (8, 8), np.float32, declared=(P(None, "shard"), "Flax Variable annotation")
    )
    assert declared.spec == P(None, "shard")
    followed = rules.leaf(_path("w"), (8, 8), np.float32, follows=(P(None, "shard"), "input 'w'"))
    assert followed.spec == P("shard", None)
    other = rules.leaf(_path("v"), (8, 8), np.float32, follows=(P(None, "shard"), "input 'v'"))
    assert other.spec == P(None, "shard") and other.reason == "follows input 'v'"


def test_an_output_follows_the_input_with_the_longest_path_it_ends_with():
    inputs = [(_path(), (8, 8), P("shard")), (_path("dense", "kernel"), (8, 8), P(None, "shard"))]
    assert follow_spec(_path(0, "mu", "dense", "kernel"), (8, 8), inputs) == (
        P(None, "shard"),
        "input 'dense/kernel'",
    )
    assert follow_spec(_path("x"), (8, 8), inputs) == (P("shard"), "input 'an argument'")
    assert follow_spec(_path("dense", "kernel"), (4, 8), inputs) is None  # Another shape.


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        ("dense", TypeError, r"layout must be a list of \(regex, spec\) pairs; got 'dense'"),
        ([("dense",)], TypeError, r"layout\[0\] must be a \(regex, spec\) pair; got \('dense',\)"),
        ([("(", P())], ValueError, r"layout\[0\]'s regex '\(' does not compile"),
        ([("w", P("replica"))], ValueError, r"names 'replica'; .*\. Replicas always hold their whole model"),
        ([("w", P("tensor", None))], ValueError, r"names 'tensor'; .* over 'shard' and 'model' only\.$"),
        ([("w", P("shard", "shard"))], ValueError, r"names 'shard' more than once; an axis splits one"),
        ([("w", P(("model", "shard"), "model"))], ValueError, r"names 'model' more than once"),
        ([("w", "shard")], TypeError, r"the spec of layout\[0\] \('w'\) must be a PartitionSpec"),
    ],
)
def test_malformed_rules_are_refused_when_the_strategy_is_made(layout, error, message):
    with pytest.raises(error, match=message):
        _rules(layout)


def test_a_spec_is_accepted_as_a_tuple_of_its_entries():
    assert _rules([("w", (None, "shard"))]).rules == (("w", P(None, "shard")),)


def test_min_shard_bytes_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match=r"min_shard_bytes must be a non-negative int.*; got -1"):
        _rules(min_shard_bytes=-1)


def test_a_rule_that_does_not_fit_its_leaf_is_an_error_naming_both():
    rules = _rules([("w", P(None, None, "shard")), ("v", P("shard"))])
    with pytest.raises(ValueError, match=r"from rule 'w' has 3 entries, but the leaf 'w' has shape \(8, 8\)"):
        rules.leaf(_path("w"), (8, 8), np.float32)
    with pytest.raises(
        ValueError,
        match=r"splits dimension 0 \(of size 6\) of the leaf 'v' over 4 devices, which does not divide it",
    ):
        rules.leaf(_path("v"), (6,), np.float32)


def test_rules_that_match_no_leaf_are_warned_about_once():
    rules = _rules([("dense/kernel", P("shard")), ("typo/kernel", P("shard"))])
    paths = [_path("dense", "kernel"), _path("dense", "bias")]
    assert rules.unmatched_rules(paths) == ["typo/kernel"]
    with pytest.warns(
        UserWarning, match=re.escape("the layout rule 'typo/kernel' matched no leaf of the tree")
    ):
        rules.warn_unmatched(paths, "ShardedStrategy.put()")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rules.warn_unmatched(paths, "ShardedStrategy.put()")


def test_the_table_gives_each_leaf_and_the_totals():
    rules = _rules([("dense/kernel", P(None, "shard"))])
    rows = (
        rules.leaf(_path("dense", "kernel"), (256, 512), np.float32),
        rules.leaf(_path("dense", "bias"), (512,), np.float32),
    )
    table = LayoutDescription(rows, shards=4, unmatched_rules=("typo",))
    # The kernel by its rule, the bias (2 KiB) by the default: a quarter of each per device.
    assert table.bytes_per_device == 256 * 512 + 512 and table.replicated_bytes == 256 * 512 * 4 + 2048
    text = str(table)
    assert text.splitlines()[0].split() == ["path", "shape", "spec", "per", "device", "decided", "by"]
    assert "dense/kernel  float32[256, 512]  (None, 'shard')  128.0 KiB   rule 'dense/kernel'" in text
    assert (
        "dense/bias    float32[512]       ()               2.0 KiB     default: largest dimension 4 divides"
        not in text
    )
    assert "per device: 128.5 KiB of 514.0 KiB replicated (25%), over 4 devices per replica" in text
    assert "rule 'typo' matched no leaf" in text
