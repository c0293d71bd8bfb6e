import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/oracles.py

# Without a GPU, generated kernels can only run under the Triton interpreter, and
# triton decides that when it is first imported: set it before any test module loads.
import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The CPU tests use tiny shapes: intra-op threading only adds overhead (and
    spins badly on a busy 2-core runner). Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Tests set launch rule constants with monkeypatch on ops shared through hladsl.load's
    cache: a plan or bound call made under another test's rules must not serve them."""
    from hladsl.runtime import launch
    launch.forget_plans()


@pytest.fixture
def interpreter_binds(monkeypatch):
    """``direct.bind`` as on a GPU, but re-launching through the interpreter with the call's
    tensors in the bound slots (direct launches need a GPU): the kernels each bound launch
    ran, in order. For the bound decode and forward paths (``runtime.step``, ``runtime.binding``)."""
    from hladsl.runtime import direct
    launched = []

    def bind(kernel, grid, args, tensors):
        class Bound:
            def launch(self, values):
                launched.append(kernel)
                kernel[grid](**{**args, **dict(zip(tensors, values))})
        return Bound()
    monkeypatch.setattr(direct, "bind", bind)
    return launched


@pytest.fixture
def state_passes(monkeypatch):
    """A list that gains an entry per state pass run (``run_state_pass``, the forward's own
    or the backward's), for tests of what a fwd + bwd runs (CPU and GPU)."""
    from hladsl.runtime import triton_backward, triton_forward
    passes = []
    for module in (triton_forward, triton_backward):
        real = module.run_state_pass
        monkeypatch.setattr(module, "run_state_pass",
                            lambda *a, _real=real, **kw: passes.append(1) or _real(*a, **kw))
    return passes


@pytest.fixture
def force_bf16_starts(monkeypatch):
    """A callable that, called, makes ``launch.starts_dtype`` answer bf16 wherever the rule
    may (read only as SDOT operands: on CPU SDOT is fp32, so the rule itself never does) and
    returns the list of its ``read_only_as_sdot`` arguments, one per buffer asked for."""
    from hladsl.runtime import launch

    def force():
        asked = []

        def forced(read_only_as_sdot, sdot):
            asked.append(read_only_as_sdot)
            return torch.bfloat16 if read_only_as_sdot else torch.float32
        monkeypatch.setattr(launch, "starts_dtype", forced)
        return asked
    return force
