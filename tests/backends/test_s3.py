"""S3 checkpoints against a real S3-compatible server on 127.0.0.1 (moto's server, a subprocess): push a trained
run, pull it into a fresh directory and train on from the pulled step; a push killed mid-step and a push
cancelled mid-step leave the bucket without a partial step; pull refuses to overwrite a different run.

A TCP relay in front of the S3 server watches the requests and acts when the upload of a chosen file starts
(kills the pushing process, or holds the request until the test has cancelled the push), so the interruptions
do not depend on timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
from test_remote_backend import KEY, Server
from tiny_loop import gather

import artnb as art
from artnb.backends import s3
from artnb.backends.ports import free_port
from artnb.backends.remote import RemoteBackend
from artnb.core.store import RunStore
from artnb.models import tiny
from artnb.utils.s3 import pull_model_from_s3

BASE = tiny(hidden_size=64, num_layers=2, seed=1)
BUCKET = "runs"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server; the environment points boto3 (and so artnb) at it."""
    port = free_port()
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    process.terminate()
    process.wait(timeout=30)


def keys(prefix: str = "") -> list[str]:
    listing = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


async def train_steps(path: Path, project: str, steps: int) -> art.TrainableModel:
    backend = art.LocalBackend(path=path, engine="hf")
    model = art.TrainableModel(name="agent", project=project, base_model=BASE)
    await model.register(backend)
    for i in range(steps):
        await model.train(await gather(model, i), config=art.TrainConfig(learning_rate=1e-2))
    await model.log(await gather(model, 9), split="val")
    await backend.close()
    return model


class Relay:
    """TCP relay to the S3 server; when a request line uploads (`verb` PUT) or downloads (GET) a key containing
    `marker`, await `action()` before passing the request on (or drop the connection if `action` returns False)."""

    def __init__(self, target: str, verb: bytes = b"PUT ") -> None:
        self.port = int(target.rsplit(":", 1)[1])
        self.verb = verb
        self.marker: bytes | None = None
        self.action = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.gather(self._pump(reader, up_writer, watch=True), self._pump(up_reader, writer))

    async def _pump(self, source, sink, watch: bool = False) -> None:
        try:
            while data := await source.read(65536):
                if watch and self.marker is not None and self.verb in data and self.marker in data:
                    action, self.marker = self.action, None
                    if await action() is False:
                        sink.transport.abort()
                        return
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.transport.abort()

    async def close(self) -> None:
        self.server.close()


async def test_push_pull_into_a_fresh_directory_and_train_on(s3_server, tmp_path):
    model = await train_steps(tmp_path / "laptop", "roundtrip", 2)
    backend = art.LocalBackend(path=tmp_path / "laptop", engine="hf")
    report = await backend._experimental_push_to_s3(model, s3_bucket=BUCKET, prefix="team")
    assert report.steps == [0, 1, 2]
    root = "team/roundtrip/models/agent/"
    stored = keys(root)
    assert f"{root}history.jsonl" in stored and f"{root}checkpoints/0002/adapter_model.safetensors" in stored
    assert f"{root}trajectories/val/0002.parquet" in stored and f"{root}.lock" not in stored
    again = await backend._experimental_push_to_s3(model, s3_bucket=BUCKET, prefix="team")
    assert again.uploaded == []  # nothing changed: nothing sent

    # ART's fork from a bucket: the source's newest step not after 1 comes from S3
    forks = art.LocalBackend(path=tmp_path / "forks", engine="hf")
    fork = art.TrainableModel(name="fork", project="roundtrip", base_model=BASE)
    await fork.register(forks)
    forked = await forks._experimental_fork_checkpoint(
        fork, from_model="agent", from_s3_bucket=BUCKET, prefix="team", not_after_step=1
    )
    assert forked == 1 and await fork.get_step() == 1
    assert RunStore(tmp_path / "forks", "roundtrip", "agent").steps() == [1]
    await forks.close()

    # another machine: pull before register (ART's order), then training goes on from step 2
    fresh = art.LocalBackend(path=tmp_path / "gpu", engine="hf")
    same = art.TrainableModel(name="agent", project="roundtrip", base_model=BASE)
    pulled = await fresh._experimental_pull_from_s3(same, s3_bucket=BUCKET, prefix="team")
    assert pulled.steps == [0, 1, 2] and not pulled.ignored_partial_steps
    here, there = (
        RunStore(tmp_path / "laptop", "roundtrip", "agent"),
        RunStore(tmp_path / "gpu", "roundtrip", "agent"),
    )
    for step in (1, 2):
        for name in ("adapter_model.safetensors", "optimizer.pt", "commit.json"):
            assert (here.checkpoint_path(step) / name).read_bytes() == (
                there.checkpoint_path(step) / name
            ).read_bytes()
    assert here.history().equals(there.history())
    await same.register(fresh)
    assert await same.get_step() == 2
    with pytest.raises(RuntimeError, match="pull before"):
        await fresh._experimental_pull_from_s3(same, s3_bucket=BUCKET, prefix="team")
    assert (await same.train(await gather(same, 5), config=art.TrainConfig(learning_rate=1e-2))).step == 3

    # delete_checkpoints here, then push with delete=True: the bucket drops the deleted steps
    deleted = await same.delete_checkpoints("val/reward")
    assert deleted
    report = await fresh._experimental_push_to_s3(same, s3_bucket=BUCKET, prefix="team", delete=True)
    steps_in_bucket, partial = s3._complete_steps(there, {k[len(root) :]: {} for k in keys(root)})
    assert steps_in_bucket == there.steps() and not partial
    await fresh.close()

    # the laptop's run is now behind the bucket and differs in history: pull brings it level
    await backend._experimental_pull_from_s3(model, s3_bucket=BUCKET, prefix="team", delete=True)
    assert here.steps() == there.steps() and here.history().equals(there.history())

    # ART's newer spelling of a one-step pull: only the newest checkpoint, nothing else of the run
    newest = art.LocalBackend(path=tmp_path / "newest", engine="hf")
    latest = await newest._experimental_pull_from_s3(
        same, s3_bucket=BUCKET, prefix="team", only_step="latest"
    )
    assert latest.steps == [there.steps()[-1]] == RunStore(tmp_path / "newest", "roundtrip", "agent").steps()
    assert not RunStore(tmp_path / "newest", "roundtrip", "agent").history_path.exists()
    with pytest.raises(ValueError, match=r"only_step=1, step=2\): these ask for different steps"):
        await newest._experimental_pull_from_s3(same, s3_bucket=BUCKET, prefix="team", step=2, only_step=1)

    # ART's benchmark notebooks pull a run with no backend, then read its trajectories
    run_dir = await pull_model_from_s3(
        "agent", "roundtrip", s3_bucket=BUCKET, prefix="team", art_path=str(tmp_path / "bench")
    )
    assert run_dir == str(RunStore(tmp_path / "bench", "roundtrip", "agent").dir)
    assert RunStore(tmp_path / "bench", "roundtrip", "agent").history().equals(there.history())

    with pytest.raises(ValueError, match="BACKUP_BUCKET"):
        await backend._experimental_push_to_s3(model)
    with pytest.raises(s3.S3SyncError, match="does not exist"):
        await backend._experimental_pull_from_s3(model, s3_bucket="no-such-bucket")


async def test_a_pull_refuses_to_overwrite_a_different_run(s3_server, tmp_path):
    first = await train_steps(tmp_path / "a", "clash", 1)
    await art.LocalBackend(path=tmp_path / "a")._experimental_push_to_s3(first, s3_bucket=BUCKET)
    other = await train_steps(tmp_path / "b", "clash", 1)  # same name, different run
    backend = art.LocalBackend(path=tmp_path / "b", engine="hf")
    before = (RunStore(tmp_path / "b", "clash", "agent").checkpoint_path(1) / "commit.json").read_bytes()
    with pytest.raises(ValueError, match="differs from the one in"):
        await backend._experimental_pull_from_s3(other, s3_bucket=BUCKET)
    after = (RunStore(tmp_path / "b", "clash", "agent").checkpoint_path(1) / "commit.json").read_bytes()
    assert before == after


async def test_a_killed_push_leaves_no_step_that_pull_would_take(s3_server, tmp_path):
    await train_steps(tmp_path / "runs", "killed", 2)
    relay = Relay(s3_server)
    url = await relay.start()
    script = (
        "import sys; from artnb.backends import s3; from artnb.core.store import RunStore; "
        f"s3.push(RunStore(sys.argv[1], 'killed', 'agent'), {BUCKET!r})"
    )
    push = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(tmp_path / "runs"), env={**os.environ, "AWS_ENDPOINT_URL": url}
    )

    async def kill() -> bool:  # step 2's adapter config and commit are in the bucket, its weights are not
        push.send_signal(signal.SIGKILL)
        return False

    relay.marker, relay.action = b"checkpoints/0002/optimizer.pt", kill
    assert await push.wait() == -signal.SIGKILL
    await relay.close()
    root = "killed/models/agent/"
    assert f"{root}checkpoints/0002/adapter_config.json" in keys(root)
    assert f"{root}checkpoints/0002/adapter_model.safetensors" not in keys(root)

    model = art.TrainableModel(name="agent", project="killed", base_model=BASE)
    fresh = art.LocalBackend(path=tmp_path / "fresh", engine="hf")
    pulled = await fresh._experimental_pull_from_s3(model, s3_bucket=BUCKET)
    assert pulled.steps == [0, 1] and pulled.ignored_partial_steps == [2]
    assert not any(
        p.name.startswith(".") for p in RunStore(tmp_path / "fresh", "killed", "agent").checkpoints.iterdir()
    )

    # the next push completes step 2; a second pull takes it
    await art.LocalBackend(path=tmp_path / "runs")._experimental_push_to_s3(model, s3_bucket=BUCKET)
    assert (await fresh._experimental_pull_from_s3(model, s3_bucket=BUCKET)).steps == [0, 1, 2]


async def test_a_killed_pull_leaves_no_partial_step_and_the_next_pull_completes(s3_server, tmp_path):
    model = await train_steps(tmp_path / "runs", "pull-killed", 2)
    await art.LocalBackend(path=tmp_path / "runs")._experimental_push_to_s3(model, s3_bucket=BUCKET)
    relay = Relay(s3_server, verb=b"GET ")
    url = await relay.start()
    script = (
        "import sys; from artnb.backends import s3; from artnb.core.store import RunStore; "
        "store = RunStore(sys.argv[1], 'pull-killed', 'agent'); store.lock(); "
        f"s3.pull(store, {BUCKET!r})"
    )
    pull = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(tmp_path / "fresh"), env={**os.environ, "AWS_ENDPOINT_URL": url}
    )

    async def kill() -> bool:  # step 2's adapter and commit record are downloaded, its optimizer state is not
        pull.send_signal(signal.SIGKILL)
        return False

    relay.marker, relay.action = b"checkpoints/0002/optimizer.pt", kill
    assert await pull.wait() == -signal.SIGKILL
    await relay.close()
    store = RunStore(tmp_path / "fresh", "pull-killed", "agent")
    assert store.steps() == [0, 1] and not store.checkpoint_path(2).exists()  # step 2 only in a temp dir
    assert [p.name for p in store.checkpoints.iterdir() if p.name.startswith(".0002-pull-")]

    fresh = art.LocalBackend(path=tmp_path / "fresh", engine="hf")
    pulled = await fresh._experimental_pull_from_s3(model, s3_bucket=BUCKET)
    assert pulled.steps == [0, 1, 2] and store.steps() == [0, 1, 2]
    assert not [p for p in store.checkpoints.iterdir() if p.name.startswith(".")]
    here = RunStore(tmp_path / "runs", "pull-killed", "agent")
    for name in ("adapter_model.safetensors", "optimizer.pt", "commit.json"):
        assert (store.checkpoint_path(2) / name).read_bytes() == (here.checkpoint_path(2) / name).read_bytes()
    assert store.history().equals(here.history())


async def test_a_cancelled_push_removes_what_it_uploaded_of_the_unfinished_step(s3_server, tmp_path):
    await train_steps(tmp_path / "runs", "cancelled", 2)
    relay = Relay(s3_server)
    url = await relay.start()
    os.environ["AWS_ENDPOINT_URL"] = url
    try:
        model = art.TrainableModel(name="agent", project="cancelled", base_model=BASE)
        push = asyncio.ensure_future(
            art.LocalBackend(path=tmp_path / "runs")._experimental_push_to_s3(model, s3_bucket=BUCKET)
        )
        held, go_on = asyncio.Event(), asyncio.Event()

        async def hold() -> bool:  # the upload of step 2's optimizer state waits until the push is cancelled
            held.set()
            await go_on.wait()
            return True

        relay.marker, relay.action = b"checkpoints/0002/optimizer.pt", hold
        await asyncio.wait_for(held.wait(), 60)
        push.cancel()
        await asyncio.sleep(0.2)
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await push
    finally:
        os.environ["AWS_ENDPOINT_URL"] = s3_server
        await relay.close()
    root = "cancelled/models/agent/"
    assert not [k for k in keys(root) if "/checkpoints/0002/" in k]  # nothing of the unfinished step
    assert f"{root}checkpoints/0001/adapter_model.safetensors" in keys(root)


async def test_a_remote_backend_pulls_and_pushes_on_the_server(s3_server, tmp_path):
    """ART's script order over `artnb serve`: pull (the server's credentials and disk), register, train, push."""
    laptop = await train_steps(tmp_path / "laptop", "remote", 1)
    await art.LocalBackend(path=tmp_path / "laptop")._experimental_push_to_s3(laptop, s3_bucket=BUCKET)
    (tmp_path / "server").mkdir()
    server = Server(tmp_path / "server")
    server.start()  # inherits AWS_ENDPOINT_URL and the test credentials
    try:
        backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path / "mirror")
        model = art.TrainableModel(name="agent", project="remote", base_model=BASE)
        newest = await backend._experimental_pull_from_s3(model, s3_bucket=BUCKET, only_step="latest")
        assert newest.steps == [1] == RunStore(server.path, "remote", "agent").steps()  # ART's one-step pull
        os.environ["BACKUP_BUCKET"] = BUCKET  # ART's default bucket, read in the notebook
        try:
            report = await backend._experimental_pull_from_s3(model)
        finally:
            del os.environ["BACKUP_BUCKET"]
        assert report.steps == [0, 1] and RunStore(server.path, "remote", "agent").steps() == [0, 1]
        pulled_history = RunStore(tmp_path / "laptop", "remote", "agent").history()
        assert RunStore(tmp_path / "mirror", "remote", "agent").history().equals(pulled_history)  # mirrored
        await model.register(backend)
        assert model.history().equals(pulled_history)
        assert await model.get_step() == 1
        assert (
            await model.train(await gather(model, 3), config=art.TrainConfig(learning_rate=1e-2))
        ).step == 2
        pushed = await backend._experimental_push_to_s3(model, s3_bucket=BUCKET)
        assert pushed.steps == [0, 1, 2] and "checkpoints/0002/adapter_model.safetensors" in pushed.uploaded
        with pytest.raises(RuntimeError, match="pull before"):
            await backend._experimental_pull_from_s3(model, s3_bucket=BUCKET)
        await backend.close()
    finally:
        server.stop()


async def test_pull_model_checkpoint_finds_the_newest_here_or_in_s3_and_returns_its_directory(
    s3_server, tmp_path
):
    """ART 0.5.23's `_experimental_pull_model_checkpoint`: the run directory first, then S3 (that checkpoint
    alone); the newest of the two for "latest", the local one when level; `local_path` gets a copy."""
    model = await train_steps(tmp_path / "laptop", "checkpoint", 2)
    laptop = art.LocalBackend(path=tmp_path / "laptop", engine="hf")
    await laptop._experimental_push_to_s3(model, s3_bucket=BUCKET, prefix="team")
    here = RunStore(tmp_path / "laptop", "checkpoint", "agent")
    weights = (here.checkpoint_path(2) / "adapter_model.safetensors").read_bytes()

    # level with the bucket: the run directory's own checkpoint, nothing downloaded
    assert await laptop._experimental_pull_model_checkpoint(model, s3_bucket=BUCKET, prefix="team") == str(
        here.checkpoint_path(2)
    )
    assert await laptop._experimental_pull_model_checkpoint(model, step=1) == str(here.checkpoint_path(1))

    # another machine: the newest is in S3 only, and only that checkpoint arrives
    gpu = art.LocalBackend(path=tmp_path / "gpu", engine="hf")
    there = RunStore(tmp_path / "gpu", "checkpoint", "agent")
    path = await gpu._experimental_pull_model_checkpoint(
        model, step="latest", s3_bucket=BUCKET, prefix="team"
    )
    assert path == str(there.checkpoint_path(2)) and there.steps() == [2]
    assert (there.checkpoint_path(2) / "adapter_model.safetensors").read_bytes() == weights
    assert not there.history_path.exists()

    # local_path: the checkpoint's adapter and optimizer, copied where the caller wants them
    out = tmp_path / "export" / "step1"
    copied = await gpu._experimental_pull_model_checkpoint(
        model, step=1, local_path=str(out), s3_bucket=BUCKET, prefix="team"
    )
    assert copied == str(out) and there.steps() == [1, 2]
    assert {p.name for p in out.iterdir()} >= {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.pt",
    }
    assert (out / "adapter_model.safetensors").read_bytes() == (
        here.checkpoint_path(1) / "adapter_model.safetensors"
    ).read_bytes()

    with pytest.raises(
        FileNotFoundError, match=r"checkpoint 0 of checkpoint/agent is not in .*pass s3_bucket"
    ):
        await gpu._experimental_pull_model_checkpoint(model, step=0)
    nobody = art.TrainableModel(name="nobody", project="checkpoint", base_model=BASE)
    with pytest.raises(FileNotFoundError, match="no checkpoint of checkpoint/nobody in .* or s3://runs/"):
        await gpu._experimental_pull_model_checkpoint(nobody, s3_bucket=BUCKET)
    with pytest.raises(FileNotFoundError, match="step 7 of checkpoint/agent is not in s3://"):
        await gpu._experimental_pull_model_checkpoint(model, step=7, s3_bucket=BUCKET, prefix="team")

    # ART's `exclude` for a whole-run pull: the folders named stay behind
    runs_only = art.LocalBackend(path=tmp_path / "history", engine="hf")
    await runs_only._experimental_pull_from_s3(
        model, s3_bucket=BUCKET, prefix="team", exclude=["checkpoints"]
    )
    history_only = RunStore(tmp_path / "history", "checkpoint", "agent")
    assert history_only.steps() == [] and history_only.history().equals(here.history())
    assert history_only.trajectory_files() == here.trajectory_files()
    bench = await pull_model_from_s3(
        "agent",
        "checkpoint",
        s3_bucket=BUCKET,
        prefix="team",
        art_path=str(tmp_path / "bench"),
        exclude=["trajectories"],
    )
    assert RunStore.from_dir(bench).steps() == [0, 1, 2] and not (Path(bench) / "trajectories").exists()
    with pytest.raises(ValueError, match=r"\['history'\] cannot be excluded; the options are"):
        await runs_only._experimental_pull_from_s3(model, s3_bucket=BUCKET, exclude=["history"])  # type: ignore[list-item]
