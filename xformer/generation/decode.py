"""Decoding a Seq2Seq model: greedy search and beam search over the KV cache, and the
teacher-forced score of a given hypothesis.

Conventions, shared by both searches (fairseq's `SequenceGenerator` unless stated):

- Source length `src_len` counts the non-pad source tokens, the trailing EOS included (what
  fairseq's `src_lengths` holds for a translation batch). Each sentence gets its own
  `max_len = floor(max_len_a * src_len + max_len_b)`, capped at `max_positions - 1` so that
  BOS plus `max_len` tokens fit the decoder. fairseq uses the padded batch width for every
  sentence; per sentence means a sentence decodes the same alone or in any batch.
- `max_len` counts output tokens without EOS: a hypothesis holds at most `max_len` tokens
  and EOS is forced after them (fairseq forces EOS at step `max_len` in the same way).
- `min_len` (default 0) tokens must come before EOS. Zero allows an empty hypothesis, so a
  model that puts EOS first is reported as doing so; fairseq-generate's default is 1.
- PAD and BOS are never generated. Scores are log-softmax in fp32 over the whole vocabulary
  and are not renormalised after masking, nor when EOS is forced.
- A finished hypothesis of `n` tokens plus EOS scores `sum log p / (n + 1) ** lenpen`.
- Returned hypotheses are token ids without BOS and EOS.

Shapes: B sentences, S source length, V vocabulary, k beam size, n sentences still
decoding; beam rows are sentence-major, row = sentence * k + beam.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from xformer.config.schema import Recipe
from xformer.data.batching import collate_source
from xformer.model.transformer import DecoderCache, Seq2Seq
from xformer.training.device import Runtime


@dataclass
class DecodeStats:
    """What decoding used besides time, filled in as it goes."""

    cache_bytes: int = 0  # the most bytes the decoder's key/value caches held at once (one batch)

    def saw(self, cache: DecoderCache) -> None:
        self.cache_bytes = max(self.cache_bytes, cache.nbytes)


@contextlib.contextmanager
def _eval_mode(model: Seq2Seq) -> Iterator[None]:
    """Dropout off while decoding; the caller's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _max_lengths(model: Seq2Seq, src: Tensor, max_len_a: float, max_len_b: int, pad_id: int) -> list[int]:
    """Per sentence: the most tokens (EOS not counted) a hypothesis may hold."""
    cap = model.decoder.embed.max_positions - 1  # BOS + max_len tokens are decoder positions
    src_len = src.ne(pad_id).sum(dim=1).tolist()
    return [max(0, min(cap, math.floor(max_len_a * n + max_len_b))) for n in src_len]


def _ban_(lprobs: Tensor, step: int, min_len: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Tokens no hypothesis may take at this step, in place. lprobs: (rows, V)."""
    lprobs[:, pad_id] = -math.inf
    lprobs[:, bos_id] = -math.inf
    if step < min_len:
        lprobs[:, eos_id] = -math.inf


@torch.inference_mode()
def greedy_decode(
    model: Seq2Seq, src: Tensor, *, max_len_a: float = 1.2, max_len_b: int = 10, min_len: int = 0,
    bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, stats: DecodeStats | None = None,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """The most probable next token at every step, a batch at a time, one token per step
    through the KV cache. src: (B, S) right-padded ids -> B token lists (no BOS, no EOS).

    A sentence leaves the batch (and its cache rows) as soon as it emits EOS. With `lengths`,
    sentence i is exactly lengths[i] tokens (EOS banned before, forced there; max_len_a/b and
    min_len unused): the work a model that ends where its references end would do.
    """
    with _eval_mode(model):
        b = src.size(0)
        if lengths is None:
            max_len = _max_lengths(model, src, max_len_a, max_len_b, pad_id)
        else:
            max_len = [max(0, min(n, model.decoder.embed.max_positions - 1)) for n in lengths]
        longest = max(max_len, default=0)
        memory, memory_pad = model.encode(src)  # (B, S, D), (B, S)
        cache = model.new_cache(longest + 1)
        active = torch.arange(b, device=src.device)  # original sentence of each row
        limit = torch.tensor(max_len, device=src.device)  # (B,) max_len of each row
        out = src.new_full((b, longest + 1), eos_id)
        prev = src.new_full((b, 1), bos_id)
        for step in range(longest + 1):
            logits = model.decode(prev, memory, memory_pad, cache)[:, -1].float()  # (n, V)
            if stats is not None:
                stats.saw(cache)
            _ban_(logits, step, min_len, bos_id, eos_id, pad_id)
            if lengths is not None:
                logits[:, eos_id] = -math.inf  # EOS only where the row's length ends (forced below)
            token = logits.argmax(dim=-1)  # (n,)
            token = torch.where(limit <= step, eos_id, token)  # forced, whatever EOS's probability
            out[active, step] = token
            going = token.ne(eos_id)
            if not going.any():
                break
            if not going.all():
                keep = going.nonzero().squeeze(1)
                cache.reorder(keep)
                active, limit, token = active[keep], limit[keep], token[keep]
                memory, memory_pad = memory[keep], memory_pad[keep]
            prev = token[:, None]
        return [row[: row.index(eos_id)] for row in out.tolist()]


@torch.inference_mode()
def beam_search(
    model: Seq2Seq, src: Tensor, *, beam: int = 5, lenpen: float = 1.0, max_len_a: float = 1.2,
    max_len_b: int = 10, min_len: int = 0, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0,
    stats: DecodeStats | None = None,
) -> list[list[int]]:
    """Beam search as fairseq's SequenceGenerator does it. src: (B, S) right-padded ids ->
    for each sentence the finished hypothesis with the best length-normalised score
    (tokens without BOS and EOS).

    Each step takes the top 2k (beam score + log p) candidates of a sentence. EOS
    candidates among the first k are finished hypotheses; the first k non-EOS candidates
    are the next beam. A sentence is done when it has k finished hypotheses, or at its
    max_len, where EOS ends every live hypothesis. Done sentences leave the batch, their
    rows dropped from the cache, so they cost nothing more. The encoder runs once. The first
    step decodes one row per sentence (its beams all start from BOS), so the cross-attention
    keys and values are computed once per sentence; the caches then expand to k rows.
    """
    k = beam
    if k < 1:
        raise ValueError(f"beam must be at least 1, found {beam}")
    with _eval_mode(model):
        b, device = src.size(0), src.device
        max_len = _max_lengths(model, src, max_len_a, max_len_b, pad_id)
        memory, memory_pad = model.encode(src)  # (B, S, D), (B, S); k rows a sentence after step 0
        cache = model.new_cache(max(max_len, default=0) + 1)

        active = list(range(b))  # original sentence of each of the n decoding sentences
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]  # (score, tokens)
        width = 1  # rows a sentence has: one at step 0 (every beam is BOS), then k
        scores = torch.zeros((b, width), device=device)  # (n, width) sum log p, fp32
        tokens = src.new_empty((b, 0))  # (n*width, step) generated so far
        prev = src.new_full((b, 1), bos_id)
        base = torch.arange(b, device=device)[:, None] * width  # (n, 1) first row of each sentence

        for step in range(max(max_len, default=0) + 1):
            logits = model.decode(prev, memory, memory_pad, cache)[:, -1].float()  # (n*width, V)
            if stats is not None:
                stats.saw(cache)
            at_max = [max_len[s] <= step for s in active]
            top_scores, top_beam, top_token = _candidates(logits, scores, at_max, step, k, min_len=min_len,
                                                          bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
            is_eos = top_token.eq(eos_id)
            _finish(finished, active, tokens, base, top_scores, top_beam, is_eos, k, lenpen, step)

            scores, rows, token = _next_beam(top_scores, top_beam, top_token, is_eos, base, k)

            going = [not done and len(finished[s]) < k for s, done in zip(active, at_max, strict=True)]
            if not any(going):
                break
            active, scores, rows, token, cross = _leave(going, active, scores, rows, token, width, k)
            if cross is not None:
                memory, memory_pad = memory[cross], memory_pad[cross]
            width = k
            base = torch.arange(len(active), device=device)[:, None] * width
            cache.reorder(rows, cross)
            tokens = torch.cat([tokens[rows], token[:, None]], dim=1)
            prev = token[:, None]

        return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]


def _leave(going: list[bool], active: list[int], scores: Tensor, rows: Tensor, token: Tensor, width: int,
           k: int) -> tuple[list[int], Tensor, Tensor, Tensor, Tensor | None]:
    """Done sentences leave the batch: (active, scores, rows, token) of those going on, and
    `cross` (n'*k,), the row of the old cross-attention caches each new row reads, or None when
    they stay as they are. Beams of a sentence share its encoder keys, so the cross caches change
    only when sentences leave, or when the one row of step 0 becomes k."""
    n, device = len(active), scores.device
    keep = None if all(going) else torch.tensor([i for i, g in enumerate(going) if g], device=device)
    cross = None
    if keep is not None or width != k:
        sentences = keep if keep is not None else torch.arange(n, device=device)
        beams = torch.arange(k, device=device)  # beam j of a sentence comes from its row j % width
        cross = (sentences[:, None] * width + beams % width).view(-1)
    if keep is not None:
        active = [active[i] for i in keep.tolist()]
        scores = scores[keep]
        rows, token = rows.view(n, k)[keep].view(-1), token.view(n, k)[keep].view(-1)
    return active, scores, rows, token, cross


def _candidates(logits: Tensor, scores: Tensor, at_max: list[bool], step: int, k: int, *, min_len: int,
                bos_id: int, eos_id: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """A step's best 2k candidates of each of the n sentences, best first, from `logits` (n*width,
    V) and the beam scores (n, width): their scores, rows within the sentence and tokens.
    At a sentence's max_len only EOS is allowed, clamped so that a hypothesis ends even if
    p(EOS) = 0."""
    n, width = scores.shape
    log_z = logits.logsumexp(dim=-1, keepdim=True)  # log p = logit - log_z, never renormalised
    eos_lprob = logits[:, eos_id] - log_z[:, 0]
    _ban_(logits, step, min_len, bos_id, eos_id, pad_id)
    # A sentence's best 2k candidates lie among each of its rows' best 2k tokens, so log p is
    # formed for those only, not for all k*V.
    c = min(2 * k, logits.size(-1))
    row_lprobs, row_tokens = logits.topk(c, dim=-1)  # (n*width, c)
    row_lprobs = row_lprobs - log_z
    if any(at_max):
        forced = torch.tensor(at_max, device=logits.device).repeat_interleave(width)[:, None]  # (n*width, 1)
        only_eos = torch.full_like(row_lprobs, -math.inf)
        only_eos[:, 0] = eos_lprob.clamp(min=torch.finfo(row_lprobs.dtype).min)
        row_lprobs = torch.where(forced, only_eos, row_lprobs)
        row_tokens = torch.where(forced, eos_id, row_tokens)
    candidates = (scores[:, :, None] + row_lprobs.view(n, width, c)).view(n, width * c)
    flat_tokens = row_tokens.view(n, width * c)
    if width * c < 2 * k:  # fewer candidates than 2k (step 0, a small vocabulary): -inf
        fill = 2 * k - width * c  # fillers, never chosen over a real candidate
        candidates = torch.cat([candidates, candidates.new_full((n, fill), -math.inf)], dim=1)
        flat_tokens = torch.cat([flat_tokens, flat_tokens.new_full((n, fill), pad_id)], dim=1)
    top_scores, top = candidates.topk(2 * k, dim=1)  # (n, 2k), best first
    return top_scores, (top // c).clamp(max=width - 1), flat_tokens.gather(1, top)


def _next_beam(top_scores: Tensor, top_beam: Tensor, top_token: Tensor, is_eos: Tensor, base: Tensor,
               k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The next beam: each sentence's first k candidates that are not EOS (EOS sorts after them
    all). Their scores (n, k), the cache rows they carry on (n*k,) and their tokens (n*k,)."""
    order = is_eos.long() * top_scores.size(1) + torch.arange(top_scores.size(1), device=top_scores.device)
    live = order.topk(k, dim=1, largest=False).indices  # (n, k), ascending
    return (top_scores.gather(1, live), (base + top_beam.gather(1, live)).view(-1),
            top_token.gather(1, live).view(-1))


def _finish(finished: list[list[tuple[float, list[int]]]], active: list[int], tokens: Tensor, base: Tensor,
            top_scores: Tensor, top_beam: Tensor, is_eos: Tensor, k: int, lenpen: float, step: int) -> None:
    """Finished hypotheses: EOS among a sentence's first k candidates, best first, until it has k;
    scored by sum log p over (length + 1) ** lenpen, the length counting the EOS."""
    ends = is_eos[:, :k] & top_scores[:, :k].isfinite()
    if not ends.any():
        return
    sent, col = ends.nonzero(as_tuple=True)
    rows = base[sent, 0] + top_beam[sent, col]
    ended = zip(sent.tolist(), tokens[rows].tolist(), (top_scores[sent, col] / (step + 1) ** lenpen).tolist(),
                strict=True)
    for s, hyp, score in ended:
        if len(finished[active[s]]) < k:
            finished[active[s]].append((score, hyp))


@torch.inference_mode()
def sequence_logprob(model: Seq2Seq, src: Tensor, hyp_tokens: list[list[int]], *,
                     bos_id: int = 2, eos_id: int = 3, pad_id: int = 0) -> Tensor:
    """Teacher-forced sum of log p(hypothesis tokens, then EOS | src), fp32 log-softmax over
    the whole vocabulary as the searches score. src: (B, S); B token lists -> (B,)."""
    with _eval_mode(model):
        t = max(len(h) for h in hyp_tokens) + 1
        tgt_in = src.new_full((len(hyp_tokens), t), pad_id)
        tgt_out = src.new_full((len(hyp_tokens), t), pad_id)
        for i, hyp in enumerate(hyp_tokens):
            tgt_in[i, : len(hyp) + 1] = torch.tensor([bos_id, *hyp])
            tgt_out[i, : len(hyp) + 1] = torch.tensor([*hyp, eos_id])
        lprobs = torch.log_softmax(model(src, tgt_in).float(), dim=-1)  # (B, T, V)
        picked = lprobs.gather(-1, tgt_out[..., None]).squeeze(-1)  # (B, T)
        return picked.masked_fill(tgt_out.eq(pad_id), 0.0).sum(dim=1)


def translate_ids(
    model: Seq2Seq, sources: list[list[int]], recipe: Recipe, rt: Runtime, *, beam: int | None = None,
    lenpen: float | None = None, on_batch: Callable[[int], None] | None = None, stats: DecodeStats | None = None,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """Decode token-id sources (no EOS) in length-sorted batches of eval.batch_sentences;
    beam 1 is greedy. Returns hypotheses in input order, without BOS/EOS; `stats` gets the
    largest KV cache of any batch. `lengths` (greedy only): each hypothesis exactly as long
    (greedy_decode)."""
    cfg = recipe.eval
    beam = cfg.beam if beam is None else beam
    lenpen = cfg.lenpen if lenpen is None else lenpen
    if lengths is not None and beam != 1:
        raise ValueError(f"forced lengths are for greedy decoding (beam 1), found beam {beam}")
    limit = recipe.model.max_positions - 1  # room for EOS
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    was_training = model.training
    model.eval()
    with torch.inference_mode(), rt.autocast():
        for start in range(0, len(order), cfg.batch_sentences):
            idx = order[start : start + cfg.batch_sentences]
            src = collate_source([sources[i][:limit] for i in idx]).to(rt.device)
            a, b = cfg.max_len_a, min(cfg.max_len_b, limit)
            if beam == 1:
                hyps = greedy_decode(model, src, max_len_a=a, max_len_b=b, stats=stats,
                                     lengths=None if lengths is None else [lengths[i] for i in idx])
            else:
                hyps = beam_search(model, src, beam=beam, lenpen=lenpen, max_len_a=a, max_len_b=b, stats=stats)
            for i, h in zip(idx, hyps, strict=True):
                out[i] = h[:limit]
            if on_batch:
                on_batch(len(idx))
    model.train(was_training)
    return out
