"""Round 48, call 2: where the attention form and the chunk form cross at d = 128 once the launch rule
counts the chunk form's one-hot column dots (``launch.chunk_form_macs``). Power gated, B = 2, H = 16,
bf16, one process: the forward by the rule, on the attention form (ATTENTION_FORM=always) and on the
chunk form (never), at the T the new rule moves; fwd + bwd at 64k on both forms."""
import sys

import torch
from triton.testing import do_bench

import hladsl
from hladsl.runtime import launch
from hladsl.ir.pipeline import chunk_program
from hladsl.ir.attention import attention_form, attention_macs, chunk_macs


def ratios(op, d, T):
    prog = chunk_program(op.compilation.algebra if hasattr(op.compilation, "algebra") else op.compilation,
                         launch.ATTENTION_CHUNK, (("d", d), ("dv", d)), True)
    form = attention_form(prog)
    a = attention_macs(form, prog, T)
    return a / chunk_macs(prog, T), a / launch.chunk_form_macs(prog, [T])


def main():
    dev, B, H, d = "cuda", 2, 16, 128
    cases = [({"p": 2}, 65536, True), ({"p": 2}, 98304, False), ({"p": 2, "normalize": True}, 65536, False)]
    if sys.argv[1:] == ["quick"]:
        cases = [({"p": 2}, 4096, True)]
    for params, T, train in cases:
        op = hladsl.load("power", **params)
        gen = torch.Generator(device=dev).manual_seed(7)
        q, k = ((torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
        v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
        g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
        try:
            old, new = ratios(op, d, T)
            line = f"power {params} d={d} T={T}: MAC ratio old {old:.2f} new {new:.2f}; fwd ms"
        except Exception as exc:   # (the ratio is a note; the times are the measurement)
            line = f"power {params} d={d} T={T}: (ratio: {type(exc).__name__} {exc}); fwd ms"
        with torch.no_grad():
            for form in ("auto", "always", "never"):
                with launch.switched(ATTENTION_FORM=form):
                    t = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=2, rep=20)
                line += f" {form} {t:.2f}"
                torch.cuda.empty_cache()
        print(line, flush=True)
        if train:
            line = f"power {params} d={d} T={T}: fwd + bwd ms"
            qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
            do = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
            for form in ("auto", "always", "never"):
                with launch.switched(ATTENTION_FORM=form):
                    def step():
                        o, _ = op(qs, ks, vs, g=g, scale=1.0)
                        torch.autograd.grad(o, (qs, ks, vs), do)
                    try:
                        t = do_bench(step, warmup=1, rep=20)
                        line += f" {form} {t:.2f}"
                    except torch.OutOfMemoryError as exc:   # (run 311: the chunk form's backward at 64k)
                        line += f" {form} out of memory ({str(exc).split('.')[0]})"
                torch.cuda.empty_cache()
            print(line, flush=True)


if __name__ == "__main__":
    main()
