"""SkyPilotBackend: `artnb serve` on a cloud GPU, launched with SkyPilot, used through RemoteBackend.

artnb writes no cloud code: SkyPilot provisions, syncs, runs, exposes ports and tears down; this module only
says what to run (a `sky.Task`) and which of SkyPilot's calls to make. Design choices:
- The cluster runs one job, `artnb serve --host 0.0.0.0 --port 7999`, and only that port is opened: each model's
  OpenAI endpoint is proxied by the server at `/models/{project}/{name}/v1`, so vLLM's own port stays private.
- The server's API key is made here (`secrets.token_urlsafe`) and given to the cluster as a SkyPilot *secret*
  env var (`ARTNB_API_KEY`), which SkyPilot redacts in its logs and YAML dumps; it is never on a command line.
  It is kept in `~/.artnb/skypilot/{cluster}.key` (mode 0600), so a later `initialize_cluster` (a restarted
  kernel) reconnects to the running server. Variables from `env_path` are secrets too (they hold API keys).
- How artnb gets onto the cluster (`art_version`): by default this checkout is the SkyPilot `workdir` (synced,
  honouring .gitignore, then `pip install .[vllm]`), since the version being developed is the one to run and
  artnb may not be on PyPI. A version string installs `artnb[vllm]==VERSION` from PyPI, a `git+https://...`
  URL installs from git, a local folder is synced as the workdir. A machine without a GPU gets no vLLM extra
  (the HF engine serves). The setup makes a uv venv with Python 3.11 in `~/artnb-venv`.
- Which SkyPilot calls to make is one pure function, `plan_cluster`: an UP cluster whose server job is alive
  and whose key we hold is reused as it is; no cluster, a stopped one or a failed setup means `sky.launch`; a
  server that stopped (or whose key we lack) is started again with `sky.exec`; `force_restart=True` cancels
  the server and `sky.launch`es on the same machine (workdir synced, setup run again, a new key). Nothing here
  tears a cluster down except `down()`.
- All SkyPilot calls run in a worker thread (SkyPilot's SDK blocks); launch, exec and down stream SkyPilot's
  own log output into the cell, and waiting for `/health` watches the job so a failed setup stops the wait.
  Interrupting the cell stops the waiting, not SkyPilot's request (`sky api status`, `sky status` show it).

- Multi-node (`num_nodes=2`): SkyPilot runs the same `run` on every node. Each node starts torchrun with its
  rendezvous from SkyPilot's environment (the head is the first of SKYPILOT_NODE_IPS, the node's rank is
  SKYPILOT_NODE_RANK, one rank per GPU), running the FSDP trainer's ranks (trainers/fsdp_rank.py); the head node
  also runs `artnb serve --trainer fsdp`, whose trainer attaches to rank 0 on the head node (ARTNB_FSDP_CONTROL,
  with a key derived from the server's secret key). vLLM serves from the head node's GPUs. A rank that dies fails
  its step; torchrun restarts the group (`--max-restarts`), and the server's trainer reconnects to the new rank 0
  at the next step and loads the last checkpoint.

Not handled: spot preemption (a preempted cluster is gone with its run directory; SkyPilot's managed jobs would
relaunch it elsewhere, but under a new address and without the checkpoints), and TLS (the server is reached
over plain HTTP at the cluster's public address; the API key guards it, the traffic is not encrypted).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from ..core.atomic import write_atomic
from ..core.config import TrainerConfig
from .machine_bill import checked_price
from .placement import FSDP_AUTHKEY_ENV, FSDP_CONTROL_ENV
from .remote import RemoteBackend
from .server import API_KEY_ENV, DEFAULT_PORT, check_bind
from .trainers.choice import check_placement

if TYPE_CHECKING:
    import sky  # pyright: ignore[reportMissingImports]  # optional: artnb[skypilot]

SERVER_JOB = "artnb-serve"  # the SkyPilot job name of the server, found again with `sky.queue`
KEYS_DIR = Path("~/.artnb/skypilot")
INSTALL_HINT = "pip install 'artnb[skypilot]'  (then `sky check` to enable a cloud)"
# SkyPilot job states in which the server job is still alive (sky.JobStatus values).
ACTIVE_JOB_STATES = frozenset({"INIT", "PENDING", "SETTING_UP", "RUNNING"})
TORCHRUN_PORT = 29500  # the rendezvous port on the head node (nodes reach each other on SkyPilot's network)
TORCHRUN_MAX_RESTARTS = 3  # a rank that dies fails its step; torchrun restarts the group for the next
FSDP_CONTROL_PORT = 29501  # where rank 0 waits for the server's FsdpTrainer (loopback on the head node)


# what runs on the cluster (pure data) ------------------------------------------------------------------
@dataclass(frozen=True)
class ArtnbInstall:
    """Where the cluster's pip gets artnb: `target[extras]specifier`, with `workdir` synced first if set."""

    target: str  # "." (the synced workdir) or "artnb"
    specifier: str = ""  # "", "==0.1.0" or " @ git+https://..."
    workdir: str | None = None  # local folder SkyPilot syncs to ~/sky_workdir

    def requirement(self, extras: str) -> str:
        return f"{self.target}[{extras}]{self.specifier}" if extras else f"{self.target}{self.specifier}"


def artnb_checkout() -> Path | None:
    """The source checkout this artnb is imported from (the folder holding its pyproject.toml), if any."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "artnb"' in pyproject.read_text():
        return root
    return None


def resolve_install(art_version: str | None, checkout: Path | None = None) -> ArtnbInstall:
    """Turn `art_version` into an install: None (this checkout, else the installed version from PyPI), a
    version ("0.1.0", from PyPI), a git URL ("git+https://github.com/you/artnb@main") or a local folder."""
    from importlib.metadata import version

    from packaging.version import InvalidVersion, Version

    if art_version is None:
        if checkout is not None:
            return ArtnbInstall(".", workdir=str(checkout))
        return ArtnbInstall("artnb", f"=={version('artnb')}")
    if Path(art_version).expanduser().is_dir():
        return ArtnbInstall(".", workdir=str(Path(art_version).expanduser().resolve()))
    if art_version.startswith(("git+", "https://", "http://")):
        url = art_version if art_version.startswith("git+") else f"git+{art_version}"
        return ArtnbInstall("artnb", f" @ {url}")
    try:
        return ArtnbInstall("artnb", f"=={Version(art_version)}")
    except InvalidVersion:
        raise ValueError(
            f"art_version={art_version!r} is not a version (e.g. '0.1.0'), a git URL "
            "('git+https://github.com/you/artnb@main') or an existing local folder"
        ) from None


@dataclass(frozen=True)
class ServerTask:
    """The SkyPilot task that installs artnb and runs `artnb serve` (SkyPilot's task YAML fields, no SkyPilot).

    Example:
        spec = ServerTask(ArtnbInstall(".", workdir="."), gpu=True, api_key="...")
        print(spec.run)   # the command SkyPilot runs; the key reaches it as the secret ARTNB_API_KEY
    """

    install: ArtnbInstall
    gpu: bool  # the cluster has an accelerator: install the vLLM extra
    api_key: str = field(repr=False)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)  # from env_path; SkyPilot redacts these
    engine_options: dict[str, Any] | None = None  # LocalBackend's engine_options on the cluster
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    runs_dir: str = "~/artnb-runs"  # `artnb serve --path` on the cluster's disk (gone after down())
    num_nodes: int = 1  # > 1: torchrun on every node runs the FSDP trainer's ranks; the head node serves
    trainer: str | None = (
        None  # `artnb serve --trainer`; None: "fsdp" on several nodes, else the server's default
    )
    trainer_config: dict[str, Any] | None = None  # `artnb serve --trainer-config`: TrainerConfig fields
    gpu_cost_per_hour_usd: float | None = None  # `artnb serve --gpu-cost-per-hour-usd` (machine_bill.py)

    def __post_init__(self) -> None:
        check_bind(self.host, self.api_key)  # the server's own rule: beyond loopback only with a key
        if self.gpu_cost_per_hour_usd is not None:
            checked_price(self.gpu_cost_per_hour_usd)  # the server's own check, before anything is launched

    @property
    def setup(self) -> str:
        requirement = shlex.quote(self.install.requirement("vllm" if self.gpu else ""))
        reinstall = " --reinstall-package artnb" if self.install.workdir else ""  # same version, new code
        return "\n".join(
            [
                "set -euo pipefail",
                "command -v uv >/dev/null 2>&1 || curl -LsSf https://astral.sh/uv/install.sh | sh",
                'export PATH="$HOME/.local/bin:$PATH"',
                "[ -x ~/artnb-venv/bin/python ] || uv venv --python 3.11 ~/artnb-venv",
                f"uv pip install --python ~/artnb-venv/bin/python{reinstall} {requirement}",
            ]
        )

    @property
    def run(self) -> str:
        argv = ["serve", "--path", self.runs_dir, "--host", self.host, "--port", str(self.port)]
        trainer = self.trainer or ("fsdp" if self.num_nodes > 1 else None)
        if trainer:
            argv += ["--trainer", trainer]
        if self.trainer_config:
            argv += ["--trainer-config", json.dumps(self.trainer_config, sort_keys=True)]
        if self.engine_options:
            argv += ["--engine-options", json.dumps(self.engine_options, sort_keys=True)]
        if self.gpu_cost_per_hour_usd is not None:
            argv += ["--gpu-cost-per-hour-usd", repr(float(self.gpu_cost_per_hour_usd))]
        quoted = " ".join(a if a == self.runs_dir else shlex.quote(a) for a in argv)  # `~` must expand
        serve = f"exec ~/artnb-venv/bin/artnb {quoted}"
        if self.num_nodes == 1:
            return serve
        return "\n".join(
            [
                "set -euo pipefail",
                'HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
                f"export {FSDP_CONTROL_ENV}=127.0.0.1:{FSDP_CONTROL_PORT}  # rank 0 runs on the head node",
                f'export {FSDP_AUTHKEY_ENV}=$(printf %s "${API_KEY_ENV}" | sha256sum | cut -c1-64)',
                "~/artnb-venv/bin/python -m torch.distributed.run"
                ' --nnodes="$SKYPILOT_NUM_NODES" --nproc-per-node="$SKYPILOT_NUM_GPUS_PER_NODE"'
                ' --node-rank="$SKYPILOT_NODE_RANK" --master-addr="$HEAD_IP"'
                f" --master-port={TORCHRUN_PORT} --max-restarts={TORCHRUN_MAX_RESTARTS}"
                " -m artnb.backends.trainers.fsdp_rank &",
                f'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then {serve}; fi',
                "wait",
            ]
        )

    @property
    def envs(self) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}  # server logs reach `sky logs` as they are written

    def task_secrets(self) -> dict[str, str]:
        return {**self.secrets, API_KEY_ENV: self.api_key}

    def to_sky(self, sky_module: Any, resources: sky.Resources) -> sky.Task:
        """The `sky.Task` for this spec on `resources` (which must open `self.port`)."""
        task = sky_module.Task(
            name=SERVER_JOB,
            setup=self.setup,
            run=self.run,
            envs=self.envs,
            secrets=self.task_secrets(),
            workdir=self.install.workdir,
            num_nodes=self.num_nodes,
        )
        return task.set_resources(resources)


def server_resources(
    sky_module: Any, gpu: str | None, resources: sky.Resources | None, port: int
) -> sky.Resources:
    """`resources` (default: any cloud SkyPilot finds cheapest) with `gpu` when it names no accelerator, and
    `port` opened. `gpu` is SkyPilot's accelerator string: "H100", "H100:2", "A100-80GB:8"; None for CPU only."""
    chosen: Any = resources if resources is not None else sky_module.Resources()
    overrides: dict[str, Any] = {}
    if not chosen.accelerators and gpu is not None:
        overrides["accelerators"] = gpu
    ports = list(chosen.ports or [])
    if str(port) not in ports:
        overrides["ports"] = [*ports, str(port)]
    return chosen.copy(**overrides) if overrides else chosen


def read_env_file(env_path: str | Path | None) -> dict[str, str]:
    """The variables of a .env file (python-dotenv's syntax), for the cluster; names without a value are errors."""
    if env_path is None:
        return {}
    from dotenv import dotenv_values

    path = Path(env_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"env_path={str(env_path)!r}: no such file")
    values = dotenv_values(path)
    empty = sorted(k for k, v in values.items() if v is None)
    if empty:
        raise ValueError(f"{path}: {', '.join(empty)} has no value; write NAME=value")
    if API_KEY_ENV in values:
        raise ValueError(
            f"{path} sets {API_KEY_ENV}; SkyPilotBackend makes the server's key itself, remove it"
        )
    return {k: v for k, v in values.items() if v is not None}


# which SkyPilot calls to make ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterPlan:
    """What `initialize_cluster` does: cancel the old server job (if set), then launch, exec or just connect."""

    action: Literal["launch", "exec", "connect"]
    reason: str
    cancel_job: int | None = None


def plan_cluster(
    cluster_status: str | None,
    server_job: tuple[int, str] | None,
    have_key: bool,
    force_restart: bool,
) -> ClusterPlan:
    """Decide from SkyPilot's view of the cluster: `cluster_status` is `sky.ClusterStatus`'s value (None: no
    such cluster), `server_job` the newest `artnb-serve` job as (id, `sky.JobStatus` value), `have_key`
    whether the key of that server is stored here."""
    if cluster_status != "UP":
        why = "no cluster yet" if cluster_status is None else f"the cluster is {cluster_status}"
        return ClusterPlan("launch", f"{why}: launching (provision, sync, setup, start artnb serve)")
    job_id, job_status = server_job if server_job is not None else (None, None)
    alive = job_status in ACTIVE_JOB_STATES
    cancel = job_id if alive else None
    if force_restart:
        return ClusterPlan(
            "launch", "force_restart: new server on the same machine (sync, setup again)", cancel
        )
    if job_status == "FAILED_SETUP":
        return ClusterPlan("launch", f"the last setup failed (job {job_id}): running it again")
    if alive and have_key:
        return ClusterPlan(
            "connect",
            f"artnb serve is {job_status} (job {job_id}): reusing it with the settings it was started with "
            "(force_restart=True starts it with these)",
        )
    if alive:
        return ClusterPlan("exec", "artnb serve runs with a key this machine lacks: restarting it", cancel)
    why = "no artnb serve job" if job_status is None else f"artnb serve ended ({job_status})"
    return ClusterPlan("exec", f"the cluster is UP, {why}: starting it")


# the key, kept for reconnecting --------------------------------------------------------------------------
def key_file(cluster_name: str, keys_dir: Path = KEYS_DIR) -> Path:
    return keys_dir.expanduser() / f"{cluster_name}.key"


def read_key(cluster_name: str, keys_dir: Path = KEYS_DIR) -> str | None:
    path = key_file(cluster_name, keys_dir)
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def new_key(cluster_name: str, keys_dir: Path = KEYS_DIR) -> str:
    """A fresh key for the cluster's server, stored with mode 0600 before SkyPilot gets it."""
    key = secrets.token_urlsafe(32)
    write_atomic(key_file(cluster_name, keys_dir), key)  # mkstemp: 0600
    return key


# SkyPilot, off the event loop --------------------------------------------------------------------------
def import_sky() -> Any:
    """SkyPilot's SDK, or an ImportError that says how to install it."""
    try:
        import sky  # pyright: ignore[reportMissingImports]  # optional: artnb[skypilot]
    except ImportError as e:
        raise ImportError(f"SkyPilotBackend needs SkyPilot: {INSTALL_HINT}") from e
    if "secrets" not in inspect.signature(sky.Task.__init__).parameters or not hasattr(sky, "endpoints"):
        raise ImportError(
            f"SkyPilotBackend needs SkyPilot >= 0.10.5 (task secrets, sky.endpoints); this is "
            f"{getattr(sky, '__version__', '?')}: {INSTALL_HINT}"
        )
    return sky


async def _sky(sky_module: Any, call: Callable[..., Any], *args: Any, stream: bool = False, **kw: Any) -> Any:
    """Run a SkyPilot SDK call (it returns a request id) in a thread and wait for its result; `stream`
    shows SkyPilot's log of the request meanwhile (provisioning, setup)."""
    wait = sky_module.stream_and_get if stream else sky_module.get
    return await asyncio.to_thread(lambda: wait(call(*args, **kw)))


def _trainer_fields(
    trainer_config: TrainerConfig | dict[str, Any] | None, trainer: str | None, num_nodes: int
) -> dict[str, Any] | None:
    """`initialize_cluster(trainer_config=...)` as the JSON fields for `artnb serve --trainer-config` (those that
    differ from the defaults), checked here as the server would check them, so that a mistake costs no launch."""
    if trainer_config is None:
        return None
    config = TrainerConfig.model_validate(trainer_config)  # a ValidationError names the field
    served_by = trainer or ("fsdp" if num_nodes > 1 else "auto")
    check_placement(served_by, config, "initialize_cluster(trainer_config=...placement='split')")
    if num_nodes > 1 and config.placement == "split":
        raise ValueError(
            f"initialize_cluster(num_nodes={num_nodes}, trainer_config=...placement='split'): on several nodes "
            "torchrun gives the FSDP ranks every GPU of each node, so vLLM cannot have half of them; leave "
            "placement at 'colocated' (vLLM sleeps while the ranks step)"
        )
    return config.model_dump(mode="json", exclude_defaults=True) or None


def _say(message: str) -> None:
    print(f"SkyPilotBackend: {message}", flush=True)


async def wait_for_health(
    base_url: str,
    api_key: str,
    job_ended: Callable[[], Awaitable[str | None]],
    timeout_s: float,
    poll_s: float = 5.0,
) -> None:
    """Poll `{base_url}/health` until it answers 200, then check the key on `/info`; stop early when
    `job_ended()` names a final job state."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=10.0, headers=headers) as client:
        while True:
            try:
                if (await client.get(f"{base_url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            ended = await job_ended()
            if ended is not None:
                raise RuntimeError(f"artnb serve stopped before answering ({ended})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"artnb serve did not answer {base_url}/health within {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)
        if (await client.get(f"{base_url}/info")).status_code == 401:
            raise PermissionError(
                f"artnb serve at {base_url} has another API key (started from another machine?): "
                "pass force_restart=True to restart it with a new one"
            )


class SkyPilotBackend(RemoteBackend):
    """A RemoteBackend whose server SkyPilot runs on a cloud GPU (see the module docstring).

    Example:
        backend = await SkyPilotBackend.initialize_cluster(cluster_name="art", gpu="H100")
        await model.register(backend)
        ...
        await backend.down()   # deletes the cluster, its run directory with it

    More than one GPU: ask SkyPilot for them and give vLLM the split, e.g. `gpu="H100:2",
    engine_options={"extra_args": ["--tensor-parallel-size", "2"]}` (or "--data-parallel-size"), and
    `trainer="fsdp"` to train on all of them. More than one node: `resources=sky.Resources(accelerators="H100:8"),
    num_nodes=2` (the FSDP trainer on all 16 GPUs, vLLM on the head node's).
    Spot or a given cloud/region: `resources=sky.Resources(infra="aws/us-east-1", use_spot=True)`.
    """

    cluster_name: str

    def __init__(
        self, base_url: str = f"http://127.0.0.1:{DEFAULT_PORT}", api_key: str | None = None, **options: Any
    ) -> None:
        # ART's examples write `await SkyPilotBackend().initialize_cluster(...)`: the bare instance only reaches
        # the classmethod, which returns the backend connected to the cluster.
        super().__init__(base_url, api_key, **options)

    @classmethod
    async def initialize_cluster(
        cls,
        cluster_name: str = "art",
        gpu: str | None = "H100",
        resources: sky.Resources | None = None,
        art_version: str | None = None,
        env_path: str | None = None,
        force_restart: bool = False,
        *,
        engine_options: dict[str, Any] | None = None,
        path: str | None = None,
        health_timeout_s: float = 1800.0,
        num_nodes: int = 1,
        trainer: str | None = None,
        trainer_config: TrainerConfig | dict[str, Any] | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        **launch_options: Any,
    ) -> SkyPilotBackend:
        """Launch (or reuse) a SkyPilot cluster running `artnb serve` and return a backend connected to it.

        gpu: SkyPilot's accelerator string ("H100", "H100:2"); used when `resources` names no accelerator;
          None for a CPU machine (HF engine). resources: a `sky.Resources` (cloud, region, spot, disk, ...).
        art_version: what artnb to install there; None: this checkout (synced), else see `resolve_install`.
        env_path: a .env file whose variables the server gets, as secrets (e.g. HF_TOKEN, WANDB_API_KEY).
        force_restart: restart the server (after syncing and running setup again) on the same machine.
        engine_options: LocalBackend's engine_options on the server. path: RemoteBackend's `path`.
        health_timeout_s: how long the server may take to answer after SkyPilot started it (setup included).
        num_nodes: machines in the cluster; above 1 the FSDP trainer spans them (see the module docstring).
        trainer: `artnb serve --trainer` ("fsdp" for every GPU of one machine); None: the server's default,
          "fsdp" when num_nodes > 1.
        trainer_config: the server's `art.TrainerConfig` (or its fields), e.g. gradient checkpointing, or
          `placement="split"` with trainer="fsdp" on one node; checked here, before anything is launched.
        gpu_cost_per_hour_usd: what the whole cluster costs per hour; each step's history row then has
          `costs/gpu/usd` (`LocalBackend(gpu_cost_per_hour_usd=...)` on the server). None: no machine cost.
          Checked here, before anything is launched or cancelled.
        launch_options: passed to `sky.launch`, e.g. `idle_minutes_to_autostop=60`, `retry_until_up=True`.
        """
        if gpu_cost_per_hour_usd is not None:
            checked_price(gpu_cost_per_hour_usd)  # before a running server is cancelled or its key replaced
        sky_module = import_sky()
        allowed = set(inspect.signature(sky_module.launch).parameters) - {"task", "cluster_name", "dryrun"}
        unknown = sorted(k for k in launch_options if k not in allowed or k.startswith("_"))
        if unknown:
            raise TypeError(f"initialize_cluster: unknown {unknown}; other keywords go to sky.launch")
        env_secrets = read_env_file(env_path)
        server_trainer_config = _trainer_fields(trainer_config, trainer, num_nodes)
        install = resolve_install(art_version, artnb_checkout())
        res = server_resources(sky_module, gpu, resources, DEFAULT_PORT)

        refresh = sky_module.StatusRefreshMode.AUTO  # an autostopped cluster must not read as UP
        status = await _sky(sky_module, sky_module.status, cluster_names=[cluster_name], refresh=refresh)
        cluster_status = status[0]["status"].value if status else None
        server_job = None
        if cluster_status == "UP":
            jobs = await _sky(sky_module, sky_module.queue, cluster_name, skip_finished=False)
            ours = [(j["job_id"], j["status"].value) for j in jobs if j["job_name"] == SERVER_JOB]
            server_job = max(ours) if ours else None
        key = read_key(cluster_name)
        plan = plan_cluster(cluster_status, server_job, key is not None, force_restart)
        _say(f"cluster {cluster_name!r}: {plan.reason}")

        if plan.cancel_job is not None:
            await _sky(sky_module, sky_module.cancel, cluster_name, job_ids=[plan.cancel_job])
        if plan.action == "connect":
            assert (
                server_job is not None and key is not None
            )  # plan_cluster connects to a running job we keyed
            job_id = server_job[0]
        else:
            key = new_key(cluster_name)
            spec = ServerTask(
                install,
                bool(res.accelerators),
                key,
                env_secrets,
                engine_options,
                num_nodes=num_nodes,
                trainer=trainer,
                trainer_config=server_trainer_config,
                gpu_cost_per_hour_usd=gpu_cost_per_hour_usd,
            )
            task = spec.to_sky(sky_module, res)
            if plan.action == "launch":
                call, kw = sky_module.launch, {"cluster_name": cluster_name, **launch_options}
            else:
                call, kw = sky_module.exec, {"cluster_name": cluster_name}
            job_id, _ = await _sky(sky_module, call, task, stream=True, **kw)

        endpoints = await _sky(sky_module, sky_module.endpoints, cluster_name, DEFAULT_PORT)
        endpoint = endpoints.get(DEFAULT_PORT) or endpoints.get(str(DEFAULT_PORT))
        if not endpoint:
            raise RuntimeError(
                f"SkyPilot gives no address for port {DEFAULT_PORT} of cluster {cluster_name!r}"
            )
        base_url = (endpoint if "://" in endpoint else f"http://{endpoint}").rstrip("/")

        async def job_ended() -> str | None:
            states = await _sky(sky_module, sky_module.job_status, cluster_name, [job_id])
            state = states.get(job_id)
            if state is None or state.value in ACTIVE_JOB_STATES:
                return None
            return f"job {job_id} is {state.value}; see `sky logs {cluster_name} {job_id}`"

        _say(f"waiting for artnb serve at {base_url} (logs: `sky logs {cluster_name} {job_id}`)")
        await wait_for_health(base_url, key, job_ended, health_timeout_s)
        _say(f"connected to {base_url}")
        backend = cls(base_url, key, path=path)
        backend.cluster_name = cluster_name
        return backend

    async def down(self) -> None:
        """Close the connection and delete the cluster (its disk, with the run directory, goes too)."""
        sky_module = import_sky()
        await self.close()
        _say(f"tearing down cluster {self.cluster_name!r}")
        await _sky(sky_module, sky_module.down, self.cluster_name, stream=True)
        key_file(self.cluster_name).unlink(missing_ok=True)

    def __repr__(self) -> str:
        cluster = getattr(self, "cluster_name", None)
        return f"SkyPilotBackend(cluster_name={cluster!r}, base_url={self.base_url!r})"  # never the key
