"""A tiny character LM built from hladsl.nn.Mixer layers that generates with the
cache, and checks that cached generation equals full recomputation.

    python examples/generate.py                 # trains ~200 steps on a CPU, then generates
    python examples/generate.py --layers hla2 linear ahla --steps 0

The layers take any specs (one per layer, here mixed). Generation: a batch of
prompts of different lengths, left padded with an attention mask, prefilled in one
call (chunk path, filling a hladsl.nn.Cache), then one token per call (op.step on the
cached state, the conv tail from the cache). The check runs the same greedy
generation in float64 and compares every step's logits with a full forward over
each unpadded sequence so far.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import hladsl.nn

TEXT = ("the quick brown fox jumps over the lazy dog. " * 3
        + "a linear attention layer keeps a state and updates it token by token. "
        + "higher order attention keeps more of the past in a richer state. ") * 4


class Block(nn.Module):
    def __init__(self, spec, hidden, heads, layer_idx):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mixer = hladsl.nn.Mixer(spec, hidden, heads, gate="data", conv_size=4,
                                     output_norm="gated", feature_map="l2", layer_idx=layer_idx)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, cache=None, attention_mask=None):
        x = x + self.mixer(self.norm1(x), cache=cache, attention_mask=attention_mask)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, specs, vocab, hidden=64, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(s, hidden, heads, i) for i, s in enumerate(specs))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, tokens, cache=None, attention_mask=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cache=cache, attention_mask=attention_mask)
        return self.head(self.norm(x))


def train(model, data, steps, T=64, batch=16):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        start = torch.randint(0, len(data) - T - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s:s + T + 1] for s in start.tolist()])
        loss = F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps:
            print(f"  step {step:4d}  loss {loss.item():.3f}", flush=True)


def left_pad(prompts):
    T = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return tokens, mask


@torch.no_grad()
def generate(model, prompts, n_new, check=False):
    """Greedy generation through the cache; with check, every step's logits are compared
    with a full forward over each unpadded sequence. Returns (sequences, max |diff|)."""
    tokens, mask = left_pad(prompts)
    cache = hladsl.nn.Cache()
    logits = model(tokens, cache=cache, attention_mask=mask)[:, -1]
    seqs = [p.clone() for p in prompts]
    worst = 0.0
    for _ in range(n_new):
        if check:
            for b, s in enumerate(seqs):
                full = model(s.unsqueeze(0))[0, -1]
                worst = max(worst, (full - logits[b]).abs().max().item())
        nxt = logits.argmax(-1)
        seqs = [torch.cat([s, n.view(1)]) for s, n in zip(seqs, nxt)]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = model(nxt.unsqueeze(1), cache=cache, attention_mask=mask)[:, -1]
    return seqs, worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs="+", default=["hla2", "linear"], help="one spec per layer")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)   # tiny shapes: intra-op threads only add overhead
    chars = sorted(set(TEXT))

    def encode(s):
        return torch.tensor([chars.index(c) for c in s])

    def decode(t):
        return "".join(chars[i] for i in t.tolist())

    model = TinyLM(args.layers, len(chars))
    print(f"TinyLM: layers {args.layers}, {sum(p.numel() for p in model.parameters())} parameters")
    start = time.time()
    train(model, encode(TEXT), args.steps)
    print(f"trained {args.steps} steps in {time.time() - start:.1f} s")

    prompts = [encode("the quick brown"), encode("a linear attention layer keeps a ")]
    seqs, _ = generate(model, prompts, args.new_tokens)
    for p, s in zip(prompts, seqs):
        print(f"  {decode(p)!r} -> {decode(s[len(p):])!r}")

    model = model.double()   # the check: exact arithmetic up to float64 rounding
    _, worst = generate(model, prompts, 12, check=True)
    ok = worst < 1e-9
    print(f"cached generation vs full recomputation (float64, 12 steps, left-padded batch): "
          f"max |logit diff| = {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
