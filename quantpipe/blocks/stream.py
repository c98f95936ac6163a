"""The FP16 model as a skeleton on the meta device, its weights read one module at a time.

Calibration needs the embeddings once (to turn token ids into block-0 inputs) and then one
decoder block at a time. :class:`ModelStream` builds the model from ``config.json`` with every
parameter on the meta device (accelerate's ``init_empty_weights``; buffers such as the rotary
``inv_freq`` stay real, on the CPU), reads a module's weights from the mmapped safetensors
shards onto the requested device (``--device``: quantpipe.blocks.device) when
:meth:`ModelStream.load` is entered and puts them back on the meta device when it exits. Peak
memory is therefore one block's weights (in fp32) plus the calibration activations, whatever
the depth of the model. Streamed sensitivity and the streamed evaluation read their output head
through :func:`output_head` the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from quantpipe.blocks.device import to_device
from quantpipe.core.families import attn_implementation, config_value, family_for, get_path
from quantpipe.core.heap import release_freed_memory


class ModelStream:
    """A causal LM from an FP16 folder, materialised one submodule at a time."""

    def __init__(self, fp16_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(fp16_dir)
        self.dtype = dtype
        config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
            self.model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation(config.model_type),
                trust_remote_code=False)
        self.model.eval()
        self._where = self._weight_map()  # tensor name -> shard file

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        out = {}
        for p in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                out.update({k: p.name for k in f.keys()})
        return out

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            fname = self._where[name]
        except KeyError:
            raise ValueError(f"{self.folder}: no tensor {name} in its shards; the folder does "
                             "not match its config.json (re-run export-fp16)") from None
        # opened for this read only: a handle kept open keeps every page read so far mapped,
        # and RSS would grow to the whole model as the blocks stream by
        with safe_open(str(self.folder / fname), framework="pt") as f:
            return f.get_tensor(name)

    def _module_tensors(self, module_name: str, names: list[str]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, tensor as stored) for each of ``module_name``'s ``names``."""
        for name in names:
            yield name, self._tensor(f"{module_name}.{name}")

    @contextlib.contextmanager
    def load(self, module_name: str, device: str | torch.device = "cpu"
             ) -> Iterator[torch.nn.Module]:
        """Materialise ``module_name``'s parameters (cast to ``dtype``) on ``device`` for the
        ``with`` body, its buffers moved there too; afterwards the parameters go back to the
        meta device and the buffers to their CPU tensors, also when the body raises."""
        module = self.model.get_submodule(module_name)
        names = [name for name, _ in module.named_parameters()]
        buffers = dict(module.named_buffers())  # [..] real CPU tensors (the skeleton's)
        try:
            for name, tensor in self._module_tensors(module_name, names):
                # as stored ([out, in] for linears, [d] for norms) -> a real parameter
                _set(module, name, to_device(tensor, device, self.dtype))
            for name, buf in buffers.items():
                _set_buffer(module, name, to_device(buf, device))
            yield module
        finally:
            for name, p in list(module.named_parameters()):
                # back on meta: frees the weights; the skeleton keeps shapes (buffers stay)
                _set(module, name, torch.empty_like(p, device="meta"))
            for name, buf in buffers.items():
                _set_buffer(module, name, buf)
            # glibc keeps freed blocks in its arenas: without this, RSS creeps up block by block
            release_freed_memory()

    @property
    def embeddings_name(self) -> str:
        """The input embedding module's name (what :meth:`load` takes to read the table)."""
        emb = self.model.get_input_embeddings()
        return next(name for name, m in self.model.named_modules() if m is emb)

    def materialised_parameters(self) -> int:
        """Parameters currently holding real memory (the rest are on the meta device)."""
        return sum(p.numel() for p in self.model.parameters() if not p.is_meta)


@contextlib.contextmanager
def output_head(stream: ModelStream):
    """A function hidden [T, d] -> logits [T, vocab] fp32 (final norm, head, soft-cap), with
    the norm and head weights read for the ``with`` body."""
    model = stream.model
    family = family_for(model.config.model_type)
    norm_name = f"{family.decoder}.{family.final_norm}"
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_name = stream.embeddings_name if tied else next(
        name for name, m in model.named_modules() if m is head)
    softcap = config_value(model.config, family.final_softcap)
    with stream.load(norm_name), stream.load(head_name) as head_mod:
        norm = get_path(model, norm_name)
        bias = None if tied else getattr(head_mod, "bias", None)

        def logits(h: torch.Tensor) -> torch.Tensor:
            out = torch.nn.functional.linear(norm(h), head_mod.weight, bias).float()
            return out if softcap is None else softcap * torch.tanh(out / softcap)

        yield logits


def _set(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))


def _set_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._buffers[leaf] = value  # keeps the buffer's persistence flag
