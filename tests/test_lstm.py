import pytest
import torch

from xformer.config.schema import ModelConfig
from xformer.model.build import build_model, count_parameters
from xformer.model.lstm import LSTMClassifier, lstm_parameters, match_hidden

V, C, PAD = 20, 5, 0


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("n_layers", [1, 3])
def test_closed_form_count_equals_the_module(bidirectional, n_layers):
    model = LSTMClassifier(V, 8, 12, n_layers, C, bidirectional=bidirectional)
    assert count_parameters(model)["total"] == lstm_parameters(V, 8, 12, n_layers, C, bidirectional)


def test_matched_to_a_transformer_classifier_within_10_percent():
    cfg = ModelConfig(arch="classifier", d_model=128, n_heads=4, d_ff=256, n_encoder_layers=4, dropout=0.0)
    target = count_parameters(build_model(cfg, V, n_classes=C))["total"]
    hidden = match_hidden(target, V, 128, 2, C, bidirectional=True)
    got = lstm_parameters(V, 128, hidden, 2, C, True)
    assert abs(got - target) / target < 0.10
    assert abs(lstm_parameters(V, 128, hidden + 1, 2, C, True) - target) >= abs(got - target)


@pytest.mark.parametrize("pooling", ["last", "mean", "max"])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_padding_never_changes_the_output(pooling, bidirectional):
    model = LSTMClassifier(V, 8, 12, 2, C, bidirectional=bidirectional, pooling=pooling).eval()
    short = torch.randint(1, V, (1, 5))
    long = torch.randint(1, V, (1, 9))
    batch = torch.cat([torch.cat([short, torch.full((1, 4), PAD)], dim=1), long])
    with torch.no_grad():
        together = model(batch)
        torch.testing.assert_close(together[0], model(short)[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(together[1], model(long)[0], atol=1e-6, rtol=0)


def test_last_pooling_reads_forward_end_and_backward_start():
    """Against the unpacked nn.LSTM on the unpadded sequence: forward state after the last
    token, backward state after the first."""
    model = LSTMClassifier(V, 8, 12, 1, C, bidirectional=True, pooling="last").eval()
    tokens = torch.randint(1, V, (1, 7))
    with torch.no_grad():
        out, _ = model.lstm(model.embedding(tokens))  # (1, 7, 24)
        expected = model.head(torch.cat([out[0, -1, :12], out[0, 0, 12:]])[None])
        padded = torch.cat([tokens, torch.full((1, 3), PAD)], dim=1)
        torch.testing.assert_close(model(padded), expected, atol=1e-6, rtol=0)
