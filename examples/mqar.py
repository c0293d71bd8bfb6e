"""Multi-query associative recall (MQAR), the synthetic recall task used to compare
linear-attention variants (Zoology; Based): a sequence lists key-value pairs, then
asks for the values of keys given again; the model must recall each value from its
recurrent state. A small 2-layer model (hladsl.nn.Mixer + MLP) is trained per spec
at a few head dims; accuracy is plotted against the op's state size in bytes.

    python examples/mqar.py --quick        # laptop CPU, a few minutes
    python examples/mqar.py                # GPU: larger task, --budget-s seconds of training (plus compiles)

Sequence: k1 v1 k2 v2 ... kN vN  q1 q2 ... qN   (q: the keys again, shuffled);
the target at each query position is its key's value (everything else is ignored).
Keys and values come from disjoint halves of the vocabulary.
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import hladsl.nn
from hladsl.plot import line_plot

SPECS = ["linear", "hla2", "ahla", "hla3_masked", "power"]


def mqar_batch(batch, n_pairs, n_keys, n_values, generator, device):
    """(tokens [B, 3N], targets [B, 3N] with -100 where there is nothing to predict)."""
    keys = torch.stack([torch.randperm(n_keys, generator=generator)[:n_pairs] for _ in range(batch)])
    values = torch.randint(0, n_values, (batch, n_pairs), generator=generator)
    keys, values = keys + 1, values + 1 + n_keys          # token 0 is unused padding
    order = torch.stack([torch.randperm(n_pairs, generator=generator) for _ in range(batch)])
    queries = keys.gather(1, order)
    answers = values.gather(1, order)
    context = torch.stack([keys, values], dim=2).reshape(batch, 2 * n_pairs)
    tokens = torch.cat([context, queries], dim=1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * n_pairs:] = answers
    return tokens.to(device), targets.to(device)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * x.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt() * self.weight


class Block(nn.Module):
    def __init__(self, spec, hidden, heads, head_dim, layer_idx, **mixer_kw):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.mixer = hladsl.nn.Mixer(spec, hidden, heads, head_dim=head_dim, layer_idx=layer_idx,
                                     **mixer_kw)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, cache=None):
        x = x + self.mixer(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, spec, vocab, hidden, heads, head_dim, layers=2, **mixer_kw):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(spec, hidden, heads, head_dim, i, **mixer_kw)
                                    for i in range(layers))
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_one(spec, head_dim, cfg, device, seconds):
    """Train for ``cfg["steps"]`` steps or ``seconds`` of training, whichever ends first;
    the clock starts after the first step (kernel compilation is not training time)."""
    torch.manual_seed(0)
    vocab = 1 + cfg["n_keys"] + cfg["n_values"]
    model = Model(spec, vocab, cfg["hidden"], cfg["heads"], head_dim, conv_size=4,
                  feature_map=cfg["feature_map"], normalize=cfg["normalize"] or None,
                  gate=None).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1)
    start, deadline = time.time(), None
    gen = torch.Generator().manual_seed(1)
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else _Null()
    step = 0
    for step in range(1, cfg["steps"] + 1):
        # warm-up then cosine decay over whichever runs out first, the steps or the time
        if step == 2:   # the first step compiled the kernels
            start = time.time()
            deadline = start + seconds
        progress = step / cfg["steps"]
        if deadline is not None:
            progress = max(progress, (time.time() - start) / max(deadline - start, 1e-9))
        for group in opt.param_groups:
            warm = min(1.0, progress / 0.1)
            group["lr"] = cfg["lr"] * warm * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        tokens, targets = mqar_batch(cfg["batch"], cfg["n_pairs"], cfg["n_keys"], cfg["n_values"],
                                     gen, device)
        with autocast:
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % cfg["log_every"] == 0:
            print(f"    step {step:5d}  loss {loss.item():.3f}", flush=True)
        if progress >= 1.0:
            if step < cfg["steps"]:
                print(f"    time budget reached at step {step}", flush=True)
            break
    return model, step, evaluate(model, cfg, device, autocast)


@torch.no_grad()
def evaluate(model, cfg, device, autocast):
    gen = torch.Generator().manual_seed(12345)   # the same held-out batches for every spec
    right = total = 0
    for _ in range(cfg["eval_batches"]):
        tokens, targets = mqar_batch(cfg["batch"], cfg["n_pairs"], cfg["n_keys"], cfg["n_values"],
                                     gen, device)
        with autocast:
            pred = model(tokens).argmax(-1)
        keep = targets != -100
        right += (pred[keep] == targets[keep]).sum().item()
        total += keep.sum().item()
    return right / total


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small task for a laptop CPU")
    parser.add_argument("--specs", nargs="+", default=SPECS)
    parser.add_argument("--head-dims", nargs="+", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="total training time; each run gets what is left / runs left "
                             "(its first step, which compiles the kernels, and evaluation excluded)")
    parser.add_argument("--feature-map", default=None,
                        help="q/k feature map (default l2, which keeps higher-order products "
                             "bounded; elu+1 with --normalize)")
    parser.add_argument("--normalize", action="store_true", help="the specs' normalised forms")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="mqar", help="prefix of the .json and .png written")
    args = parser.parse_args(argv)
    if args.quick:
        cfg = dict(n_pairs=8, n_keys=32, n_values=32, hidden=64, heads=2, batch=32, steps=400,
                   lr=1e-2, eval_batches=8, log_every=100, head_dims=[8, 16],
                   budget_s=600)   # a safety cap: about 3 minutes on an idle laptop CPU
    else:
        cfg = dict(n_pairs=32, n_keys=128, n_values=128, hidden=128, heads=2, batch=64,
                   steps=2000, lr=2e-3, eval_batches=16, log_every=250, head_dims=[16, 32, 64],
                   budget_s=420)   # 7 minutes of training on an H100, plus compilation
    cfg["normalize"] = args.normalize
    cfg["feature_map"] = args.feature_map or ("elu+1" if args.normalize else "l2")
    for key in ("head_dims", "steps", "budget_s"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if not args.quick and args.device == "cpu":
        print("note: the full mode is sized for a GPU; try --quick on a CPU", flush=True)
    if args.device == "cpu":   # tiny shapes: intra-op threads only add overhead
        torch.set_num_threads(1)
    runs = [(spec, hd) for spec in args.specs for hd in cfg["head_dims"]]
    trained = 0.0   # training seconds spent so far (compilation excluded)
    print(f"MQAR: {cfg['n_pairs']} pairs, T = {3 * cfg['n_pairs']}, {len(runs)} runs, "
          f"{cfg['budget_s']:.0f} s of training in all (compilation excluded), device {args.device}",
          flush=True)
    results, failed = [], []
    for n, (spec, head_dim) in enumerate(runs, 1):
        print(f"[{n}/{len(runs)}] {spec} head_dim={head_dim}", flush=True)
        start = time.time()
        share = max(0.0, cfg["budget_s"] - trained) / (len(runs) - n + 1)
        try:   # evaluation follows training: keep ~10% of the share for it
            model, steps, acc = train_one(spec, head_dim, cfg, args.device, 0.9 * share)
            trained += min(time.time() - start, share)
        except Exception as exc:   # report and go on: one failure must not hide the rest
            print(f"    failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            failed.append(dict(spec=spec, head_dim=head_dim, error=f"{type(exc).__name__}: {exc}"))
            continue
        state = model.blocks[0].mixer.state_bytes()   # one layer, all heads, fp32
        results.append(dict(spec=spec, head_dim=head_dim, state_bytes=state, accuracy=acc,
                            steps=steps, seconds=round(time.time() - start, 1)))
        print(f"    accuracy {acc:.3f}  state {state} bytes/layer  {steps} steps  "
              f"{results[-1]['seconds']} s", flush=True)
    print(f"\n{'spec':12s} {'head_dim':>8s} {'state bytes':>12s} {'accuracy':>9s}")
    for r in results:
        print(f"{r['spec']:12s} {r['head_dim']:>8d} {r['state_bytes']:>12d} {r['accuracy']:>9.3f}")
    for r in failed:
        print(f"{r['spec']:12s} {r['head_dim']:>8d} failed: {r['error'][:200]}")
    with open(f"{args.out}.json", "w") as f:
        json.dump(dict(config=cfg, device=args.device, results=results, failed=failed), f,
                  indent=1)
    series = {}
    for r in results:
        series.setdefault(r["spec"], []).append((r["state_bytes"], r["accuracy"]))
    how = line_plot(f"{args.out}.png", [dict(title=f"MQAR {cfg['n_pairs']} pairs",
                                             xlabel="state bytes per layer", ylabel="accuracy",
                                             logx=True, series=series)],
                    "hladsl.nn.Mixer on MQAR")
    print(f"wrote {args.out}.json and {args.out}.png ({how})")
    return results


if __name__ == "__main__":
    main()
