"""The SkyPilot two-node run script, run here as the head node of a one-node cluster: torchrun starts the FSDP
trainer's ranks (2 gloo ranks for the node's 2 "GPUs"), `artnb serve --trainer fsdp` attaches to rank 0, and a
RemoteBackend in this process registers a model and trains a step over the server. This is the multi-node recipe
end to end except for the second machine (SkyPilot itself and a cloud are not needed: the script reads only
SkyPilot's environment variables).
"""

import os
import shlex
import subprocess
import sys

import psutil
import pytest
from test_skypilot_launch import wait_for_server
from tiny_loop import gather

import artnb as art
from artnb import models
from artnb.backends import skypilot as sp
from artnb.backends.ports import free_port
from artnb.backends.remote import RemoteBackend
from artnb.core.config import LoRAConfig

KEY = "multi-node-key-7Hq"


def venv_command(directory, name: str, target: str) -> None:
    """~/artnb-venv/bin/<name> on the 'cluster' (this machine's HOME stand-in), running this venv's `target`."""
    path = directory / "artnb-venv" / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
    path.chmod(0o755)


@pytest.fixture
def head_node(tmp_path):
    """The run script of `ServerTask(num_nodes=2)` on node 0, with SkyPilot's variables for a one-node cluster."""
    venv_command(tmp_path, "python", shlex.quote(sys.executable))
    venv_command(tmp_path, "artnb", f"{shlex.quote(sys.executable)} -m artnb.cli")
    port = free_port()
    spec = sp.ServerTask(
        install=sp.ArtnbInstall(".", workdir=str(sp.artnb_checkout())),
        gpu=False,
        api_key=KEY,
        port=port,
        num_nodes=2,
    )
    env = {
        **os.environ,
        **spec.envs,
        **spec.task_secrets(),
        "HOME": str(tmp_path),
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "2",
    }
    log = open(tmp_path / "node0.log", "wb")
    script = subprocess.Popen(
        ["bash", "-c", spec.run], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield f"http://127.0.0.1:{port}", script, tmp_path / "node0.log"
    finally:
        # The script `exec`s artnb serve on the head node: its process is the server, torchrun is its child.
        head = psutil.Process(script.pid)
        everything = [*head.children(recursive=True), head] if script.poll() is None else []
        for process in everything:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(everything, timeout=30)
        for process in alive:
            process.kill()
        script.wait(timeout=30)
        log.close()


async def test_the_two_node_script_trains_over_torchrun_ranks(head_node, tmp_path, capsys):
    url, script, log = head_node
    wait_for_server(url, script, lambda: log.read_text(errors="replace")[-4000:], timeout_s=120)
    backend = RemoteBackend(url, api_key=KEY, path=tmp_path / "mirror")
    model = art.TrainableModel(
        name="multi", project="nodes", base_model=models.tiny(), lora=LoRAConfig(r=4, alpha=8)
    )
    await model.register(backend)
    assert (
        (  # the notebook is told what the server's log says: torchrun's ranks, not ranks the server started
            f"artnb: {url} trains multi with its FsdpTrainer; placement: no GPU; the engine and the gloo ranks "
            "torchrun started (rank 0 at 127.0.0.1:"
        )
        in capsys.readouterr().out
    )
    result = await backend.train(model, await gather(model, seed=1), learning_rate=1e-2)
    assert result.step == 1 and await model.get_step() == 1
    text = log.read_text(errors="replace")
    assert "artnb fsdp rank 0/2 up" in text and "artnb fsdp rank 1/2 up" in text  # torchrun's ranks trained
    (agent,) = [
        p
        for p in psutil.Process(script.pid).children(recursive=True)
        if "torch.distributed.run" in " ".join(p.cmdline())
    ]
    ranks = agent.children()  # torchrun (the script) started the ranks, not the server
    assert len(ranks) == 2
    assert all("artnb.backends.trainers.fsdp_rank" in " ".join(p.cmdline()) for p in ranks)
