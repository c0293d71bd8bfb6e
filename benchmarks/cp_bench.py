"""Context parallelism on GPUs (NCCL): one long sequence over 2 GPUs vs 1.

    torchrun --standalone --nproc_per_node=2 benchmarks/cp_bench.py
    python benchmarks/cp_bench.py                 # spawns the 2 processes itself
    options: --spec hla2 --T 131072 --H 16 --d 64 --iters 5 --strategies auto,relay --gated 0,1

Per variant (gated or not) and strategy: the forward + backward time of the whole
sequence on one GPU (rank 0 alone, the other waiting) and sharded over the group
(the slowest rank, median of --iters after a warm-up), their ratio (DESIGN section 8
asks <= 0.6 at 128k), the bytes each rank sent and received in one step (counted at
the torch.distributed calls, next to what ``cp_plan_text`` predicts), and the RMS
error ratio of the sharded output and gradients against the one-GPU op (bf16 both).
Writes benchmarks/results/cp_bench.json (a --device cpu dry run writes
cp_bench_cpu_dry_run.json beside it: not a measurement).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hladsl
from hladsl.runtime.context_parallel import choose_strategy, cp_call, cp_plan_text

RESULTS = Path(__file__).resolve().parent / "results" / "cp_bench.json"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spec", default="hla2")
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--strategies", default="auto,relay")
    p.add_argument("--gated", default="0,1")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun")
    p.add_argument("--device", default="cuda",
                   help="cuda (NCCL); cpu (gloo, float32: a dry run of this script, small --T)")
    return p.parse_args(argv)


# -- bytes moved: counted at the torch.distributed calls hladsl.runtime.context_parallel makes -------

class ByteCounter:
    """Wraps the point-to-point and collective calls; per rank: bytes sent, received."""
    NAMES = ("send", "recv", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
             "all_reduce", "reduce_scatter_tensor")

    def __init__(self):
        self.sent = self.received = 0
        self.calls: dict[str, int] = {}
        self._saved = {}

    def __enter__(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args, _name=name, _original=original, **kwargs):
                self._count(_name, args, kwargs, world, rank)
                return _original(*args, **kwargs)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _count(self, name, args, kwargs, world, rank):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in ("all_gather", "all_gather_into_tensor"):
            n = args[1].numel() * args[1].element_size()
            self.sent, self.received = self.sent + n, self.received + (world - 1) * n
            return
        x = args[0] if name != "reduce_scatter_tensor" else args[1]
        n = x.numel() * x.element_size()
        if name == "send":
            self.sent += n
        elif name == "recv":
            self.received += n
        elif name == "broadcast":   # the source sends, everyone else receives
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            self.sent, self.received = (self.sent + n, self.received) if src == rank else \
                (self.sent, self.received + n)
        elif name == "reduce":
            dst = kwargs.get("dst", args[1] if len(args) > 1 else 0)
            self.sent, self.received = (self.sent, self.received + n) if dst == rank else \
                (self.sent + n, self.received)
        else:   # all_reduce, reduce_scatter: ring volume ~ 2 (W-1)/W of the buffer each way
            share = 2 * (world - 1) * n // world
            self.sent, self.received = self.sent + share, self.received + share


# -- timing --------------------------------------------------------------------------

DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, iters, barrier):
    """Median ms of fn() over iters, after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def timed(fn, iters):
    """The slowest rank's median ms."""
    ms = torch.tensor([median_ms(fn, iters, True)], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def rms_ratio(ref, out):
    ref, out = ref.float(), out.float()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def inputs(args, gated):
    """The same global tensors on every rank (bf16 on the GPU, float32 on the CPU)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    B, T, H, d = args.B, args.T, args.H, args.d

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)
    q = randn(B, T, H, d).to(dtype)
    k = (randn(B, T, H, d) / math.sqrt(d)).to(dtype)
    v = randn(B, T, H, d).to(dtype)
    g = torch.nn.functional.logsigmoid(4 + randn(B, T, H)) if gated else None
    do = randn(B, T, H, d).to(dtype)
    return q, k, v, g, do


def leaves(q, k, v, g):
    out = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out.append(None if g is None else g.detach().clone().requires_grad_())
    return out


def run(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    op = hladsl.load(args.spec)
    rows = []
    for gated in [bool(int(x)) for x in args.gated.split(",")]:
        q, k, v, g, do = inputs(args, gated)
        shard = args.T // world
        lo, hi = rank * shard, (rank + 1) * shard

        # one GPU: rank 0 runs the whole sequence; the others wait at the barrier
        ref = {}
        if rank == 0:
            x = leaves(q, k, v, g)

            def single():
                for t in x:
                    if t is not None:
                        t.grad = None
                o, _ = op(*x[:3], x[3])
                o.backward(do)
                ref["o"] = o.detach()
            single_ms = median_ms(single, args.iters, False)
            ref.update({n: t.grad for n, t in zip("qkvg", x) if t is not None})
        dist.barrier()
        single_ms = broadcast_float(single_ms if rank == 0 else 0.0)

        for strategy in args.strategies.split(","):
            x = leaves(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], None if g is None else g[:, lo:hi])
            out = {}

            def sharded():
                for t in x:
                    if t is not None:
                        t.grad = None
                o, _ = cp_call(op, {"q": x[0], "k": x[1], "v": x[2]}, x[3], None, None, False,
                               None, None, strategy)
                o.backward(do[:, lo:hi])
                out["o"] = o.detach()
            ms = timed(sharded, args.iters)
            with ByteCounter() as counter:
                sharded()
                sync()
            errors = compare(ref, out, x, world)
            picked = strategy if strategy != "auto" else choose_strategy(
                op.algebra, {"d": args.d, "dv": args.d}, world, args.H * args.B)[0]
            row = dict(spec=args.spec, T=args.T, B=args.B, H=args.H, d=args.d, gated=gated,
                       world=world, strategy=strategy, ran=picked, single_ms=single_ms,
                       sharded_ms=ms, ratio=ms / single_ms, sent_bytes=counter.sent,
                       received_bytes=counter.received, calls=counter.calls, **errors)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        print(cp_plan_text(op.algebra, {"d": args.d, "dv": args.d}, world, heads=args.H,
                           batch=args.B))
        path = RESULTS if DEVICE == "cuda" else RESULTS.with_name("cp_bench_cpu_dry_run.json")
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(rows, indent=1))
        print(f"{'gated':>5} {'strategy':>8} {'1 GPU ms':>9} {f'{world} GPUs ms':>10} {'ratio':>6} "
              f"{'sent':>10} {'received':>10} {'rms o':>8} {'rms dq':>8}")
        for r in rows:
            print(f"{r['gated']!s:>5} {r['ran']:>8} {r['single_ms']:9.2f} {r['sharded_ms']:10.2f} "
                  f"{r['ratio']:6.2f} {r['sent_bytes']:10d} {r['received_bytes']:10d} "
                  f"{r['rms_o']:8.1e} {r['rms_dq']:8.1e}")
        print(f"wrote {path}")


def broadcast_float(value):
    t = torch.tensor([value], device=DEVICE, dtype=torch.float64)
    dist.broadcast(t, src=0)
    return t.item()


def compare(ref, out, x, world):
    """RMS error ratios of the sharded o and gradients vs the one-GPU run (on rank 0)."""
    names = ["o", "q", "k", "v"] + (["g"] if x[3] is not None else [])
    mine = [out["o"]] + [t.grad for t in x if t is not None]
    errors = {}
    for name, t in zip(names, mine):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        if dist.get_rank() == 0:
            errors["rms_" + ("o" if name == "o" else "d" + name)] = rms_ratio(
                ref[name], torch.cat(parts, 1))
    got = [errors]
    dist.broadcast_object_list(got, src=0)
    return got[0]


def worker(rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    main(argv)


def main(argv=None):
    global DEVICE
    args = parse(argv)
    DEVICE = args.device
    local = int(os.environ["LOCAL_RANK"])
    if DEVICE == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        import socket

        import torch.multiprocessing as mp
        nproc = parse().nproc
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(nproc, port, sys.argv[1:]), nprocs=nproc, join=True)
