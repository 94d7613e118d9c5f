"""Multi-node training with torchrun's own rendezvous, simulated on loopback (docs/scale_out.md).

Two torchrun launchers stand for two nodes (``--nnodes=2 --node_rank=0/1``, one process per node)
and meet through the c10d rendezvous at ``127.0.0.1:PORT``, exactly as two machines would meet at
the first node's address; the two processes form one gloo group of world size 2 and run
``rlplug train trainer=fsdp2 debug=tiny rollout.colocate=false`` for 2 steps (the hf rollout on the main rank: the server
fleet of a real multi-node run is ``rollout.server_urls``, tested in tests/test_replicas.py).

With the c10d backend torchrun assigns the global ranks in rendezvous order (``--node_rank`` only
names the launcher), so either launcher may hold rank 0: the test finds the main one by its output.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from rlplug.rollout.serving import free_port
from rlplug.run.metrics import read_metrics_jsonl

PY = sys.executable


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def node_command(node_rank: int, port: int, args: list[str]) -> list[str]:
    """The launch command of one node (docs/scale_out.md, with HOST = 127.0.0.1 and 1 process per node)."""
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node_rank={node_rank}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=rlplug-multinode-test",
        "-m",
        "rlplug",
        "train",
        *args,
    ]


def test_two_nodes_on_loopback_train_two_steps_with_fsdp2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "trainer=fsdp2",
        "debug=tiny",
        f"trainer.default_local_dir={run_dir}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.num_threads=1",
        # rank-0 generation, as the docstring says: two nodes on one 2-core machine would each start an engine on
        # both cores; colocated engines under torchrun are tested in tests/test_fsdp2.py (slow)
        "rollout.colocate=false",
    ]
    port = free_port()
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            node_command(rank, port, args), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=480))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.monotonic() - t0
    print(f"2-node loopback run: {wall:.1f} s")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-6000:]
    # one main process (global rank 0, on either node) logs one console line per step; the other none
    steps = [[line.split("|")[0].strip() for line in out.splitlines() if line.startswith("step ")] for out, _ in outs]
    assert sorted(steps, key=len) == [[], ["step 1", "step 2"]], steps
    # the checkpoint of step 2 was written by both nodes together: DCP shards of a world of 2
    ckpt = run_dir / "global_step_2"
    assert (ckpt / "COMPLETE").is_file()
    assert json.loads((ckpt / "backend" / "backend_state.json").read_text())["world_size"] == 2
    assert len(list((ckpt / "backend" / "actor" / "dcp").glob("*.distcp"))) == 2  # one shard file per rank
    records = [r for r in read_metrics_jsonl(run_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
