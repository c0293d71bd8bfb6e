"""hladsl.nn: the Mixer layer and its Cache.

* every shipped spec trains one step and every parameter gets a finite, nonzero gradient;
* prefill + decode through the cache equals the full forward (float64, 1e-10), with and
  without the convolution and the gates, one token and several tokens per decode call;
* left padding (attention_mask) gives the real tokens the unpadded outputs, and decoding
  after a padded prefill continues them; varlen (cu_seqlens) equals separate runs;
* the convolution equals torch's grouped conv1d (an independent implementation);
* bad arguments raise ValueError naming them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hladsl.frontend.specs import shipped_names
from hladsl.nn import FEATURE_MAPS, GATE_LOGIT_NORMALIZER, NORM_EPS, Cache, Mixer

try:
    from oracles import oracle
except ImportError:  # tests/ collected as a package
    from tests.oracles import oracle

F64 = torch.float64
SPECS = shipped_names()
HIDDEN, HEADS = 16, 2
# (gate, conv_size, output_norm, feature_map)
VARIANTS = [
    (None, None, True, "identity"),
    ("scalar", 4, False, "l2"),
    ("data", 4, "gated", "elu+1"),
]


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def mixer(spec, gate=None, conv_size=None, output_norm=True, feature_map=None, seed=0, **kw):
    torch.manual_seed(seed)
    m = Mixer(spec, HIDDEN, HEADS, gate=gate, conv_size=conv_size, output_norm=output_norm,
              feature_map=feature_map, layer_idx=3, **kw).double()
    if gate == "data":   # fla's init leaves the gate near 0; make decay visible in the test
        with torch.no_grad():
            m.g_proj.bias.fill_(-3.0)
    return m


@pytest.mark.parametrize("spec", SPECS)
def test_forward_equals_an_independent_reference(spec):
    """The layer assembled by hand: torch's grouped conv1d, the brute-force float64
    oracle of the spec per (sequence, head), an explicit gated RMSNorm."""
    m = mixer(spec, "data", 4, "gated", normalize=True)
    B, T, H, d = 2, 9, HEADS, HIDDEN // HEADS
    x = torch.randn(B, T, HIDDEN, dtype=F64)
    with torch.no_grad():
        got = m(x)
        proj = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], -1).transpose(1, 2)
        conv = F.conv1d(F.pad(proj, (3, 0)), m.conv_weight.unsqueeze(1), groups=proj.shape[1])
        q, k, v = F.silu(conv.transpose(1, 2)).split(H * d, -1)
        q, k, v = (F.elu(q) + 1).view(B, T, H, d), (F.elu(k) + 1).view(B, T, H, d), v.view(B, T, H, d)
        g = F.logsigmoid(m.g_proj(x)) / GATE_LOGIT_NORMALIZER
        o = torch.stack([torch.stack([oracle(spec, q[b, :, h] * d ** -0.5, k[b, :, h], v[b, :, h],
                                             g[b, :, h], normalize=True) for h in range(H)], 1)
                         for b in range(B)])
        o = o / (o.pow(2).mean(-1, keepdim=True) + NORM_EPS).sqrt() * m.norm_weight
        o = o * F.silu(m.out_gate_proj(x)).view(B, T, H, d)
        want = m.o_proj(o.reshape(B, T, H * d))
    assert rel_err(got, want) < 1e-10


@pytest.mark.parametrize("spec", SPECS)
def test_trains_one_step_and_gradients_flow(spec):
    torch.manual_seed(0)
    m = Mixer(spec, HIDDEN, HEADS, gate="data", conv_size=4, output_norm="gated",
              feature_map="l2")
    x = torch.randn(2, 24, HIDDEN)
    target = torch.randn(2, 24, HIDDEN)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = F.mse_loss(m(x), target)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    opt.step()
    with torch.no_grad():
        assert F.mse_loss(m(x), target) < loss


@pytest.mark.parametrize("variant", VARIANTS, ids=["plain", "conv-scalar-l2", "conv-data-gated"])
@pytest.mark.parametrize("spec", SPECS)
def test_prefill_then_decode_equals_full_forward(spec, variant):
    gate, conv, norm, fmap = variant
    m = mixer(spec, gate, conv, norm, fmap)
    x = torch.randn(2, 19, HIDDEN, dtype=F64)
    with torch.no_grad():
        full = m(x)
        cache = Cache()
        parts = [m(x[:, :12], cache=cache)]
        for t in range(12, 16):                     # one token per call
            parts.append(m(x[:, t:t + 1], cache=cache))
        parts.append(m(x[:, 16:19], cache=cache))   # several tokens in one decode call
    assert rel_err(torch.cat(parts, 1), full) < 1e-10
    assert cache.get_seq_length() == 19
    assert 3 in cache and set(cache[3].state) == set(m.op.state_names)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_from_an_empty_cache(spec):
    """Short first call with an empty cache: prefill by the chunk path, then step."""
    m = mixer(spec, "scalar", 3)
    x = torch.randn(1, 5, HIDDEN, dtype=F64)
    with torch.no_grad():
        full = m(x)
        cache = Cache()
        got = torch.cat([m(x[:, t:t + 1], cache=cache) for t in range(5)], 1)
    assert rel_err(got, full) < 1e-10



def test_left_padding_at_eps_zero_trains_finite():
    """eps = 0, normalised, left padding: a padded token's quotient is 0 / 0, so the layer sets
    its output to 0 -- y and every gradient finite, the real tokens' as unpadded."""
    m = mixer("linear", gate="data", normalize=True, eps=0.0)
    x = torch.randn(2, 9, HIDDEN, dtype=F64, requires_grad=True)
    mask = torch.ones(2, 9)
    mask[1, :4] = 0
    y = m(x, attention_mask=mask)
    (y * mask[..., None]).sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    with torch.no_grad():
        assert rel_err(y[1, 4:], m(x[1:, 4:].detach())[0]) < 1e-10

@pytest.mark.parametrize("variant", [dict(gate="data", conv_size=4, output_norm="gated",
                                          normalize=True),            # elu+1 by default
                                     dict(gate="scalar", conv_size=2, feature_map="l2")],
                         ids=["normalised-data-gate", "scalar-gate-l2"])
@pytest.mark.parametrize("spec", SPECS)
def test_left_padding_equals_unpadded(spec, variant):
    m = mixer(spec, **variant)
    lengths, T = (11, 7), 11
    seqs = [torch.randn(1, n, HIDDEN, dtype=F64) for n in lengths]
    x = torch.randn(2, T, HIDDEN, dtype=F64) * 5          # padding holds garbage
    mask = torch.zeros(2, T)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        x[b, T - n:] = s[0]
        mask[b, T - n:] = 1
    nxt = torch.randn(2, 2, HIDDEN, dtype=F64)
    with torch.no_grad():
        cache = Cache()
        padded = m(x, cache=cache, attention_mask=mask)
        mask = torch.cat([mask, torch.ones(2, 1)], 1)      # HF style: the mask covers the past
        step1 = m(nxt[:, :1], cache=cache, attention_mask=mask)
        step2 = m(nxt[:, 1:], cache=cache)
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            alone = m(torch.cat([s, nxt[b:b + 1]], 1))
            assert rel_err(padded[b, T - n:], alone[0, :n]) < 1e-10
            assert rel_err(step1[b], alone[0, n:n + 1]) < 1e-10
            assert rel_err(step2[b], alone[0, n + 1:]) < 1e-10
    assert cache[3].offsets.tolist() == [lengths[0] + 2, lengths[1] + 2]


@pytest.mark.parametrize("spec", ["linear", "hla2", "power"])
def test_varlen_equals_separate_sequences_and_decodes_as_a_batch(spec):
    m = mixer(spec, "data", 4)
    lengths = (6, 2, 9)
    seqs = [torch.randn(1, n, HIDDEN, dtype=F64) for n in lengths]
    cu = torch.tensor([0, 6, 8, 17])
    nxt = torch.randn(3, 1, HIDDEN, dtype=F64)
    with torch.no_grad():
        cache = Cache()
        packed = m(torch.cat(seqs, 1), cache=cache, cu_seqlens=cu)
        step = m(nxt, cache=cache)
        for n, s in enumerate(seqs):
            alone = m(torch.cat([s, nxt[n:n + 1]], 1))
            assert rel_err(packed[0, cu[n]:cu[n + 1]], alone[0, :-1]) < 1e-10
            assert rel_err(step[n], alone[0, -1:]) < 1e-10


def test_cache_reorder_selects_sequences():
    """Beam search: reorder([1, 1, 0]) continues sequence 1 twice and sequence 0 once."""
    m = mixer("hla2", "data", 4)
    x = torch.randn(2, 7, HIDDEN, dtype=F64)
    nxt = torch.randn(3, 1, HIDDEN, dtype=F64)
    index = torch.tensor([1, 1, 0])
    with torch.no_grad():
        cache = Cache()
        m(x, cache=cache)
        cache.reorder(index)
        got = m(nxt, cache=cache)
        want = m(torch.cat([x[index], nxt], 1))[:, -1:]
    assert rel_err(got, want) < 1e-10
    assert cache[3].offsets.tolist() == [8, 8, 8]


CUSTOM_SPEC = """
mechanism renamed {
  dims d, dv
  input a[d], b[d], c[dv]
  param normalize = false, eps = 1e-6
  state S[i, e] = b[i] c[e]
  state z[i] = b[i]
  output o[e] = a[i] S[i, e]
  normalizer = a[i] z[i]
}
"""


def test_a_new_spec_file_needs_no_python(tmp_path):
    """A spec with other input names: projections follow its declarations, the
    feature map its query/key side, and it equals the shipped linear layer."""
    path = tmp_path / "renamed.hla"
    path.write_text(CUSTOM_SPEC)
    torch.manual_seed(0)
    custom = Mixer(str(path), HIDDEN, HEADS, gate="data", conv_size=4, normalize=True,
                   layer_idx=0).double()
    assert custom.token_inputs == ("a", "b", "c") and custom.mapped_inputs == ("a", "b")
    torch.manual_seed(0)
    linear = Mixer("linear", HIDDEN, HEADS, gate="data", conv_size=4, normalize=True).double()
    x = torch.randn(2, 11, HIDDEN, dtype=F64)
    with torch.no_grad():
        full = custom(x)
        assert rel_err(full, linear(x)) < 1e-12
        cache = Cache()
        got = torch.cat([custom(x[:, :6], cache=cache)]
                        + [custom(x[:, t:t + 1], cache=cache) for t in range(6, 11)], 1)
    assert rel_err(got, full) < 1e-10


def test_convolution_equals_grouped_conv1d():
    m = mixer("linear", None, 4)
    proj = torch.randn(2, 9, m.conv_weight.shape[0], dtype=F64)
    ours = m._conv(proj, None, None)
    channels = proj.shape[-1]
    ref = F.conv1d(F.pad(proj.transpose(1, 2), (3, 0)), m.conv_weight.unsqueeze(1),
                   groups=channels).transpose(1, 2)
    assert rel_err(ours, ref) < 1e-12


def test_feature_maps_and_state_bytes():
    x = torch.randn(3, 8, dtype=F64)
    assert (FEATURE_MAPS["elu+1"](x) > 0).all()
    assert torch.allclose(FEATURE_MAPS["l2"](x).norm(dim=-1), torch.ones(3, dtype=F64))
    assert torch.allclose(FEATURE_MAPS["softmax"](x).sum(-1), torch.ones(3, dtype=F64))
    assert Mixer("linear", 16, 2).state_bytes() == 2 * 64 * 4     # S [8, 8] per head, fp32
    normalised = Mixer("linear", 16, 2, normalize=True)             # and z [8]
    assert normalised.state_bytes() == 2 * (64 + 8) * 4


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="gate"):
        Mixer("linear", 16, 2, gate="sometimes")
    with pytest.raises(ValueError, match="feature_map"):
        Mixer("linear", 16, 2, feature_map="tanh")
    with pytest.raises(ValueError, match="head_dim"):
        Mixer("linear", 15, 2)
    m = Mixer("linear", 16, 2)
    with pytest.raises(ValueError, match="x must be"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(2, 5, 16), cache=Cache())
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.randn(2, 5, 16), attention_mask=torch.ones(2, 3))


def _example(name):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_example_cached_equals_full_recomputation(capsys):
    assert _example("generate").main(["--steps", "2", "--new-tokens", "3"]) == 0
    assert "OK" in capsys.readouterr().out


def test_mqar_example_runs_and_writes_its_plot(tmp_path):
    results = _example("mqar").main(["--quick", "--specs", "linear", "power", "--head-dims", "4",
                                     "--steps", "3", "--device", "cpu",
                                     "--out", str(tmp_path / "m")])
    assert [r["spec"] for r in results] == ["linear", "power"]
    assert all(0 <= r["accuracy"] <= 1 and r["state_bytes"] > 0 for r in results)
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "m.json").exists()


def test_feature_map_in_fp32_under_autocast_feeds_the_op_one_dtype(monkeypatch):
    """CUDA autocast runs norms in fp32, so an l2 feature map returns fp32 while v stays
    bf16 (examples/mqar.py on the H100): the layer casts the mapped inputs back."""
    import hladsl.nn as hnn
    l2 = hnn.FEATURE_MAPS["l2"]
    monkeypatch.setitem(hnn.FEATURE_MAPS, "l2", lambda x: l2(x).float())
    layer = hnn.Mixer("linear", 32, 2, feature_map="l2").to(torch.bfloat16)
    y = layer(torch.randn(1, 8, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
