"""Where calibration's block work runs (``quantpipe calibrate --device cpu|cuda|cuda:N``).

The split, the same for every device: the model skeleton, the embeddings, the token ids and
the block activations (in RAM or spilled to files) stay on the CPU; each block's weights are
loaded onto the device (:meth:`quantpipe.blocks.stream.ModelStream.load`), its inputs go
there a batch at a time and its outputs come back batch by batch
(:func:`quantpipe.blocks.execute.run_block`), its positions and mask are moved once
(:meth:`quantpipe.blocks.execute.BlockContext.to`). The statistics are made on the device of
the block's weights, the quantization maths runs on the device of its inputs (every tensor it
makes is made there), and each result comes back to the CPU
(:func:`quantpipe.calibration.result.result_to_host`) before it is saved.

A CPU run takes exactly this path with ``device="cpu"``: every move is then a no-op that
returns its input, so the CPU tests run the code a GPU run executes.
"""

from __future__ import annotations

import re

import torch

HOST = torch.device("cpu")  # where activations, token ids and saved results live
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str) -> None:
    """ValueError with a remedy unless ``device`` is "cpu", "cuda" or "cuda:N" and usable."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device (torch "
                         f"{torch.__version__}); use --device cpu, or install a CUDA build "
                         "of torch on a machine with an NVIDIA GPU")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) "
                         f"visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def is_cpu(device: str | torch.device) -> bool:
    """Whether ``device`` is the CPU (CPU-only settings, such as OpenMP threads, apply)."""
    return torch.device(device).type == "cpu"


def to_device(t: torch.Tensor, device: str | torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host -> the block's device (and ``dtype``): every tensor the block work receives from
    the CPU side passes here. ``t`` itself when it is already there (CPU runs)."""
    return t.to(device=device, dtype=dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The block's device -> CPU: what goes back into the activations or into a saved file
    passes here. ``t`` itself on a CPU run."""
    return t.to(HOST)


def module_device(module: torch.nn.Module) -> torch.device:
    """The one device of ``module``'s parameters (a block is loaded onto one device)."""
    devices = {p.device for p in module.parameters()}
    assert len(devices) == 1, f"a block's parameters must share one device, got {devices}"
    return devices.pop()
