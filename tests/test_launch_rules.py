"""Rules of the launch layer that need no kernel: the schedule and the chunk size."""
import pytest
import torch

from hladsl.runtime import launch


class _Cuda:
    type = "cuda"


@pytest.fixture
def gpu_of_132_sms(monkeypatch):
    monkeypatch.setattr(launch, "sms", lambda device: 132)
    return _Cuda()


def test_auto_fuses_only_many_pairs_over_several_chunks(gpu_of_132_sms):
    dev = gpu_of_132_sms
    many = 2 * 132
    assert launch.use_fused("auto", True, dev, many, n_chunks=4)
    assert not launch.use_fused("auto", True, dev, many - 1, n_chunks=4)   # chunk parallelism fills better
    # one chunk (T <= 64, where narrow chunks occur): nothing to fuse, and hla2's fused
    # kernel faulted at C = 16 on the H100
    assert not launch.use_fused("auto", True, dev, 1024, n_chunks=1)
    assert not launch.use_fused("auto", False, dev, many, n_chunks=4)     # no fused kernel (packed)
    assert not launch.use_fused("two_pass", True, dev, many, n_chunks=4)
    assert launch.use_fused("fused", True, dev, 1, n_chunks=1)            # asked for explicitly
    assert not launch.use_fused("auto", True, torch.device("cpu"), many, n_chunks=4)
    with pytest.raises(ValueError, match="schedule"):
        launch.use_fused("fast", True, dev, many, n_chunks=4)


def test_chunks_shrink_to_short_sequences_only_on_cpu():
    cpu, cuda = torch.device("cpu"), _Cuda()
    assert launch.chunk_for(1, 64, cpu) == 16
    assert launch.chunk_for(17, 64, cpu) == 32
    assert launch.chunk_for(1000, 64, cpu) == 64
    # CUDA: kernels at C = 16 faulted on the H100; a short sequence runs one chunk of 64
    assert launch.chunk_for(1, 64, cuda) == 64
    assert launch.chunk_for(16, 64, cuda) == 64
    assert launch.chunk_for(1000, 32, cuda) == 32    # an explicit chunk_size is kept
