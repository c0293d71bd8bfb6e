"""Tuning the form of a stateless call on CUDA (``Op._tuned_form``): the attention and the chunk
form timed by the tuner's real clock (``triton.testing.do_bench``), at shapes where one wins by
2.5x or more, forward and fwd + bwd, in every run so far (benchmarks/RESULTS.md rounds 45, 46):
power p = 2 at d = 64, T = 4096 on the attention form, linear at d = 64, T = 16384 on the chunk
form (not d = 128's power: its chunk-form backward compiles for minutes). Launch configs
and schedules keep the rules' (tuning every kernel would compile for minutes), so only the form
is timed. The tuned call's o and gradients against the
fp32 torch path."""
from __future__ import annotations

import json

import pytest
import torch

from hladsl.runtime import autotune, launch

from gpu_support import BY_ID, Inputs, Ratios, check_against_reference, gates, generator, group, load, tokens

GRAD_BAR = 1e-2


class FormOnlyTuner(autotune.Tuner):
    """Times the form with the real clock; a schedule is the runner's own "auto" rule's (and the
    test turns the kernels' launch tuning off: ``launch._tuned``)."""

    def lookup(self, key, fast=None):
        return {"schedule": "auto"} if key.get("runner") not in (None, "form") else super().lookup(key, fast)


@pytest.mark.parametrize("spec_id,B,T,H,winner", [
    pytest.param("power2", 1, 4096, 16, "attention", marks=group("form_tuning", "power2")),
    pytest.param("linear", 2, 16384, 16, "chunk", marks=group("form_tuning", "linear"))])
def test_tuning_times_the_forms_and_runs_the_winner(spec_id, B, T, H, winner, tmp_path, record_property, monkeypatch):
    """(Tuning times calls as a tuned op runs them, unbound, host time included: at B = 1, H = 4
    linear's chunk form lost to the attention form at 16k, run 300 -- right for a tuned op, which
    never binds; the test runs where the GPU's time dominates.)"""
    spec = BY_ID[spec_id]
    monkeypatch.setattr(launch, "_tuned", lambda *a, **k: False)   # (the launch rules' configs)
    d = 64
    gen = generator(5100 + T)
    op, ref = load(spec, "auto"), load(spec, "torch")
    x = tokens(spec, B, T, H, d, d, torch.bfloat16, False, gen)
    g = gates(B, T, H, gen)
    tuner = FormOnlyTuner(tmp_path / "autotune.json")
    shape = autotune.shape_class(next(iter(x.values())), {"d": d, "dv": d}, True, B)
    ratios = Ratios(record_property)
    with autotune.tuning(tuner, shape), launch.switched(ATTENTION_FORM="auto"):
        check_against_reference(op, ref, Inputs(x, g), ratios, GRAD_BAR, gen, output_final_state=False)
        # what routes the calls from now on (a later call may replay its bound launches: no spy sees it)
        routed = {training: op._attention(list(x.values()), g, None, None, training=training)
                  for training in (False, True)}
    entries = {json.loads(k)["training"]: v for k, v in json.loads((tmp_path / "autotune.json").read_text())[
        "entries"].items() if json.loads(k).get("runner") == "form"}
    print(spec_id, d, entries, ratios.rows)
    assert entries == {False: {"form": winner}, True: {"form": winner}}, entries
    assert routed == {False: winner == "attention", True: winner == "attention"}
    ratios.check()
