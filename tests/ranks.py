"""Launch a test file as several ranks of one torch.distributed job, as torchrun would set them up
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT on a free local port), and check that
every rank exits 0 and prints ``OK <scenario>``. Shared by the tests that run real process groups
(tests/test_trial40ep.py on CPU, tests/test_gpu_ep.py on one GPU); not a test module itself."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_ranks(script, scenario: str, nproc: int = 2, timeout: float = 120.0, gpu: bool = False) -> str:
    """Run ``python script scenario`` in ``nproc`` processes (rank r: RANK=r; LOCAL_RANK=r, or 0
    on every rank with ``gpu``: all share GPU 0; without ``gpu`` CUDA is hidden). Fails the test
    unless each exits 0 and prints ``OK scenario``; kills them all after ``timeout`` seconds (a
    hang fails the test). Returns the ranks' output."""
    pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [subprocess.Popen([sys.executable, str(script), scenario], cwd=ROOT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK="0" if gpu else str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(nproc)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: ranks still running after {timeout} s (a hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    assert text.count(f"OK {scenario}") == nproc, text[-6000:]
    return text
