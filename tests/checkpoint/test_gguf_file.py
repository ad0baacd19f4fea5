"""The GGUF header parser: round trips through the gguf package's writer, agreement with its
reader, and bad files (truncated anywhere, wrong magic, absurd counts and lengths, fuzzed
bytes) failing with GGUFFormatError only."""

from __future__ import annotations

import random
import struct

import gguf
import numpy as np
import pytest
from tests.support.gguf_tiny import write_gguf
from tests.support.tiers import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.checkpoint import GGUFFile
from hybridkv.checkpoint.gguf_file import _NUMPY, _SCALARS, MAX_ARRAY_DEPTH
from hybridkv.errors import GGUFFormatError, WeightLoadError

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

_INT_RANGES = {
    V.UINT8: (0, 2**8 - 1), V.INT8: (-(2**7), 2**7 - 1), V.UINT16: (0, 2**16 - 1), V.INT16: (-(2**15), 2**15 - 1),
    V.UINT32: (0, 2**32 - 1), V.INT32: (-(2**31), 2**31 - 1), V.UINT64: (0, 2**64 - 1), V.INT64: (-(2**63), 2**63 - 1),
}


def _f32(x: float) -> float:
    return float(np.float32(x))


def _scalar(vtype):
    """(strategy of values written, how the parser gives them back)."""
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        return st.integers(lo, hi), lambda v: v
    if vtype == V.FLOAT32:
        return st.floats(allow_nan=False, width=32), _f32
    if vtype == V.FLOAT64:
        return st.floats(allow_nan=False), lambda v: v
    if vtype == V.BOOL:
        return st.booleans(), lambda v: v
    return st.text(max_size=12), lambda v: v  # unicode, empty strings


_SCALAR_TYPES = [*_INT_RANGES, V.FLOAT32, V.FLOAT64, V.BOOL, V.STRING]


@st.composite
def _entries(draw):
    """(value, type, item type, expected) of one metadata entry: a scalar, an array, or nested arrays."""
    kind = draw(st.sampled_from(["scalar", "array", "nested"]))
    if kind == "scalar":
        vtype = draw(st.sampled_from(_SCALAR_TYPES))
        values, back = _scalar(vtype)
        v = draw(values)
        return v, vtype, None, back(v)
    if kind == "array":
        sub = draw(st.sampled_from(_SCALAR_TYPES))
        values, back = _scalar(sub)
        items = draw(st.lists(values, min_size=1, max_size=20))
        return items, V.ARRAY, sub, [back(v) for v in items]
    # nested: GGUFWriter infers the inner item type from Python values (int -> INT32, str -> STRING)
    inner = draw(st.sampled_from([V.INT32, V.STRING, V.BOOL, V.FLOAT32]))
    values, back = _scalar(inner)
    rows = draw(st.lists(st.lists(values, min_size=1, max_size=5), min_size=1, max_size=4))
    return rows, V.ARRAY, V.ARRAY, [[back(v) for v in row] for row in rows]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.dictionaries(st.text(min_size=1, max_size=10), _entries(), max_size=8))
def test_metadata_round_trips_through_gguf_writer(tmp_path_factory, entries):
    path = tmp_path_factory.mktemp("rt") / "m.gguf"
    entries.pop("general.architecture", None)
    write_gguf(path, "llama", [(k, v, t, s) for k, (v, t, s, _) in entries.items()])
    f = GGUFFile.open(path)
    assert f.metadata == {"general.architecture": "llama", **{k: e[3] for k, e in entries.items()}}
    for k, (_, vtype, _, want) in entries.items():
        assert f.value_types[k] == int(vtype)
        got = f.metadata[k]
        assert type(got) is type(want)  # plain Python values, never numpy scalars
        if isinstance(want, list):
            assert all(type(a) is type(b) for a, b in zip(got, want))
    assert f.tensors == ()


def test_value_type_ids_are_the_gguf_packages():
    names = {t.name: int(t) for t in V}
    fmt_by_name = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i",
                   "FLOAT32": "f", "BOOL": "?", "UINT64": "Q", "INT64": "q", "FLOAT64": "d"}
    assert {names[n]: f for n, f in fmt_by_name.items()} == {k: f for k, (f, _) in _SCALARS.items()}
    assert set(_NUMPY) == set(_SCALARS) - {names["BOOL"]}
    assert (names["STRING"], names["ARRAY"]) == (8, 9)


_TENSOR_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _random_tensors(rng: random.Random, n: int):
    out = []
    for i in range(n):
        qtype = rng.choice(_TENSOR_TYPES)
        dims = [rng.randint(1, 3) for _ in range(rng.randint(0, 3))] + [32 * rng.randint(1, 3)]
        x = np.random.default_rng(i).standard_normal(dims).astype(np.float32)
        if qtype == Q.F32:
            out.append((f"t{i}.weight", x, None))
        elif qtype == Q.F16:
            out.append((f"t{i}.weight", x.astype(np.float16), None))
        else:
            out.append((f"t{i}.weight", gguf.quants.quantize(x, qtype), qtype))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_tensor_infos_and_data_agree_with_gguf_reader(tmp_path, seed):
    rng = random.Random(seed)
    path = write_gguf(tmp_path / "t.gguf", "gemma3", [("k", "v", V.STRING, None)], _random_tensors(rng, rng.randint(1, 7)))
    ours, ref = GGUFFile.open(path), gguf.GGUFReader(path)
    assert len(ours.tensors) == len(ref.tensors)
    for info, t in zip(ours.tensors, ref.tensors):
        assert (info.name, info.ggml_type, info.offset, info.nbytes) == (t.name, int(t.tensor_type), t.data_offset, t.n_bytes)
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.n_elements == t.n_elements
        assert ours.raw(info).tobytes() == t.data.tobytes() and ours.raw(info).shape == t.data.shape
        assert ours.tensor(info.name) is info and info.name in ours
    assert ours.data_offset == ref.data_offset
    import hashlib

    assert ours.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ bad files
def _valid_file(tmp_path):
    rng = random.Random(7)
    md = [("general.name", "tiny", V.STRING, None), ("a.list", ["x", "", "ü"], V.ARRAY, V.STRING),
          ("a.ints", [1, 2, 3], V.ARRAY, V.INT32), ("a.f", 1.5, V.FLOAT32, None)]
    return write_gguf(tmp_path / "ok.gguf", "llama", md, _random_tensors(rng, 3))


def test_every_truncation_is_a_gguf_format_error(tmp_path):
    data = _valid_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFFormatError) as info:
            GGUFFile.open(cut)
        assert str(cut) in str(info.value)
        assert "\n" not in str(info.value)
    cut.write_bytes(data)
    assert len(GGUFFile.open(cut).tensors) == 3


def test_fuzzed_headers_parse_or_fail_with_gguf_format_error(tmp_path):
    good = _valid_file(tmp_path)
    data = good.read_bytes()
    header_end = GGUFFile.open(good).data_offset
    rng = random.Random(0)
    bad = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(header_end)
            mutated[i] = rng.randrange(256) if rng.random() < 0.7 else 0xFF
        bad.write_bytes(bytes(mutated))
        try:
            GGUFFile.open(bad)
            outcomes["ok"] += 1
        except GGUFFormatError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50 and outcomes["ok"] > 0


def _header(version=3, n_tensors=0, n_kv=0, magic=b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty file"),
        (b"GGU", "not a GGUF file"),
        (b"PK\x03\x04" + b"\0" * 40, "not a GGUF file (starts with b'PK"),
        (b'{"architectures": []}', "not a GGUF file"),
        (_header(version=1), "GGUF version 1 is not supported"),
        (_header(version=3 << 24), "big-endian"),
        (_header(n_kv=2**63), "9,223,372,036,854,775,808 metadata entries"),
        (_header(n_tensors=2**40), "tensor infos"),
        (_header(n_kv=1) + _str(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 2**62), "'k' needs"),
        (_header(n_kv=1) + struct.pack("<Q", 2**64 - 1) + b"\0" * 8, "metadata key 0 needs"),
        (_header(n_kv=1) + _str(b"k") + struct.pack("<IIQ", 9, 8, 2**61), "2,305,843,009,213,693,952 strings"),
        (_header(n_kv=1) + _str(b"k") + struct.pack("<IIQ", 9, 4, 2**60), "items"),
        (_header(n_kv=1) + _str(b"k") + struct.pack("<I", 13) + b"\0" * 8, "unknown value type 13"),
        (_header(n_kv=1) + _str(b"k") + struct.pack("<II", 9, 77) + struct.pack("<Q", 1) + b"\0" * 8,
         "unknown item type 77"),
        (_header(n_kv=1) + _str(b"\xff\xfe") + struct.pack("<I", 0) + b"\0", "not valid UTF-8"),
        (_header(n_kv=2) + (_str(b"k") + struct.pack("<IB", 0, 1)) * 2, "'k' appears twice"),
        (_header(n_kv=1) + _str(b"general.alignment") + struct.pack("<II", 4, 48), "power-of-two"),
        (_header(n_tensors=1) + _str(b"w") + struct.pack("<I", 5) + b"\0" * 48, "has 5 dims"),
        (_header(n_tensors=1) + _str(b"w") + struct.pack("<IQIQ", 1, 32, 99, 0), "unknown ggml type 99"),
        (_header(n_tensors=1) + _str(b"w") + struct.pack("<IQIQ", 1, 30, 8, 0), "not whole Q8_0 blocks of 32"),
        (_header(n_tensors=1) + _str(b"w") + struct.pack("<IQIQ", 1, 4, 0, 3), "not aligned to 32"),
        (_header(n_tensors=1) + _str(b"w") + struct.pack("<IQIQ", 1, 2**40, 0, 0), "truncated GGUF file: tensor 'w'"),
        (_header(n_tensors=2) + (_str(b"w") + struct.pack("<IQIQ", 1, 1, 0, 0)) * 2 + b"\0" * 64, "'w' appears twice"),
    ],
)
def test_bad_files_raise_gguf_format_error(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError) as info:
        GGUFFile.open(path)
    assert message in str(info.value)
    assert isinstance(info.value, WeightLoadError)


def _nested_array(depth: int) -> bytes:
    """A metadata value: ``depth`` arrays, each holding one array, the innermost one u8."""
    if depth == 1:
        return struct.pack("<IIQB", 9, 0, 1, 7)
    return struct.pack("<IIQ", 9, 9, 1) + _nested_array(depth - 1)[4:]


def test_nesting_depth_is_bounded(tmp_path):
    path = tmp_path / "deep.gguf"
    path.write_bytes(_header(n_kv=1) + _str(b"k") + _nested_array(MAX_ARRAY_DEPTH))
    value = GGUFFile.open(path).metadata["k"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value = value[0]
    assert value == [7]
    path.write_bytes(_header(n_kv=1) + _str(b"k") + _nested_array(MAX_ARRAY_DEPTH + 1))
    with pytest.raises(GGUFFormatError, match="nested more than"):
        GGUFFile.open(path)


def test_empty_arrays_and_strings(tmp_path):
    """GGUFWriter refuses empty arrays; llama.cpp writes them (e.g. no merges): they read as []."""
    path = tmp_path / "empty.gguf"
    path.write_bytes(_header(n_kv=3) + _str(b"a") + struct.pack("<IIQ", 9, 8, 0) + _str(b"b")
                     + struct.pack("<IIQ", 9, 6, 0) + _str(b"") + struct.pack("<I", 8) + _str(b""))
    assert GGUFFile.open(path).metadata == {"a": [], "b": [], "": ""}


def test_folder_and_missing_file(tmp_path):
    with pytest.raises(GGUFFormatError, match="is a folder"):
        GGUFFile.open(tmp_path)
    with pytest.raises(GGUFFormatError, match="cannot read"):
        GGUFFile.open(tmp_path / "nope.gguf")
