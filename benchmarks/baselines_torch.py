"""Times the torch baselines of ../shared/reference/anchors.md on this GPU, for the same workloads
as flash_dmattn_bench_forward, so that both land in one run of scripts/gpu_check.sh.

SDPA flash and cuDNN run with no mask and no bias (dense ceilings); SDPA's memory-efficient
backend gets the mask folded into a float bias (what a user without this library would do),
which requires grad in the backward, as a learned bias would. The backward is timed alone
(autograd.grad on a retained graph), for the workloads that have one.
CUDA-event medians after warm-up. Prints a table and, with --json, writes it.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WORKLOADS = [
    # name, B, H, Hk, Sq, Sk, D, causal, mask kind, window
    ("train_dense_d128", 2, 16, 4, 8192, 8192, 128, True, "all_true", 0),
    ("train_window1024_d128", 2, 16, 4, 8192, 8192, 128, True, "window", 1024),
    ("train_dense_d64", 2, 16, 4, 8192, 8192, 64, True, "all_true", 0),
    ("seed_dense_d32_s16k", 1, 2, 1, 16384, 16384, 32, True, "all_true", 0),
    ("decode_sk131072_d128", 1, 32, 8, 1, 131072, 128, False, "all_true", 0),
]


def median_ms(fn, runs):
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def backward_ms(forward, inputs, runs):
    """Times the backward of forward(*inputs) alone, on a graph kept across runs."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = forward(*inputs)
    dout = torch.randn_like(out)
    return median_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), runs)


def float_bias(B, H, Hk, Sq, Sk, causal, kind, window, bias):
    """The mask folded into an additive float bias of shape (B, H, Sq, Sk), KV heads expanded."""
    i = torch.arange(Sq, device="cuda")[:, None]
    j = torch.arange(Sk, device="cuda")[None, :]
    diag = i + Sk - Sq
    visible = torch.ones(Sq, Sk, dtype=torch.bool, device="cuda")
    if causal or kind == "window":
        visible &= j <= diag
    if kind == "window":
        visible &= j > diag - window
    full = bias.repeat_interleave(H // Hk, dim=1).expand(B, H, Sq, Sk).clone()
    return full.masked_fill_(~visible, float("-inf"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, B, H, Hk, Sq, Sk, D, causal, kind, window in WORKLOADS:
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16)
        dense_flops = 4 * B * H * Sq * Sk * D * (0.5 if causal else 1.0)
        row = {"workload": name}
        has_backward = Sq > 1
        for label, backend in (("sdpa_flash_nomask", SDPBackend.FLASH_ATTENTION),
                               ("sdpa_cudnn_nomask", SDPBackend.CUDNN_ATTENTION)):
            attention = lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal and Sq > 1, enable_gqa=True)
            try:
                with sdpa_kernel(backend):
                    row[label] = median_ms(lambda: attention(q, k, v), args.runs)
                    if has_backward:
                        row[label + "_bwd"] = backward_ms(attention, (q, k, v), args.runs)
            except RuntimeError as error:  # a backend that does not take this shape
                row[label] = row[label + "_bwd"] = None
                print(f"{name}: {label} skipped: {str(error).splitlines()[0]}")
        bias = torch.rand(B, Hk, 1, Sk, device="cuda", dtype=torch.bfloat16) * 4 - 2
        try:
            mask_bias = float_bias(B, H, Hk, Sq, Sk, causal, kind, window, bias)
            ke, ve = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
            attention = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                row["sdpa_efficient_floatmask"] = median_ms(lambda: attention(q, ke, ve, mask_bias), args.runs)
                if has_backward:
                    row["sdpa_efficient_floatmask_bwd"] = backward_ms(attention, (q, ke, ve, mask_bias), args.runs)
            del mask_bias, ke, ve
        except (RuntimeError, torch.OutOfMemoryError) as error:
            row["sdpa_efficient_floatmask"] = row["sdpa_efficient_floatmask_bwd"] = None
            print(f"{name}: sdpa_efficient_floatmask skipped: {str(error).splitlines()[0]}")
        row["dense_flops"] = dense_flops
        rows.append(row)
        torch.cuda.empty_cache()

    # The memory ceiling: a device-to-device copy of 2 GiB, counting bytes read plus written.
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), args.runs)
    copy_tbps = 2 * src.numel() * src.element_size() / copy_ms / 1e9
    del src, dst

    device = torch.cuda.get_device_name()
    print(f"torch {torch.__version__} baselines, {device}, bf16, median of {args.runs} runs (CUDA events)")
    print(f"device-to-device copy: {copy_tbps:.2f} TB/s (read + write)")
    print(f"{'workload':24} {'flash ms':>10} {'cudnn ms':>10} {'eff+mask ms':>12} "
          f"{'flash bwd':>10} {'cudnn bwd':>10} {'eff+mask bwd':>12}")
    fmt = lambda x: f"{x:10.3f}" if x is not None else f"{'-':>10}"
    for r in rows:
        print(f"{r['workload']:24} {fmt(r['sdpa_flash_nomask'])} {fmt(r['sdpa_cudnn_nomask'])} "
              f"{fmt(r['sdpa_efficient_floatmask']):>12} {fmt(r.get('sdpa_flash_nomask_bwd'))} "
              f"{fmt(r.get('sdpa_cudnn_nomask_bwd'))} {fmt(r.get('sdpa_efficient_floatmask_bwd')):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "runs": args.runs, "copy_tbps": copy_tbps,
                       "baselines": rows}, f, indent=2)


if __name__ == "__main__":
    main()
