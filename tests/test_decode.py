import itertools
import math

import pytest
import torch
from torch import nn

from xformer.config.schema import ModelConfig
from xformer.generation.decode import DecodeStats, beam_search, greedy_decode, sequence_logprob
from xformer.model.build import build_model

D, V = 32, 13
PAD, UNK, BOS, EOS = 0, 1, 2, 3
LENGTHS = [7, 3, 5, 9, 2, 6]  # source tokens per sentence, EOS included


def tiny_seq2seq(vocab=V, *, seed=0, scale=1.0, eos_bias=0.0, dropout=0.0):
    """A randomly initialised tiny model. Its output layer gets a bias so a test can steer
    EOS, and `scale` sharpens the next-token distributions (a fresh model's are nearly flat,
    so every hypothesis would run to the length limit)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=D, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=dropout, tie_embeddings="none")
    model = build_model(cfg, vocab, pad_id=PAD)
    output = nn.Linear(D, vocab)
    with torch.no_grad():
        output.weight.copy_(model.output.weight * scale)
        output.bias.zero_()
        output.bias[EOS] = eos_bias
    model.output = output
    return model.eval()


def flat_model():
    """Fresh init: EOS is improbable, hypotheses run to the length limit."""
    return tiny_seq2seq()


def varied_model():
    """Sharper distributions and a likelier EOS: hypotheses of many lengths, some empty,
    and beam search's early stop matters."""
    return tiny_seq2seq(scale=3.0, eos_bias=4.0)


def sources(lengths=LENGTHS, vocab=V, seed=0):
    """Right-padded (B, S) sources of `lengths` tokens each, the last one EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    return src


def normalised(model, src, hyps, lenpen=1.0):
    lengths = torch.tensor([len(h) + 1 for h in hyps], dtype=torch.float32)
    return sequence_logprob(model, src, hyps) / lengths**lenpen


@torch.no_grad()
def reference_greedy(model, src, max_len):
    """One sentence src (1, S), no cache: the whole prefix through model.forward each step."""
    tokens = [BOS]
    for step in range(max_len + 1):
        logits = model(src, torch.tensor([tokens]))[0, -1]
        logits[[PAD, BOS]] = -math.inf
        token = EOS if step == max_len else int(logits.argmax())
        if token == EOS:
            return tokens[1:]
        tokens.append(token)


@torch.no_grad()
def reference_beam(model, src, k, lenpen, max_len):
    """fairseq's beam search for one sentence src (1, S), with lists and no cache: top 2k
    candidates; EOS among the first k finishes a hypothesis; the first k others live on;
    stop at k finished hypotheses or after the forced EOS at max_len."""
    beams, finished = [(0.0, [])], []
    for step in range(max_len + 1):
        tgt = torch.tensor([[BOS, *tokens] for _, tokens in beams])
        lprobs = torch.log_softmax(model(src.expand(len(beams), -1), tgt)[:, -1].float(), dim=-1)
        candidates = [(score + lprobs[i, token].item(), i, token)
                      for i, (score, _) in enumerate(beams) for token in range(lprobs.size(1))
                      if token not in (PAD, BOS) and (step < max_len or token == EOS)]
        candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * k]
        for score, i, token in candidates[:k]:
            if token == EOS and len(finished) < k:
                finished.append((score / (step + 1) ** lenpen, beams[i][1]))
        if len(finished) == k or step == max_len:
            return max(finished, key=lambda f: f[0])[1]
        beams = [(score, beams[i][1] + [token]) for score, i, token in candidates if token != EOS][:k]


@torch.no_grad()
def exhaustive_best(model, src, max_len, lenpen, min_len, vocab):
    """Score every hypothesis of min_len..max_len tokens (no PAD, BOS or EOS) teacher-forced
    and return the best by sum log p / (len + 1) ** lenpen. src: (1, S)."""
    allowed = [t for t in range(vocab) if t not in (PAD, BOS, EOS)]
    hyps = [list(h) for n in range(min_len, max_len + 1) for h in itertools.product(allowed, repeat=n)]
    tgt_in = torch.full((len(hyps), max_len + 1), PAD)
    tgt_out = torch.full((len(hyps), max_len + 1), PAD)
    for i, h in enumerate(hyps):
        tgt_in[i, : len(h) + 1] = torch.tensor([BOS, *h])
        tgt_out[i, : len(h) + 1] = torch.tensor([*h, EOS])
    lprobs = torch.log_softmax(model(src.expand(len(hyps), -1), tgt_in).float(), dim=-1)
    per_token = lprobs.gather(-1, tgt_out[..., None]).squeeze(-1).masked_fill(tgt_out == PAD, 0.0)
    scores = per_token.sum(1) / torch.tensor([len(h) + 1.0 for h in hyps]) ** lenpen
    return hyps[int(scores.argmax())]


@pytest.mark.parametrize("make", [flat_model, varied_model])
def test_cached_greedy_equals_uncached_reference(make):
    model, src = make(), sources()
    hyps = greedy_decode(model, src, max_len_a=1.5, max_len_b=1)
    expected = [reference_greedy(model, src[i : i + 1, :n], math.floor(1.5 * n + 1)) for i, n in enumerate(LENGTHS)]
    assert hyps == expected
    assert all(h and h[-1] != EOS and BOS not in h and PAD not in h for h in hyps if h)


@pytest.mark.parametrize("make", [flat_model, varied_model])
def test_beam_of_one_equals_greedy(make):
    model, src = make(), sources()
    greedy = greedy_decode(model, src, max_len_a=1.0, max_len_b=3)
    assert beam_search(model, src, beam=1, max_len_a=1.0, max_len_b=3) == greedy
    assert len({len(h) for h in greedy}) > 1  # sentences finish at different steps


@pytest.mark.parametrize("make,lenpen", [(varied_model, 0.5), (varied_model, 1.0), (varied_model, 2.0),
                                         (flat_model, 1.0)])
def test_beam_equals_reference_beam_search(make, lenpen):
    model, src = make(), sources()
    hyps = beam_search(model, src, beam=4, lenpen=lenpen, max_len_a=1.0, max_len_b=3)
    expected = [reference_beam(model, src[i : i + 1, :n], 4, lenpen, n + 3) for i, n in enumerate(LENGTHS)]
    assert hyps == expected
    assert hyps != greedy_decode(model, src, max_len_a=1.0, max_len_b=3)


def test_beam_scores_at_least_greedy():
    # Not a theorem: the greedy prefix can fall out of the beam, and beam search stops at k
    # finished hypotheses. With a fresh model every hypothesis runs to the length limit and
    # beam 4 keeps improving on greedy; a reordering or scoring bug would not.
    model, src = flat_model(), sources()
    greedy = greedy_decode(model, src, max_len_a=1.2, max_len_b=5)
    beam = beam_search(model, src, beam=4, lenpen=1.0, max_len_a=1.2, max_len_b=5)
    greedy_scores, beam_scores = normalised(model, src, greedy), normalised(model, src, beam)
    assert (beam_scores >= greedy_scores - 1e-5).all()
    assert (beam_scores > greedy_scores + 1e-3).sum() >= len(LENGTHS) // 2


@pytest.mark.parametrize("lenpen,min_len", [(0.0, 0), (0.5, 0), (1.0, 0), (2.0, 0), (1.0, 1)])
def test_wide_beam_finds_the_exhaustive_best(lenpen, min_len):
    # Vocabulary 8 leaves 5 tokens a hypothesis may use (UNK and 4..7); at most 3 of them:
    # 1 + 5 + 25 + 125 hypotheses. A beam of 125 holds every live prefix at every step.
    vocab, max_len = 8, 3
    model = tiny_seq2seq(vocab, scale=2.0, eos_bias=3.0)
    lengths = [4, 2, 5, 3, 6, 4]
    src = sources(lengths, vocab, seed=1)
    kwargs = dict(lenpen=lenpen, max_len_a=0.0, max_len_b=max_len, min_len=min_len)
    hyps = beam_search(model, src, beam=125, **kwargs)
    best = [exhaustive_best(model, src[i : i + 1, :n], max_len, lenpen, min_len, vocab) for i, n in enumerate(lengths)]
    assert hyps == best
    narrow = beam_search(model, src, beam=2, **kwargs)
    assert any(h != b for h, b in zip(narrow, best, strict=True))  # the search problem is not trivial


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batching_does_not_change_results(search):
    model, src = varied_model(), sources()

    def decode(s):
        if search == "greedy":
            return greedy_decode(model, s, max_len_a=1.0, max_len_b=3)
        return beam_search(model, s, beam=3, max_len_a=1.0, max_len_b=3)

    batched = decode(src)
    alone = [decode(src[i : i + 1, :n])[0] for i, n in enumerate(LENGTHS)]
    assert batched == alone
    assert decode(src.flip(0)) == batched[::-1]


@pytest.mark.parametrize("search", ["greedy", "beam"])
@pytest.mark.parametrize("eos_bias", [-1e4, -math.inf])  # EOS never the better choice; or impossible
def test_max_length_is_floor_of_a_times_source_plus_b(search, eos_bias):
    model = tiny_seq2seq(eos_bias=eos_bias)
    src = sources()
    if search == "greedy":
        hyps = greedy_decode(model, src, max_len_a=1.5, max_len_b=2)
    else:
        hyps = beam_search(model, src, beam=3, max_len_a=1.5, max_len_b=2)
    # floor(1.5 * n + 2) for n = 7, 3, 5, 9, 2, 6 source tokens, EOS included
    assert [len(h) for h in hyps] == [12, 6, 9, 15, 5, 11]


def test_max_length_is_capped_by_max_positions():
    model = tiny_seq2seq(eos_bias=-1e4)
    model.decoder.embed.max_positions = 8  # BOS + 7 tokens
    assert [len(h) for h in greedy_decode(model, sources(), max_len_a=1.0, max_len_b=3)] == [7, 6, 7, 7, 5, 7]


@pytest.mark.parametrize("eos_bias", [1e4, 4.0, -1e4])
def test_forced_lengths_hold_whatever_the_model_says_of_eos(eos_bias):
    """With `lengths`, each hypothesis is exactly as long, EOS-free, and is the greedy path of a
    model that cannot end: the prefix of the reference greedy search with EOS banned."""
    model, src = tiny_seq2seq(scale=3.0, eos_bias=eos_bias), sources()
    lengths = [4, 0, 2, 9, 1, 3]
    hyps = greedy_decode(model, src, lengths=lengths)
    assert [len(h) for h in hyps] == lengths and not any(EOS in h for h in hyps)
    with torch.no_grad():
        model.output.bias[EOS] = -1e4  # the same model, unable to end
    expected = [reference_greedy(model, src[i : i + 1, :n], lengths[i]) for i, n in enumerate(LENGTHS)]
    assert hyps == expected
    model.decoder.embed.max_positions = 4  # BOS + 3 tokens: the cap still holds
    assert [len(h) for h in greedy_decode(model, src, lengths=lengths)] == [3, 0, 2, 3, 1, 3]


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_eos_first_gives_empty_hypotheses_unless_min_len(search):
    model, src = tiny_seq2seq(eos_bias=1e4), sources()
    decode = greedy_decode if search == "greedy" else beam_search
    assert decode(model, src) == [[]] * len(LENGTHS)
    assert [len(h) for h in decode(model, src, min_len=1)] == [1] * len(LENGTHS)


def test_decoding_ignores_dropout_and_restores_training_mode():
    model, src = tiny_seq2seq(dropout=0.5, scale=3.0, eos_bias=4.0), sources()
    expected = greedy_decode(model, src), beam_search(model, src, beam=3)
    model.train()
    assert (greedy_decode(model, src), beam_search(model, src, beam=3)) == expected
    assert model.training and all(m.training for m in model.modules())


def test_sequence_logprob_ignores_padding_of_other_hypotheses():
    model, src = varied_model(), sources()
    hyps = [[5, 6, 7], [], [4], [8, 9, 10, 11, 12], [1], [4, 4]]
    together = sequence_logprob(model, src, hyps)
    alone = torch.cat([sequence_logprob(model, src[i : i + 1, :n], [h])
                       for i, (n, h) in enumerate(zip(LENGTHS, hyps, strict=True))])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    assert (together < 0).all()


def test_a_preallocated_cache_holds_what_concatenation_holds_and_grows_when_full():
    from xformer.model.cache import KVCache

    torch.manual_seed(0)
    grown, plain = KVCache(capacity=2), KVCache()
    for t in (1, 1, 3, 1):  # past the capacity twice
        k, v = torch.randn(2, 1, t, 4), torch.randn(2, 1, t, 4)
        got, want = grown.append(k, v), plain.append(k, v)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    index = torch.tensor([1, 0])
    grown.reorder(index), plain.reorder(index)
    torch.testing.assert_close(grown.k, plain.k, rtol=0, atol=0)
    grown.reorder(torch.tensor([1])), plain.reorder(torch.tensor([1]))  # a row leaves
    torch.testing.assert_close((grown.k, grown.v), (plain.k, plain.v), rtol=0, atol=0)
    assert grown.length == plain.length == 6 and torch.equal(grown.positions(), torch.arange(6))


def test_beam_search_leaves_the_encoder_keys_in_place_while_no_sentence_leaves(monkeypatch):
    """Reordering beams within sentences never touches the cross-attention caches (every beam of
    a sentence has the same encoder keys); the result is the search's all the same."""
    from xformer.model.transformer import DecoderCache

    calls = []
    original = DecoderCache.reorder

    def spy(self, index, cross=True):
        calls.append(cross if cross is None else len(cross) if not isinstance(cross, bool) else cross)
        return original(self, index, cross)

    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                                    dropout=0.0, max_positions=64), 20).eval()
    src = torch.randint(4, 20, (3, 6))
    before = beam_search(model, src, beam=3)
    monkeypatch.setattr(DecoderCache, "reorder", spy)
    assert beam_search(model, src, beam=3) == before
    assert None in calls and True not in calls  # within sentences: untouched; when one leaves: its rows


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_kv_cache_holds_k_heads_of_keys_and_values_and_no_more(kv_heads, beam):
    """At its largest (the first step with every sentence's rows: B greedy, B*k in a beam)
    the cache holds, in each decoder layer, keys and values of K heads over the preallocated
    positions (max_len + BOS) and the source's: MQA's is H times smaller than MHA's."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_heads=4, n_kv_heads=kv_heads, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.0)
    model = build_model(cfg, V, pad_id=PAD).eval()
    src, stats = sources(), DecodeStats()
    if beam == 1:
        greedy_decode(model, src, max_len_a=0.0, max_len_b=6, stats=stats)
    else:
        beam_search(model, src, beam=beam, max_len_a=0.0, max_len_b=6, stats=stats)
    rows, source = src.size(0) * beam, src.size(1)
    layers, tensors, fp32 = 2, 2, 4  # decoder layers; keys and values; bytes a number
    assert stats.cache_bytes == layers * tensors * rows * kv_heads * (D // 4) * ((6 + 1) + source) * fp32
