"""quantpipe.blocks.activations: a set of block activations in RAM or spilled to a file."""

import pytest
import torch

from quantpipe.blocks.activations import Activations, activation_budget, spills


def _values(n=5, L=3, d=4, seed=0):
    return torch.randn(n, L, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spilled", [False, True])
def test_write_read_round_trip_exact(tmp_path, spilled):
    x = _values()
    acts = Activations.new(tuple(x.shape), tmp_path / "state" / "hidden-1" if spilled else None)
    assert acts.in_memory is not spilled
    for start in range(0, 5, 2):  # batches of 2, the last one short
        acts.write(start, x[start:start + 2])
    acts.commit()
    for start in range(0, 5, 2):
        assert torch.equal(acts.read(start, start + 2), x[start:start + 2])
    assert torch.equal(acts.materialize(), x)
    if spilled:
        assert acts.path == tmp_path / "state" / "hidden-1.f32" and acts.path.is_file()
        assert not (tmp_path / "state" / "hidden-1.f32.tmp").exists()
        assert torch.equal(Activations.open(acts.path, tuple(x.shape)).materialize(), x)


def test_an_uncommitted_file_never_has_the_final_name(tmp_path):
    x = _values()
    acts = Activations.new(tuple(x.shape), tmp_path / "hidden-2")
    acts.write(0, x[:2])  # a run killed here leaves only the .tmp file
    assert not (tmp_path / "hidden-2.f32").exists()
    assert (tmp_path / "hidden-2.f32.tmp").stat().st_size == x.numel() * 4  # sized up front
    with pytest.raises(ValueError, match="missing or truncated"):
        Activations.open(tmp_path / "hidden-2.f32", tuple(x.shape))


def test_truncated_file_and_bad_writes_are_refused(tmp_path):
    x = _values()
    acts = Activations.new(tuple(x.shape), tmp_path / "h")
    acts.write(0, x)
    acts.commit()
    with open(acts.path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="missing or truncated"):
        Activations.open(acts.path, tuple(x.shape))
    with pytest.raises(ValueError, match="short read"):
        acts.read(0, 5)
    mem = Activations.new(tuple(x.shape), None)
    with pytest.raises(ValueError, match="cannot write"):
        mem.write(4, x[:2])  # past the end
    with pytest.raises(ValueError, match="cannot write"):
        mem.write(0, torch.zeros(1, 3, 5))  # wrong width


def test_budget_decides_spilling():
    shape = (128, 512, 4096)  # 1 GiB per set in fp32
    assert spills(shape, 2, 2**31 - 1) and not spills(shape, 2, 2**31)
    assert activation_budget(123) == 123 and activation_budget(None) > 0
