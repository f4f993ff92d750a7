"""What a DeepSeek-V4 layer keeps of one sequence between steps: its streams.

Legend: W sliding_window, D head_dim, DI index_head_dim, S compressed entries (one per m tokens).
    window      [<= W-1, D]  the raw KV of the sequence's last W-1 tokens (older ones are never read again)
    compressed  [S, D]       CSA / HCA: the closed windows' entries
    index_keys  [S, DI]      CSA: the indexer's compressed keys, entry for entry
    compressor / index_compressor: the open window (attention_v4/compressor.py's CompressorState)

This is the dense reference layout (per-sequence tensors grown by concatenation), held by the model's caller;
`nbytes` is what the sequence holds. The engine keeps the streams in pools instead (attention_v4/paged.py),
the same interface; this layout is the reference it is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compressor import CompressorState
from .config import V4AttentionConfig


@dataclass
class LayerStreams:
    """The dense reference: per-sequence tensors grown by concatenation (attention_v4/paged.py has the pools).
    What the attention calls, for a chunk of T new tokens starting at position p0 (the tokens held so far):
        window_rows(p0) -> [min(p0, W-1), D] oldest first
        write_window(kv [T, D], p0) -> kv as window_rows will give it back (exact here; fp8 pools: round-tripped)
        load_state(name, p0) -> CompressorState;  store_state(name, state, p0 + T)
        append_entries(name, new [n, ·], p0) -> every entry so far [p0 // m + n, ·]
    name: "compressor" / "index_compressor" for states, "compressed" / "index_keys" for entries."""
    window: torch.Tensor
    sliding_window: int
    compressed: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    compressor: CompressorState | None = None
    index_compressor: CompressorState | None = None

    @classmethod
    def empty(cls, cfg: V4AttentionConfig, kind: str, device, dtype) -> "LayerStreams":
        D = cfg.head_dim
        s = cls(torch.zeros(0, D, device=device, dtype=dtype), cfg.sliding_window)
        if kind != "sliding":
            s.compressed = torch.zeros(0, D, device=device, dtype=dtype)
            s.compressor = CompressorState.empty(2 * D if kind == "csa" else D, device, dtype)
        if kind == "csa":
            s.index_keys = torch.zeros(0, cfg.index_head_dim, device=device, dtype=dtype)
            s.index_compressor = CompressorState.empty(2 * cfg.index_head_dim, device, dtype)
        return s

    def window_rows(self, p0: int) -> torch.Tensor:
        return self.window

    def write_window(self, kv: torch.Tensor, p0: int) -> torch.Tensor:
        keep = self.sliding_window - 1
        self.window = torch.cat([self.window, kv])[-keep:] if keep else self.window
        return kv

    def load_state(self, name: str, p0: int) -> CompressorState:
        return getattr(self, name)

    def store_state(self, name: str, state: CompressorState, p_end: int) -> None:
        pass   # advanced in place

    def append_entries(self, name: str, new: torch.Tensor, p0: int) -> torch.Tensor:
        setattr(self, name, torch.cat([getattr(self, name), new]))
        return getattr(self, name)

    def nbytes(self) -> int:
        tensors = [t for t in (self.window, self.compressed, self.index_keys) if t is not None]
        states = [c for c in (self.compressor, self.index_compressor) if c is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(c.nbytes() for c in states)


@dataclass
class SequenceStreams:
    """Every layer's streams of one sequence (LayerStreams, or attention_v4/paged.py's views of the pools), and how
    many of its tokens they hold."""
    layers: list
    num_tokens: int = 0

    @classmethod
    def empty(cls, cfg: V4AttentionConfig, kinds: tuple[str, ...], device, dtype) -> "SequenceStreams":
        return cls([LayerStreams.empty(cfg, k, device, dtype) for k in kinds])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def growing_bytes(cfg: V4AttentionConfig, kind: str, num_tokens: int, elt: int) -> int:
    """Bytes of one layer's streams that grow with a sequence's length: its compressed entries (and indexer keys),
    one per m tokens."""
    m = cfg.ratio(kind)
    if not m:
        return 0
    width = cfg.head_dim + (cfg.index_head_dim if kind == "csa" else 0)
    return (num_tokens // m) * width * elt


@dataclass(frozen=True)
class V4Meta:
    """One step's (or microbatch's) chunks: tokens [starts[i], starts[i] + lens[i]) of the flattened step are
    chunk i's, at positions first[i] onwards of the sequence whose streams are streams[i]. positions [T].
    A DBO microbatch may hold the second part of a sequence whose first part is in the other microbatch:
    its first[i] is past the streams' num_tokens, and the other microbatch's layer i runs before its own.
    Whoever runs the step advances num_tokens after it (DeepseekV4Model.forward, or the runner's split step)."""
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    first: tuple[int, ...]
    streams: tuple[SequenceStreams, ...]
    positions: torch.Tensor = field(repr=False)
    cache: dict = field(default_factory=dict, repr=False, compare=False)   # per-step indices (attention_v4/decode.py)

    @classmethod
    def build(cls, lens: list[int], streams: list[SequenceStreams], device="cpu",
              offsets: list[int] | None = None) -> "V4Meta":
        """offsets[i]: chunk i starts that many tokens past streams[i].num_tokens (default 0)."""
        if len(lens) != len(streams):
            raise ValueError(f"{len(lens)} chunk lengths for {len(streams)} sequences")
        offsets = offsets if offsets is not None else [0] * len(lens)
        starts, first, pos, t = [], [], [torch.zeros(0, dtype=torch.int64)], 0
        for n, s, off in zip(lens, streams, offsets):
            if n < 1:
                raise ValueError(f"a sequence's chunk must have at least one token, got {n}")
            starts.append(t)
            first.append(s.num_tokens + off)
            pos.append(torch.arange(first[-1], first[-1] + n))
            t += n
        return cls(tuple(starts), tuple(lens), tuple(first), tuple(streams), torch.cat(pos).to(device))

    @property
    def ctx_lens(self) -> list[int]:
        return [p + n for p, n in zip(self.first, self.lens)]
