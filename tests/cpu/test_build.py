"""cpu/build.py: every struct the launchers pass is checked against the library's own layout table at load
(a ctypes Structure that differs in a field's offset or size, lacks a field or has one too many is an
error naming the struct and the field); every C struct and kernel has its ctypes twin; the cache key
covers every source file; a sanitizer build without its runtime says how to run it."""
from __future__ import annotations

import ctypes
import os
import re

import pytest

from wideep.cpu import build, fused, layers
from wideep.cpu.build import BuildError, LayoutError, check_layout, fields, layouts, library, unusable

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")

P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def test_every_c_struct_and_kernel_has_its_checked_twin():
    table = layouts(library())
    assert set(table) == set(build._structs)                      # no struct on one side only
    for name, cls in build._structs.items():
        check_layout(name, cls, table)
    kernels = {n[:-len("_args")] for n in table if n.endswith("_args")}
    assert kernels == set(build._kernels)
    for fn in kernels:
        assert getattr(library(), fn).argtypes == [ctypes.POINTER(build._kernels[fn][0])]
    assert table["wd_rmsnorm_args"][None] == (0, ctypes.sizeof(layers.RmsnormArgs))
    assert table["wd_mla_weights"]["in_eps"] == (fused.MlaWeights.in_eps.offset, 4)


class NarrowField(ctypes.Structure):   # ldx as 32 bits: every later field moves
    _fields_ = fields("x w y", P) + [("ldx", ctypes.c_int32)] + fields("ldy M N wdt xdt ydt", I) + [("eps", F)]


class SwappedFields(ctypes.Structure):   # the same fields, two of them in the other order
    _fields_ = fields("x w y", P) + fields("ldy ldx M N wdt xdt ydt", I) + [("eps", F)]


class MissingField(ctypes.Structure):
    _fields_ = fields("x w y", P) + fields("ldx ldy M wdt xdt ydt", I) + [("eps", F)]


class ExtraField(ctypes.Structure):
    _fields_ = fields("x w y", P) + fields("ldx ldy M N wdt xdt ydt", I) + [("eps", F), ("spare", F)]


class Packed(ctypes.Structure):   # the C fields and offsets, but no tail padding: a smaller sizeof
    _pack_ = 4
    _fields_ = fields("x w y", P) + fields("ldx ldy M N wdt xdt ydt", I) + [("eps", F)]


@pytest.mark.parametrize("cls,message", [
    (NarrowField, "wd_rmsnorm_args (ctypes NarrowField): field 'ldx' is at offset 24, 4 bytes in ctypes, at offset 24, "
                  "8 bytes in C"),
    (SwappedFields, "wd_rmsnorm_args (ctypes SwappedFields): field 'ldy' is at offset 24, 8 bytes in ctypes, at "
                    "offset 32"),
    (MissingField, "wd_rmsnorm_args (ctypes MissingField): field 'N' is in the C struct, not in the ctypes Structure"),
    (ExtraField, "wd_rmsnorm_args (ctypes ExtraField): field 'spare' is in the ctypes Structure, not in the C struct"),
    (Packed, "wd_rmsnorm_args (ctypes Packed): sizeof is 84 in ctypes, 88 in C"),
])
def test_a_mismatched_structure_is_named_with_its_field(cls, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        check_layout("wd_rmsnorm_args", cls, layouts(library()))


def test_a_mismatched_structure_fails_the_load(monkeypatch):
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setitem(build._structs, "wd_mlp_weights", ExtraField)
    with pytest.raises(LayoutError, match=r"wd_mlp_weights \(ctypes ExtraField\): field 'x' is in the ctypes"):
        unusable()
    monkeypatch.setitem(build._structs, "wd_no_such_struct", NarrowField)
    monkeypatch.setitem(build._structs, "wd_mlp_weights", fused.MlpWeights)
    with pytest.raises(LayoutError, match="the library has no struct wd_no_such_struct"):
        unusable()


def test_the_cache_key_covers_every_source_file(monkeypatch, tmp_path):
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    src = {"probe.c": '#include "probe.h"\nint probe(void) { return VALUE; }\n', "probe.h": "#define VALUE 1\n"}
    assert build.build("probe", src).probe() == 1
    assert build.build("probe", src | {"probe.h": "#define VALUE 2\n"}).probe() == 2     # only the header changed
    assert len(list(tmp_path.glob("probe-*.so"))) == 2
    assert list(build.sources()) == sorted(n for n in os.listdir(build.CSRC) if n.endswith((".c", ".h")))


def test_a_sanitizer_build_without_its_runtime_says_how(monkeypatch, tmp_path):
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WIDEEP_CPU_SANITIZE", "1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(BuildError, match=r"needs the ASan runtime preloaded: LD_PRELOAD=\$\(cc -print-file-name"):
        build.build("probe", "int probe(void) { return 1; }")
    assert list(tmp_path.iterdir()) == []
