"""Read HF-format DeepSeek safetensors checkpoints and copy them into a model's parameters.

Legend: E routed experts, Im moe_intermediate_size, H hidden. Names are HF tensor names
(`model.layers.3.mlp.experts.7.gate_proj.weight`). FP8 checkpoints store a linear weight as
float8_e4m3fn plus a sibling `<name>_scale_inv` [ceil(rows/br), ceil(cols/bc)] (fp32, or e8m0 as DeepSeek-V4
stores it); an FP4 weight (DeepSeek-V4's routed experts, moe/fp4.py) as int8 pairs [rows, cols/2] with e8m0
scales per 1x32 block. The reader dequantises on `get` unless fp8 itself is asked for (or, for an FP4 weight,
uint8: its packed bytes as stored, and its scale as e8m0 bytes), and `shape` is the dequantised one unless
`packed` is asked for.

The model decides what it wants: `load_weights` gets `targets` {name -> destination tensor} (a
destination may be a view into a stacked parameter, e.g. w13[e, :Im] for expert e's gate_proj) and
an `ignore` predicate for names it deliberately leaves out (other EP ranks' experts). Everything
else in the checkpoint is an error, except DeepSeek-V3-family multi-token-prediction layers (`model.layers.{L}`),
which are skipped; DeepSeek-V4's MTP blocks (`mtp.{k}.*`) are the model's own targets (engine/model/v4_model.py V4MTPBlock).
A multimodal checkpoint (Kimi-K2.5) is read through `text_model_rename`: its language model's tensors
under their text-model names, its vision tower and projector never read.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from wideep.moe.fp4 import PACKED_DTYPES, dequantize_fp4, scale_to_e8m0, scale_to_float
from wideep.moe.fp8 import FP8_DTYPE, dequantize_fp8_block

log = logging.getLogger("wideep.loader")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_MAX_LISTED = 10
OTHER_MODALITIES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


class CheckpointError(ValueError):
    """A checkpoint that does not match what the model expects; the message names the tensors."""


def _listing(names: list[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def text_model_rename(name: str) -> str | None:
    """A multimodal (Kimi-K2.5) checkpoint's tensor name -> its text model's (`model.*`, `lm_head.*`), or
    None for the vision tower and projector. Text tensors may sit under `language_model.model.` (as
    published) or `model.language_model.` (as transformers holds them); other names stay as they are."""
    for prefix, to in (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    if name.startswith(OTHER_MODALITIES):
        return None
    return name


_V4_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
           "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def v4_rename(name: str) -> str:
    """A DeepSeek-V4 checkpoint's tensor name -> DeepSeek's own spelling (`layers.3.attn.wq_a.weight`, `embed.weight`).
    transformers 5.24 saves V4 in DeepSeek's layer names under a `model.` prefix, with its own names for the
    embedding and the final hyper-connection head; DeepSeek's checkpoints are already canonical, except that the block
    scales of an FP8/FP4 weight `X.weight` are `X.scale` there (the reader's `X.weight_scale_inv` here), and the
    attention's KV norm is `attn.kv_norm` there (transformers' save writes it `attn.norm`, its reverse of the
    compressor's `norm` -> `kv_norm` renaming)."""
    if name.startswith("model."):
        name = name[len("model."):]
    name = name.replace(".attn.kv_norm.", ".attn.norm.")
    if name.endswith(".scale"):   # DeepSeek's block scales of `X.weight` are `X.scale`
        return name[:-len("scale")] + "weight" + SCALE_SUFFIX
    return _V4_TOP.get(name, name)


def v4_ignore(owned: Callable[[int, int], bool], num_hidden_layers: int) -> Callable[[str], bool]:
    """ignore predicate for a DeepSeek-V4 checkpoint: other ranks' experts, of the decoder layers
    (`layers.{i}.ffn.experts.{e}.*`, owned(i, e)) and of the multi-token-prediction blocks (`mtp.{k}.ffn.experts.{e}.*`,
    owned(num_hidden_layers + k, e))."""
    expert = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")

    def ignore(name: str) -> bool:
        m = expert.match(name)
        if m is None:
            return False
        layer = int(m.group(2)) + (num_hidden_layers if m.group(1) == "mtp" else 0)
        return not owned(layer, int(m.group(3)))

    return ignore


def v4_mtp_blocks(names, num_nextn_predict_layers: int) -> int:
    """How many MTP blocks (`mtp.{k}.*`, k = 0, 1, ...) a V4 checkpoint's tensor names hold; they must be the first
    ones and at most the config's num_nextn_predict_layers (transformers saves none)."""
    ks = sorted({int(m.group(1)) for m in map(re.compile(r"^mtp\.(\d+)\.").match, names) if m})
    if ks != list(range(len(ks))) or len(ks) > num_nextn_predict_layers:
        raise CheckpointError(f"the checkpoint holds MTP blocks {ks}, but the config's num_nextn_predict_layers "
                              f"{num_nextn_predict_layers} allows blocks 0..{num_nextn_predict_layers - 1}")
    return len(ks)


# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


class SafetensorsFile:
    """One .safetensors file read with pread, a tensor at a time into memory of its own: the file is never mapped
    into the process, so loading a checkpoint adds to the resident set only what the model keeps (a mapped file's
    pages count in it while they are touched: a peak of the checkpoint's size). keys / get_slice(name).get_shape()
    / .get_dtype() / get_tensor(name): safetensors' safe_open calls that CheckpointReader makes."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path!r} is not a safetensors file (shorter than its 8-byte header size)")
            n = int.from_bytes(head, "little")
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(f"{path!r} is not a safetensors file (header of {n} bytes in {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path!r} has an unreadable safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self._base, self._size, self._header = 8 + n, size, header
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path!r}: tensor {name!r} has dtype {info['dtype']!r}, which wideep does "
                                      f"not read")
            if not 0 <= lo <= hi or self._base + hi > size:
                raise CheckpointError(f"{path!r}: tensor {name!r} lies past the end of the file ({size} bytes)")
        self._fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self._header[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._header[name]
        lo, hi = info["data_offsets"]
        dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        self._pread(name, buf)
        return buf.view(dtype).view(shape) if hi > lo else torch.empty(shape, dtype=dtype)

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """The stored bytes of `name` straight into `out` (no buffer of its own, no copy) where `out` is a contiguous
        CPU tensor of the stored dtype and shape; False (nothing read) otherwise."""
        info = self._header[name]
        if (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != SAFETENSORS_DTYPES[info["dtype"]]
                or list(out.shape) != info["shape"]):
            return False
        lo, hi = info["data_offsets"]
        if hi > lo:
            self._pread(name, out.view(-1).view(torch.uint8))
        return True

    def _pread(self, name: str, buf: torch.Tensor) -> None:
        """buf (uint8, contiguous) <- the tensor's bytes"""
        lo, hi = self._header[name]["data_offsets"]
        view, done = memoryview(buf.numpy()), 0
        while done < hi - lo:   # pread may return less than asked: go on from there
            got = os.preadv(self._fd, [view[done:]], self._base + lo + done)
            if got <= 0:
                raise CheckpointError(f"{self.path!r}: tensor {name!r} ends early (read {done} of {hi - lo} bytes)")
            done += got


class _Slice:
    def __init__(self, info: dict):
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info["shape"])

    def get_dtype(self) -> str:
        return self._info["dtype"]


class CheckpointReader:
    """Lazy, memory-mapped view of `model.safetensors` or a sharded `model.safetensors.index.json`.

    Files are opened on first use and tensors are read one at a time, so a 700 GB checkpoint never
    has more than one tensor (plus its scale) materialised. rename: stored name -> the name the model
    asks for, or None for a tensor that is not the model's (counted in `other`, never read).
    """

    def __init__(self, model_dir: str, rename: Callable[[str], str | None] | None = None):
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
        self.model_dir = model_dir
        self._handles: dict[str, object] = {}
        index, single = os.path.join(model_dir, INDEX_FILE), os.path.join(model_dir, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no 'weight_map'")
            for shard in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(model_dir, shard)):
                    names = [n for n, s in weight_map.items() if s == shard]
                    raise FileNotFoundError(f"{index} maps {len(names)} tensors (e.g. {names[0]!r}) to "
                                            f"{shard!r}, which does not exist in {model_dir!r}")
            self._file_of: dict[str, str] = dict(weight_map)
        elif os.path.isfile(single):
            self._file_of = {n: SINGLE_FILE for n in self._handle(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(f"no safetensors checkpoint in {model_dir!r}: "
                                    f"looked for {SINGLE_FILE} and {INDEX_FILE}")
        self._stored: dict[str, str] = {}  # the model's name -> the stored one, where they differ
        self.other: list[str] = []         # stored names of tensors that are not the model's
        if rename is not None:
            renamed: dict[str, str] = {}
            for stored, file in self._file_of.items():
                name = rename(stored)
                if name is None:
                    self.other.append(stored)
                    continue
                if name in renamed:
                    raise CheckpointError(f"checkpoint tensors {self._stored.get(name, name)!r} and {stored!r} in "
                                          f"{model_dir!r} are both the model's {name!r}")
                renamed[name] = file
                if name != stored:
                    self._stored[name] = stored
            self._file_of = renamed
        self.names: frozenset[str] = frozenset(self._file_of)
        self.block_size = self._config_block_size()

    def _config_block_size(self) -> tuple[int, int]:
        # The block is a property of the checkpoint, so take it from its config rather than assume 128.
        path = os.path.join(self.model_dir, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            # a multimodal config (Kimi-K2.5) may keep it in its text_config
            quant = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
            block = (quant or {}).get("weight_block_size")
            if block:
                return int(block[0]), int(block[1])
        return 128, 128

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(os.path.join(self.model_dir, file))
        return self._handles[file]

    def file_of(self, name: str) -> str:
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.model_dir!r}")
        return self._file_of[name]

    def shape(self, name: str, packed: bool = False) -> tuple[int, ...]:
        """The tensor's shape, an FP4 weight's dequantised one [rows, cols] unless packed ([rows, cols/2])."""
        shape = tuple(self._slice(name).get_shape())
        if not packed and self.is_fp4(name):
            shape = shape[:-1] + (2 * shape[-1],)
        return shape

    def _slice(self, name: str):
        return self._handle(self.file_of(name)).get_slice(self._stored.get(name, name))

    def is_fp4(self, name: str) -> bool:
        """Whether `name` is stored as FP4 pairs (int8 / uint8 with a block scale beside it)."""
        return self._slice(name).get_dtype() in ("I8", "U8") and name + SCALE_SUFFIX in self._file_of

    def is_fp8(self, name: str) -> bool:
        """Whether `name` is stored as e4m3 (an fp8 weight, its block scale beside it)."""
        return self._slice(name).get_dtype() == "F8_E4M3" and name + SCALE_SUFFIX in self._file_of

    def _scale(self, name: str) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self._file_of:
            raise CheckpointError(f"{name!r} is quantised but the checkpoint has no {scale_name!r} to dequantise it with")
        return scale_to_float(self._handle(self._file_of[scale_name]).get_tensor(self._stored.get(scale_name,
                                                                                                 scale_name)))

    def read_into(self, name: str, dest: torch.Tensor) -> bool:
        """`get(name, dest.dtype)` written into dest by the file read itself where that is a plain copy of the stored
        bytes (same dtype and shape, dest contiguous; not a block scale, which get converts): the load's one pass
        over the bytes instead of three (a buffer's first touch, the read, the copy). False: nothing done."""
        if name.endswith(SCALE_SUFFIX):
            return False
        if dest.dtype == torch.uint8:   # FP4 pairs: get's bytes as stored (int8 or uint8), whatever their dtype name
            if not self.is_fp4(name):
                return False
            dest = dest.view(SAFETENSORS_DTYPES[self._slice(name).get_dtype()])
        return self._handle(self.file_of(name)).read_into(self._stored.get(name, name), dest)

    def get(self, name: str, dtype: torch.dtype, block_size: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor in `dtype`. An fp8 weight is dequantised with `<name>_scale_inv`; asking for
        `dtype=float8_e4m3fn` returns the stored fp8 values untouched (load the scale separately)."""
        t = self._handle(self.file_of(name)).get_tensor(self._stored.get(name, name))
        if dtype == torch.uint8:   # an FP4 weight's packed bytes, or its scale's e8m0 bytes, as stored
            if name.endswith(SCALE_SUFFIX) and self.is_fp4(name[:-len(SCALE_SUFFIX)]):
                return scale_to_e8m0(t)
            if t.dtype not in PACKED_DTYPES or not self.is_fp4(name):
                raise CheckpointError(f"{name!r} is wanted as FP4 pairs (uint8), but the checkpoint stores it as "
                                      f"{t.dtype} {tuple(t.shape)} without being FP4")
            return t.view(torch.uint8)
        if t.dtype in PACKED_DTYPES and dtype.is_floating_point:
            return dequantize_fp4(t, self._scale(name), dtype)
        if name.endswith(SCALE_SUFFIX) and dtype.is_floating_point:   # a block scale (e8m0 as float8_e8m0fnu or bytes)
            return scale_to_float(t).to(dtype)
        if t.dtype != FP8_DTYPE or dtype == FP8_DTYPE:
            return t.to(dtype)
        return dequantize_fp8_block(t, self._scale(name), block_size or self.block_size, dtype)


@dataclass(frozen=True)
class LoadReport:
    loaded: int  # targets filled
    bytes_loaded: int  # bytes written into the targets
    skipped_mtp: int  # checkpoint tensors of multi-token-prediction layers, never read
    ignored: int  # checkpoint tensors the caller's `ignore` predicate skipped, never read
    other_modalities: int = 0  # a multimodal checkpoint's vision tower / projector tensors, never read


def expert_ignore(owned: Callable[[int, int], bool]) -> Callable[[str], bool]:
    """ignore predicate for `load_weights`: True for `model.layers.{i}.mlp.experts.{e}.*` (incl. the
    fp8 scales) when `owned(i, e)` is False. `e` is the logical expert id as the checkpoint names it."""

    def ignore(name: str) -> bool:
        m = _EXPERT.match(name)
        return m is not None and not owned(int(m.group(1)), int(m.group(2)))

    return ignore


def _is_mtp(name: str, num_hidden_layers: int | None) -> bool:
    m = _LAYER.match(name) if num_hidden_layers is not None else None
    return m is not None and int(m.group(1)) >= num_hidden_layers


def load_weights(reader: CheckpointReader, targets: dict[str, torch.Tensor], *,
                 ignore: Callable[[str], bool] | None = None, num_hidden_layers: int | None = None,
                 progress: bool = True, dtype: torch.dtype | None = None) -> LoadReport:
    """Fill every `targets[name]` with checkpoint tensor `name` (`dest.copy_`), read as `dtype`
    (default: the destination's dtype; fp8 is dequantised unless the destination is fp8).

    Every name is checked before anything is read, so a mismatched checkpoint fails fast and leaves
    the model untouched. Layers >= `num_hidden_layers` (DeepSeek-V3's MTP module) are skipped
    unless targeted. Raises CheckpointError for missing, unexpected or wrongly shaped tensors.
    """
    ckpt = reader.names
    missing = [n for n in targets if n not in ckpt]
    if missing:
        raise CheckpointError(f"{len(missing)} tensors the model needs are not in the checkpoint at "
                              f"{reader.model_dir!r}: {_listing(missing)}")

    def claimed(name: str) -> bool:  # an fp8 scale belongs to its weight
        return name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in targets

    mtp, ignored, unexpected = [], [], []
    for name in ckpt:
        if name in targets or claimed(name):
            continue
        if _is_mtp(name, num_hidden_layers):
            mtp.append(name)
        elif ignore is not None and (ignore(name) or (name.endswith(SCALE_SUFFIX)
                                                      and ignore(name[:-len(SCALE_SUFFIX)]))):
            ignored.append(name)
        else:
            unexpected.append(name)
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} checkpoint tensors are not used by the model (pass an "
                              f"`ignore` predicate to skip them on purpose): {_listing(unexpected)}")
    wrong = [f"{n}: expected {tuple(d.shape)}, found {reader.shape(n, packed=d.dtype == torch.uint8)}"
             for n, d in targets.items() if tuple(d.shape) != reader.shape(n, packed=d.dtype == torch.uint8)]
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensors have the wrong shape: " + "; ".join(wrong[:_MAX_LISTED])
                              + (f" ... and {len(wrong) - _MAX_LISTED} more" if len(wrong) > _MAX_LISTED else ""))
    if mtp:
        layers = sorted({int(_LAYER.match(n).group(1)) for n in mtp})
        log.info("skipping %d tensors of multi-token-prediction layers %s (not served)", len(mtp), layers)

    nbytes = 0
    # Shard by shard, in name order: the page cache then streams each file front to back.
    order = sorted(targets, key=lambda n: (reader.file_of(n), n))
    with torch.no_grad():
        for name in tqdm(order, desc="loading weights", unit="tensor", disable=not progress):
            dest = targets[name]
            if (dtype or dest.dtype) != dest.dtype or not reader.read_into(name, dest):
                dest.copy_(reader.get(name, dtype or dest.dtype))
            nbytes += dest.numel() * dest.element_size()
    if reader.other:
        log.info("skipping %d tensors that are not the text model's (e.g. %s)", len(reader.other), reader.other[0])
    return LoadReport(loaded=len(targets), bytes_loaded=nbytes, skipped_mtp=len(mtp), ignored=len(ignored),
                      other_modalities=len(reader.other))


class OnlineFp8Reader:
    """A CheckpointReader of an unquantised (bfloat16 / float32) checkpoint read as DeepSeek's FP8 format
    (quantization "fp8" on such a checkpoint, vLLM's online FP8): every weight in `fp8_names` (the model's fp8
    targets) comes out as e4m3 in block x block tiles (moe/fp8.py quantize_fp8_block, the format DeepSeek-V3
    publishes) and its `<name>_scale_inv` beside it, computed from the stored tensor when asked (one weight
    quantised at a time: the loader asks for a weight and then its scale, both in its shard's turn). Every other
    tensor, and every other question, goes to the wrapped reader."""

    def __init__(self, reader: CheckpointReader, fp8_names: set[str], block: tuple[int, int]):
        missing = sorted(n for n in fp8_names if n not in reader.names)
        if missing:   # load_weights names them; nothing to quantise from
            fp8_names = set(fp8_names) - set(missing)
        self._r, self._fp8, self.block_size = reader, frozenset(fp8_names), block
        self.names = reader.names | frozenset(n + SCALE_SUFFIX for n in self._fp8)
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name: str):   # model_dir, other, is_fp4, ...
        return getattr(self._r, name)

    def _weight(self, name: str) -> str | None:
        """The fp8 weight whose scale `name` is, or None."""
        w = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        return w if w in self._fp8 else None

    def file_of(self, name: str) -> str:
        return self._r.file_of(self._weight(name) or name)

    def shape(self, name: str, packed: bool = False) -> tuple[int, ...]:
        w = self._weight(name)
        if w is None:
            return self._r.shape(name, packed)
        rows, cols = self._r.shape(w)
        return -(-rows // self.block_size[0]), -(-cols // self.block_size[1])

    def _quantised(self, w: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != w:
            from wideep.moe.fp8 import quantize_fp8_block
            t = self._r.get(w, torch.float32)
            if t.dim() != 2:
                raise CheckpointError(f"quantization 'fp8' quantises 2-D weights in blocks, but {w!r} has shape "
                                      f"{tuple(t.shape)}")
            self._last = (w, *quantize_fp8_block(t, self.block_size, scratch=True))   # t: a fresh tensor of ours
        return self._last[1], self._last[2]

    def read_into(self, name: str, dest: torch.Tensor) -> bool:
        """The wrapped reader's, except for the weights quantised here and their scales (get computes them)."""
        if name in self._fp8 or self._weight(name) is not None:
            return False
        return self._r.read_into(name, dest)

    def get(self, name: str, dtype: torch.dtype, block_size: tuple[int, int] | None = None) -> torch.Tensor:
        w = self._weight(name)
        if w is not None:
            return self._quantised(w)[1].to(dtype)
        if name in self._fp8 and dtype == FP8_DTYPE:
            return self._quantised(name)[0]
        return self._r.get(name, dtype, block_size)
