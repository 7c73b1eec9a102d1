"""Export a trained translation run for the tools people deploy with (`xformer export`).

    hf           a Hugging Face transformers directory: MarianMTModel (config.json,
                 model.safetensors, generation_config.json) and its MarianTokenizer (the run's
                 sentencepiece model as source.spm and target.spm, vocab.json), loadable with
                 from_pretrained
    ctranslate2  that directory converted by CTranslate2's own TransformersConverter (weights
                 in float32, or int8 with quantize="int8"), the sentencepiece model beside it
                 and xformer-ctranslate2.json; `xformer eval RUN --ctranslate2 DIR` decodes with it

The mapping is exact for the architecture Marian has: Post-LN LayerNorm layers with biases,
sinusoidal positions from 0, tokens scaled by sqrt(d_model), multi-head attention (no GQA),
ReLU, GELU or SiLU (Marian's swish) FFNs, full attention, one joint vocabulary (embeddings tied as
model.tie_embeddings says: "all" is Marian's shared embeddings, "decoder" and "none" its
share_encoder_decoder_embeddings = false, with tie_word_embeddings true and false). Anything
else is refused with the field that stands in the way.

Marian's sinusoids put every sine in the first half of the features and every cosine in the
second, where xformer interleaves them (Vaswani's layout); the two tables are one permutation of
the features apart, so every tensor's d_model axis is permuted the same way: the residual stream
is the same up to that permutation, LayerNorm commutes with it, and logits are unchanged.
HF transformers comes from the optional `peers` extra and is imported only when exporting.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import sentencepiece
import torch

from xformer.config.loading import load_run_recipe
from xformer.data.tokenizer import VOCABULARY
from xformer.errors import RunError
from xformer.files import atomic_write_folder
from xformer.generation.ctranslate2_engine import CT2_META, export_record, file_digests
from xformer.tasks import make_task
from xformer.training.run_folder import tokenizer_dir

FORMATS = ("hf", "ctranslate2")
BOS, EOS, PAD, UNK = 2, 3, 0, 1
MARIAN_ACTIVATION = {"relu": "relu", "gelu": "gelu", "silu": "swish"}  # model.ffn -> Marian's activation_function
# the one embedding matrix of a model with every embedding tied, under each of Marian's names for it
EMBEDDINGS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
              "lm_head.weight")


def marian_problems(recipe) -> list[str]:
    """Why the recipe's model cannot be a MarianMTModel (empty: it can)."""
    m = recipe.model
    wanted = {"arch": "seq2seq", "positional": "sinusoidal", "norm": "layernorm", "norm_position": "post",
              "attention": "full", "memory_tokens": 0, "downsample_every": 0, "scale_embeddings": True,
              "residual": True}
    out = [f"model.{k}: Marian has {v!r}, found {getattr(m, k)!r}" for k, v in wanted.items()
           if getattr(m, k) != v and not (k == "downsample_every" and getattr(m, k) >= m.n_encoder_layers)]
    if m.arch == "seq2seq":
        if not recipe.data.joint_vocab:
            out.append("data.joint_vocab: Marian numbers both languages' pieces in one vocabulary, found false")
        if m.ffn not in MARIAN_ACTIVATION:
            out.append(f"model.ffn: Marian has relu, gelu or silu (its swish), found {m.ffn!r}")
        if m.kv_heads != m.n_heads:
            out.append(f"model.n_kv_heads: Marian has one key/value head per query head, found {m.kv_heads}")
        if m.pruned_heads:
            out.append("model.pruned_heads: Marian has the same heads in every layer")
    return out


def export_run(run_dir: str | Path, out_dir: str | Path, *, fmt: str = "hf", checkpoint: str | None = None,
               quantize: str | None = None) -> Path:
    """Write the run's checkpoint (default: eval.checkpoint) as `fmt` into the new or empty
    directory out_dir (written in a temporary sibling, then renamed: never half-written)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if fmt not in FORMATS:
        raise RunError(f"format {fmt}: expected one of {', '.join(FORMATS)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RunError(f"out {out_dir}: exists and is not an empty directory; choose a new one")
    recipe = load_run_recipe(run_dir)
    problems = marian_problems(recipe)
    if not make_task(recipe).EXPORTS:
        problems.insert(0, f"data.task: export writes translation models, found {recipe.data.task!r}")
    if fmt == "ctranslate2" and (tokenizer_dir(run_dir) / VOCABULARY).is_file():
        problems.append(f"{tokenizer_dir(run_dir) / VOCABULARY}: an imported vocabulary; the ctranslate2 format "
                        "reads one sentencepiece model's own ids (export --format hf writes this run)")
    if problems:
        raise RunError([f"{run_dir}: cannot be a MarianMTModel: {p}" for p in problems])
    if quantize not in (None, "int8") or (quantize and fmt != "ctranslate2"):
        raise RunError(f"quantize {quantize}: only int8, and only with format ctranslate2")
    checkpoint = checkpoint or recipe.eval.checkpoint
    model, _ = make_task(recipe).open_run(run_dir, checkpoint, "cpu", "fp32")
    with _quiet_transformers():
        return atomic_write_folder(out_dir, lambda staging: _write(fmt, model, recipe, staging, run_dir, checkpoint,
                                                                    quantize))


def _write(fmt: str, model, recipe, staging: Path, run_dir: Path, checkpoint: str, quantize: str | None) -> None:
    if fmt == "hf":
        _write_marian(model, recipe, staging, tokenizer_dir(run_dir))
    else:
        _write_ctranslate2(model, recipe, staging, tokenizer_dir(run_dir), quantize,
                           {**export_record(run_dir, checkpoint), "quantize": quantize})


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars and its advice to install sacremoses (a tokenizer xformer's
    export never uses) say nothing a user of export can act on: kept off the terminal."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the writer says what to install
        yield
        return
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
            yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def feature_order(d_model: int) -> torch.Tensor:
    """Marian's feature i is xformer's feature order[i]: the sines (even features), then the cosines."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _write_marian(model, recipe, out: Path, tokenizer: Path) -> None:
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    m = recipe.model
    vocab = model.output.weight.size(0)
    config = MarianConfig(
        vocab_size=vocab, d_model=m.d_model, encoder_layers=m.n_encoder_layers, decoder_layers=m.n_decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff,
        decoder_ffn_dim=m.d_ff, max_position_embeddings=m.max_positions, activation_function=MARIAN_ACTIVATION[m.ffn],
        dropout=m.dropout, attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout,
        scale_embedding=True, share_encoder_decoder_embeddings=m.tie_embeddings == "all",
        tie_word_embeddings=m.tie_embeddings != "none", decoder_vocab_size=vocab,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=EOS,
        num_beams=recipe.eval.beam, max_length=m.max_positions)
    hf = MarianMTModel(config)
    order = feature_order(m.d_model)
    state = hf.state_dict()
    for name, value in _marian_tensors(model, order).items():
        if state[name].shape != value.shape:
            raise RunError(f"{name}: Marian expects {tuple(state[name].shape)}, the run has {tuple(value.shape)}")
        state[name] = value
    hf.load_state_dict(state)
    # as xformer's searches: padding and BOS are never generated
    hf.generation_config.update(num_beams=recipe.eval.beam, length_penalty=recipe.eval.lenpen,
                                decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                suppress_tokens=[PAD, BOS])
    hf.save_pretrained(out, safe_serialization=True)
    d = recipe.data
    if (tokenizer / VOCABULARY).is_file():  # an imported model's: two models, one renumbered vocabulary
        source, target, vocab_file = tokenizer / "source.spm", tokenizer / "target.spm", tokenizer / VOCABULARY
        names = {i: p for p, i in json.loads(vocab_file.read_text(encoding="utf-8")).items()}
        special = [names[i] for i in (UNK, EOS, PAD)]
    else:
        source = target = tokenizer / "spm.model"
        if not source.is_file():
            raise RunError(f"{tokenizer}: no spm.model (a joint sentencepiece model is what Marian's tokenizer reads)")
        processor = sentencepiece.SentencePieceProcessor(model_file=str(source))
        pieces = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
        vocab_file = out / "vocab.json"
        vocab_file.write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
        special = [processor.id_to_piece(i) for i in (UNK, EOS, PAD)]
    hf_tokenizer = MarianTokenizer(str(source), str(target), str(vocab_file), source_lang=d.source_lang,
                                   target_lang=d.target_lang, unk_token=special[0], eos_token=special[1],
                                   pad_token=special[2], model_max_length=m.max_positions)
    hf_tokenizer.save_pretrained(out)


def _write_ctranslate2(model, recipe, out: Path, tokenizer: Path, quantize: str | None, meta: dict) -> None:
    try:
        import ctranslate2
    except ImportError:
        raise RunError("format ctranslate2: CTranslate2 is not installed (pip install ctranslate2)") from None
    hf_dir = out / "hf"
    _write_marian(model, recipe, hf_dir, tokenizer)
    converted = out / "model"
    with _xformer_marian_loader():
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(converted), quantization=quantize)
    for name in converted.iterdir():
        name.rename(out / name.name)
    converted.rmdir()
    shutil.rmtree(hf_dir)
    shutil.copy(tokenizer / "spm.model", out / "spm.model")
    (out / CT2_META).write_text(json.dumps({**meta, "files": file_digests(out)}, indent=2), encoding="utf-8")


@contextlib.contextmanager
def _xformer_marian_loader():
    """CTranslate2's MarianMT loader, for the time of one conversion, without its OPUS-MT
    assumptions: that the last vocabulary entry is a padding token to drop and that the decoder
    starts from a zero embedding. An xformer export keeps every entry and starts from BOS."""
    from ctranslate2.converters import transformers as ct2

    class XformerMarianLoader(ct2.MarianMTLoader):
        def get_model_spec(self, model):
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            return ct2.BartLoader.get_model_spec(self, model)

        def set_config(self, config, model, tokenizer):
            config.eos_token = tokenizer.eos_token
            config.unk_token = tokenizer.unk_token
            config.decoder_start_token = tokenizer.convert_ids_to_tokens(BOS)

        def set_decoder(self, spec, decoder):
            spec.start_from_zero_embedding = False
            ct2.BartLoader.set_decoder(self, spec, decoder)

        def get_vocabulary(self, model, tokenizer):
            return ct2.BartLoader.get_vocabulary(self, model, tokenizer)

    original = ct2._MODEL_LOADERS["MarianConfig"]
    ct2._MODEL_LOADERS["MarianConfig"] = XformerMarianLoader()
    try:
        yield
    finally:
        ct2._MODEL_LOADERS["MarianConfig"] = original


def marian_names(model) -> list[tuple[str, torch.Tensor, str]]:
    """(Marian's name, the xformer tensor it holds, where its d_model axis is: "rows" (output),
    "cols" (input), "" (none), or "row": none, and Marian's is a (1, N) row) for every tensor a
    MarianMTModel has; the tied embedding
    appears under all four of Marian's names. Export writes them (permuted by feature_order),
    xformer.importing reads them back."""
    out: list[tuple[str, torch.Tensor, str]] = []

    def attention(prefix, module):
        for proj in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(module, proj)
            out.extend([(f"{prefix}.{proj}.weight", linear.weight, "cols"), (f"{prefix}.{proj}.bias", linear.bias, "")])
        out.extend([(f"{prefix}.out_proj.weight", module.out_proj.weight, "rows"),
                    (f"{prefix}.out_proj.bias", module.out_proj.bias, "rows")])

    def norm(prefix, module):
        out.extend([(f"{prefix}.weight", module.weight, "rows"), (f"{prefix}.bias", module.bias, "rows")])

    def ffn(prefix, module):
        out.extend([(f"{prefix}.fc1.weight", module.fc1.weight, "cols"), (f"{prefix}.fc1.bias", module.fc1.bias, ""),
                    (f"{prefix}.fc2.weight", module.fc2.weight, "rows"),
                    (f"{prefix}.fc2.bias", module.fc2.bias, "rows")])

    source, target = model.encoder.embed.embedding.weight, model.decoder.embed.embedding.weight
    if source is target:  # model.tie_embeddings = "all": one matrix under all four names
        out.extend((name, source, "cols") for name in EMBEDDINGS)
    else:  # "decoder" (the output is the target embedding) or "none"
        out.extend([("model.encoder.embed_tokens.weight", source, "cols"),
                    ("model.decoder.embed_tokens.weight", target, "cols"),
                    ("lm_head.weight", model.output.weight, "cols")])
    if model.output.bias is not None:  # model.output_bias: Marian keeps it as a (1, V) buffer
        out.append(("final_logits_bias", model.output.bias, "row"))
    for i, layer in enumerate(model.encoder.layers):
        p = f"model.encoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.self_attn_norm)
        ffn(p, layer.ffn)
        norm(f"{p}.final_layer_norm", layer.ffn_norm)
    for i, layer in enumerate(model.decoder.layers):
        p = f"model.decoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.self_attn_norm)
        attention(f"{p}.encoder_attn", layer.cross_attn)
        norm(f"{p}.encoder_attn_layer_norm", layer.cross_attn_norm)
        ffn(p, layer.ffn)
        norm(f"{p}.final_layer_norm", layer.ffn_norm)
    return out


def _marian_tensors(model, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """xformer's weights under Marian's names, every d_model axis permuted by `order` (cloned:
    with model.qkv = "shared" the three projections are one tensor, and a file holds each once)."""
    permute = {"rows": lambda t: t[order], "cols": lambda t: t[:, order], "": lambda t: t, "row": lambda t: t[None]}
    return {name: permute[axis](tensor.detach()).clone() for name, tensor, axis in marian_names(model)}
