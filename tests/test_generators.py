"""The generators of synthetic classification data: ListOps (LRA) and multi-query associative recall."""

from collections import Counter
from statistics import median

import pytest

from xformer.data.generators import (
    GENERATORS,
    evaluate_listops,
    generate_listops,
    generate_recall,
    generator_splits,
    listops_spec,
    recall_spec,
)


def interpret(tokens: list[str]) -> int:
    """A recursive ListOps interpreter, written apart from the generator (LRA's semantics)."""
    ops = {
        "[MAX": max,
        "[MIN": min,
        "[MED": lambda a: int(median(a)),  # LRA: int(np.median(a)); statistics.median averages too
        "[SM": lambda a: sum(a) % 10,
    }

    def parse(i: int) -> tuple[int, int]:
        if tokens[i] not in ops:
            return int(tokens[i]), i + 1
        op, args, i = tokens[i], [], i + 1
        while tokens[i] != "]":
            value, i = parse(i)
            args.append(value)
        assert len(args) >= 2
        return ops[op](args), i + 1

    value, end = parse(0)
    assert end == len(tokens)
    return value


def test_interpreter_semantics():
    assert interpret("[MAX 2 9 [MIN 4 7 ] 0 ]".split()) == 9
    assert interpret("[MED 3 4 ]".split()) == 3  # median 3.5, truncated as LRA's int()
    assert interpret("[MED 1 8 2 ]".split()) == 2
    assert interpret("[SM 9 8 [MAX 1 5 ] ]".split()) == 2
    assert evaluate_listops("[MED 3 4 ]".split()) == 3


@pytest.mark.parametrize("max_length", [64, 256])
def test_listops_lengths_labels_and_evaluator(max_length):
    spec = listops_spec()
    assert spec.vocab[spec.pad_id] == "<pad>" and spec.n_classes == 10
    data = generate_listops(300, max_length, seed=0)
    assert len(data) == 300
    assert len({tuple(ids) for ids, _ in data}) == 300  # LRA keeps a set: no duplicates
    for ids, label in data:
        assert max_length // 4 < len(ids) < max_length  # LRA's strict bounds, min = max // 4
        assert spec.pad_id not in ids
        tokens = [spec.vocab[i] for i in ids]
        assert tokens[0].startswith("[")  # a lone digit is never long enough
        assert label == interpret(tokens) == evaluate_listops(tokens)
    counts = Counter(label for _, label in data)
    assert len(counts) >= 8 and max(counts.values()) < 0.3 * len(data)


def test_listops_uses_every_operator_and_reaches_depth():
    spec = listops_spec()
    data = generate_listops(200, 256, seed=1)
    seen = Counter(spec.vocab[i] for ids, _ in data for i in ids)
    assert all(seen[op] > 0 for op in ["[MAX", "[MIN", "[MED", "[SM"])
    depths = []
    for ids, _ in data:
        depth = deepest = 0
        for i in ids:
            depth += spec.vocab[i].startswith("[")
            depth -= spec.vocab[i] == "]"
            deepest = max(deepest, depth)
        depths.append(deepest)
    assert max(depths) <= 9  # LRA's max_depth=10 counts the digit leaves' level
    assert max(depths) >= 6


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_deterministic_by_seed(name):
    generate = GENERATORS[name][1]
    assert generate(50, 128, 3) == generate(50, 128, 3)
    assert generate(50, 128, 3) != generate(50, 128, 4)


@pytest.mark.parametrize("seq_len", [20, 64, 101, 2000])
def test_recall_labels_are_the_last_query_binding(seq_len):
    """Read back with the vocabulary, independently of the generator's id arithmetic."""
    spec = recall_spec()
    n_pairs, n_queries = 8, 4
    data = generate_recall(200 if seq_len < 2000 else 20, seq_len, seed=0, n_queries=n_queries, n_pairs=n_pairs)
    for ids, label in data:
        assert len(ids) == seq_len
        tokens = [spec.vocab[i] for i in ids]
        keys, values = tokens[0 : 2 * n_pairs : 2], tokens[1 : 2 * n_pairs : 2]
        rest = tokens[2 * n_pairs :]
        assert all(k.startswith("k") for k in keys) and all(v.startswith("v") for v in values)
        queries = [t for t in rest if t.startswith("k")]
        assert all(t.startswith(("k", "f")) for t in rest) and rest[-1] == queries[-1]
        assert len(set(keys)) == n_pairs and len(set(queries)) == len(queries) == n_queries
        assert set(queries) <= set(keys)
        binding = dict(zip(keys, values, strict=True))
        assert f"v{label}" == binding[tokens[-1]]
        assert 0 <= label < spec.n_classes


@pytest.mark.parametrize("seq_len", [20, 64, 301])
def test_recall_bindings_at_the_end_sit_just_before_the_query(seq_len):
    """With bindings = "end" the pairs are the 2 * n_pairs tokens before the last, the filler and
    its distractor queries come first; read back with the vocabulary, as above."""
    spec = recall_spec()
    n_pairs, n_queries = 4, 3
    for ids, label in generate_recall(200, seq_len, seed=2, n_queries=n_queries, n_pairs=n_pairs, bindings="end"):
        tokens = [spec.vocab[i] for i in ids]
        pairs = tokens[-1 - 2 * n_pairs : -1]
        keys, values = pairs[0::2], pairs[1::2]
        assert all(k.startswith("k") for k in keys) and all(v.startswith("v") for v in values)
        front = tokens[: -1 - 2 * n_pairs]
        assert all(t.startswith(("k", "f")) for t in front) and len(front) == seq_len - 2 * n_pairs - 1
        distractors = [t for t in front if t.startswith("k")]
        assert len(distractors) == n_queries - 1 and tokens[-1] not in distractors
        assert set(distractors + [tokens[-1]]) <= set(keys)
        assert f"v{label}" == dict(zip(keys, values, strict=True))[tokens[-1]]


def test_recall_bindings_start_and_end_are_the_same_data_where_there_is_no_filler():
    """The two layouts draw the same numbers: at the shortest length they cannot differ, and at
    any length the labels and the multiset of tokens are the same."""
    shortest = 2 * 3 + 1
    assert generate_recall(50, shortest, seed=4, n_queries=1, n_pairs=3) == \
        generate_recall(50, shortest, seed=4, n_queries=1, n_pairs=3, bindings="end")
    start = generate_recall(50, 40, seed=4, n_queries=2, n_pairs=3)
    end = generate_recall(50, 40, seed=4, n_queries=2, n_pairs=3, bindings="end")
    assert [b for _, b in start] == [b for _, b in end]
    assert all(Counter(a) == Counter(b) and a != b for (a, _), (b, _) in zip(start, end, strict=True))
    with pytest.raises(ValueError, match="bindings"):
        generate_recall(1, 40, seed=0, bindings="middle")


def test_recall_distractor_queries_spread_over_the_filler():
    positions = Counter()
    for ids, _ in generate_recall(400, 200, seed=1, n_queries=2, n_pairs=4):
        (spot,) = [i for i in range(8, 199) if ids[i] <= 64]  # the one distractor key before the last token
        positions[(spot - 8) // 48] += 1
    assert len(positions) == 4 and min(positions.values()) > 50  # roughly uniform over the gap


def test_recall_labels_roughly_uniform():
    spec = recall_spec()
    labels = Counter(label for _, label in generate_recall(3200, 64, seed=5))
    expected = 3200 / spec.n_classes
    assert len(labels) == spec.n_classes
    assert all(0.6 * expected < c < 1.4 * expected for c in labels.values())


def test_recall_spec_sizes_and_custom_vocab():
    spec = recall_spec(n_keys=40, n_values=5, n_filler=3)
    assert len(spec.vocab) == 1 + 40 + 5 + 3 and spec.n_classes == 5 and spec.vocab[0] == "<pad>"
    for ids, label in generate_recall(20, 60, seed=0, n_keys=40, n_values=5, n_filler=3):
        assert max(ids) < len(spec.vocab) and 0 <= label < 5
    with pytest.raises(ValueError):
        generate_recall(1, 100, seed=0, n_pairs=48, n_keys=40)  # 48 pairs need 48 distinct keys
    with pytest.raises(ValueError):
        generate_recall(1, 19, seed=0, n_pairs=8, n_queries=4)  # 16 + 4 tokens do not fit in 19


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generator_splits_sizes_determinism_and_disjoint_seeds(name):
    splits = generator_splits(name, 40, 10, 10, 256, seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 40, "valid": 10, "test": 10}
    assert splits == generator_splits(name, 40, 10, 10, 256, seed=0)
    seqs = {k: {tuple(ids) for ids, _ in v} for k, v in splits.items()}
    assert not (seqs["train"] & seqs["valid"] or seqs["train"] & seqs["test"] or seqs["valid"] & seqs["test"])
    assert splits["train"][:10] != splits["valid"] and splits["valid"] != splits["test"]
    assert generator_splits(name, 40, 10, 10, 256, seed=1)["train"] != splits["train"]
    with pytest.raises(ValueError):
        generator_splits("nope", 1, 1, 1, 64, seed=0)
