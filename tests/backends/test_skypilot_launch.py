"""SkyPilotBackend's launch: the task it hands SkyPilot, the calls it chooses, and the key's path.

Two layers. Without SkyPilot (CI installs no cloud tooling): the task's fields, the decision function, the
setup script's syntax, the key file, the health wait against a local HTTP server, and the generated run
command executed here as `artnb serve`. With SkyPilot >= 0.10.5 importable: the same spec built into a real
`sky.Task`, round-tripped through SkyPilot's task-YAML schema, and validated by SkyPilot where that needs no
cloud catalog. Launching, `sky.status`/`queue`/`endpoints` on a real cluster and the optimizer need a cloud
account (and SkyPilot's catalog download), so they are not exercised here.
"""

from __future__ import annotations

import copy
import http.server
import os
import shlex
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import httpx
import pytest

import artnb as art
from artnb.backends import skypilot as sp
from artnb.backends.ports import free_port
from artnb.backends.server import API_KEY_ENV

KEY = "test-key-Zq8pL2"
HF_TOKEN = "hf_secret_value_9x"


def _spec(**kw) -> sp.ServerTask:
    fields = dict(
        install=sp.ArtnbInstall(".", workdir=str(sp.artnb_checkout())),
        gpu=True,
        api_key=KEY,
        secrets={"HF_TOKEN": HF_TOKEN},
    )
    return sp.ServerTask(**{**fields, **kw})


def _sky():
    """SkyPilot, or skip: its tests run where `pip install 'artnb[skypilot]'` was done."""
    pytest.importorskip("sky")
    try:
        return sp.import_sky()
    except ImportError as e:
        pytest.skip(str(e))


# without SkyPilot -----------------------------------------------------------------------------------------
async def test_missing_skypilot_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sky", None)  # `import sky` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'artnb\[skypilot\]'"):
        sp.import_sky()
    with pytest.raises(ImportError, match=r"pip install 'artnb\[skypilot\]'"):
        await sp.SkyPilotBackend.initialize_cluster("art", gpu="H100")
    with pytest.raises(ImportError, match=r"pip install 'artnb\[skypilot\]'"):  # ART's examples call it so
        await sp.SkyPilotBackend().initialize_cluster(cluster_name="art", gpu="H100-SXM", force_restart=True)


@pytest.mark.parametrize(
    "cluster, job, have_key, force, action, cancel",
    [
        (None, None, False, False, "launch", None),  # nothing yet
        (None, None, True, True, "launch", None),
        ("STOPPED", (4, "RUNNING"), True, False, "launch", None),  # sky.launch restarts a stopped cluster
        ("INIT", None, False, False, "launch", None),  # half-provisioned: launch retries
        ("UP", (4, "RUNNING"), True, False, "connect", None),  # the one reuse
        ("UP", (4, "SETTING_UP"), True, False, "connect", None),
        ("UP", (4, "RUNNING"), True, True, "launch", 4),  # force_restart: cancel, then launch in place
        ("UP", (4, "SUCCEEDED"), True, True, "launch", None),
        ("UP", (4, "RUNNING"), False, False, "exec", 4),  # someone else's key: restart the server
        ("UP", (4, "FAILED"), True, False, "exec", None),  # the server died: start it again
        ("UP", (4, "CANCELLED"), False, False, "exec", None),
        ("UP", None, False, False, "exec", None),  # a cluster without the server
        ("UP", (4, "FAILED_SETUP"), True, False, "launch", None),  # setup must run again
    ],
)
def test_plan_cluster_chooses_skypilot_calls(cluster, job, have_key, force, action, cancel):
    plan = sp.plan_cluster(cluster, job, have_key, force)
    assert (plan.action, plan.cancel_job) == (action, cancel), plan.reason


def test_key_is_a_secret_never_in_commands_or_repr():
    spec = _spec()
    assert spec.task_secrets() == {"HF_TOKEN": HF_TOKEN, API_KEY_ENV: KEY}
    for text in (spec.run, spec.setup, repr(spec), str(spec.envs)):
        assert KEY not in text and HF_TOKEN not in text
    assert "--api-key" not in spec.run  # the key reaches `artnb serve` through $ARTNB_API_KEY only
    backend = sp.SkyPilotBackend("http://203.0.113.7:7999", KEY, path="./.art-remote/test")
    backend.cluster_name = "art"
    assert KEY not in repr(backend) and "cluster_name='art'" in repr(backend)


def test_non_loopback_server_is_started_with_a_key():
    argv = shlex.split(_spec().run)
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "7999"
    with pytest.raises(ValueError, match="without an API key"):
        _spec(api_key="")
    assert sp.ServerTask(sp.ArtnbInstall("artnb"), gpu=False, api_key="", host="127.0.0.1")  # loopback: fine


def test_install_sources():
    checkout = sp.artnb_checkout()
    assert checkout is not None and (checkout / "artnb" / "backends" / "skypilot.py").is_file()
    assert sp.resolve_install(None, checkout) == sp.ArtnbInstall(".", workdir=str(checkout))
    assert sp.resolve_install(None, None) == sp.ArtnbInstall("artnb", f"=={version('artnb')}")
    assert sp.resolve_install("0.2.0").requirement("vllm") == "artnb[vllm]==0.2.0"
    assert sp.resolve_install("0.2.0").requirement("") == "artnb==0.2.0"
    url = "https://github.com/you/artnb@main"
    assert sp.resolve_install(url).requirement("vllm") == f"artnb[vllm] @ git+{url}"
    assert sp.resolve_install(str(checkout / "artnb")).workdir == str(checkout / "artnb")
    with pytest.raises(ValueError, match="not a version"):
        sp.resolve_install("latest-please")


def test_setup_script_is_bash_and_installs_the_right_thing():
    for spec, wanted in [
        (_spec(), "--reinstall-package artnb '.[vllm]'"),  # this checkout, synced as the workdir
        (_spec(install=sp.resolve_install("0.2.0")), " 'artnb[vllm]==0.2.0'"),
        (_spec(install=sp.resolve_install("0.2.0"), gpu=False), " artnb==0.2.0"),  # CPU: HF engine
    ]:
        assert spec.setup.splitlines()[-1].endswith(wanted)
        subprocess.run(["bash", "-n", "-c", spec.setup], check=True)
    subprocess.run(["bash", "-n", "-c", _spec().run], check=True)


def test_trainer_config_reaches_artnb_serve_checked_before_launch():
    fields = sp._trainer_fields(art.TrainerConfig(gradient_checkpointing=True), None, 1)
    assert fields == {"gradient_checkpointing": True}  # only what differs from the defaults
    argv = shlex.split(_spec(trainer_config=fields).run)
    assert argv[argv.index("--trainer-config") + 1] == '{"gradient_checkpointing": true}'
    assert sp._trainer_fields({"placement": "split"}, "fsdp", 1) == {"placement": "split"}
    assert sp._trainer_fields(art.TrainerConfig(), None, 1) is None  # all defaults: no flag
    with pytest.raises(ValueError, match="gradient_checkpointin"):
        sp._trainer_fields({"gradient_checkpointin": True}, None, 1)
    with pytest.raises(ValueError, match=r"trainer='auto' is not the FSDP trainer"):
        sp._trainer_fields({"placement": "split"}, None, 1)
    with pytest.raises(ValueError, match=r"num_nodes=2, .* torchrun gives the FSDP ranks every GPU"):
        sp._trainer_fields({"placement": "split"}, None, 2)  # several nodes: the server's trainer is fsdp


def test_the_machine_price_reaches_artnb_serve_checked_before_launch():
    argv = shlex.split(_spec(gpu_cost_per_hour_usd=12).run)
    assert argv[argv.index("--gpu-cost-per-hour-usd") + 1] == "12.0"
    assert "--gpu-cost-per-hour-usd" not in _spec().run
    with pytest.raises(ValueError, match=r"gpu_cost_per_hour_usd=-1: pass the machine's price"):
        _spec(gpu_cost_per_hour_usd=-1)


def test_engine_options_reach_artnb_serve():
    run = _spec(engine_options={"extra_args": ["--tensor-parallel-size", "2"]}).run
    argv = shlex.split(run)
    assert argv[argv.index("--engine-options") + 1] == '{"extra_args": ["--tensor-parallel-size", "2"]}'


def test_env_file(tmp_path):
    env = tmp_path / ".env"
    env.write_text("HF_TOKEN=abc\nWANDB_API_KEY='x y'\n")
    assert sp.read_env_file(env) == {"HF_TOKEN": "abc", "WANDB_API_KEY": "x y"}
    assert sp.read_env_file(None) == {}
    env.write_text(f"{API_KEY_ENV}=mine\n")
    with pytest.raises(ValueError, match="makes the server's key"):
        sp.read_env_file(env)
    env.write_text("HF_TOKEN\n")
    with pytest.raises(ValueError, match="HF_TOKEN has no value"):
        sp.read_env_file(env)
    with pytest.raises(FileNotFoundError):
        sp.read_env_file(tmp_path / "missing.env")


def test_key_file_is_private_and_read_back(tmp_path):
    assert sp.read_key("art", tmp_path) is None
    key = sp.new_key("art", tmp_path)
    assert len(key) >= 40 and sp.read_key("art", tmp_path) == key
    assert sp.key_file("art", tmp_path).stat().st_mode & 0o777 == 0o600


async def test_wait_for_health(tmp_path):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            keyed = self.headers.get("Authorization") == f"Bearer {KEY}"
            self.send_response(200 if self.path == "/health" or keyed else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def running():
        return None

    async def failed():
        return "job 3 is FAILED_SETUP; see `sky logs art 3`"

    up = f"http://127.0.0.1:{server.server_port}"
    try:
        await sp.wait_for_health(up, KEY, running, 5, poll_s=0.05)
        with pytest.raises(PermissionError, match="force_restart=True"):  # a server started with another key
            await sp.wait_for_health(up, "not-its-key", running, 5, poll_s=0.05)
    finally:
        server.shutdown()
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="FAILED_SETUP"):
        await sp.wait_for_health(closed, KEY, failed, 5, poll_s=0.05)
    with pytest.raises(TimeoutError):
        await sp.wait_for_health(closed, KEY, running, 0.2, poll_s=0.05)


def test_run_command_starts_artnb_serve_with_the_secret_key(tmp_path):
    """The cluster's run command, run here: ~/artnb-venv is this venv, the secrets come as SkyPilot sets them."""
    artnb_cmd = tmp_path / "artnb-venv" / "bin" / "artnb"
    artnb_cmd.parent.mkdir(parents=True)
    artnb_cmd.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m artnb.cli "$@"\n')
    artnb_cmd.chmod(0o755)
    port = free_port()
    spec = _spec(port=port, gpu=False)
    env = {**os.environ, "HOME": str(tmp_path), **spec.envs}
    env.pop(API_KEY_ENV, None)
    refused = subprocess.run(["bash", "-c", spec.run], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "without an API key" in refused.stderr  # no secret: no server

    proc = subprocess.Popen(
        ["bash", "-c", spec.run],
        env={**env, **spec.task_secrets()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_server(base, proc, lambda: proc.stdout.read(), timeout_s=90)
        assert httpx.get(f"{base}/info", timeout=5).status_code == 401
        info = httpx.get(f"{base}/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        assert info.json()["path"] == str(tmp_path / "artnb-runs")  # `~` expanded in the cluster's HOME
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert KEY not in proc.stdout.read()


def wait_for_server(url: str, proc: subprocess.Popen, output, timeout_s: float) -> None:
    """Until `artnb serve` at `url` answers /health; fails with `output()` if `proc` ends first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "artnb serve did not answer /health"
        time.sleep(0.2)


# with SkyPilot ------------------------------------------------------------------------------------------
def test_skypilot_task_from_our_spec():
    sky = _sky()
    resources = sp.server_resources(sky, "H100", None, 7999)
    spec = _spec(engine_options={"max_loras": 2})
    task = spec.to_sky(sky, resources)
    assert (task.name, task.setup, task.run, task.envs) == ("artnb-serve", spec.setup, spec.run, spec.envs)
    assert task.workdir == str(sp.artnb_checkout())
    secret_values = {k: getattr(v, "get_secret_value", lambda v=v: v)() for k, v in task.secrets.items()}
    assert secret_values == spec.task_secrets()  # SkyPilot 0.14 wraps them in SecretStr, 0.10 keeps str
    (res,) = task.resources
    assert (res.accelerators, res.ports) == ({"H100": 1}, ["7999"])
    assert KEY not in repr(task) and HF_TOKEN not in repr(task)
    # SkyPilot's own validation: its task-YAML schema (from_yaml_config), name and run checks, the workdir.
    config = task.to_yaml_config()
    again = sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict it is given
    assert {k: v for k, v in again.to_yaml_config().items() if k != "_user_specified_yaml"} == config
    task.validate_name()
    task.validate_run()
    task.expand_and_validate_workdir()


def test_skypilot_resources_override():
    sky = _sky()
    spot = sp.server_resources(sky, "H100:2", sky.Resources(infra="aws", use_spot=True, ports=[8080]), 7999)
    assert (spot.accelerators, spot.use_spot, set(spot.ports), str(spot.cloud)) == (
        {"H100": 2},
        True,
        {"8080", "7999"},
        "AWS",
    )
    own = sp.server_resources(sky, "H100", sky.Resources(accelerators="A100-80GB:8"), 7999)
    assert own.accelerators == {"A100-80GB": 8}  # resources that name a GPU win over `gpu`
    cpu = sp.server_resources(sky, None, sky.Resources(infra="aws"), 7999)
    task = _spec(gpu=bool(cpu.accelerators)).to_sky(sky, cpu)
    task.validate()  # the whole check SkyPilot does before launching; a named cloud without GPUs needs no catalog


async def test_unknown_launch_option_fails_before_any_skypilot_call():
    _sky()
    with pytest.raises(TypeError, match=r"unknown \['retry_until_upp'\]"):
        await sp.SkyPilotBackend.initialize_cluster("art", retry_until_upp=True)


async def test_a_bad_price_fails_before_any_skypilot_call():
    """Before a running server could be cancelled (force_restart) or its key replaced; SkyPilot not needed."""
    with pytest.raises(ValueError, match=r"gpu_cost_per_hour_usd=nan: pass the machine's price"):
        await sp.SkyPilotBackend.initialize_cluster(
            "art", force_restart=True, gpu_cost_per_hour_usd=float("nan")
        )


def test_multi_node_run_script_starts_torchrun_everywhere_and_the_server_on_the_head():
    spec = _spec(num_nodes=2)
    subprocess.run(["bash", "-n", "-c", spec.run], check=True)
    lines = spec.run.splitlines()
    (torchrun,) = [line for line in lines if "torch.distributed.run" in line]
    for flag in (
        '--nnodes="$SKYPILOT_NUM_NODES"',
        '--node-rank="$SKYPILOT_NODE_RANK"',
        '--master-addr="$HEAD_IP"',
    ):
        assert flag in torchrun
    assert torchrun.endswith("-m artnb.backends.trainers.fsdp_rank &")
    (serve,) = [line for line in lines if "artnb serve" in line or "bin/artnb" in line]
    assert serve.startswith('if [ "$SKYPILOT_NODE_RANK" = 0 ]') and "--trainer fsdp" in serve
    assert KEY not in spec.run  # the ranks' key is derived on the node from the secret
    assert "--trainer" not in _spec().run  # one node: the server's default trainer, as before
    assert "--trainer fsdp" in _spec(trainer="fsdp").run


def test_multi_node_run_script_runs_torchrun_with_skypilots_environment(tmp_path):
    """The script on a worker node (rank 1 of 2), with a stand-in venv whose python echoes its arguments."""
    python = tmp_path / "artnb-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "python $*" "control=$ARTNB_FSDP_CONTROL" "key=$ARTNB_FSDP_AUTHKEY"\n')
    python.chmod(0o755)
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        API_KEY_ENV: KEY,
    }
    out = subprocess.run(
        ["bash", "-c", _spec(num_nodes=2).run], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert (
        "--nnodes=2 --nproc-per-node=8 --node-rank=1 --master-addr=10.0.0.5 --master-port=29500" in out.stdout
    )
    assert "control=127.0.0.1:29501" in out.stdout
    assert len(out.stdout.split("key=")[1].strip()) == 64 and KEY not in out.stdout


def test_skypilot_multi_node_task():
    sky = _sky()
    resources = sp.server_resources(sky, None, sky.Resources(accelerators="H100:8"), 7999)
    spec = _spec(num_nodes=2)
    task = spec.to_sky(sky, resources)
    assert task.num_nodes == 2 and task.run == spec.run
    (res,) = task.resources
    assert res.accelerators == {"H100": 8}
    config = task.to_yaml_config()
    assert config["num_nodes"] == 2
    again = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert again.num_nodes == 2 and again.run == spec.run
    task.validate_name()
    task.validate_run()
    task.expand_and_validate_workdir()
