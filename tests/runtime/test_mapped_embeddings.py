"""The CPU runtime's untied fp16 input embedding table read through a memory map of its shard
(runtime.loader ``map_embeddings``, quantpipe.core.io.map_safetensors_tensor): the same logits
as the table loaded into memory, a file-backed read-only mapping of which only the rows read
become resident, and a clear error for a truncated or altered shard."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from quantpipe.core.io import map_safetensors_tensor
from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.fp_head import CastEmbedding, set_half_head
from quantpipe.runtime.loader import load_quantized_model
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import quantize_folder
from tests.tiny_models import make_family_model, save_model

SPECS = [QuantSpec(4, 32, True), QuantSpec(8, -1, True)]
# llama, qwen2 (q/k/v biases), gemma (embed_scale on the looked-up rows)
FAMILIES = ("llama", "qwen2", "gemma")
IDS = torch.tensor([[3, 17, 5, 200, 9, 41, 11, 383]])


def _quantized(tmp_path_factory, family: str, tie: bool):
    model, tok = make_family_model(family, tie_word_embeddings=tie)
    tmp = tmp_path_factory.mktemp(f"map-{family}-{'tied' if tie else 'untied'}")
    src = save_model(model, tok, tmp / "src")
    export_fp16(Fp16ExportSpec(str(src), tmp / "fp16"))
    quantize_folder(tmp / "fp16", tmp / "q", SPECS)
    return tmp / "q"


@pytest.fixture(scope="module", params=FAMILIES)
def untied(request, tmp_path_factory):
    return request.param, _quantized(tmp_path_factory, request.param, tie=False)


def _load(qdir, mapped: bool, mode: str = "fp16"):
    model = load_quantized_model(qdir, "cpu", torch.float32, keep_fp16_embeddings=True,
                                 map_embeddings=mapped)
    set_half_head(model, mode, act_dtype=torch.float32)
    return model


def _mapping(t: torch.Tensor) -> tuple[str, str] | None:
    """(permissions, path) of the /proc/self/maps region holding t's data; path "" if
    anonymous (heap)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[1], fields[5] if len(fields) > 5 else ""
    return None


def _resident_kb(t: torch.Tensor) -> int:
    """Rss (kB) of the /proc/self/smaps region holding t's data."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a region's first line
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no smaps region holds the tensor")


def _table_shard(qdir) -> str:
    index = json.loads((qdir / "model.safetensors.index.json").read_text())
    return index["weight_map"]["model.embed_tokens.weight"]


@pytest.mark.parametrize("mode", ["fp16", "auto"])
def test_mapped_table_gives_the_in_memory_logits_bitwise(untied, mode):
    family, qdir = untied
    ref, got = _load(qdir, mapped=False, mode=mode), _load(qdir, mapped=True, mode=mode)
    emb_ref, emb = ref.get_input_embeddings(), got.get_input_embeddings()
    assert isinstance(emb, CastEmbedding) and emb.weight.dtype == torch.float16
    assert torch.equal(emb.weight, emb_ref.weight)  # the same fp16 table
    if family == "gemma":  # sqrt(hidden) on the rows, carried by CastEmbedding
        assert float(emb.embed_scale) == float(emb_ref.embed_scale) != 1.0
    with torch.no_grad():
        assert torch.equal(emb(IDS), emb_ref(IDS))
        assert torch.equal(got(IDS).logits, ref(IDS).logits)
    # the mapped table is a read-only view of its shard; the other one is what safetensors
    # returns (a writable copy-on-write mapping of the whole shard)
    assert _mapping(emb.weight) == ("r--s", str((qdir / _table_shard(qdir)).resolve()))
    assert _mapping(emb_ref.weight)[0].startswith("rw")


def test_engine_decodes_the_same_tokens_from_the_mapped_table(untied):
    from quantpipe.runtime.engine.loading import load_model_for_serving
    from quantpipe.runtime.generate import engine_decode

    _, qdir = untied
    served, tok = load_model_for_serving(qdir, "cpu", head_dtype="fp16")  # maps by default
    assert _mapping(served.get_input_embeddings().weight)[0] == "r--s"
    ref = _load(qdir, mapped=False)
    ids = IDS[0].tolist()
    want = engine_decode(ref, tok, ids, 8, stop_at_eos=False)[0]
    assert engine_decode(served, tok, ids, 8, stop_at_eos=False)[0] == want


def test_mapped_table_is_a_read_only_file_mapping(untied):
    _, qdir = untied
    weight = _load(qdir, mapped=True).get_input_embeddings().weight
    perms, path = _mapping(weight)
    assert perms.startswith("r-") and path == str((qdir / _table_shard(qdir)).resolve())
    assert not weight.untyped_storage().resizable()  # not torch's own allocation


def test_tied_table_stays_in_memory(tmp_path_factory):
    """The tied head reads the whole table every token: no mapping for it."""
    qdir = _quantized(tmp_path_factory, "llama", tie=True)
    model = _load(qdir, mapped=True)
    assert _mapping(model.get_input_embeddings().weight)[0].startswith("rw")


def test_only_the_rows_read_become_resident(tmp_path):
    """A 32 MiB table: three rows looked up map the pages around them, not the table. (How
    much around them depends on the page cache: read-around, fault-around and large folios of
    a file just written; evicting it first keeps the count near the rows.)"""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(8192, 2048, generator=g).half()  # 4 KiB rows
    path = tmp_path / "t.safetensors"
    save_file({"a.bias": torch.randn(3), "table": table}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a hint: the bound holds anyway
    finally:
        os.close(fd)
    t = map_safetensors_tensor(path, "table")
    assert t.dtype == torch.float16 and t.shape == (8192, 2048)
    assert _resident_kb(t) <= 64  # nothing read yet (the header's page at most)
    rows = torch.tensor([7, 3000, 8000])
    assert torch.equal(torch.nn.functional.embedding(rows, t), table[rows])
    assert _resident_kb(t) <= table.numel() * 2 // 1024 // 4


def test_truncated_or_altered_shard_is_a_clear_error(untied, tmp_path):
    _, qdir = untied
    bad = tmp_path / "q"
    shutil.copytree(qdir, bad)
    shard = bad / _table_shard(qdir)
    data = shard.read_bytes()
    shard.write_bytes(data[:-4096])
    with pytest.raises(ValueError, match=_table_shard(qdir)):
        load_quantized_model(bad, keep_fp16_embeddings=True)

    # the mapping's own checks (a shard changed after the folder was verified)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = "model.embed_tokens.weight"
    begin, end = header[name]["data_offsets"]
    assert torch.equal(map_safetensors_tensor(qdir / _table_shard(qdir), name),
                       load_quantized_model(qdir, keep_fp16_embeddings=True,
                                            map_embeddings=False).model.embed_tokens.weight)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:8 + n + end - 1])  # the table's last byte missing
    with pytest.raises(ValueError, match=r"cut\.safetensors: .*truncated"):
        map_safetensors_tensor(cut, name)

    def altered(entry: dict) -> bytes:
        h = json.loads(data[8:8 + n])
        h[name].update(entry)
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + data[8 + n:]

    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(altered({"shape": [header[name]["shape"][0] + 1,
                                         header[name]["shape"][1]]}))
    with pytest.raises(ValueError, match=r"wrong\.safetensors: .*data_offsets"):
        map_safetensors_tensor(wrong, name)
    wrong.write_bytes(altered({"data_offsets": [begin, len(data)]}))
    with pytest.raises(ValueError, match="data_offsets"):
        map_safetensors_tensor(wrong, name)
    wrong.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match="not a safetensors file or truncated"):
        map_safetensors_tensor(wrong, name)
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        map_safetensors_tensor(qdir / _table_shard(qdir), "nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_loads_the_table_as_before(untied):
    _, qdir = untied
    model = load_quantized_model(qdir, "cuda", keep_fp16_embeddings=True)
    weight = model.get_input_embeddings().weight
    assert weight.is_cuda
    cpu = _load(qdir, mapped=True)
    assert torch.equal(weight.cpu().half(), cpu.get_input_embeddings().weight)
