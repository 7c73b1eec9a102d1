"""PyTorch's CPU LSTM at the recall sweep's shapes: forward + backward time per step, packed and
unpacked, so a throughput cliff in a sweep can be told apart from xformer overhead (the long-range
Transformer-vs-LSTM comparison, docs/results.md).

    python benchmarks/lstm_cpu_speed.py

Measured 2026-11-30 on the 2-core CPU (torch 2.13.0): 48-60 ms/step at (S 64, B 128) and
(S 128, B 64), but ~550 ms at (S 256, B 32), 300 ms at (512, 16), 200 ms at (1024, 8): per token
10x slower from S 256 on, packed or not, with oneDNN on or off, with glibc malloc or tcmalloc.
"""

import time

import torch
from torch.nn.utils.rnn import pack_padded_sequence


def step(lstm: torch.nn.LSTM, x: torch.Tensor, packed: bool) -> None:
    batch, length = x.shape[:2]
    inputs = (pack_padded_sequence(x, torch.full((batch,), length), batch_first=True, enforce_sorted=False)
              if packed else x)
    _, (h, _) = lstm(inputs)
    h[-1].sum().backward()


def main() -> None:
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(64, 151, 1, batch_first=True)  # the recall LSTM baseline's shape
    for length, batch in ((64, 128), (128, 64), (256, 32), (512, 16), (1024, 8)):
        x = torch.randn(batch, length, 64, requires_grad=True)
        for packed in (True, False):
            step(lstm, x, packed)
            started = time.perf_counter()
            for _ in range(3):
                step(lstm, x, packed)
            seconds = (time.perf_counter() - started) / 3
            print(f"length {length:5d} batch {batch:4d} packed {packed!s:5}: {seconds * 1000:6.0f} ms/step, "
                  f"{batch * length / seconds:9,.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
