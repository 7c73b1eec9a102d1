"""Synthetic long-range classification tasks: ListOps (LRA) and multi-query associative recall.

Each task yields `(token_ids, label)` pairs for a sequence classifier: one label per
sequence, ids index `TaskSpec.vocab`, and id 0 is always `"<pad>"` (never emitted).

ListOps -- Long Range Arena, Tay et al. 2020 (arXiv:2011.04006), after Nangia & Bowman 2018
(arXiv:1804.06028). Follows google-research/long-range-arena, lra_benchmarks/data/listops.py:

    [MAX 2 9 [MIN 4 7 ] 0 ]   ->  9

  * operators MAX, MIN, MED (int(np.median), so an even count floors the mean of the two
    middle values) and SM (sum mod 10), over the digits 0..9; 10 classes
  * generate_tree(depth=1, max_depth=10, max_args=10): below max_depth a node is a digit
    when random() > 0.25, otherwise an operator with randint(2, max_args) arguments (the
    operator is drawn after its arguments); at max_depth every node is a digit
  * length counts operator, digit and "]" tokens (LRA's printed parentheses are not tokens)
  * rejection sampling keeps a tree only when min_length < length < max_length (strict, as
    in LRA), and duplicate sequences are dropped (LRA collects its samples in a set)

  The distribution of accepted trees is LRA's; the random stream is not (each draw is one
  `random()` call, and a tree is abandoned once it reaches max_length), so the same integer
  seed does not reproduce LRA's files.

  min_length rule: LRA uses max_length=2000, min_length=500; we keep that ratio,
  min_length = max_length // 4, so every length in the 64..2000 sweep keeps LRA's shape.

Multi-query associative recall (MQAR) -- Zoology, Arora et al. 2023 (arXiv:2312.04927),
in a classification form:

    k17 v3 k902 v11 k5 v3 ... k5 k902 k17   ->  v3 (the value bound to the LAST query)

  * N key-value pairs, keys distinct (from "k0".."k{n_keys-1}"), values drawn uniformly
    with replacement (from "v0".."v{n_values-1}"), so the label is uniform over n_values
  * then n_queries distinct query keys drawn from the N bound keys; only the last is
    labelled, the earlier ones are distractors the model must read past
  * the pairs fill the length: N = (seq_len - n_queries) // 2, so a sequence is seq_len
    tokens long (seq_len - 1 when seq_len - n_queries is odd)
  * n_classes = n_values; Zoology draws values without replacement from a large vocabulary
    and predicts every query's value, which a one-label classifier cannot do
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

PAD = "<pad>"


@dataclass(frozen=True)
class TaskSpec:
    """A classification task: its vocabulary (vocab[pad_id] == "<pad>") and number of labels."""

    name: str
    vocab: list[str]
    n_classes: int
    pad_id: int = 0


# ---------------------------------------------------------------- ListOps

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = [MIN, MAX, MED, SUM_MOD]  # LRA's order: random.choice depends on it
VALUES = range(10)
VALUE_P = 0.25  # a node below max_depth is an operator with probability VALUE_P
MAX_DEPTH = 10
MAX_ARGS = 10

LISTOPS_VOCAB = [PAD, MAX, MIN, MED, SUM_MOD, END] + [str(v) for v in VALUES]


def listops_spec() -> TaskSpec:
    """ListOps (LRA): 16 tokens, labels 0..9."""
    return TaskSpec(name="listops", vocab=list(LISTOPS_VOCAB), n_classes=10)


def _apply(op: str, args: list[int]) -> int:
    if op == MIN:
        return min(args)
    if op == MAX:
        return max(args)
    if op == MED:  # int(np.median(args)) on non-negative ints
        s = sorted(args)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
    if op == SUM_MOD:
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


class _TooLong(Exception):
    pass


_DIGITS = [str(v) for v in VALUES]


def _operator(rng: random.Random, depth: int, out: list[str], limit: int) -> int:
    """Append an operator node at `depth` (LRA's r <= VALUE_P branch) to `out`; return its value.

    Same draws as LRA's generate_tree, in the same order, each one `rng.random()` for speed
    (uniform up to float rounding): n_args in 2..MAX_ARGS, then each argument (operator with
    probability VALUE_P below MAX_DEPTH, else a digit), then the operator last. Raises
    _TooLong once `out` reaches `limit` tokens: LRA would reject that tree anyway, so
    abandoning it early leaves the distribution of accepted trees unchanged.
    """
    n_args = 2 + int(rng.random() * (MAX_ARGS - 1))
    start = len(out)
    out.append("")  # the operator's slot: LRA draws it after the arguments
    args = []
    for _ in range(n_args):
        if depth + 1 < MAX_DEPTH and rng.random() <= VALUE_P:
            args.append(_operator(rng, depth + 1, out, limit))
        else:  # digits are most nodes, so they are inlined here
            value = int(rng.random() * 10)
            out.append(_DIGITS[value])
            if len(out) >= limit:
                raise _TooLong
            args.append(value)
    op = OPERATORS[int(rng.random() * len(OPERATORS))]
    out[start] = op
    out.append(END)
    return _apply(op, args)


def _tree(rng: random.Random, out: list[str], limit: int) -> int:
    """One LRA generate_tree(depth=1) draw appended to `out` as tokens; its value."""
    if 1 < MAX_DEPTH and rng.random() <= VALUE_P:
        return _operator(rng, 1, out, limit)
    value = int(rng.random() * 10)
    out.append(_DIGITS[value])
    return value


def listops_min_length(max_length: int) -> int:
    """LRA's 500 for 2000, kept proportional: lengths must lie strictly between the two."""
    return max_length // 4


def generate_listops(n: int, max_length: int, seed: int) -> list[tuple[list[int], int]]:
    """n distinct ListOps sequences of min_length < length < max_length, with their values."""
    min_length = listops_min_length(max_length)
    if max_length - min_length < 2:
        raise ValueError(f"max_length={max_length} leaves no length strictly between {min_length} and it")
    rng = random.Random(seed)
    index = {tok: i for i, tok in enumerate(LISTOPS_VOCAB)}
    seen: set[tuple[int, ...]] = set()
    data: list[tuple[list[int], int]] = []
    while len(data) < n:
        tokens: list[str] = []
        try:
            value = _tree(rng, tokens, max_length)
        except _TooLong:
            continue
        if min_length < len(tokens) < max_length:
            ids = tuple(index[t] for t in tokens)
            if ids not in seen:
                seen.add(ids)
                data.append((list(ids), value))
    return data


def evaluate_listops(tokens: list[str]) -> int:
    """Value of a ListOps expression given as token strings, e.g. ["[MAX", "2", "9", "]"]."""
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None
    for tok in tokens:
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == END:
            op, args = stack.pop()
            value = _apply(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            value = int(tok)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
    if stack or result is None:
        raise ValueError(f"unbalanced ListOps expression: {' '.join(tokens)}")
    return result


# ---------------------------------------------------------------- associative recall

RECALL_N_KEYS = 1024  # >= the (2000 - n_queries) // 2 distinct keys of the longest sweep length
RECALL_N_VALUES = 16


def recall_spec(n_keys: int = RECALL_N_KEYS, n_values: int = RECALL_N_VALUES) -> TaskSpec:
    """MQAR as classification: vocab <pad>, k0.., v0..; one class per value token."""
    vocab = [PAD] + [f"k{i}" for i in range(n_keys)] + [f"v{i}" for i in range(n_values)]
    return TaskSpec(name="recall", vocab=vocab, n_classes=n_values)


def generate_recall(
    n: int,
    seq_len: int,
    seed: int,
    n_queries: int = 4,
    *,
    n_keys: int = RECALL_N_KEYS,
    n_values: int = RECALL_N_VALUES,
) -> list[tuple[list[int], int]]:
    """n sequences of (seq_len - n_queries) // 2 key-value pairs then n_queries query keys.

    The label is the value index (0..n_values-1) bound to the last query key. Ids follow
    recall_spec(n_keys, n_values): key i is id 1 + i, value j is id 1 + n_keys + j.
    """
    n_pairs = (seq_len - n_queries) // 2
    if n_queries < 1 or n_pairs < n_queries:
        raise ValueError(f"seq_len={seq_len} holds {n_pairs} pairs, fewer than n_queries={n_queries}")
    if n_pairs > n_keys:
        raise ValueError(f"seq_len={seq_len} needs {n_pairs} distinct keys, only n_keys={n_keys}")
    rng = np.random.default_rng(seed)
    value_base = 1 + n_keys
    data: list[tuple[list[int], int]] = []
    for _ in range(n):
        keys = rng.choice(n_keys, size=n_pairs, replace=False)
        values = rng.integers(0, n_values, size=n_pairs)
        pairs = np.empty(2 * n_pairs, dtype=np.int64)
        pairs[0::2] = 1 + keys
        pairs[1::2] = value_base + values
        asked = rng.choice(n_pairs, size=n_queries, replace=False)  # positions among the pairs
        ids = pairs.tolist() + (1 + keys[asked]).tolist()
        data.append((ids, int(values[asked[-1]])))
    return data


# ---------------------------------------------------------------- registry and splits

TASKS = {
    "listops": (listops_spec, generate_listops),
    "recall": (recall_spec, generate_recall),
}

SPLITS = ("train", "valid", "test")


def split_seed(seed: int, split: str) -> int:
    """A per-split seed derived from (seed, split index), so splits never share a stream."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1)[0])


def task_splits(
    name: str, n_train: int, n_valid: int, n_test: int, seq_len: int, seed: int
) -> dict[str, list[tuple[list[int], int]]]:
    """Train/valid/test data for task `name`, each split from its own derived seed.

    Splits are independent draws: for ListOps at short lengths a sequence can recur across
    splits (LRA's single set would exclude that); at LRA lengths this is vanishingly rare.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    generate = TASKS[name][1]
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    return {split: generate(sizes[split], seq_len, split_seed(seed, split)) for split in SPLITS}
