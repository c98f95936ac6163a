"""Stage 1: export the reference FP16 (or BF16) checkpoint that every later stage reads."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from quantpipe.core.experts import model_name, split_fused_name
from quantpipe.core.families import FAMILIES
from quantpipe.core.io import (
    ChunkedTensor,
    LazyTensors,
    atomic_output_dir,
    parse_size,
    save_sharded,
    sha256_file,
    write_manifest,
    write_shards,
)
from quantpipe.core.sources import (
    DTYPES,
    ModelSource,
    check_remote_code,
    load_model,
    load_tokenizer,
    reading,
    resolve_source,
)

log = logging.getLogger(__name__)

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@dataclass(frozen=True)
class Fp16ExportSpec:
    source: str  # folder, .gguf file or "smollm2-135m"
    out: Path  # output folder (must not exist or be empty unless force)
    dtype: str = "fp16"  # "fp16" or "bf16"
    max_shard_size: str = "2GB"  # per-shard byte limit, e.g. "2GB", "500MB"
    force: bool = False  # replace a non-empty output folder
    trust_remote_code: bool = False  # never on unless asked

    def __post_init__(self) -> None:
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"dtype {self.dtype!r} is not supported; use fp16 or bf16")
        parse_size(self.max_shard_size, "--max-shard-size")  # before any slow work


@dataclass(frozen=True)
class Fp16ExportResult:
    out: Path
    num_parameters: int
    shards: list[dict]
    seconds: float


def _convert_in_place(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters one by one (never two full copies), refusing fp16 overflow."""
    for name, p in tqdm(list(model.named_parameters()), desc="casting", unit="tensor",
                        leave=False):
        if dtype == torch.float16 and p.dtype != torch.float16 and p.numel():
            amax = p.detach().abs().max().item()
            if not amax <= FP16_MAX:  # also catches NaN
                raise ValueError(
                    f"tensor {name} has |value| up to {amax:.4g}, beyond the fp16 range "
                    f"({FP16_MAX:.0f}); export with --dtype bf16 instead"
                )
        p.data = p.data.to(dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.data = b.data.to(dtype)


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without tied duplicates (``lm_head.weight`` when tied to the embeddings)."""
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


def export_fp16(spec: Fp16ExportSpec) -> Fp16ExportResult:
    """Write the FP16 folder; bad input fails before ``spec.out`` is touched, and the whole
    export runs under the output lock inside a hidden temp folder (see quantpipe.core.io).

    A safetensors folder (tensor names the model's, or a MoE family's hub names: experts per
    expert, renamed and fused per tensor) and a GGUF file of an architecture whose tensors
    transformers converts one by one (MoE experts one expert at a time) are converted tensor by
    tensor (one tensor, or one expert's part, in memory; never the model); other sources
    (``.bin``, quantized safetensors, other GGUF architectures) are loaded whole by
    transformers.
    """
    t0 = time.perf_counter()
    src = resolve_source(spec.source)
    check_remote_code(src, spec.trust_remote_code)
    dtype = DTYPES[spec.dtype]
    # checks --out (not the source, not inside or around it; empty unless --force) and takes
    # the output lock before the slow load; SOURCE is the model folder or the .gguf file
    with atomic_output_dir(spec.out, spec.force, inputs={"SOURCE": src.path}) as tmp:
        log.info("loading %s (%s)", src.path, src.kind)
        tokenizer = load_tokenizer(src, spec.trust_remote_code)
        plan = stream_plan(src, dtype, spec.trust_remote_code)
        if plan is not None:
            log.info("converting %s tensor by tensor", src.path)
            config, generation = plan.config, plan.generation_config()
            n_params = sum(plan.numel.values())
            shards = write_shards(((k, plan.converted(k)) for k in plan.numel), tmp,
                                  spec.max_shard_size)
        else:
            model = load_model(src, "auto", spec.trust_remote_code)
            _convert_in_place(model, dtype)
            config, generation = model.config, model.generation_config
            state = unique_state_dict(model)
            n_params = sum(t.numel() for t in state.values())
            shards = save_sharded(state, tmp, spec.max_shard_size)
            del model, state
        log.info("wrote %d parameters", n_params)
        config.dtype = dtype
        src_hash_file = src.hash_target()
        log.info("hashing source %s", src_hash_file)
        src_sha = sha256_file(src_hash_file) if src_hash_file else None
        config.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(
            tmp,
            stage="fp16",
            source={"name": spec.source, "kind": src.kind, "path": str(src.path),
                    "sha256": src_sha,
                    "sha256_of": src_hash_file.name if src_hash_file else None},
            dtype=spec.dtype,
            model_type=config.model_type,
            num_parameters=n_params,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            shards=shards,
        )
    seconds = time.perf_counter() - t0
    log.info("wrote %s in %.1fs", spec.out, seconds)
    return Fp16ExportResult(Path(spec.out), n_params, shards, seconds)


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor in the export dtype; integer tensors keep theirs; fp16 overflow refused."""
    if not t.is_floating_point():
        return t
    if dtype == torch.float16 and t.dtype != torch.float16 and t.numel():
        amax = t.abs().max().item()
        if not amax <= FP16_MAX:  # also catches NaN
            raise ValueError(
                f"tensor {name} has |value| up to {amax:.4g}, beyond the fp16 range "
                f"({FP16_MAX:.0f}); export with --dtype bf16 instead"
            )
    return t.to(dtype)


@dataclass(frozen=True)
class FusedExperts:
    """A MoE block's 3-D experts parameter (transformers' ``gate_up_proj`` [E, 2I, H] or
    ``down_proj`` [E, H, I]) that the source stores per expert: the source tensors whose rows,
    in order, are its rows (expert 0's gate, its up, expert 1's gate, ...; or each expert's
    down), as transformers' loader concatenates them."""

    parts: tuple[str, ...]  # source names, in row order
    shape: tuple[int, ...]  # of the fused parameter
    part_shape: tuple[int, ...]  # of each part: [I, H] (gate, up) or [H, I] (down)


@dataclass
class StreamPlan:
    """A source read tensor by tensor, in the model's own state-dict order."""

    folder: Path
    dtype: torch.dtype  # what floating tensors are written as
    config: object  # transformers PretrainedConfig
    source: Mapping[str, torch.Tensor]  # the source's tensors, read on access
    numel: dict[str, int]  # tensors to write (tied duplicates left out) -> element count
    buffers: dict[str, torch.Tensor]  # persistent buffers the source does not store
    stored_as: dict[str, str]  # model tensor -> the source's name for it (Mixtral's router)
    fused: dict[str, FusedExperts]  # experts assembled from per-expert source tensors

    def converted(self, name: str) -> torch.Tensor | ChunkedTensor:
        if name in self.fused:
            fused = self.fused[name]
            # one expert's part in memory at a time: never the fused parameter
            return ChunkedTensor(fused.shape, self.dtype, lambda: (
                _cast(p, self.source[p], self.dtype) for p in fused.parts))
        t = self.buffers[name] if name in self.buffers else self.source[self.stored_as[name]]
        return _cast(name, t, self.dtype)

    def generation_config(self):
        from transformers import GenerationConfig

        try:
            # no trust_remote_code: it runs no model code, and would store the key as a setting
            return GenerationConfig.from_pretrained(self.folder)
        except OSError:  # no generation_config.json: derive it from the model config
            return GenerationConfig.from_model_config(self.config)


# source dtypes streamed as they are (floating ones cast); others (fp8...) go to transformers
_STREAMED_DTYPES = {"F16", "BF16", "F32", "F64", "BOOL", "U8", "I8", "I16", "U16", "I32", "U32",
                    "I64", "U64"}


def _source_tensors(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(tensor -> file, tensor -> dtype string) from the source's safetensors headers."""
    where, dtypes = {}, {}
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                where[k] = p.name
                dtypes[k] = f.get_slice(k).get_dtype()
    return where, dtypes


def stream_plan(src: ModelSource, dtype: torch.dtype,
                trust_remote_code: bool = False) -> StreamPlan | None:
    """How to convert ``src`` tensor by tensor, or None when it must be loaded whole: remote
    code, an already quantized checkpoint, tensor names that transformers would rename or
    convert while loading (other than a MoE family's per-expert hub names, which are done
    here), or a GGUF architecture whose tensors transformers converts in ways not repeated
    here (GPT-OSS, MiniMax-M2, ...)."""
    if src.kind == "gguf":  # transformers builds a GGUF's model from its own classes
        return _gguf_plan(src, dtype)
    if trust_remote_code:
        return None
    if src.kind != "folder" or not any(src.path.glob("*.safetensors")):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src.path, trust_remote_code=False)
    if getattr(config, "quantization_config", None):
        return None  # transformers dequantizes it while loading
    where, dtypes = _source_tensors(src.path)
    if not set(dtypes.values()) <= _STREAMED_DTYPES:
        return None  # e.g. fp8 tensors: leave them to transformers
    return _plan(src, dtype, config, set(where), lambda: LazyTensors(src.path, where))


def _skeleton(config):
    """The causal LM of ``config`` on the meta device (buffers real), embeddings tied as the
    config says."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # shapes only; buffers stay real
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    skeleton.tie_weights()  # from_config leaves tied embeddings as two meta tensors
    return skeleton


def _plan(src: ModelSource, dtype: torch.dtype, config, stored: set[str], source,
          skeleton=None) -> StreamPlan | None:
    """The plan when the source stores ``stored``; ``source()`` reads them. Names are the
    model's, or a MoE family's hub names (per expert, Mixtral's ``block_sparse_moe``), renamed
    and fused per tensor as transformers' loader does. None when a parameter of the model is
    stored neither way."""
    skeleton = _skeleton(config) if skeleton is None else skeleton
    emb_in, emb_out = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    tied = emb_out is not None and emb_out.weight is emb_in.weight
    out_name = next((n for n, m in skeleton.named_modules() if m is emb_out), None)
    state = skeleton.state_dict()
    stored_as = _model_names(config.model_type, stored)
    fused = _fused_experts(config.model_type, state, stored_as)
    numel, buffers = {}, {}
    for name, t in state.items():
        if tied and name == f"{out_name}.weight":
            continue  # stored once, as the input embeddings
        if name not in stored_as and name not in fused:
            if t.is_meta:
                log.info("%s: %s is not stored under the model's name; loading it whole",
                         src.path, name)
                return None
            buffers[name] = t  # a persistent buffer the checkpoint does not carry
        numel[name] = t.numel()
    plan = StreamPlan(src.folder, dtype, config, source(), numel, buffers, stored_as, fused)
    _check_parts(src, plan)
    return plan


def _model_names(model_type: str, stored: set[str]) -> dict[str, str]:
    """Model tensor name -> the source's name for it: the identity, except for a MoE family's
    hub names (Mixtral ``block_sparse_moe.`` -> ``mlp.``, transformers' WeightRenaming)."""
    family = FAMILIES.get(model_type)
    if family is None or family.moe is None:
        return {k: k for k in stored}
    return {model_name(k, family.blocks, family.moe): k for k in stored}


def _fused_experts(model_type: str, state: Mapping[str, torch.Tensor],
                   stored_as: dict[str, str]) -> dict[str, FusedExperts]:
    """The model's 3-D experts parameters that the source stores per expert (hub layout:
    ``{block}.{experts}.{e}.{linear}.weight``), as transformers' WeightConverter fuses them:
    gate_up [E, 2I, H] = each expert's gate rows then its up rows; down [E, H, I] stacked."""
    family = FAMILIES.get(model_type)
    moe = None if family is None else family.moe
    if moe is None:
        return {}
    gate, up, down = moe.linear_names
    out = {}
    for name, t in state.items():
        found = split_fused_name(name, family.blocks, moe)
        if found is None or name in stored_as:
            continue  # not experts, or stored fused already (e.g. a quantpipe FP16 export)
        prefix, kind = found
        linears, rows = ((gate, up), t.shape[1] // 2) if kind == moe.gate_up else ((down,),
                                                                                  t.shape[1])
        per_expert = [f"{prefix}.{moe.path}.{e}.{lin}.weight" for e in range(t.shape[0])
                      for lin in linears]
        if all(p in stored_as for p in per_expert):
            out[name] = FusedExperts(tuple(stored_as[p] for p in per_expert), tuple(t.shape),
                                     (rows, t.shape[2]))
    return out


def _check_parts(src: ModelSource, plan: StreamPlan) -> None:
    """Every per-expert part has the shape the config gives it (its bytes are written as rows
    of the fused parameter, so a wrong shape must fail here, naming it, not corrupt the
    output)."""
    for name, fused in plan.fused.items():
        for part in fused.parts:
            shape = tuple(plan.source.shape(part))
            if shape != fused.part_shape:
                raise ValueError(f"{src.path}: {part} has shape {list(shape)}, but the config "
                                 f"makes each expert part of {name} "
                                 f"{list(fused.part_shape)}; the checkpoint does not match "
                                 "its config.json")


# transformers' GGUF tensor processors that convert each tensor on its own (llama.cpp's q/k
# row permutation undone, Gemma's norm offset), and Qwen2-MoE's, which gathers only the 3-D
# expert tensors (read here one expert at a time, see _expert_entries); the others gather or
# split tensors in ways not repeated here, so those architectures are loaded whole
_GGUF_TENSOR_BY_TENSOR = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
                          "Qwen2MoeTensorProcessor")
# llama.cpp's MoE experts: one 3-D tensor per block and linear, [E, rows, cols] as numpy reads it
_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


@dataclass(frozen=True)
class _GGUFEntry:
    name: str  # the tensor's GGUF name
    offset: int  # of its bytes in the file
    nbytes: int
    np_dtype: object  # numpy dtype and shape of its raw data (GGUFReader's view of it)
    shape: tuple[int, ...]
    qtype: object  # gguf GGMLQuantizationType
    logical: tuple[int, ...]  # its shape once dequantized (numpy order)


class GGUFTensors:
    """A GGUF file's tensors under the model's names, each read with a plain file read (no
    mapping stays behind it), dequantized and processed as transformers' GGUF loader does when
    it is accessed: one tensor in memory at a time. A MoE block's 3-D expert tensors appear
    per expert (``{block}.mlp.experts.{e}.{linear}.weight``), each expert's rows read alone."""

    def __init__(self, path: Path, entries: dict[str, _GGUFEntry], processor) -> None:
        self.path = path
        self.entries = entries
        self.processor = processor

    def __getitem__(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        e = self.entries[name]
        with open(self.path, "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.nbytes)
        data = np.frombuffer(raw, dtype=e.np_dtype).reshape(e.shape)
        weights = self.processor.process(weights=dequantize(data, e.qtype), name=e.name).weights
        return torch.from_numpy(np.array(weights, copy=True))  # writable, owns its memory

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's dequantized shape (before the processor; nothing is read)."""
        return self.entries[name].logical


def _entry(t, name: str | None = None) -> _GGUFEntry:
    return _GGUFEntry(name or t.name, int(t.data_offset), int(t.n_bytes), t.data.dtype,
                      tuple(t.data.shape), t.tensor_type,
                      tuple(int(n) for n in reversed(t.shape)))


def _expert_entries(t, m: re.Match, family) -> dict[str, _GGUFEntry]:
    """A 3-D ``blk.N.ffn_{gate,up,down}_exps`` tensor as one entry per expert, named as the hub
    names the expert's linear; expert e's bytes are the e-th of E equal slices (llama.cpp
    quantizes along rows, so a slice dequantizes to exactly that expert's rows)."""
    moe = family.moe
    whole = _entry(t)
    n = whole.shape[0]  # experts
    assert whole.nbytes % n == 0, t.name
    per = whole.nbytes // n
    linear = moe.linear_names[("gate", "up", "down").index(m.group(2))]
    prefix = f"{family.blocks}.{m.group(1)}.{moe.path}"
    return {f"{prefix}.{e}.{linear}.weight": _GGUFEntry(
        t.name, whole.offset + e * per, per, whole.np_dtype, whole.shape[1:], whole.qtype,
        whole.logical[1:]) for e in range(n)}


def _mixtral_config(reader, config):
    """llama.cpp writes Mixtral as architecture ``llama`` with ``llama.expert_count``;
    transformers reads such a file as a dense Llama (and initialises its missing MLPs at
    random). The Mixtral config of the same fields, with the expert counts; None for a
    dense Llama."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import read_field

    experts = read_field(reader, "llama.expert_count")
    if not experts or not experts[0]:
        return None
    used = read_field(reader, "llama.expert_used_count")
    keep = set(AutoConfig.for_model("mixtral").to_dict()) - {
        "model_type", "architectures", "transformers_version"}
    fields = {k: v for k, v in config.to_dict().items() if k in keep}
    fields.update(num_local_experts=int(experts[0]), num_experts_per_tok=int(used[0]))
    return AutoConfig.for_model("mixtral", **fields)


# GGUF keys of a Qwen MoE's expert widths -> config fields (transformers' GGUF config reads
# neither and keeps the config class defaults, right only for the models they were taken from)
_GGUF_EXPERT_WIDTHS = {"expert_feed_forward_length": "moe_intermediate_size",
                       "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def _expert_widths(reader, arch: str, config) -> None:
    """Set a Qwen MoE config's expert widths from the file, where it has them."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    if arch not in ("qwen2moe", "qwen3moe"):
        return
    for key, field in _GGUF_EXPERT_WIDTHS.items():
        value = read_field(reader, f"{arch}.{key}")
        if value and hasattr(config, field):
            setattr(config, field, int(value[0]))


def _gguf_plan(src: ModelSource, dtype: torch.dtype) -> StreamPlan | None:
    """GGUF: transformers' config, name map and tensor processor, applied a tensor at a time
    (the same values as its whole-model load: the same dequantization and processing); MoE
    experts read one expert at a time (llama.cpp's Mixtral, a ``llama`` file with experts that
    transformers cannot load, gets the Mixtral config)."""
    from gguf import GGUFReader
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    with reading(src.path, "a GGUF file"):
        reader = GGUFReader(str(src.path))
        arch = read_field(reader, "general.architecture")[0]
    processor_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if processor_cls.__name__ not in _GGUF_TENSOR_BY_TENSOR:
        log.info("%s: GGUF %s tensors are converted together; loading it whole", src.path, arch)
        return None
    with reading(src.path, "a GGUF file"):
        config = AutoConfig.from_pretrained(str(src.folder), gguf_file=src.path.name,
                                            trust_remote_code=False)
    if hasattr(config, "quantization_config"):  # the file's types, dequantized here
        del config.quantization_config
    mixtral = _mixtral_config(reader, config) if arch == "llama" else None
    config = mixtral or config
    _expert_widths(reader, arch, config)
    skeleton = _skeleton(config)
    config.architectures = [type(skeleton).__name__]  # as the loaded model records it
    # the processors read HF config keys (num_attention_heads, ...): the config parsed above
    # has them, so the file's metadata is not parsed a third time
    processor = processor_cls(config=config.to_dict())
    # GGUF name -> model name (a Mixtral skeleton through llama.cpp's "llama" names)
    names = get_gguf_hf_weights_map(skeleton, processor, model_type=arch if mixtral else None)
    family = FAMILIES.get(config.model_type)
    entries = {}
    for t in reader.tensors:
        m = _GGUF_EXPERTS.fullmatch(t.name)
        if m and family is not None and family.moe is not None:
            entries.update(_expert_entries(t, m, family))
        elif t.name in names:
            entries[names[t.name]] = _entry(t)
    del reader  # its file mapping: nothing of the tensors was read through it
    plan = _plan(src, dtype, config, set(entries),
                 lambda: GGUFTensors(src.path, entries, processor), skeleton)
    if plan is None and mixtral is not None:
        raise ValueError(f"{src.path}: a Mixtral GGUF whose experts are not 3-D "
                         "blk.N.ffn_{gate,up,down}_exps tensors (an older llama.cpp layout); "
                         "convert the model again with a current llama.cpp")
    return plan
