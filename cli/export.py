"""xformer export RUN: a trained translation run as a Hugging Face transformers model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xformer.export import FORMATS, export_run
from xformer_cli.common import CheckpointOption, RunArgument, choices, flags_named, stdout, user_errors
from xformer_cli.evaluate import QuantizeOption

Format = choices("Format", FORMATS)


@user_errors
def export(
    run: RunArgument,
    out: Annotated[Path, typer.Option("--out", help="New or empty directory to write.")],
    fmt: Annotated[Format, typer.Option("--format", help="hf: MarianMTModel + MarianTokenizer; ctranslate2: "
                                                         "that, converted by CTranslate2.")] = Format.hf,
    checkpoint: CheckpointOption = None,
    quantize: QuantizeOption = None,
) -> None:
    """Write the run's checkpoint as a MarianMTModel directory (config, safetensors weights,
    generation config, sentencepiece tokenizer) that transformers' from_pretrained loads."""
    with flags_named("out", "format", "quantize"):
        path = export_run(run, out, fmt=fmt.value, checkpoint=checkpoint, quantize=quantize.value if quantize else None)
    if fmt.value == "hf":
        stdout.print(f"{path}: MarianMTModel.from_pretrained({str(path)!r}) and MarianTokenizer.from_pretrained "
                     "load it")
    else:
        stdout.print(f"{path}: xformer eval {run} --ctranslate2 {path} decodes with it")
