"""Per-input-group statistics of calibration: the X^T X sums GPTQ needs, the input
recorders AWQ's search reads, collected with hooks while
:func:`quantpipe.blocks.execute.run_block` runs a block over its inputs.
"""

from __future__ import annotations

import torch

from quantpipe.blocks.device import to_device
from quantpipe.blocks.execute import StopForward
from quantpipe.core.families import InputGroup

# rows per stored strip of the X^T X sum (see GroupStats): the strips hold the upper triangle
# plus half a strip's square per strip, so narrower strips waste less
XTX_STRIP_ROWS = 256


class GroupStats:
    """Statistics of one shared linear input, accumulated over all calibration tokens.

    X^T X is symmetric, so only its upper triangle is summed: row strips ``[r0:r1, r0:in]``
    (each with its full diagonal square) in float64, about half of the full [in, in] float64
    matrix (a 7B down_proj's 11008^2 sum). Each batch's fp32 product is added in place, as a
    full matrix would be; the Hessian is rebuilt by mirroring the strips. fp64 sums keep
    calibration's results those of the reference runs (docs/scale.md).

    Every buffer is made on ``device``, the device of the block whose inputs it sums (its
    inputs arrive there); the Hessian and dXXT it gives are on that device too.
    """

    def __init__(self, in_features: int, xtx: torch.Tensor | None = None,
                 abs_sum: torch.Tensor | None = None, tokens: int = 0,
                 sample: list[torch.Tensor] | None = None, sample_rows: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.in_features = in_features
        self.device = torch.device(device)
        # [in] fp64 sum of |x|
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64, device=self.device) \
            if abs_sum is None else abs_sum
        self.tokens = tokens
        self.sample: list[torch.Tensor] = [] if sample is None else sample  # rows for clipping
        self.sample_rows = sample_rows
        # GPTAQ: [in, in] fp64 sum of (x_fp - x)^T x over the tokens; None unless paired
        self.dxxt_sum: torch.Tensor | None = None
        # [r1 - r0, in - r0] fp64 each, views of one buffer; None once taken
        self._strips: list[torch.Tensor] | None
        self._strips = self._new_strips()
        if xtx is not None:
            self.xtx = xtx

    def _bounds(self) -> list[tuple[int, int]]:
        n = self.in_features
        return [(r0, min(r0 + XTX_STRIP_ROWS, n)) for r0 in range(0, n, XTX_STRIP_ROWS)]

    def _new_strips(self) -> list[torch.Tensor]:
        """Zeroed strips, views of one fp64 buffer: one large allocation that goes back to the
        system when the strips are dropped (many strip-sized ones would stay in malloc's
        heap after they are freed, and the process would not shrink)."""
        n = self.in_features
        sizes = [(r1 - r0) * (n - r0) for r0, r1 in self._bounds()]
        # [sum of strip sizes] fp64
        buf = torch.zeros(sum(sizes), dtype=torch.float64, device=self.device)
        return [part.view(r1 - r0, n - r0) for part, (r0, r1)
                in zip(buf.split(sizes), self._bounds())]

    def add_xtx(self, x: torch.Tensor) -> None:
        """x: [tokens, in] fp32: add x^T x (symmetric) to the fp64 sum, one upper strip at a
        time: half the products of the full [in, in] matrix, and no [in, in] temporary."""
        for (r0, r1), strip in zip(self._bounds(), self._strips):
            # [r1 - r0, tokens] @ [tokens, in - r0] fp32; fp64 += fp32 elementwise
            strip.add_(x[:, r0:r1].T @ x[:, r0:])

    def _full(self, scale: float | None, dtype: torch.dtype, consume: bool) -> torch.Tensor:
        """The symmetric [in, in] matrix from the strips (times ``scale``), in ``dtype``."""
        if self._strips is None:
            raise ValueError("X^T X was already taken by take_hessian()")
        n = self.in_features
        out = torch.empty(n, n, dtype=dtype, device=self.device)
        for i, (r0, r1) in enumerate(self._bounds()):
            strip = self._strips[i]
            if scale is not None:  # 2 X^T X / tokens: multiply, then divide, in fp64
                strip = strip.mul_(2.0) if consume else strip * 2.0
                strip.div_(scale)
            out[r0:r1, r0:] = strip  # the cast rounds as .float() would
            out[r1:, r0:r1] = out[r0:r1, r1:].T  # mirrored: X^T X is symmetric
        if consume:
            self._strips = None  # frees the fp64 buffer
        return out

    @property
    def xtx(self) -> torch.Tensor:
        """X^T X summed over the tokens: [in, in] fp64 (a full copy, built from the strips)."""
        return self._full(None, torch.float64, consume=False)

    @xtx.setter
    def xtx(self, value: torch.Tensor) -> None:
        """Replace the sum by a symmetric [in, in] matrix (its upper triangle is kept)."""
        assert value.shape == (self.in_features, self.in_features), value.shape
        self._strips = self._new_strips()
        for (r0, r1), strip in zip(self._bounds(), self._strips):
            strip.copy_(value[r0:r1, r0:])

    def scale_inputs(self, s: torch.Tensor) -> None:
        """The statistics of the inputs x / s (s: [in] fp32), in place: X^T X / (s s^T) and
        sum |x| / s (AWQ's rescaling, sec. 3: the next linear reads x / s)."""
        for (r0, r1), strip in zip(self._bounds(), self._strips):
            strip /= (s[r0:r1, None] * s[None, r0:]).double()  # [r1 - r0, in - r0]
        self.abs_sum /= s.double()

    @property
    def H(self) -> torch.Tensor:
        """GPTQ Hessian of the layer-wise loss: 2 X^T X / tokens  -> [in, in] fp32 (a copy)."""
        return self._full(max(self.tokens, 1), torch.float32, consume=False)

    def take_hessian(self) -> torch.Tensor:
        """:attr:`H`, scaling the fp64 strips in place before the fp32 copy (no second fp64
        matrix); the statistics keep no X^T X afterwards."""
        return self._full(max(self.tokens, 1), torch.float32, consume=True)

    @property
    def x_absmean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()  # [in]

    def x_sample(self) -> torch.Tensor:
        if not self.sample:
            return torch.zeros(0, self.in_features, device=self.device)  # [0, in]
        return torch.cat(self.sample)  # [rows, in]

    def add_dxxt(self, x_fp: torch.Tensor, x: torch.Tensor) -> None:
        """GPTAQ: add (x_fp - x)^T x to the fp64 sum (x_fp: the FP model's inputs of the same
        tokens, in the same order; x: [tokens, in] fp32 each)."""
        if self.dxxt_sum is None:
            self.dxxt_sum = torch.zeros(self.in_features, self.in_features,
                                        dtype=torch.float64, device=self.device)
        # [in, tokens] @ [tokens, in] -> [in, in] fp32, not symmetric: rows index dX's feature
        self.dxxt_sum.add_((x_fp - x).T @ x)

    def take_dxxt(self) -> torch.Tensor:
        """GPTAQ's dXXT = 2 (X_fp - X_q)^T X_q / tokens ([in, in] fp32), normalised as the
        Hessian; the statistics keep no sum afterwards."""
        if self.dxxt_sum is None:
            raise ValueError("no FP inputs were paired with these statistics (GPTAQ only)")
        out = self.dxxt_sum.mul_(2.0).div_(max(self.tokens, 1)).float()
        self.dxxt_sum = None
        return out


class StatsCollector:
    """Forward pre-hooks on the first linear of each input group of one block."""

    def __init__(self, block, groups: tuple[InputGroup, ...], sample_rows: int = 4096,
                 seed: int = 0, fp_inputs: dict[InputGroup, list[torch.Tensor]] | None = None,
                 stop: bool = False, keep_inputs: bool = False):
        if stop and len(groups) != 1:
            raise ValueError("stop=True ends the forward at the hook: it needs one group")
        self.stats: dict[InputGroup, GroupStats] = {}
        # keep_inputs: per group, every call's input as the linear sees it ([..., in], on the
        # block's device), in call order (GPTAQ computes later passes from them)
        self.kept: dict[InputGroup, list[torch.Tensor]] | None = (
            {g: [] for g in groups} if keep_inputs else None)
        # end the forward (StopForward) once the group's inputs are summed: GPTAQ's pass for
        # one group needs nothing after that group's linears
        self._stop = stop
        # GPTAQ: per group, the FP model's inputs of the same forward calls, in call order
        # (GroupInputRecorder); each call's inputs are paired with the FP ones and consumed
        self._fp_inputs = fp_inputs
        self._handles = []
        # on the CPU whatever the device: the same rows are sampled on every device
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self._sample_rows = sample_rows
        for group in groups:
            lin = block.get_submodule(group.linears[0])
            in_f = lin.in_features
            self.stats[group] = GroupStats(in_f, device=lin.weight.device)
            self._handles.append(lin.register_forward_pre_hook(self._hook(group)))

    def _hook(self, group: InputGroup):
        def hook(_module, args):
            if self.kept is not None:  # a copy: the forward may reuse its buffers
                self.kept[group].append(args[0].detach().clone())  # [..., in]
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            st = self.stats[group]
            st.add_xtx(x)  # [in, in] fp64 (upper strips) += [in, tokens] @ [tokens, in] fp32
            st.abs_sum += x.abs().sum(0).double()
            st.tokens += x.shape[0]
            if self._fp_inputs is not None:
                x_fp = self._fp_inputs[group].pop(0)  # [tokens, in] fp32, same tokens
                assert x_fp.shape == x.shape, "FP and quantized forwards must see the same rows"
                st.add_dxxt(x_fp, x)
            want = self._sample_rows - st.sample_rows
            if want > 0:
                take = min(want, max(1, x.shape[0] // 8))
                idx = torch.randperm(x.shape[0], generator=self._gen, device="cpu")[:take]
                st.sample.append(x[to_device(idx, x.device)].clone())  # [take, in]
                st.sample_rows += take
            if self._stop:
                raise StopForward

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class GroupInputRecorder:
    """GPTAQ: every input of each group's first linear, per forward call, as [tokens, in]
    fp32 (the FP model's side of the pairs StatsCollector forms with ``fp_inputs``). Holds
    all calibration tokens of every group: a second copy of the block's activations."""

    def __init__(self, block, groups: tuple[InputGroup, ...]):
        self.inputs: dict[InputGroup, list[torch.Tensor]] = {g: [] for g in groups}
        self._handles = [block.get_submodule(g.linears[0]).register_forward_pre_hook(
            self._hook(g)) for g in groups]

    def _hook(self, group: InputGroup):
        def hook(_module, args):
            # [..., in] -> [tokens, in] fp32 (a copy: the forward may reuse its buffers)
            self.inputs[group].append(
                args[0].detach().reshape(-1, args[0].shape[-1]).float().clone())

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class InputRecorder:
    """Records the positional input of named submodules (AWQ's inspected modules)."""

    def __init__(self, block, names: list[str], max_samples: int):
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self._count: dict[str, int] = dict.fromkeys(names, 0)
        self._max = max_samples
        self._handles = [
            block.get_submodule(n).register_forward_pre_hook(self._hook(n), with_kwargs=True)
            for n in names
        ]

    def _hook(self, name: str):
        def hook(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            room = self._max - self._count[name]
            if room > 0:
                self.inputs[name].append(x[:room].detach().clone())
                self._count[name] += min(room, x.shape[0])

        return hook

    def get(self, name: str) -> torch.Tensor:
        return torch.cat(self.inputs[name])  # [n, L, d]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
