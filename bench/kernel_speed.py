"""INT4 / INT8 quantized matmul vs dense FP16/BF16 matmul, side by side in one run.

GPU: Triton kernels (autotuned) at M in {1, 4, 16, 64, 256} for 4096x4096, 8192x8192 and
4096x11008 (N x K), fp16 activations. CPU: quantpipe's int4 / int8 kernels (``w4a16_avx512`` /
``w8a32_avx512``, where they are usable) and torch's int4pack / int8pack on the same layers (the
peers, bf16 activations) vs dense fp32 and bf16, smaller shapes, INT8 both in groups of 128
(calibrate's default) and per channel (torch's int8pack takes only that); --quick shrinks
further. For
each case prints the time, the speed-up over the dense baseline, and the achieved fraction of
measured memory bandwidth (bytes of weights + activations + output / time, over a measured
device copy bandwidth).
Not a test; writes bench/results/kernels-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantpipe.core.qformat import QuantSpec, pack_int32, resolve_group_size  # noqa: E402
from quantpipe.runtime.kernels.layout import PackedLinear  # noqa: E402
from quantpipe.runtime.quant_linear import QuantLinear  # noqa: E402

GPU_SHAPES = [(4096, 4096), (8192, 8192), (11008, 4096), (4096, 11008)]  # (N=out, K=in)
CPU_SHAPES = [(1536, 576), (576, 1536), (4096, 4096)]
CPU_QUICK = [(1536, 576), (2048, 2048)]


def timeit(fn, device: torch.device, min_s: float = 0.2) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3
    fn()
    times = []
    t_end = time.perf_counter() + min_s
    while time.perf_counter() < t_end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Measured bytes/s of a large device-to-device copy (read + write)."""
    n = (256 if device.type == "cuda" else 64) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    s = timeit(lambda: b.copy_(a), device)
    return 2 * n / s


def packed(n: int, k: int, spec: QuantSpec) -> PackedLinear:
    spec = spec.with_group_size(resolve_group_size(spec.group_size, k))  # 576 -> g64
    g = spec.n_groups(k)
    q = torch.randint(0, 2**spec.bits, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, g) * 0.01 + 0.001).half()
    return PackedLinear(spec, pack_int32(q, spec.bits), scales, None, None, None, k)


def _ratios(rows: list[dict], pairs, n: int, k: int, m: int) -> list[dict]:
    """One row per (a, b, name, text) of ``pairs``: b's time over a's at this shape, printed."""
    out = []
    for a, b, name, text in pairs:
        ta, tb = (next(r["s"] for r in reversed(rows) if r["kernel"] == x) for x in (a, b))
        out.append({"N": n, "K": k, "M": m, "kernel": name, "ratio": tb / ta})
        print(f"{'':>12s} {m:>4d} " + text.format(tb / ta), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        shapes, ms = GPU_SHAPES, [1, 4, 16, 64, 256]
        dense_dtypes, act = [torch.float16, torch.bfloat16], torch.float16
    else:
        shapes = CPU_QUICK if args.quick else CPU_SHAPES
        ms = [1, 4] if args.quick else [1, 4, 16, 64]
        dense_dtypes, act = [torch.float32, torch.bfloat16], torch.float32
    if args.quick and dev.type == "cuda":
        shapes, ms = shapes[:2], [1, 16, 256]
    bw = copy_bandwidth(dev)
    print(f"device {dev}, measured copy bandwidth {bw / 1e9:.1f} GB/s, threads "
          f"{torch.get_num_threads()}")
    # int4 g128 and int8 g128 (calibrate's defaults; or the largest group size dividing K),
    # int8 per channel (--int8-group-size -1, the only INT8 torch's int8pack takes)
    specs = {"int4": QuantSpec(4, 128, True), "int8": QuantSpec(8, 128, True),
             "int8pc": QuantSpec(8, -1, True)}
    peers = (("int4", "int4pack"), ("int8pc", "int8pack"))
    rows = []
    print(f"{'N x K':>12s} {'M':>4s} {'kernel':>10s} {'backend':>9s} {'us':>9s} "
          f"{'vs ' + str(dense_dtypes[0])[6:]:>10s} {'vs ' + str(dense_dtypes[1])[6:]:>10s} "
          f"{'BW frac':>8s}")
    for n, k in shapes:
        dense = {dt: torch.randn(n, k, device=dev).to(dt) for dt in dense_dtypes}
        layers = {name: QuantLinear(packed(n, k, s), dev) for name, s in specs.items()}
        if dev.type == "cpu":  # torch's kernels on the same layers: the peer, side by side
            for bits, peer in peers:
                if layers[bits].backend != peer:
                    layers[f"{bits}_torch"] = QuantLinear(packed(n, k, specs[bits]), dev,
                                                          backend=peer)
        for m in ms:
            x = torch.randn(m, k, device=dev)
            base = {dt: timeit(lambda w=w, xd=x.to(dt): xd @ w.T, dev) for dt, w in dense.items()}
            for dt, t in base.items():
                nbytes = (n * k + m * k + m * n) * dense[dt].element_size()
                rows.append({"N": n, "K": k, "M": m, "kernel": f"dense_{str(dt)[6:]}",
                             "s": t, "bw_frac": nbytes / t / bw})
            for name, layer in layers.items():
                xa = x.to(act)
                t = timeit(lambda layer=layer, xa=xa: layer(xa), dev)
                bits = layer.spec.bits
                w_bytes = n * k * bits / 8 + n * layer.spec.n_groups(k) * 2
                nbytes = w_bytes + (m * k + m * n) * xa.element_size()
                r = {"N": n, "K": k, "M": m, "kernel": name, "spec": layer.spec.label(),
                     "backend": layer.backend, "s": t,
                     "bw_frac": nbytes / t / bw,
                     **{f"speedup_vs_{str(dt)[6:]}": base[dt] / t for dt in dense_dtypes}}
                rows.append(r)
                print(f"{n:>5d}x{k:<6d} {m:>4d} {layer.spec.label():>10s} {layer.backend:>9s} "
                      f"{t * 1e6:9.1f} "
                      f"{base[dense_dtypes[0]] / t:9.2f}x {base[dense_dtypes[1]] / t:9.2f}x "
                      f"{r['bw_frac']:8.2f}", flush=True)
            print(f"{'':>12s} {m:>4d} dense: " + ", ".join(
                f"{str(dt)[6:]} {t * 1e6:.1f} us" for dt, t in base.items()), flush=True)
            # ratios of times side by side: (faster?, slower?, row name, what is printed)
            pairs = [(bits, f"{bits}_torch", f"{bits}_ours_vs_{peer}",
                      f"{bits}: ours {{:.2f}}x torch {peer}") for bits, peer in peers
                     if f"{bits}_torch" in layers]
            if "int8pc" in layers:  # what the grouped default costs against per channel
                pairs.append(("int8", "int8pc", "int8_grouped_vs_pc",
                              "int8 grouped: {:.2f}x the speed of per channel"))
            rows += _ratios(rows, pairs, n, k, m)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-{dev.type}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps({"device": str(dev), "copy_bandwidth_Bps": bw,
                                "threads": torch.get_num_threads(), "torch": torch.__version__,
                                "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
