"""EP on NCCL: runs tests/gpu/ep_nccl_worker.py under torchrun (EP2 on two GPUs; its
ordinary-MXFP4 and host-sync checks also on one rank, one GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("ep_nccl_worker.py")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two GPUs (nvidia-h200-x2)",
)
def test_ep2_over_nccl():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(WORKER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_rank_over_nccl():
    """On a one-rank NCCL group: the EP op on the fused kernels with an MXFP4 base and its
    masters, kept packed and decoded once, bitwise the straight-through path; and a step's
    host syncs, one, in the dispatch plan."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--standalone",
    ]
    result = subprocess.run(
        [*command, str(WORKER), "--one-rank"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "EP1 NCCL checks: 0 failure(s)" in result.stdout
