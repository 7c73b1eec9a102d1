"""Generators of synthetic long-range classification data: ListOps (LRA) and multi-query
associative recall (the tasks that use them are xformer/tasks/generated.py).

Each task yields `(token_ids, label)` pairs for a sequence classifier: one label per
sequence, ids index `GeneratorSpec.vocab`, and id 0 is always `"<pad>"` (never emitted).

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

    k17 v3 k42 v11 k5 v3 ... | f9 f2 k42 f30 ... f7 k5 f1 k17   ->  v3 (the value of the LAST query)

  * as in Zoology, n_pairs key-value pairs come first (default 8), keys distinct (from
    "k0".."k{n_keys-1}"), values drawn uniformly with replacement (from "v0".."v{n_values-1}"),
    so the label is uniform over n_values
  * the rest of the seq_len tokens are filler drawn uniformly from "f0".."f{n_filler-1}"
    (Zoology fills with random tokens; here they are their own words, so a filler token never
    reads as a key), with n_queries distinct bound keys: the labelled one is the LAST token, the
    other n_queries - 1 sit at random filler positions as distractors
  * so the distance from a binding to its query grows with seq_len while the amount to
    remember (n_pairs bindings) stays fixed: what "memory fades with distance" is about
  * n_classes = n_values; Zoology predicts every query's value, which a one-label classifier
    cannot do
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

PAD = "<pad>"


@dataclass(frozen=True)
class GeneratorSpec:
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


def listops_spec() -> GeneratorSpec:
    """ListOps (LRA): 16 tokens, labels 0..9."""
    return GeneratorSpec(name="listops", vocab=list(LISTOPS_VOCAB), n_classes=10)


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

RECALL_N_KEYS = 64
RECALL_N_VALUES = 16
RECALL_N_FILLER = 32
RECALL_N_PAIRS = 8
RECALL_BINDINGS = ("start", "end")  # where the key-value pairs go: first, or just before the query


def recall_spec(n_keys: int = RECALL_N_KEYS, n_values: int = RECALL_N_VALUES,
                n_filler: int = RECALL_N_FILLER) -> GeneratorSpec:
    """MQAR as classification: vocab <pad>, k0.., v0.., f0..; one class per value token."""
    vocab = ([PAD] + [f"k{i}" for i in range(n_keys)] + [f"v{i}" for i in range(n_values)]
             + [f"f{i}" for i in range(n_filler)])
    return GeneratorSpec(name="recall", vocab=vocab, n_classes=n_values)


def generate_recall(
    n: int,
    seq_len: int,
    seed: int,
    n_queries: int = 4,
    *,
    n_pairs: int = RECALL_N_PAIRS,
    n_keys: int = RECALL_N_KEYS,
    n_values: int = RECALL_N_VALUES,
    n_filler: int = RECALL_N_FILLER,
    bindings: str = "start",
) -> list[tuple[list[int], int]]:
    """n sequences of seq_len tokens: n_pairs key-value pairs, then filler holding n_queries - 1
    distractor queries, then the labelled query key last. With `bindings` = "end" the filler
    (and its distractors) comes first and the pairs last, just before the query: the lookup is
    then the same distance back at every length, where "start" moves it away as inputs grow.
    Both draw the same numbers, so at a length with no filler they are the same data.

    The label is the value index (0..n_values-1) bound to the last token. Ids follow
    recall_spec: key i is id 1 + i, value j is 1 + n_keys + j, filler f is 1 + n_keys + n_values + f.
    """
    if bindings not in RECALL_BINDINGS:
        raise ValueError(f"bindings: expected one of {', '.join(RECALL_BINDINGS)}, found {bindings!r}")
    if not 1 <= n_queries <= n_pairs <= n_keys:
        raise ValueError(f"needs 1 <= n_queries ({n_queries}) <= n_pairs ({n_pairs}) <= n_keys ({n_keys})")
    gap = seq_len - 2 * n_pairs - 1  # filler positions, distractor queries among them
    if gap < n_queries - 1:
        raise ValueError(f"seq_len={seq_len} is too short for {n_pairs} pairs and {n_queries} queries "
                         f"(at least {2 * n_pairs + n_queries})")
    rng = np.random.default_rng(seed)
    value_base, filler_base = 1 + n_keys, 1 + n_keys + n_values
    data: list[tuple[list[int], int]] = []
    for _ in range(n):
        keys = rng.choice(n_keys, size=n_pairs, replace=False)
        values = rng.integers(0, n_values, size=n_pairs)
        ids = np.empty(seq_len, dtype=np.int64)
        pairs, rest = (0, 2 * n_pairs) if bindings == "start" else (gap, 0)  # where the pairs and the filler begin
        ids[pairs : pairs + 2 * n_pairs : 2] = 1 + keys
        ids[pairs + 1 : pairs + 2 * n_pairs : 2] = value_base + values
        filler = filler_base + rng.integers(0, n_filler, size=seq_len - 2 * n_pairs)
        ids[rest : rest + gap] = filler[:gap]
        asked = rng.choice(n_pairs, size=n_queries, replace=False)  # which pairs are queried
        spots = rest + rng.choice(gap, size=n_queries - 1, replace=False)
        ids[spots] = 1 + keys[asked[:-1]]
        ids[-1] = 1 + keys[asked[-1]]
        data.append((ids.tolist(), int(values[asked[-1]])))
    return data


# ---------------------------------------------------------------- by name, and splits

GENERATORS = {
    "listops": (listops_spec, generate_listops),
    "recall": (recall_spec, generate_recall),
}

SPLITS = ("train", "valid", "test")


def split_seed(seed: int, split: str) -> int:
    """A per-split seed derived from (seed, split index), so splits never share a stream."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1)[0])


def generator_splits(
    name: str, n_train: int, n_valid: int, n_test: int, seq_len: int, seed: int
) -> dict[str, list[tuple[list[int], int]]]:
    """Train/valid/test data of generator `name`, each split from its own derived seed.

    Splits are independent draws: for ListOps at short lengths a sequence can recur across
    splits (LRA's single set would exclude that); at LRA lengths this is vanishingly rare.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(GENERATORS)}")
    generate = GENERATORS[name][1]
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    return {split: generate(sizes[split], seq_len, split_seed(seed, split)) for split in SPLITS}
