"""Benchmarks that compare xformer's own options in one run: `bench_attention` times one
self-attention layer, forward and backward, for every attention pattern and backend across
sequence lengths, with peak memory, the ratio to full attention measured in the same run, and
the fitted growth exponents (time ~ n^a, memory ~ n^b); `bench_train` and `bench_decode` time
training steps and searches of the encoder-decoder of the peers' benchmark (target tokens/s
with MFU against a matmul peak measured first; sentences/s, greedy and beam).

Every figure is a median over `repeats` with its min and max. A cell whose estimated memory
exceeds `memory_limit_mb`, or that follows a cell of the same series slower than
`max_seconds`, is skipped and recorded as skipped, so a long sweep never swaps or hangs.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch

from xformer.allocator import allocator
from xformer.config.schema import ModelConfig
from xformer.errors import XformerError
from xformer.events import Event, ignore
from xformer.generation.decode import beam_search, greedy_decode
from xformer.model.attention import MultiHeadAttention
from xformer.model.build import build_model
from xformer.model.dropout import use_fast_dropout
from xformer.model.flex import unavailable as flex_unavailable
from xformer.model.lowrank import LowRankProjection
from xformer.model.patterns import PATTERNS, PatternMask, make_pattern
from xformer.results import Result
from xformer.training.device import resolve_runtime
from xformer.training.losses import sequence_loss
from xformer.training.measure import PeakMemory


@dataclass
class AttentionBenchConfig:
    """What `bench_attention` measures: one self-attention layer of d_model and n_heads on a
    batch of `batch` sequences of each length, forward + backward."""

    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])
    patterns: list[str] = field(default_factory=lambda: list(PATTERNS))
    backends: list[str] = field(default_factory=lambda: ["sdpa", "explicit"])
    d_model: int = 256
    n_heads: int = 4
    batch: int = 1
    window: int = 256
    global_tokens: int = 1
    stride: int = 64
    topk: int = 32
    rank: int = 64
    repeats: int = 3
    device: str = "auto"
    max_seconds: float = 30.0  # a series stops growing after a cell this slow
    memory_limit_mb: float = 8192.0  # skip a cell whose score matrices would need more
    # the decoder KV cache: one decoder layer generating this many tokens one at a time, per
    # pattern that decodes; [] skips it
    decode_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])

    def problems(self) -> list[str]:
        """What cannot be measured, one line each (the CLI's flags named beside the fields)."""
        out = []
        if self.n_heads < 1 or self.d_model % self.n_heads:
            out.append(f"d_model (--d-model) {self.d_model}: expected a multiple of n_heads (--heads) {self.n_heads}")
        bad = [n for n in self.lengths if n < 1]
        if bad or not self.lengths:
            out.append(f"lengths (--length): expected positive sequence lengths, found {bad or 'none'}")
        if any(n < 0 for n in self.decode_lengths):
            out.append(f"decode_lengths (--decode-length): expected lengths >= 0 (0 skips the cache), found "
                       f"{[n for n in self.decode_lengths if n < 0]}")
        for name in ("window", "repeats", "batch"):
            if getattr(self, name) < 1:
                out.append(f"{name} (--{name}): expected at least 1, found {getattr(self, name)}")
        if self.max_seconds < 0:  # 0: every series stops after its first cell
            out.append(f"max_seconds (--max-seconds): expected seconds >= 0, found {self.max_seconds}")
        return out


@dataclass
class AttentionBench(Result):
    """Per (pattern, backend, length): seconds and peak MB (median, min, max) and ratios to full
    attention on the same backend; per (pattern, backend): the fitted exponents."""

    device: str
    config: dict
    cells: list[dict]
    exponents: list[dict]
    cache: list[dict] = field(default_factory=list)  # per (pattern, generated tokens): the KV cache held


def bench_attention(config: AttentionBenchConfig | None = None, *, on_event: Event | None = None) -> AttentionBench:
    """Measure every (pattern, backend, length) cell; events: "cell" (a finished cell)."""
    config = config or AttentionBenchConfig()
    if config.problems():
        raise XformerError([f"bench attention: {problem}" for problem in config.problems()])
    emit = on_event or ignore
    rt = resolve_runtime(config.device, "fp32", training=False)
    cells = []
    for pattern_name in config.patterns:
        pattern = make_pattern(pattern_name, window=config.window, global_tokens=config.global_tokens,
                               stride=config.stride, topk=config.topk, rank=config.rank)
        for backend in config.backends:
            too_slow = False
            for n in config.lengths:
                cell = {"pattern": pattern_name, "backend": backend, "length": n}
                needed = _score_bytes(config, n, backend, pattern) / 2**20
                cannot = _cannot(backend, rt.device)
                if cannot:
                    cell["skipped"] = cannot
                elif too_slow or needed > config.memory_limit_mb:
                    cell["skipped"] = ("a shorter length took more than max_seconds" if too_slow else
                                       f"needs ~{needed:,.0f} MB of scores, more than memory_limit_mb")
                else:
                    cell.update(_measure(config, pattern, backend, n, rt.device))
                    too_slow = cell["seconds"] > config.max_seconds
                cells.append(cell)
                emit("cell", cell)
    _add_ratios(cells)
    exponents = [_exponents(cells, p, b) for p in config.patterns for b in config.backends]
    cache = []
    if any(n > 0 for n in config.decode_lengths):  # 0 skips the cache
        for pattern_name in config.patterns:
            if not make_pattern(pattern_name, rank=config.rank).PROJECTS_KEYS:  # encoders only
                cache += _decode_cache(config, pattern_name, rt.device)
                emit("cache", cache[-1])
    return AttentionBench(device=str(rt.device), config=vars(config), cells=cells, exponents=exponents,
                          cache=cache)


def _decode_cache(config: AttentionBenchConfig, pattern: str, device: torch.device) -> list[dict]:
    """Greedy-style incremental decoding of max(decode_lengths) tokens through one decoder layer
    of `pattern` with the model's own cache (Seq2Seq.new_cache): the MB of keys and values it
    holds, and the seconds per token, at each of decode_lengths."""
    lengths = sorted(n for n in config.decode_lengths if n > 0)
    cfg = ModelConfig(d_model=config.d_model, n_heads=config.n_heads, d_ff=config.d_model, n_encoder_layers=1,
                      n_decoder_layers=1, dropout=0.0, max_positions=lengths[-1] + 1, attention=pattern,
                      window=config.window, global_tokens=config.global_tokens, stride=config.stride,
                      topk=config.topk)
    torch.manual_seed(0)
    model = build_model(cfg, 16).to(device).eval()
    rows, tokens = [], torch.full((1, 1), 4, device=device)
    with torch.no_grad():
        memory, pad = model.encode(torch.full((1, 4), 5, device=device))
        cache = model.new_cache()
        started = time.perf_counter()
        for step in range(1, lengths[-1] + 1):
            model.decode(tokens, memory, pad, cache)
            if step in lengths:
                held = sum(c.k.numel() * c.k.element_size() * 2 for c, _ in cache.layers)
                rows.append({"pattern": pattern, "generated": step, "cache_mb": held / 2**20,
                             "seconds_per_token": (time.perf_counter() - started) / step})
    return rows


def _cannot(backend: str, device: torch.device) -> str | None:
    """Why a backend cannot be timed forward + backward here, or None."""
    if backend != "flex":
        return None
    if flex_unavailable():
        return flex_unavailable()
    return "flex attention has no backward pass on a CPU" if device.type == "cpu" else None


def _measure(config: AttentionBenchConfig, pattern, backend: str, n: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    projection = LowRankProjection(config.rank, n) if pattern.PROJECTS_KEYS else None
    attention = MultiHeadAttention(config.d_model, config.n_heads, backend=backend, score_hook=pattern.score_hook,
                                   key_projection=projection).to(device)
    x = torch.randn(config.batch, n, config.d_model, device=device, requires_grad=True)
    seconds, memory = [], []
    for _ in range(config.repeats + 1):  # the first is a warm-up
        with PeakMemory(device) as peak:
            started = time.perf_counter()
            mask = PatternMask(pattern, n, device=device) if pattern.QUERY_DEPENDENT else None
            out, _ = attention(x, mask=mask)
            out.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - started
        seconds.append(elapsed)
        memory.append(peak.peak_mb)
        x.grad = None
        attention.zero_grad(set_to_none=True)
    seconds, memory = seconds[1:], memory[1:]
    return {"seconds": statistics.median(seconds), "seconds_min": min(seconds), "seconds_max": max(seconds),
            "peak_mb": statistics.median(memory), "peak_mb_min": min(memory), "peak_mb_max": max(memory)}


def _score_bytes(config: AttentionBenchConfig, n: int, backend: str, pattern) -> float:
    """What the (B, H, n, keys scored) score matrices of one forward + backward need, roughly:
    the explicit path and the blocked kernels keep scores, probabilities and their gradients;
    SDPA about one such matrix when it falls back to its math kernel (a mask or a hook); a
    dense mask adds n^2 bytes."""
    blocked = pattern.banded(n)
    matrices = 4 if backend == "explicit" or pattern.score_hook is not None or blocked else 1
    dense_mask = n * n if pattern.QUERY_DEPENDENT and not blocked else 0
    return config.batch * config.n_heads * n * pattern.scored_keys(n) * 4 * matrices + dense_mask


def _add_ratios(cells: list[dict]) -> None:
    full = {(c["backend"], c["length"]): c for c in cells if c["pattern"] == "full" and "seconds" in c}
    for c in cells:
        base = full.get((c["backend"], c["length"]))
        if base is not None and "seconds" in c:
            c["time_vs_full"] = c["seconds"] / base["seconds"]
            c["memory_vs_full"] = c["peak_mb"] / base["peak_mb"] if base["peak_mb"] > 0 else None


def _exponents(cells: list[dict], pattern: str, backend: str) -> dict:
    """Least-squares slopes of log time and log memory against log length (None under 2 points)."""
    mine = [c for c in cells if c["pattern"] == pattern and c["backend"] == backend and "seconds" in c]
    return {"pattern": pattern, "backend": backend, "time_exponent": _slope(mine, "seconds"),
            "memory_exponent": _slope([c for c in mine if c["peak_mb"] > 0], "peak_mb")}


def _slope(cells: list[dict], key: str) -> float | None:
    if len(cells) < 2:
        return None
    xs = [math.log(c["length"]) for c in cells]
    ys = [math.log(c[key]) for c in cells]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


# ---------------------------------------------------------------- the model: training and decoding speed


@dataclass
class ModelBenchConfig:
    """The workload of `bench_train` and `bench_decode`: an encoder-decoder of the peers'
    benchmark (3 + 3 layers, d_model 256, 4 heads, FFN 1024, a tied vocabulary of 8000) on
    random tokens; training batches of `batch` pairs of src_len + tgt_len tokens (Adam, label
    smoothing 0.1, dropout 0.1); decoding `sentences` sources of src_len tokens in batches of
    `batch`, exactly `new_tokens` tokens each."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    layers: int = 3
    vocab: int = 8000
    batch: int = 64
    src_len: int = 24
    tgt_len: int = 24
    steps: int = 20  # timed training steps per round
    rounds: int = 3
    sentences: int = 256
    new_tokens: int = 32
    beam: int = 5
    precision: str = "fp32"
    device: str = "auto"
    # bench_peers only: a translation corpus (a Multi30k-like folder, a file or a Hub id) whose
    # first `data_batches` training batches, as `xformer train` makes them (a `vocab` joint
    # unigram vocabulary, token buckets of `max_tokens`), every peer also trains on
    data: str | None = None
    source_lang: str = "de"
    target_lang: str = "en"
    data_batches: int = 20
    max_tokens: int = 4096


@dataclass
class ModelBench(Result):
    """Medians over rounds with min and max; `rounds` holds each round's figure."""

    device: str
    precision: str
    config: dict
    parameters: int
    figures: dict  # name -> {"median", "min", "max", "rounds"}
    matmul_peak_gflops: float | None = None  # measured at the start (bench_train)
    mfu: float | None = None  # model FLOP/s of the median round over the matmul peak
    peak_rss_mb: float | None = None  # the process's peak resident set (bench_train; Linux)
    allocator: dict | None = None  # the C allocator in effect (xformer.allocator)


def _model(config: ModelBenchConfig, device: torch.device):
    cfg = ModelConfig(d_model=config.d_model, n_heads=config.n_heads, d_ff=config.d_ff,
                      n_encoder_layers=config.layers, n_decoder_layers=config.layers, dropout=0.1,
                      tie_embeddings="all", max_positions=512)  # the peers' 512
    torch.manual_seed(0)
    return build_model(cfg, config.vocab).to(device), cfg


def _figure(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """The best of a few n x n matmuls, in GFLOP/s: what MFU is measured against."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(4):
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e9


def train_flops(cfg: ModelConfig, vocab: int, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one training step (forward + backward = 3x forward): 2 per weight per token
    through every linear layer (the encoder's over source tokens, the decoder's and the output
    projection over target tokens) and the attention score and value matmuls (4 T S D each)."""
    d, f = cfg.d_model, cfg.d_ff
    attention_weights, ffn_weights = 4 * d * d, 2 * d * f
    encoder = cfg.n_encoder_layers * (attention_weights + ffn_weights) * src_len
    decoder = cfg.n_decoder_layers * (2 * attention_weights + ffn_weights) * tgt_len + vocab * d * tgt_len
    scores = cfg.n_encoder_layers * src_len * src_len + cfg.n_decoder_layers * (tgt_len * tgt_len
                                                                                  + tgt_len * src_len)
    forward = batch * (2 * (encoder + decoder) + 4 * d * scores)
    return 3 * forward


def bench_train(config: ModelBenchConfig | None = None, *, on_event: Event | None = None) -> ModelBench:
    """Target tokens/s of training steps (forward, label-smoothed loss, backward, Adam), one
    figure per round of `steps` steps after a warm-up step, with the model GFLOP/s and the
    minor page faults per step of each round (the kernel's count: what malloc's mmap churn costs,
    xformer.allocator); MFU against a matmul peak measured first, and the process's peak RSS.
    Events: "round" {"round", "tokens_per_s"}."""
    config = config or ModelBenchConfig()
    emit = on_event or ignore
    rt = resolve_runtime(config.device, config.precision)
    peak = matmul_peak_gflops(rt.device)
    model, cfg = _model(config, rt.device)
    use_fast_dropout(model, rt.device.type == "cpu")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, config.vocab, (config.batch, config.src_len), generator=generator).to(rt.device)
    tgt = torch.randint(4, config.vocab, (config.batch, config.tgt_len + 1), generator=generator).to(rt.device)
    tgt[:, 0] = 2  # BOS

    def step():
        with rt.autocast():
            logits = model(src, tgt[:, :-1])
            loss = sequence_loss(logits, tgt[:, 1:], 0, 0.1) / tgt[:, 1:].numel()
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    flops = train_flops(cfg, config.vocab, config.batch, config.src_len, config.tgt_len)
    rates, gflops, faults = [], [], []
    for index in range(config.rounds):
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        started, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(config.steps):
            step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        seconds = time.perf_counter() - started
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted) / config.steps)
        rates.append(config.steps * config.batch * config.tgt_len / seconds)
        gflops.append(config.steps * flops / seconds / 1e9)
        emit("round", {"round": index + 1, "tokens_per_s": rates[-1]})
    figure = _figure(rates)
    steps_per_s = figure["median"] / (config.batch * config.tgt_len)
    return ModelBench(device=str(rt.device), precision=rt.precision, config=vars(config),
                      parameters=sum(p.numel() for p in model.parameters()),
                      figures={"train_target_tokens_per_s": figure, "model_gflop_per_s": _figure(gflops),
                               "minor_faults_per_step": _figure(faults)},
                      matmul_peak_gflops=peak, mfu=flops * steps_per_s / (peak * 1e9),
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, allocator=allocator())


def bench_decode(config: ModelBenchConfig | None = None, *, on_event: Event | None = None) -> ModelBench:
    """Sentences/s of greedy decoding and of beam search (config.beam), exactly new_tokens
    tokens per sentence (EOS banned before, forced at new_tokens), in batches of config.batch;
    one figure per round. Events: "round" {"round", "search", "sentences_per_s"}."""
    config = config or ModelBenchConfig()
    emit = on_event or ignore
    rt = resolve_runtime(config.device, config.precision, training=False)
    model, _ = _model(config, rt.device)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    sources = torch.randint(4, config.vocab, (config.sentences, config.src_len), generator=generator).to(rt.device)
    exact = dict(max_len_a=0.0, max_len_b=config.new_tokens, min_len=config.new_tokens)
    searches = {"greedy": lambda src: greedy_decode(model, src, **exact),
                f"beam{config.beam}": lambda src: beam_search(model, src, beam=config.beam, **exact)}
    figures = {}
    for name, search in searches.items():
        with rt.autocast():
            search(sources[: config.batch])  # warm-up
        rates = []
        for index in range(config.rounds):
            started = time.perf_counter()
            with rt.autocast():
                for start in range(0, config.sentences, config.batch):
                    out = search(sources[start:start + config.batch])
                    assert all(len(o) == config.new_tokens for o in out)
            rates.append(config.sentences / (time.perf_counter() - started))
            emit("round", {"round": index + 1, "search": name, "sentences_per_s": rates[-1]})
        figures[f"{name}_sentences_per_s"] = _figure(rates)
    return ModelBench(device=str(rt.device), precision=rt.precision, config=vars(config),
                      parameters=sum(p.numel() for p in model.parameters()), figures=figures)
