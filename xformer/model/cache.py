"""The key/value cache of one attention module during incremental decoding (KVCache): grown
by concatenation, written into preallocated buffers, or kept as a ring of a window."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one attention module during incremental decoding.

    Self-attention appends one step at a time; cross-attention fills it once from the
    encoder output and reuses it. `reorder` follows beams as beam search reorders them.

    With `window` (a sliding-window decoder) it is a ring of the last window - 1 positions plus
    the `keep_first` global ones: before new keys are appended, older ones no query can see
    again are dropped, so its size stays constant however many tokens are generated.
    `positions()` gives the absolute position of every key it holds.

    With `capacity` (and no window) keys are written into buffers of that many positions,
    allocated at the first append, instead of concatenated every step; `k` and `v` are views
    of the part filled so far. A longer sequence than the capacity grows the buffers.
    """

    def __init__(self, window: int | None = None, keep_first: int = 0, capacity: int | None = None):
        self._k: Tensor | None = None  # (B, K, S or capacity, Dh)
        self._v: Tensor | None = None
        self.window, self.keep_first = window, keep_first
        self.capacity = capacity if window is None else None
        self.seen = 0  # positions appended so far (the absolute position of the next one)
        self._positions: Tensor | None = None

    @property
    def k(self) -> Tensor | None:
        """(B, K, S, Dh): the keys held."""
        return self._k if self._k is None or self.capacity is None else self._k[:, :, :self.seen]

    @property
    def v(self) -> Tensor | None:
        return self._v if self._v is None or self.capacity is None else self._v[:, :, :self.seen]

    @property
    def length(self) -> int:
        """Positions decoded so far (not the keys held: a windowed cache holds fewer)."""
        return self.seen

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value tensors held, preallocated positions included."""
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes

    def positions(self) -> Tensor:
        """(S,) absolute positions of the keys held, in order (0 .. S - 1 without a window)."""
        if self._positions is None:
            return torch.arange(self.k.size(2), device=self.k.device)
        return self._positions

    def _kept(self) -> Tensor | None:
        """Indices of the held keys that the next query (at self.seen) can still see, or None
        for all of them: with a window, the keep_first global ones and the last window - 1."""
        if self.window is None or self.k is None:
            return None
        old = self.positions()
        keep = (old < self.keep_first) | (old > self.seen - self.window)
        return None if bool(keep.all()) else keep.nonzero().squeeze(1)

    def positions_after(self, t: int, device: torch.device | None = None) -> Tensor:
        """The positions() that appending t keys will leave (what a mask for them is built over)."""
        new = torch.arange(self.seen, self.seen + t, device=device)
        if self.k is None:
            return new
        kept, old = self._kept(), self.positions()
        return torch.cat([old if kept is None else old[kept], new.to(old.device)])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.capacity is not None:
            return self._write(k, v)
        # only a ring needs its positions kept: every other cache holds 0 .. S - 1
        positions = self.positions_after(k.size(2), k.device) if self.window is not None else None
        if self._k is None:
            self._k, self._v = k, v
        else:
            kept = self._kept()
            if kept is not None:  # drop what no query can see again: the ring stays window - 1 long
                self._k, self._v = self._k.index_select(2, kept), self._v.index_select(2, kept)
            self._k = torch.cat([self._k, k], dim=2)
            self._v = torch.cat([self._v, v], dim=2)
        self.seen += k.size(2)
        self._positions = positions
        return self._k, self._v

    def _write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append into the preallocated buffers (growing them when full)."""
        end = self.seen + k.size(2)
        if self._k is None or end > self._k.size(2):
            size = max(self.capacity, end) if self._k is None else max(2 * self._k.size(2), end)
            grown_k = k.new_empty(k.size(0), k.size(1), size, k.size(3))
            grown_v = v.new_empty(v.size(0), v.size(1), size, v.size(3))
            if self._k is not None:
                grown_k[:, :, :self.seen], grown_v[:, :, :self.seen] = self.k, self.v
            self._k, self._v = grown_k, grown_v
        self._k[:, :, self.seen:end] = k
        self._v[:, :, self.seen:end] = v
        self.seen = end
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index`, in that order (beam search's reordering, or dropping done rows)."""
        if self._k is None:
            return
        if self.capacity is not None and index.numel() == self._k.size(0):  # same batch size: in place,
            self._k[:, :, :self.seen] = self.k.index_select(0, index)  # the filled part only
            self._v[:, :, :self.seen] = self.v.index_select(0, index)
        else:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)
