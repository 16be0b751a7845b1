"""Weak scaling of context_parallel_attention: the same tokens per rank on 1, 2, 4 ... ranks.

Run under torchrun, one process a GPU (NCCL), or on CPU with gloo for a smoke test:

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --tokens-per-rank 65536
    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --device cpu --tokens-per-rank 64 --head-dim 16

Every rank holds a zigzag shard of (B, S, H, D) with S = W x tokens-per-rank, an all-true mask and a
bias that need one row for all queries, (B, Hk, 1, S) (a mask with a row per query takes
S/W x S bytes per head and rank: 16 GB at 64k tokens on 4 ranks), causal, with the bias gradient.
Rank 0 prints the median forward and backward milliseconds (CUDA events, after warm-up) and the
per-token throughput; compare the line of each world size with the one-rank line.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

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

    def forward():
        with torch.no_grad():
            context_parallel_attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

    def forward_backward():
        out = context_parallel_attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
        torch.autograd.grad(out, (q, k, v, bias), dout)

    forward_ms = timed(forward, device, args.runs)
    total_ms = timed(forward_backward, device, args.runs)
    if rank == 0:
        backward_ms = total_ms - forward_ms
        print(f"world {world} ({device.type}): B{B} H{H}/Hk{Hk} D{D} S {seqlen} ({local} per rank), causal, mask + "
              f"bias: forward {forward_ms:.3f} ms, backward {backward_ms:.3f} ms; per rank "
              f"{local / forward_ms:.1f} tokens/ms forward, {local / backward_ms:.1f} tokens/ms backward")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
