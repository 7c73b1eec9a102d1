"""xformer bench attention: every cell measured or said to be skipped, ratios against full
attention from the same run, growth exponents fitted from the cells."""

import json

import pytest
from typer.testing import CliRunner

from tests.extras import need
from xformer.bench.speed import AttentionBenchConfig, _slope, bench_attention
from xformer_cli.main import app


def test_every_pattern_and_backend_gets_its_cells_and_full_is_the_baseline():
    config = AttentionBenchConfig(lengths=[16, 32], d_model=16, n_heads=2, window=4, stride=4, topk=4, repeats=1,
                                  device="cpu", decode_lengths=[])
    result = bench_attention(config)
    assert {(c["pattern"], c["backend"]) for c in result.cells} == {(p, b) for p in config.patterns
                                                                     for b in config.backends}
    for c in result.cells:
        assert c["seconds_min"] <= c["seconds"] <= c["seconds_max"]
        if c["pattern"] == "full":
            assert c["time_vs_full"] == 1.0
    assert len(result.exponents) == len(config.patterns) * len(config.backends)


def test_a_cell_too_large_or_after_a_slow_one_is_skipped_not_run():
    config = AttentionBenchConfig(lengths=[16, 32, 64], patterns=["full"], backends=["explicit"], d_model=16,
                                  n_heads=2, repeats=1, device="cpu", memory_limit_mb=32 * 32 * 2 * 4 * 4 / 2**20,
                                  decode_lengths=[])
    cells = bench_attention(config).cells
    assert "seconds" in cells[0] and "seconds" in cells[1] and "needs ~" in cells[2]["skipped"]
    config.memory_limit_mb, config.max_seconds = 1e6, 0.0  # every cell "too slow": only the first runs
    cells = bench_attention(config).cells
    assert "seconds" in cells[0] and all("skipped" in c for c in cells[1:])


def test_the_windowed_decoder_cache_stays_constant_and_the_full_one_grows():
    config = AttentionBenchConfig(lengths=[16], patterns=["full", "sliding_window", "local_global", "low_rank"],
                                  backends=["sdpa"], d_model=16, n_heads=2, window=4, global_tokens=1, repeats=1,
                                  device="cpu", decode_lengths=[8, 16, 32])
    by = {(r["pattern"], r["generated"]): r["cache_mb"] for r in bench_attention(config).cache}
    assert {p for p, _ in by} == {"full", "sliding_window", "local_global"}  # low_rank does not decode
    assert by[("full", 32)] == 2 * by[("full", 16)] == 4 * by[("full", 8)]  # every key kept
    per_key = by[("full", 8)] / 8
    assert by[("sliding_window", 8)] == by[("sliding_window", 32)] == pytest.approx(4 * per_key)  # window - 1 + new
    assert by[("local_global", 32)] == pytest.approx(5 * per_key)  # and the global one


def test_flex_is_skipped_with_the_reason_where_it_has_no_backward():
    config = AttentionBenchConfig(lengths=[16], patterns=["full"], backends=["flex"], d_model=16, n_heads=2,
                                  repeats=1, device="cpu", decode_lengths=[])
    (cell,) = bench_attention(config).cells
    assert "no backward pass on a CPU" in cell["skipped"] or "needs torch" in cell["skipped"]


def test_the_fitted_exponent_is_the_log_log_slope():
    cells = [{"length": n, "seconds": 3.0 * n**1.5} for n in (64, 128, 256)]
    assert _slope(cells, "seconds") == pytest.approx(1.5)
    assert _slope(cells[:1], "seconds") is None


def test_the_command_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--length", "16", "--length", "32", "--pattern", "full",
                                      "--pattern", "strided", "--backend", "sdpa", "--d-model", "16", "--heads", "2",
                                      "--repeats", "1", "--decode-length", "8", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "vs full" in result.stdout and "decoder KV cache" in result.stdout
    saved = json.loads(out.read_text())
    assert [c["pattern"] for c in saved["cells"]] == ["full", "full", "strided", "strided"]
    for flags, words in ((["--d-model", "10", "--heads", "3"], "d_model (--d-model) 10: expected a multiple of"),
                         (["--length", "-5"], "lengths (--length): expected positive sequence lengths, found [-5]"),
                         (["--length", "0"], "found [0]"), (["--decode-length", "-1"], "decode_lengths")):
        bad = CliRunner().invoke(app, ["bench", "attention", *flags, "--device", "cpu"])
        assert bad.exit_code == 2 and words in bad.stderr and bad.stderr.strip().count("\n") == 0, bad.output
    refused = CliRunner().invoke(app, ["bench", "attention", "--pattern", "dense"])
    assert refused.exit_code == 2 and "'dense' is not one of" in refused.output


def test_the_model_benches_print_their_figures_and_count_flops_as_written():
    from xformer.bench.speed import train_flops
    from xformer.config.schema import ModelConfig

    cfg = ModelConfig(d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1)
    # encoder: (4*64 + 2*128) * 3 tokens; decoder: (2*4*64 + 2*128) * 2 + 10 * 8 * 2; scores: 9 + 4 + 6
    forward = 2 * (512 * 3 + 768 * 2 + 160) + 4 * 8 * (9 + 4 + 6)
    assert train_flops(cfg, 10, 1, 3, 2) == 3 * forward
    trained = CliRunner().invoke(app, ["bench", "train", "--steps", "1", "--rounds", "2", "--batch", "2",
                                       "--device", "cpu", "--json"])
    assert trained.exit_code == 0, trained.output
    report = json.loads(trained.stdout)
    figure = report["figures"]["train_target_tokens_per_s"]
    assert len(figure["rounds"]) == 2 and figure["min"] <= figure["median"] <= figure["max"] and 0 < report["mfu"]
    # each round's model GFLOP/s is its tokens/s times the FLOPs of a step over its target tokens
    step_flops = train_flops(ModelConfig(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3),
                             8000, 2, 24, 24)
    for tokens, gflops in zip(figure["rounds"], report["figures"]["model_gflop_per_s"]["rounds"], strict=True):
        assert gflops == pytest.approx(tokens / (2 * 24) * step_flops / 1e9)
    assert all(f >= 0 for f in report["figures"]["minor_faults_per_step"]["rounds"])
    assert report["peak_rss_mb"] > 0 and report["allocator"]["name"]
    decoded = CliRunner().invoke(app, ["bench", "decode", "--rounds", "1", "--batch", "2", "--sentences", "4",
                                       "--new-tokens", "3", "--beam", "2", "--device", "cpu"])
    assert decoded.exit_code == 0, decoded.output
    assert "greedy sentences per s" in decoded.stdout and "beam2 sentences per s" in decoded.stdout


def test_bench_peers_runs_each_peer_in_its_own_process_and_reports_ratios():
    from xformer.bench.peers import bench_peers
    from xformer.bench.speed import ModelBenchConfig

    config = ModelBenchConfig(d_model=16, n_heads=2, d_ff=32, layers=1, vocab=50, batch=2, steps=1, rounds=2,
                              sentences=2, new_tokens=3, beam=2, device="cpu")
    report = bench_peers(config, ["xformer", "torch_nn"])
    assert not report.errors and report.peers == ["xformer", "torch_nn"]
    ours, theirs = report.figures["xformer"], report.figures["torch_nn"]
    assert len(ours["train_target_tokens_per_s"]["rounds"]) == 2  # one process per peer and round
    assert "beam2_sentences_per_s" in ours and "beam2_sentences_per_s" not in theirs  # no cache, no beam there
    for figure in ("train_target_tokens_per_s", "greedy_sentences_per_s"):
        assert report.xformer_vs[figure]["torch_nn"] == pytest.approx(ours[figure]["median"] / theirs[figure]["median"])
    # MFU: one FLOP count for both (the same model), so the shares stand as the throughputs do
    assert report.matmul_peak_gflops > 0 and set(report.mfu) == {"xformer", "torch_nn"}
    assert report.mfu["xformer"] / report.mfu["torch_nn"] == pytest.approx(
        report.xformer_vs["train_target_tokens_per_s"]["torch_nn"])


def test_real_batches_are_xformers_token_buckets_and_every_peer_trains_on_them(corpus, tmp_path):
    """bench peers --data: the saved batches are the token buckets of xformer train (within
    max_tokens, BOS then target then EOS), they pad less than random batches of the same size,
    and each peer reports real target tokens/s over them."""
    from safetensors.torch import load_file

    from xformer.bench.peers import BOS, PAD, bench_peers, real_batches
    from xformer.bench.speed import ModelBenchConfig

    config = ModelBenchConfig(d_model=16, n_heads=2, d_ff=32, layers=1, vocab=300, batch=2, steps=1, rounds=1,
                              sentences=2, new_tokens=3, beam=2, device="cpu", data=str(corpus), data_batches=3,
                              max_tokens=256)
    made = real_batches(config, tmp_path)
    saved = load_file(str(tmp_path / "batches.safetensors"))
    assert made["batches"] == 3 and len(saved) == 6
    assert made["pairs"] == sum(saved[f"{i}.src"].size(0) for i in range(3))
    assert made["target_tokens"] == sum(int(saved[f"{i}.tgt"][:, 1:].ne(PAD).sum()) for i in range(3))
    for i in range(3):
        src, tgt = saved[f"{i}.src"], saved[f"{i}.tgt"]
        assert src.size(0) * max(src.size(1), tgt.size(1) - 1) <= 256 and bool(tgt[:, 0].eq(BOS).all())
    assert 0 <= made["padding_fraction"] < made["random_padding_fraction"] < 1
    report = bench_peers(config, ["xformer", "torch_nn"])
    assert not report.errors and report.data["batches"] == 3
    for peer in ("xformer", "torch_nn"):
        assert report.figures[peer]["multi30k_target_tokens_per_s"]["median"] > 0
    assert "multi30k_target_tokens_per_s" in report.xformer_vs


@pytest.mark.slow
def test_bench_peers_against_hf_marian_through_the_cli():
    need("transformers")
    result = CliRunner().invoke(app, ["bench", "peers", "--peer", "xformer", "--peer", "marian", "--peer", "torch_nn",
                                      "--rounds", "1", "--steps", "1", "--batch", "2", "--sentences", "2",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert not report["errors"], report["errors"]
    ours, hf = report["figures"]["xformer"], report["figures"]["marian"]
    assert set(ours) == set(hf) == {"train_target_tokens_per_s", "greedy_sentences_per_s", "beam5_sentences_per_s"}
    assert "beam5_sentences_per_s" not in report["figures"]["torch_nn"]  # no cache, no beam search there
    ratio = report["xformer_vs"]["train_target_tokens_per_s"]["marian"]
    assert ratio == pytest.approx(ours["train_target_tokens_per_s"]["median"]
                                  / hf["train_target_tokens_per_s"]["median"])
    refused = CliRunner().invoke(app, ["bench", "peers", "--peer", "fairseq"])
    assert refused.exit_code == 2 and "'fairseq' is not one of" in refused.output


@pytest.mark.slow
def test_bench_peers_prints_its_figures_as_a_table():
    result = CliRunner().invoke(app, ["bench", "peers", "--peer", "xformer", "--peer", "torch_nn", "--rounds", "1",
                                      "--steps", "1", "--batch", "2", "--sentences", "2", "--device", "cpu"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "the peers' workload on cpu, fp32: median of 1 rounds" in result.stdout
    rows = {line.split("│")[1].strip(): line.split("│")[2:-1] for line in result.stdout.splitlines()
            if line.count("│") == 5}  # figure, xformer, torch_nn, xformer vs
    for figure in ("train target tokens per s", "greedy sentences per s"):
        ours, theirs, ratio = (cell.strip() for cell in rows[figure])
        assert float(ratio.removesuffix("x torch_nn")) > 0 and ours and theirs
