"""Weak scaling of context_parallel_attention: the same tokens per rank on 1, 2, 4 ... ranks.

Run under torchrun, one process a GPU (NCCL), or on CPU with gloo for a smoke test:

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --tokens-per-rank 65536
    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --device cpu --tokens-per-rank 64 --head-dim 16

Every rank holds a zigzag shard of (B, S, H, D) with S = W x tokens-per-rank, an all-true mask and a
bias that need one row for all queries, (B, Hk, 1, S) (a mask with a row per query takes
S/W x S bytes per head and rank: 16 GB at 64k tokens on 4 ranks), causal, with the bias gradient.
Rank 0 prints the median forward and backward milliseconds (CUDA events, after warm-up) and each
rank's share of the causal work as TFLOP/s: the whole sequence's S(S+1)/2 visible pairs x 4·H·D
FLOPs forward (10·H·D backward: five GEMMs to the forward's two) over W ranks. Under weak scaling
the work per rank grows with W (S does), so tokens per ms must fall as 1/W; TFLOP/s per rank is
what can stay flat. With one rank the script first times a plain flash_dmattn_func call (the
"single" line), the baseline: scripts/context_parallel_check.sh prints each line's TFLOP/s per rank
against it.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from flash_dmattn import flash_dmattn_func
from flash_dmattn.distributed import context_parallel_attention


def timed(fn, device, runs):
    times = []
    for i in range(runs + 3):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
        else:
            begin = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - begin)
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-rank", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if args.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    local, seqlen = args.tokens_per_rank, args.tokens_per_rank * world
    B, H, Hk, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, local, H, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, local, Hk, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, local, Hk, D, device=device, dtype=dtype, requires_grad=True)
    mask = torch.ones(B, Hk, 1, seqlen, device=device, dtype=torch.bool)
    bias = torch.randn(B, Hk, 1, seqlen, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, local, H, D, device=device, dtype=dtype)

    def report(label, attention):
        def forward():
            with torch.no_grad():
                attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

        def forward_backward():
            out = attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
            torch.autograd.grad(out, (q, k, v, bias), dout)

        forward_ms = timed(forward, device, args.runs)
        backward_ms = timed(forward_backward, device, args.runs) - forward_ms
        if rank == 0:
            pairs = B * H * seqlen * (seqlen + 1) / 2 / world  # this rank's share of the causal (query, key) pairs
            forward_tflops, backward_tflops = 4 * D * pairs / forward_ms / 1e9, 10 * D * pairs / backward_ms / 1e9
            print(f"{label} {world} ({device.type}): B{B} H{H}/Hk{Hk} D{D} S {seqlen} ({local} per rank), causal, "
                  f"mask + bias: forward {forward_ms:.3f} ms, backward {backward_ms:.3f} ms; per rank "
                  f"{forward_tflops:.1f} TFLOP/s forward, {backward_tflops:.1f} TFLOP/s backward", flush=True)

    if world == 1:  # the baseline: one flash_dmattn_func call on the whole (unsharded) sequence
        report("single", flash_dmattn_func)
    report("world", context_parallel_attention)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
