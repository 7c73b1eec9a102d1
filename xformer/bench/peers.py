"""The peers of `xformer bench peers`: the workload of bench.ModelBenchConfig (an encoder-decoder
of 3 + 3 layers, d_model 256, 4 heads, FFN 1024, a tied vocabulary of 8000, dropout 0.1; Adam;
random tokens) built in each library from its own configuration, nothing downloaded:

    xformer         build_model, as `xformer train` and `xformer eval` run it
    marian          HF transformers' MarianMTModel from a MarianConfig; generate() to decode
    x_transformers  x-transformers' XTransformer; its decoder's generate, greedy (its beam_search
                    does not expand the encoder context to the beams, so no beam figure)
    torch_nn        torch.nn.Transformer with embeddings and a tied output layer; greedy
                    decoding re-runs the decoder over the prefix (it has no cache), no beam

Every peer trains with torch's fused Adam (HF Trainer's default optimizer, and what `xformer
train` runs). With config.data, every peer also trains on the same real batches: the first
config.data_batches training batches of that corpus as `xformer train` cuts them (token
buckets), saved once by `real_batches` (multi30k_target_tokens_per_s counts real target
tokens only, so padding costs each peer what it costs).

Each peer runs in its own process (`python -m xformer.bench.peers NAME CONFIG_JSON [BATCHES]`, one
round of each figure, printed as JSON), so one library's threads, allocator or compiled state
never touch another's. HF transformers and x-transformers come from the optional `peers` extra and
are imported only here, inside the functions that need them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from xformer.bench.speed import ModelBenchConfig, _figure, _model, matmul_peak_gflops, train_flops
from xformer.config.schema import ModelConfig, Recipe, TrainConfig
from xformer.errors import XformerError
from xformer.events import Event, ignore
from xformer.generation.decode import beam_search, greedy_decode
from xformer.model.dropout import use_fast_dropout
from xformer.results import Result
from xformer.tasks import make_task
from xformer.tasks.translation import TranslationData
from xformer.training.device import resolve_runtime
from xformer.training.losses import sequence_loss
from xformer.training.optim import fused_supported

PEERS = ("xformer", "marian", "x_transformers", "torch_nn")
BOS, EOS, PAD = 2, 3, 0


def _xformer(config: ModelBenchConfig, device: torch.device):
    model, _ = _model(config, device)
    use_fast_dropout(model, device.type == "cpu")

    def loss(src, tgt):  # as xformer train computes it: on the CPU only real target rows are projected
        out = tgt[:, 1:]
        keep = out.ne(PAD) if device.type == "cpu" else None
        logits = model(src, tgt[:, :-1], keep=keep)
        return sequence_loss(logits, out[keep] if keep is not None else out, PAD, 0.1) / out.ne(PAD).sum()

    exact = dict(max_len_a=0.0, max_len_b=config.new_tokens, min_len=config.new_tokens)
    return model, loss, lambda src: greedy_decode(model, src, **exact), \
        lambda src: beam_search(model, src, beam=config.beam, **exact)


def _marian(config: ModelBenchConfig, device: torch.device):
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(vocab_size=config.vocab, d_model=config.d_model, encoder_layers=config.layers,
                       decoder_layers=config.layers, encoder_attention_heads=config.n_heads,
                       decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff,
                       decoder_ffn_dim=config.d_ff, max_position_embeddings=512, dropout=0.1,
                       attention_dropout=0.0, activation_dropout=0.0, activation_function="relu",
                       pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS,
                       forced_eos_token_id=None, scale_embedding=True, share_encoder_decoder_embeddings=True)
    torch.manual_seed(0)
    model = MarianMTModel(cfg).to(device)

    def loss(src, tgt):
        logits = model(input_ids=src, decoder_input_ids=tgt[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt[:, 1:].reshape(-1),
                               ignore_index=PAD, label_smoothing=0.1)

    def search(beams):
        def run(src):
            out = model.generate(input_ids=src, attention_mask=src.ne(PAD), num_beams=beams, do_sample=False,
                                 max_new_tokens=config.new_tokens, min_new_tokens=config.new_tokens,
                                 length_penalty=1.0, early_stopping=True)
            return [row[1:].tolist() for row in out]
        return run

    return model, loss, search(1), search(config.beam)


def _x_transformers(config: ModelBenchConfig, device: torch.device):
    from x_transformers import XTransformer

    torch.manual_seed(0)
    model = XTransformer(dim=config.d_model, tie_token_emb=True, enc_num_tokens=config.vocab,
                         enc_depth=config.layers, enc_heads=config.n_heads, enc_max_seq_len=512,
                         enc_ff_mult=config.d_ff // config.d_model, enc_ff_dropout=0.1,
                         dec_num_tokens=config.vocab, dec_depth=config.layers, dec_heads=config.n_heads,
                         dec_max_seq_len=512, dec_ff_mult=config.d_ff // config.d_model,
                         dec_ff_dropout=0.1).to(device)

    def loss(src, tgt):
        return model(src, tgt, mask=src.ne(PAD))

    def greedy(src):
        start = torch.full((src.size(0), 1), BOS, device=src.device)
        out = model.generate(src, start, config.new_tokens, mask=src.ne(PAD), temperature=0.0, cache_kv=True)
        return out.tolist()

    # its beam_search expands the prompts to the beams but not the encoder context, so an
    # encoder-decoder cannot use it (x-transformers 2.31): greedy only
    return model, loss, greedy, None


class _TorchTransformer(nn.Module):
    def __init__(self, config: ModelBenchConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.d_model, padding_idx=PAD)
        self.positions = nn.Embedding(512, config.d_model)
        self.core = nn.Transformer(config.d_model, config.n_heads, config.layers, config.layers, config.d_ff,
                                   dropout=0.1, batch_first=True)
        self.scale = math.sqrt(config.d_model)

    def _in(self, tokens):
        return self.embed(tokens) * self.scale + self.positions(torch.arange(tokens.size(1), device=tokens.device))

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        hidden = self.core(self._in(src), self._in(tgt), tgt_mask=causal, tgt_is_causal=True,
                           src_key_padding_mask=src.eq(PAD), memory_key_padding_mask=src.eq(PAD))
        return hidden @ self.embed.weight.T


def _torch_nn(config: ModelBenchConfig, device: torch.device):
    torch.manual_seed(0)
    model = _TorchTransformer(config).to(device)

    def loss(src, tgt):
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1), ignore_index=PAD,
                               label_smoothing=0.1)

    def greedy(src):  # no KV cache in torch.nn.Transformer: the decoder re-runs over the prefix
        out = torch.full((src.size(0), 1), BOS, device=src.device)
        memory = model.core.encoder(model._in(src), src_key_padding_mask=src.eq(PAD))
        for _ in range(config.new_tokens):
            causal = nn.Transformer.generate_square_subsequent_mask(out.size(1), device=src.device)
            hidden = model.core.decoder(model._in(out), memory, tgt_mask=causal, tgt_is_causal=True,
                                        memory_key_padding_mask=src.eq(PAD))
            logits = hidden[:, -1] @ model.embed.weight.T
            logits[:, EOS] = -math.inf  # exactly new_tokens tokens, as the others
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
        return out[:, 1:].tolist()

    return model, loss, greedy, None


BUILDERS: dict[str, Callable] = {"xformer": _xformer, "marian": _marian, "x_transformers": _x_transformers,
                                 "torch_nn": _torch_nn}


def run_peer(name: str, config: ModelBenchConfig, batches: str | Path | None = None) -> dict:
    """One round of every figure of peer `name` in this process: {"parameters", figure: value};
    `batches`: a file of real_batches, timed as multi30k_target_tokens_per_s."""
    rt = resolve_runtime(config.device, config.precision)
    model, loss, greedy, beam = BUILDERS[name](config, rt.device)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, config.vocab, (config.batch, config.src_len), generator=generator).to(rt.device)
    tgt = torch.randint(4, config.vocab, (config.batch, config.tgt_len + 1), generator=generator).to(rt.device)
    tgt[:, 0] = BOS
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), fused=fused_supported(params) or None)
    model.train()

    def step(src, tgt):
        with rt.autocast():
            value = loss(src, tgt)
        rt.backward(value)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    out = {"parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
    step(src, tgt)  # warm-up
    out["train_target_tokens_per_s"] = config.steps * config.batch * config.tgt_len / _timed(
        lambda: [step(src, tgt) for _ in range(config.steps)], rt.device)
    if batches is not None:
        saved = load_file(str(batches))
        pairs = [(saved[f"{i}.src"].to(rt.device), saved[f"{i}.tgt"].to(rt.device))
                 for i in range(len(saved) // 2)]
        step(*pairs[0])  # warm-up
        real = sum(int(t[:, 1:].ne(PAD).sum()) for _, t in pairs)
        out["multi30k_target_tokens_per_s"] = real / _timed(lambda: [step(*pair) for pair in pairs], rt.device)
    model.eval()
    sources = torch.randint(4, config.vocab, (config.sentences, config.src_len), generator=generator).to(rt.device)
    for label, search in (("greedy", greedy), (f"beam{config.beam}", beam)):
        if search is None:
            continue

        def decode_all(search=search):
            with torch.inference_mode(), rt.autocast():
                for start in range(0, config.sentences, config.batch):
                    search(sources[start:start + config.batch])

        with torch.inference_mode(), rt.autocast():
            search(sources[: config.batch])  # warm-up
        out[f"{label}_sentences_per_s"] = config.sentences / _timed(decode_all, rt.device)
    return out


def _timed(work: Callable, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def real_batches(config: ModelBenchConfig, folder: Path) -> dict:
    """The training batches `xformer train` makes of config.data (a config.vocab joint unigram
    vocabulary trained into `folder`, token buckets of config.max_tokens, epoch 0's order); the
    first config.data_batches saved to folder/batches.safetensors as `{i}.src` (B, S) and
    `{i}.tgt` (B, 1 + T: BOS, then the target and EOS). Returns what they are made of: the
    padding fraction of every training batch of the epoch (pad cells over all cells, source
    and target), and that of random batches of the same mean size padded to their longest
    (a sampler without length buckets, HF Trainer's default)."""
    data = TranslationData(dataset=config.data, source_lang=config.source_lang, target_lang=config.target_lang,
                           vocab_size=config.vocab, max_tokens=config.max_tokens)
    task = make_task(Recipe(data=data, train=TrainConfig(max_steps=1)))
    task.load(ignore)
    task.prepare(folder, ignore)
    epoch = list(task.train_batches.iter_epoch(0))
    cells = sum(b["src"].numel() + b["tgt_out"].numel() for b in epoch)
    real = sum(int(b["src"].ne(PAD).sum() + b["tgt_out"].ne(PAD).sum()) for b in epoch)
    src_lens = np.concatenate([b["src"].ne(PAD).sum(1).numpy() for b in epoch])
    tgt_lens = np.concatenate([b["tgt_out"].ne(PAD).sum(1).numpy() for b in epoch])
    size = max(1, round(len(src_lens) / len(epoch)))
    order = np.random.default_rng(0).permutation(len(src_lens))
    random_cells = sum(len(rows) * (src_lens[rows].max() + tgt_lens[rows].max())
                       for rows in np.array_split(order, math.ceil(len(order) / size)))
    kept = epoch[: config.data_batches]
    tensors = {}
    for i, b in enumerate(kept):
        tensors[f"{i}.src"] = b["src"].contiguous()
        tensors[f"{i}.tgt"] = torch.cat([torch.full_like(b["tgt_out"][:, :1], BOS), b["tgt_out"]], dim=1)
    save_file(tensors, str(folder / "batches.safetensors"))
    return {"data": config.data, "batches": len(kept), "pairs": sum(len(b["src"]) for b in kept),
            "target_tokens": sum(int(b["tgt_out"].ne(PAD).sum()) for b in kept),
            "epoch_batches": len(epoch), "pairs_per_batch": len(src_lens) / len(epoch),
            "padding_fraction": 1 - real / cells, "random_padding_fraction": 1 - real / random_cells}


@dataclass
class PeersBench(Result):
    """Per peer: parameters and, per figure, the median, min and max over rounds (or the error
    that stopped it); per figure: xformer's median over each peer's (xformer_vs)."""

    device: str
    precision: str
    config: dict
    peers: list[str]
    parameters: dict
    figures: dict  # peer -> figure -> {"median", "min", "max", "rounds"}
    errors: dict  # peer -> the last line its process wrote to stderr
    xformer_vs: dict  # figure -> peer -> xformer median / peer median
    data: dict | None = None  # with config.data: what real_batches returned
    matmul_peak_gflops: float | None = None  # measured before the first round
    mfu: dict | None = None  # peer -> model FLOP/s of its median synthetic training round over the peak


def bench_peers(config: ModelBenchConfig | None = None, peers: list[str] | None = None, *,
                on_event: Event | None = None) -> PeersBench:
    """Every round runs each peer once in its own process, peers in turn, so a slow patch of a
    shared machine touches them all; events: "round" {"round", "peer", figures or "error"}."""
    config = config or ModelBenchConfig()
    peers = list(peers or PEERS)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise XformerError(f"peer {unknown[0]}: expected one of {', '.join(PEERS)}")
    emit = on_event or ignore
    rt = resolve_runtime(config.device, config.precision)
    peak = matmul_peak_gflops(rt.device)
    rounds: dict[str, dict[str, list[float]]] = {p: {} for p in peers}
    parameters, errors = {}, {}
    with tempfile.TemporaryDirectory(prefix="xformer-peers-") as folder:
        data = real_batches(config, Path(folder)) if config.data else None
        batches = Path(folder) / "batches.safetensors" if config.data else None
        for index in range(config.rounds):
            for peer in peers:
                if peer in errors:
                    continue
                result = _in_process(peer, config, batches)
                if "error" in result:
                    errors[peer] = result["error"]
                    emit("round", {"round": index + 1, "peer": peer, "error": result["error"]})
                    continue
                parameters[peer] = result.pop("parameters")
                for figure, value in result.items():
                    rounds[peer].setdefault(figure, []).append(value)
                emit("round", {"round": index + 1, "peer": peer, **result})
    figures = {p: {f: _figure(v) for f, v in rounds[p].items()} for p in peers if p not in errors}
    ratios: dict[str, dict[str, float]] = {}
    for figure, ours in figures.get("xformer", {}).items():
        for peer, theirs in figures.items():
            if peer != "xformer" and figure in theirs:
                ratios.setdefault(figure, {})[peer] = ours["median"] / theirs[figure]["median"]
    # every peer trains the same model on the same synthetic batches: one FLOP count for all
    model = ModelConfig(d_model=config.d_model, n_heads=config.n_heads, d_ff=config.d_ff,
                        n_encoder_layers=config.layers, n_decoder_layers=config.layers)
    per_token = train_flops(model, config.vocab, config.batch, config.src_len, config.tgt_len) / (
        config.batch * config.tgt_len)
    mfu = {p: f["train_target_tokens_per_s"]["median"] * per_token / (peak * 1e9)
           for p, f in figures.items() if "train_target_tokens_per_s" in f}
    return PeersBench(device=str(rt.device), precision=rt.precision, config=vars(config), peers=peers,
                      parameters=parameters, figures=figures, errors=errors, xformer_vs=ratios, data=data,
                      matmul_peak_gflops=peak, mfu=mfu)


def _in_process(peer: str, config: ModelBenchConfig, batches: Path | None) -> dict:
    """One round of `peer` in a fresh interpreter: its figures, or {"error": why it stopped}."""
    one = {**vars(config), "rounds": 1}
    extra = [str(batches)] if batches is not None else []
    done = subprocess.run([sys.executable, "-m", "xformer.bench.peers", peer, json.dumps(one), *extra],
                          capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        if "ModuleNotFoundError" in last:
            last += " (pip install 'xformer[peers]' installs the peers)"
        return {"error": last}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m xformer.bench.peers NAME CONFIG_JSON [BATCHES]
    peer, fields = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(run_peer(peer, ModelBenchConfig(**fields), sys.argv[3] if len(sys.argv) > 3 else None)))
