"""The two-GPU EP harness (tests/gpu/ep_nccl_worker.py) self-tested on the CPU: its
``--cpu`` mode runs the same checks on gloo with the CPU twins of the EP layer, so a
broken harness is found here and not on a lent two-GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "gpu" / "ep_nccl_worker.py"


def test_the_ep_harness_passes_its_gloo_self_test():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*launch, "--standalone", str(WORKER), "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout[-6000:] + result.stderr[-6000:]
    assert result.returncode == 0, output
    assert "0 failure(s)" in result.stdout, output
