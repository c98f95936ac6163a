"""Build a runnable transformers model from a quantized folder, with ``QuantLinear`` layers.

``load_quantized_model(qdir, device, dtype)``:
1. verify and read the checkpoint (native, GPTQ or compressed-tensors, also made by other
   tools) into :class:`PackedCheckpoint`;
2. build the model with :func:`quantpipe.core.hf_model.build_causal_lm` (parameters on the
   meta device, so no FP16 copy of a quantized weight is ever allocated), which
3. puts a ``QuantLinear`` (repacked on ``device``) in place of every quantized ``nn.Linear``,
   one layer at a time: each is read from the mmapped files (a native checkpoint's packed
   words as they are stored; other formats unpacked and packed to the native layout),
   repacked for its kernel and dropped before the next, so the peak is the packed model plus
   one layer's stored tensors and the repack's temporaries;
4. and assigns the FP tensors (embeddings, norms, kept-FP linears) cast to ``dtype``, tying
   embeddings. With the CPU half head (``keep_fp16_embeddings``) an untied fp16 input table is
   not read at all: it is a read-only memory map of its shard (``map_embeddings``), of which
   decoding touches only the rows it looks up.

MoE families (Mixtral, Qwen MoE): the checkpoint names each expert's linears
(``...experts.E.w1``); transformers' model holds 3-D expert parameters instead.
``build_causal_lm`` places only ``nn.Linear`` replacements, so those parameters get a
zero-stride placeholder (no memory) and, once the model is built, each block's experts module
is replaced by a :class:`quantpipe.core.experts.SplitExperts` of the experts' QuantLinears
(FP ``nn.Linear`` for an expert a plan kept FP16). transformers' router module stays and
routes (softmax, top-k, its renormalisation), so the routing is the HF model's.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.experts import ExpertMLP, SplitExperts, config_ints, model_name
from quantpipe.core.families import FAMILIES, Family
from quantpipe.core.formats.loader import QuantizedCheckpoint, load_quantized
from quantpipe.core.formats.native import NAME as NATIVE
from quantpipe.core.formats.native import quantized_tensors
from quantpipe.core.heap import release_freed_memory
from quantpipe.core.hf_model import build_causal_lm
from quantpipe.core.io import LazyTensors
from quantpipe.core.qformat import QuantSpec
from quantpipe.core.vocab import vocab_tables
from quantpipe.runtime.fp_head import page_out
from quantpipe.runtime.kernels.layout import PackedLinear
from quantpipe.runtime.quant_embedding import QuantEmbedding
from quantpipe.runtime.quant_linear import QuantLinear

log = logging.getLogger(__name__)


@dataclass
class PackedCheckpoint:
    """Any quantized checkpoint, converted to the runtime's inputs layer by layer."""

    config: dict  # HF config.json without quantization_config
    source: QuantizedCheckpoint  # verified; layers and FP tensors read on access

    def layer_names(self) -> list[str]:
        return list(self.source.layers)

    def packed_layers(self) -> Iterator[tuple[str, PackedLinear]]:
        """(name, packed inputs) of each quantized linear, one at a time.

        A native checkpoint stores the runtime's inputs as they are: each layer's tensors
        are read from the mmapped shards (after the verifier checked every layer) and nothing
        is unpacked. Other formats are unpacked to quantpipe's convention and packed again."""
        stored = (LazyTensors.of_folder(self.source.folder)
                  if self.source.checkpoint_format == NATIVE else None)
        for name in self.source.layers:
            # no local holds the layer: it is dropped before the next one is read
            yield name, (self._stored(name, stored) if stored is not None
                         else self._converted(name))

    def _bias(self, name: str) -> torch.Tensor | None:
        fp = self.source.fp_tensors
        return fp[f"{name}.bias"] if f"{name}.bias" in fp else None

    def _stored(self, name: str, stored: LazyTensors) -> PackedLinear:
        """A native layer's stored tensors (``quantized_tensors``' layout): the same
        PackedLinear as :meth:`_converted` makes from it, bit for bit."""
        spec = self.source.plan[name]
        qweight = stored[f"{name}.qweight"]  # int32 [out, in * bits / 32], file-mapped
        # a stored g_idx without act-order was checked sequential: the spec's i // group_size
        g_idx = stored.get(f"{name}.g_idx") if spec.act_order else None
        return PackedLinear(spec=spec, qweight=qweight, scales=stored[f"{name}.scales"],
                            qzeros=None if spec.sym else stored[f"{name}.qzeros"], g_idx=g_idx,
                            bias=self._bias(name),
                            in_features=qweight.shape[1] * 32 // spec.bits)

    def _converted(self, name: str) -> PackedLinear:
        qw = self.source.layers[name]  # unpacked from the mmapped file now
        t = quantized_tensors(name, qw)  # native layout: qweight [out, in*bits/32] int32
        return PackedLinear(
            spec=qw.spec,
            qweight=t[f"{name}.qweight"],
            scales=t[f"{name}.scales"],
            qzeros=t.get(f"{name}.qzeros"),
            g_idx=t.get(f"{name}.g_idx"),
            bias=self._bias(name),
            in_features=qw.shape[1],
        )

    def fp_tensors(self, mapped: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor that is not part of a quantized linear (biases belong to the linear).

        ``mapped``: a tensor given as a read-only memory map of its file where it is stored
        in fp16 (:meth:`quantpipe.core.io.LazyTensors.mapped`), read into memory otherwise."""
        fp = self.source.fp_tensors
        biases = {f"{name}.bias" for name in self.source.layers}
        for k in fp:
            if k in biases:
                continue
            t = _mapped_fp16(fp, k) if k == mapped else None
            yield k, fp[k] if t is None else t


def _mapped_fp16(tensors, key: str) -> torch.Tensor | None:
    """``tensors[key]`` mapped from its file if it is stored in fp16, else None (read it)."""
    mapped = getattr(tensors, "mapped", None)  # LazyTensors; other mappings are read
    t = mapped(key) if mapped is not None else None
    return t if t is not None and t.dtype == torch.float16 else None


def _untied_input_table(config: dict, family: Family | None) -> str | None:
    """The checkpoint name of the input embedding table when it is not the output head's
    (a tied table is read whole by the head every token), else None."""
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**config)
    if family is None or getattr(hf_config, "tie_word_embeddings", False):
        return None
    return f"{family.decoder}.embed_tokens.weight"  # the engine's decoder.embed_tokens


def read_packed(qdir: str | Path, verify: bool = True) -> PackedCheckpoint:
    """Any quantized folder (native, GPTQ, compressed-tensors) as the runtime's packed inputs.

    ``quantpipe.core.formats.loader.load_quantized`` verifies the folder first (manifest and shard
    hashes, tensor shapes and dtypes, finite positive scales, zeros in range) and unpacks it
    to quantpipe's convention; :meth:`PackedCheckpoint.packed_layers` then packs each layer in
    the native layout the kernels take, as it is needed. ``verify=False`` (``--no-verify``)
    skips the hashes and value checks (headers, shapes and config sizes are still checked);
    otherwise a verified stamp skips them for files unchanged since they last passed.
    """
    ckpt = load_quantized(qdir, "stamp" if verify else "skip")
    return PackedCheckpoint(ckpt.model_config(), ckpt)


def default_dtype(device: torch.device) -> torch.dtype:
    # CPU: fp32 for the FP layers (fp16/bf16 dense matmuls are several times slower on these
    # CPUs; quantized layers still run with bf16 activations). CUDA: fp16.
    return torch.float32 if device.type == "cpu" else torch.float16


def load_quantized_model(qdir: str | Path, device: str | torch.device = "cpu",
                         dtype: torch.dtype | None = None, backend: str | None = None,
                         keep_fp16_embeddings: bool = False, map_embeddings: bool = True,
                         verify: bool = True):
    """A transformers causal LM running from the packed weights of ``qdir`` (eval mode).

    ``keep_fp16_embeddings``: an fp16 embedding table and head stay fp16 (for
    ``runtime.fp_head.set_half_head``, which then never needs an fp32 copy of them).
    ``map_embeddings`` (with ``keep_fp16_embeddings`` on CPU): an fp16 input embedding table
    that is not tied to the head is not read into memory but viewed through a read-only
    memory map of its shard, so only the rows the prompts and generated tokens look up become
    resident (the same fp16 values: the same logits). A tied table, the CUDA path and
    non-fp16 tables load as before. ``verify``: see :func:`read_packed`."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False; "
                         "use --device cpu")
    dtype = dtype or default_dtype(device)
    ckpt = read_packed(qdir, verify)
    # each QuantLinear is built (repacked on device) as build_causal_lm asks for the next one
    quant_linears = _quant_linears(ckpt, device, backend, dtype)
    family = FAMILIES.get(ckpt.config.get("model_type"))
    experts = _Experts(family, ckpt, dtype, device) if family and family.moe else None
    mapped = (_untied_input_table(ckpt.config, family)
              if map_embeddings and keep_fp16_embeddings and device.type == "cpu" else None)
    tensors = ckpt.fp_tensors(mapped)
    if experts is not None:
        quant_linears, tensors = experts.take(quant_linears), experts.placeholders(tensors)
    vocab = _QuantVocab(ckpt, dtype, device, backend) if ckpt.source.embeddings else None
    if vocab is not None:
        quant_linears, tensors = vocab.head(quant_linears), vocab.placeholders(tensors)
    model = build_causal_lm(ckpt.config, tensors, dtype, device=device,
                            modules=quant_linears, where=qdir,
                            keep_fp16_embeddings=keep_fp16_embeddings)
    if experts is not None:
        experts.install(model)
    if vocab is not None:
        vocab.install(model)
    del ckpt, quant_linears, tensors, experts, vocab
    release_freed_memory()
    counts = Counter(m.backend for m in model.modules() if isinstance(m, QuantLinear))
    log.info("loaded %s on %s: %d QuantLinear layers %s", qdir, device, sum(counts.values()),
             dict(counts))
    model.quantpipe_backends = dict(counts)
    return model


def _quant_linears(ckpt: PackedCheckpoint, device: torch.device, backend: str | None,
                   dtype: torch.dtype) -> Iterator[tuple[str, QuantLinear]]:
    """(name, QuantLinear) of each quantized linear, built when asked for; a layer's packed
    inputs are dropped before the next layer is read (the load holds one at a time)."""
    for name, packed in ckpt.packed_layers():
        module = QuantLinear(packed, device, backend=backend, bias_dtype=dtype)
        del packed
        yield name, module


class _QuantVocab:
    """A checkpoint's quantized embedding table (``export --vocab-weights``): the decoder's
    ``embed_tokens`` becomes a :class:`QuantEmbedding` over the stored packed table (on CPU a
    read-only memory map of its shard: the rows looked up are read), and a head tied to it a
    :class:`QuantLinear` made from the same stored tensors (the checkpoint holds the table
    once; the head's kernel layout is its own copy). An untied quantized head is a layer of
    the plan and is built like every other."""

    def __init__(self, ckpt: PackedCheckpoint, dtype: torch.dtype, device: torch.device,
                 backend: str | None) -> None:
        tables = vocab_tables(ckpt.config)
        (self.name,) = ckpt.source.embeddings  # native stores at most the one input table
        assert self.name == tables.embedding, (self.name, tables.embedding)
        self.tied, self.head_name = tables.tied, tables.head
        self.dtype, self.device, self.backend = dtype, device, backend
        self.packed = self._packed(ckpt)

    def _packed(self, ckpt: PackedCheckpoint) -> PackedLinear:
        """The stored table as the native layout (mapped on CPU, else read to ``device``)."""
        source, name = ckpt.source, self.name
        if source.checkpoint_format == NATIVE:
            stored = LazyTensors.of_folder(source.folder)
            spec = QuantSpec.from_dict(source.config["quantization_config"]["embeddings"][name])

            def read(key: str) -> torch.Tensor | None:
                if key not in stored:
                    return None
                t = stored.mapped(key) if self.device.type == "cpu" else None
                return (stored[key] if t is None else t).to(self.device)

            qweight = read(f"{name}.qweight")  # int32 [vocab, hidden * bits / 32]
            return PackedLinear(spec, qweight, read(f"{name}.scales"), read(f"{name}.qzeros"),
                                None, None, qweight.shape[1] * 32 // spec.bits)
        qw = source.embeddings[name]  # unpacked to quantpipe's convention, packed again
        t = quantized_tensors(name, qw)
        return PackedLinear(qw.spec, t[f"{name}.qweight"].to(self.device),
                            t[f"{name}.scales"].to(self.device),
                            None if qw.spec.sym else t[f"{name}.qzeros"].to(self.device),
                            None, None, qw.shape[1])

    def head(self, quant_linears: Iterator[tuple[str, torch.nn.Module]]
             ) -> Iterator[tuple[str, torch.nn.Module]]:
        """The quantized linears, then a tied head made from the table."""
        yield from quant_linears
        if self.tied:
            yield self.head_name, QuantLinear(self.packed, self.device, backend=self.backend,
                                              bias_dtype=self.dtype)

    def placeholders(self, tensors: Iterator[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """The FP tensors and a zero-stride stand-in (no memory) for the table's weight,
        replaced by :meth:`install` once the model is built."""
        yield from tensors
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        yield f"{self.name}.weight", zero.expand(self.packed.out_features,
                                                 self.packed.in_features)

    def install(self, model: torch.nn.Module) -> None:
        """``embed_tokens`` -> QuantEmbedding over the stored table."""
        emb = model.get_input_embeddings()
        p = self.packed
        model.set_input_embeddings(QuantEmbedding(
            p.spec, p.qweight, p.scales, p.qzeros, self.dtype, emb.num_embeddings,
            getattr(emb, "embed_scale", None)))
        if self.tied and self.device.type == "cpu":
            # the tied head's repack read the whole mapped table: hand its clean file pages
            # back, so that only rows looked up from now on are resident
            for t in (p.qweight, p.scales):
                page_out(t)


class _Experts:
    """A MoE checkpoint's experts, set aside while ``build_causal_lm`` builds the rest, then
    installed per block as :class:`SplitExperts` (module docstring)."""

    def __init__(self, family: Family, ckpt: PackedCheckpoint, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.family, self.moe = family, family.moe
        config = ckpt.config
        self.num_experts, self.hidden, self.inter = config_ints(
            config, self.moe.num_experts, "hidden_size", self.moe.intermediate)
        self.dtype, self.device = dtype, device
        leaves = "|".join(map(re.escape, self.moe.linear_names))
        # a split-model name: {blocks}.N.{path}.E.{gate|up|down}
        self._pattern = re.compile(rf"({re.escape(family.blocks)}\.\d+)\."
                                   rf"{re.escape(self.moe.path)}\.(\d+)\.({leaves})")
        names = [*ckpt.layer_names(), *(k.removesuffix(".weight") for k in ckpt.source.fp_tensors)]
        # the blocks with experts (a Qwen2-MoE dense layer has none), from the names alone
        self.blocks = sorted({m.group(1) for m in map(self._match, names) if m is not None})
        self.modules: dict[str, dict[tuple[int, str], torch.nn.Module]] = {}  # per block

    def _match(self, hub: str):
        return self._pattern.fullmatch(model_name(hub, self.family.blocks, self.moe))

    def _keep(self, m, module: torch.nn.Module) -> None:
        self.modules.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = module

    def take(self, quant_linears: Iterator[tuple[str, torch.nn.Module]]
             ) -> Iterator[tuple[str, torch.nn.Module]]:
        """The QuantLinears build_causal_lm places (model names); experts' are kept here."""
        for name, module in quant_linears:
            m = self._match(name)
            if m is None:
                yield model_name(name, self.family.blocks, self.moe), module
            else:
                self._keep(m, module)

    def placeholders(self, tensors: Iterator[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """The FP tensors under the model's names; an expert kept FP16 becomes an nn.Linear
        kept here; each MoE block's 3-D expert parameters get a zero-stride placeholder."""
        for name, t in tensors:
            m = self._match(name[: -len(".weight")]) if name.endswith(".weight") else None
            if m is None:
                yield model_name(name, self.family.blocks, self.moe), t
                continue
            lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(t.to(self.device, self.dtype), requires_grad=False)
            self._keep(m, lin)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        E, H, inter = self.num_experts, self.hidden, self.inter
        for block in self.blocks:
            pre = f"{block}.{self.moe.path}"
            yield f"{pre}.{self.moe.gate_up}", zero.expand(E, 2 * inter, H)  # [E, 2I, H]
            yield f"{pre}.{self.moe.down}", zero.expand(E, H, inter)  # [E, H, I]

    def install(self, model: torch.nn.Module) -> None:
        """Each MoE block's experts module -> SplitExperts of the kept linears."""
        names = self.moe.linear_names
        for block in self.blocks:
            got = self.modules.get(block, {})
            missing = [(e, n) for e in range(self.num_experts) for n in names if (e, n) not in got]
            if missing:
                raise ValueError(f"{block}: experts {sorted({e for e, _ in missing})} lack "
                                 f"{sorted({n for _, n in missing})}; the checkpoint is "
                                 "incomplete")
            parent_name, _, child = f"{block}.{self.moe.path}".rpartition(".")
            parent = model.get_submodule(parent_name)
            act_fn = getattr(parent, child).act_fn
            setattr(parent, child, SplitExperts(
                ExpertMLP(names, *(got[e, n] for n in names), act_fn)
                for e in range(self.num_experts)))
        self.modules.clear()
