"""Per-sequence decode state of DeepSeek-V4, with snapshots and truncation.

One :class:`DeepseekV4State` per sequence, owned by the caller and handed to
``DeepseekV4ForCausalLM.forward`` next to the sequence's tokens. Per layer it holds:

- ``window``: the sliding-window keys (= values, V4 shares them), the last
  ``sliding_window - 1 + max_rollback`` rows, so that rolling back up to
  ``max_rollback`` tokens still leaves the ``sliding_window - 1`` rows a query needs;
- for CSA/HCA layers a :class:`CompressorState` (and for CSA a second one for the
  lightning indexer's keys): the emitted compressed entries plus the raw projected
  rows (kv and gate) of the most recent tokens. The compressor's pending tokens (the
  unfinished window) and, for CSA, the overlap state (the previous window's first
  half) are both read from those rows, so truncating is dropping rows and entries.

All updates replace tensors instead of writing into them, so :meth:`snapshot` is a
shallow copy and :meth:`restore` is exact. Shapes: ``D`` head dim, ``W`` raw row
width of a compressor (twice its entry dim when windows overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class CompressorState:
    """What one compressor of one layer carries between forward calls.

    Attributes
    ----------
    kv_rows, gate_rows : torch.Tensor
        ``[r, W]`` raw ``kv_proj`` / ``gate_proj`` outputs of the sequence's last ``r``
        tokens (``r = min(num_tokens, keep)``), before the position bias.
    entries : torch.Tensor
        ``[num_tokens // rate, d]`` compressed entries emitted so far (normed, rotated).
    """

    kv_rows: torch.Tensor
    gate_rows: torch.Tensor
    entries: torch.Tensor

    def truncated(self, drop_tokens: int, num_entries: int) -> CompressorState:
        """A copy without the last ``drop_tokens`` rows and with ``num_entries`` entries."""
        keep = self.kv_rows.shape[0] - drop_tokens
        return CompressorState(kv_rows=self.kv_rows[:keep], gate_rows=self.gate_rows[:keep],
                               entries=self.entries[:num_entries])


@dataclass(frozen=True)
class LayerState:
    """State of one attention layer for one sequence.

    Attributes
    ----------
    window : torch.Tensor
        ``[w, D]`` keys of the last ``w`` tokens (normed, rotated).
    compressor : CompressorState | None
        The CSA/HCA compressor; None on sliding-only layers.
    indexer : CompressorState | None
        The lightning indexer's compressor (CSA only).
    """

    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass(frozen=True)
class DeepseekV4Snapshot:
    """An immutable copy of a :class:`DeepseekV4State` (see :meth:`DeepseekV4State.snapshot`)."""

    num_tokens: int
    layers: tuple[LayerState, ...]
    mtp_num_tokens: int
    mtp_layers: tuple[LayerState, ...]


class DeepseekV4State:
    """Decode state of one sequence: main layers and the MTP layers.

    ``num_tokens`` tokens have gone through the main layers (positions
    ``0 .. num_tokens-1``); ``mtp_num_tokens`` positions through the MTP layers (which
    run one token behind, as position ``i`` needs token ``i + 1``).

    Parameters
    ----------
    layers, mtp_layers : list[LayerState]
        Initial per-layer states, from :meth:`DeepseekV4ForCausalLM.new_state`.
    max_rollback : int
        Most tokens :meth:`truncate` may remove at once.
    """

    def __init__(self, layers: list[LayerState], mtp_layers: list[LayerState], *,
                 max_rollback: int) -> None:
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self.num_tokens = 0
        self.layers = list(layers)
        self.mtp_num_tokens = 0
        self.mtp_layers = list(mtp_layers)
        self.max_rollback = max_rollback

    def snapshot(self) -> DeepseekV4Snapshot:
        """Capture the state (O(layers), no tensor copies); does not change it."""
        return DeepseekV4Snapshot(num_tokens=self.num_tokens, layers=tuple(self.layers),
                                  mtp_num_tokens=self.mtp_num_tokens,
                                  mtp_layers=tuple(self.mtp_layers))

    def restore(self, snap: DeepseekV4Snapshot) -> None:
        """Put the state back to ``snap`` exactly (changes the state)."""
        if len(snap.layers) != len(self.layers) or len(snap.mtp_layers) != len(self.mtp_layers):
            raise ValueError("snapshot was taken from a state of another model shape")
        self.num_tokens = snap.num_tokens
        self.layers = list(snap.layers)
        self.mtp_num_tokens = snap.mtp_num_tokens
        self.mtp_layers = list(snap.mtp_layers)

    def truncate(self, num_tokens: int, *, rates: list[int]) -> None:
        """Forget every token from position ``num_tokens`` on (changes the state).

        Parameters
        ----------
        num_tokens : int
            Tokens to keep, ``num_tokens - max_rollback <= num_tokens <= self.num_tokens``.
        rates : list[int]
            Compress rate of each main layer (0 for sliding layers); the model's
            ``truncate_state`` passes them.

        Raises
        ------
        ValueError
            ``num_tokens`` is negative, beyond the current length, or removes more
            than ``max_rollback`` tokens (the rows needed are gone: snapshot instead).
        """
        drop = self.num_tokens - num_tokens
        if num_tokens < 0 or drop < 0:
            raise ValueError(f"cannot truncate a state of {self.num_tokens} tokens to {num_tokens}")
        if drop > self.max_rollback:
            raise ValueError(f"truncating {drop} tokens exceeds max_rollback={self.max_rollback}; "
                             "take a snapshot() before speculating that far and restore() it")
        self.layers = [_truncate_layer(s, self.num_tokens, num_tokens, rate)
                       for s, rate in zip(self.layers, rates)]
        self.num_tokens = num_tokens
        mtp_keep = min(self.mtp_num_tokens, num_tokens)
        self.mtp_layers = [_truncate_layer(s, self.mtp_num_tokens, mtp_keep, 0)
                           for s in self.mtp_layers]
        self.mtp_num_tokens = mtp_keep


def _truncate_layer(state: LayerState, old: int, new: int, rate: int) -> LayerState:
    drop = old - new
    if drop == 0:
        return state
    window = state.window[:state.window.shape[0] - drop]
    compressor = indexer = None
    if state.compressor is not None:
        compressor = state.compressor.truncated(drop, new // rate)
    if state.indexer is not None:
        indexer = state.indexer.truncated(drop, new // rate)
    return replace(state, window=window, compressor=compressor, indexer=indexer)
