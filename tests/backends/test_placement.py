"""The split placement (`TrainerConfig(placement="split")`) and ART's dedicated mode (`_internal_config`
trainer_gpu_ids and inference_gpu_ids): the settings, where they are refused, and the GPUs each process is given.
GPUs are absent here, so what is checked is every pure step from the setting to the command line and environment
of vLLM's process, the HF engine's device and each trainer rank's GPUs; nothing was run on GPUs."""

import doctest

import pytest
from pydantic import ValidationError

import artnb as art
from artnb import models
from artnb.backends import placement as placement_module
from artnb.backends.model_setup import apply_placement, trainer_config_for
from artnb.backends.placement import dedicated_placement, plan_placement, visible_devices
from artnb.backends.trainers import fsdp_trainer
from artnb.backends.trainers.choice import check_placement, make_trainer
from artnb.backends.trainers.fsdp_trainer import local_placement, rank_environment
from artnb.core.config import LoRAConfig, TrainerConfig
from artnb.core.store import RunStore
from artnb.dev.settings import resolve_internal_config

GIB = 2**30


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


def test_doctests():
    assert doctest.testmod(placement_module).failed == 0
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(rank_environment, globs=vars(fsdp_trainer)):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 2)  # (failed, attempted)


def test_visible_devices_maps_positions_through_the_parents_list():
    assert visible_devices((2, 3), "4,5,6,7") == "6,7"
    assert visible_devices((0, 1), None) == "0,1"  # unset: every GPU, numbered from 0
    assert visible_devices((1,), "GPU-aaaa, GPU-bbbb") == "GPU-bbbb"  # UUIDs, spaces after commas
    assert visible_devices((), "4,5") == ""
    with pytest.raises(ValueError, match=r"GPU 2: this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES='4,5'\)"):
        visible_devices((2,), "4,5")
    with pytest.raises(ValueError, match="sees 0 GPUs"):
        visible_devices((0,), "")


def test_trainer_config_placement_is_validated():
    assert TrainerConfig().placement == "colocated"
    assert TrainerConfig(placement="split").placement == "split"
    with pytest.raises(ValidationError, match="'colocated' or 'split'"):
        TrainerConfig(placement="spilt")
    with pytest.raises(ValidationError, match="'colocated' or 'split'"):
        resolve_internal_config({"trainer_args": {"placement": "halves"}}, on_cuda=False)


def test_split_is_the_fsdp_trainers_only():
    check_placement("fsdp", TrainerConfig(placement="split"))
    check_placement("peft", TrainerConfig())
    for trainer in ("auto", "peft", "unsloth"):
        with pytest.raises(
            ValueError, match=rf"trainer='{trainer}' is not the FSDP trainer: use .*trainer='fsdp'"
        ):
            check_placement(trainer, TrainerConfig(placement="split"))
    with pytest.raises(ValueError, match=r"TrainerConfig\(placement='split'\) gives half the GPUs to vLLM"):
        art.LocalBackend(trainer="peft", trainer_config=TrainerConfig(placement="split"))


def test_internal_config_placement_is_carried_and_checked_before_the_engine_starts(tmp_path, tiny):
    """`_internal_config.trainer_args.placement` reaches the trainer's config (the one local_placement and the
    trainer get), and with a trainer other than fsdp is refused by name at register, before the engine starts."""
    settings = resolve_internal_config({"trainer_args": {"placement": "split", "seed": 3}}, on_cuda=False)
    config = trainer_config_for(TrainerConfig(gradient_checkpointing=True), settings)
    assert (config.placement, config.seed, config.gradient_checkpointing) == ("split", 3, True)
    with pytest.raises(ValueError, match=r"_internal_config.trainer_args.placement='split' gives half"):
        apply_placement(settings, "peft", tiny, TrainerConfig(), on_cuda=True)
    apply_placement(settings, "fsdp", tiny, TrainerConfig(), on_cuda=False)  # no CUDA: vLLM gets nothing
    assert settings.vllm_args == [] and settings.placement is not None
    assert settings.placement.serve_gpus == ()  # the 2 gloo ranks share the CPU with the engine


def test_split_placement_gives_vllm_the_first_half_and_the_ranks_the_second(tiny):
    """placement="split" reaches local_placement; on 4 GPUs of a process that sees physical GPUs 4-7, vLLM gets
    4,5 (awake: no sleep mode) and each of the 2 ranks sees 6,7, rank r using the r-th."""
    split = local_placement(tiny, TrainerConfig(placement="split"), gpus=(4, 80 * GIB))
    assert (split.serve_gpus, split.train_gpus) == ((0, 1), (2, 3))
    assert str(split).startswith(
        "placement: split (vLLM stays awake while the trainer steps); vLLM on GPUs [0, 1]"
    )
    assert split.vllm_args() == [
        "--tensor-parallel-size", "1", "--data-parallel-size", "2",
        "--no-enable-sleep-mode", "--gpu-memory-utilization", "0.9",  # vLLM alone on its GPUs
    ]  # fmt: skip
    assert split.vllm_env("4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert split.vllm_env(None) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    parent = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "HOME": "/home/me"}
    ranks = len(split.train_gpus)
    for rank in range(ranks):
        env = rank_environment(
            rank, ranks, gpus=split.train_gpus, parent=parent, extra={"MASTER_PORT": "29500"}
        )
        assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (env["HOME"], env["MASTER_PORT"]) == ("/home/me", "29500")
    assert parent["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # the parent's own environment is not changed
    env = rank_environment(0, 2, gpus=split.train_gpus, parent={}, extra={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # parent unset: physical = position
    with pytest.raises(
        ValueError, match=r"ranks=3: the placement gives the FSDP trainer 2 GPUs \(\[2, 3\]\)"
    ):
        rank_environment(0, 3, gpus=split.train_gpus, parent={}, extra={})


def test_colocated_is_unchanged(tiny):
    colocated = local_placement(tiny, TrainerConfig(), gpus=(4, 80 * GIB))
    assert colocated.serve_gpus == colocated.train_gpus == (0, 1, 2, 3)
    assert "--no-enable-sleep-mode" not in colocated.vllm_args()
    assert colocated.vllm_env("4,5,6,7") == {}  # vLLM sees every GPU, as before
    env = rank_environment(
        3, 4, gpus=colocated.train_gpus, parent={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, extra={}
    )
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("3", "4,5,6,7")  # rank 3 on physical GPU 7


def test_on_a_cpu_nothing_is_placed(tiny):
    """No GPU (this machine, or device="cpu"): split plans nothing and the ranks' GPUs are left alone."""
    for config in (TrainerConfig(placement="split"), TrainerConfig(placement="split", device="cpu")):
        cpu = local_placement(tiny, config)
        assert (cpu.serve_gpus, cpu.train_gpus, cpu.vllm_env(None)) == ((), (), {})
    env = rank_environment(1, 2, gpus=(), parent={"CUDA_VISIBLE_DEVICES": "0"}, extra={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["LOCAL_RANK"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in rank_environment(0, 2, gpus=(), parent={}, extra={})


def test_split_needs_two_gpus_and_says_how_to_turn_it_off():
    with pytest.raises(
        ValueError, match=r"placement='split'\)\) needs at least 2 GPUs.* use placement='colocated'"
    ):
        plan_placement(1, GIB, 80 * GIB, split=True)


def test_vllm_parses_the_split_flags_with_sleep_mode_off():
    """The installed vLLM takes the split placement's flags after artnb's CUDA default (--enable-sleep-mode),
    and the later --no-enable-sleep-mode wins (VLLMEngine.sleep_mode reads the same flag)."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = arg_utils.AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    split = plan_placement(4, GIB, 80 * GIB, split=True)
    args = parser.parse_args(["--enable-sleep-mode", "--gpu-memory-utilization", "0.7", *split.vllm_args()])
    assert (args.enable_sleep_mode, args.tensor_parallel_size, args.data_parallel_size) == (False, 1, 2)
    assert args.gpu_memory_utilization == 0.9


# ART's dedicated mode: art.dev.InternalModelConfig(trainer_gpu_ids=[0], inference_gpu_ids=[1])


@pytest.mark.parametrize(
    "config, message",
    [
        ({"trainer_gpu_ids": [0]}, r"dedicated mode needs both \(e.g. trainer_gpu_ids=\[0\], inference"),
        ({"inference_gpu_ids": [1]}, "needs both"),
        ({"trainer_gpu_ids": [], "inference_gpu_ids": [1]}, "trainer_gpu_ids must be a non-empty list"),
        ({"trainer_gpu_ids": 0, "inference_gpu_ids": [1]}, "trainer_gpu_ids must be a non-empty list"),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1, 1]}, "inference_gpu_ids must be .* distinct"),
        ({"trainer_gpu_ids": [True], "inference_gpu_ids": [1]}, r"ints >= 0"),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [-1]}, r"ints >= 0"),
        ({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [1, 2]}, "GPU 1 is in both; .* leave both out"),
        (
            {"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"enable_sleep_mode": True}},
            "in dedicated mode vLLM has its GPUs to itself and never sleeps; leave enable_sleep_mode out",
        ),
    ],
)
def test_dedicated_gpu_ids_are_checked_on_any_machine(config, message):
    """A wrong shape is an error on a laptop as on the GPU server, where the run would otherwise start."""
    for on_cuda in (False, True):
        with pytest.raises(ValueError, match=message):
            resolve_internal_config(config, on_cuda=on_cuda)


def test_dedicated_placement_sizes_vllm_on_its_gpus_and_checks_the_trainers():
    one = dedicated_placement([0], [1, 2, 3], 4, 15 * GIB, 80 * GIB, in_process=True)
    assert (one.serve_gpus, one.train_gpus, one.tensor_parallel_size, one.data_parallel_size) == (
        (1, 2, 3), (0,), 1, 3
    )  # fmt: skip
    assert not one.colocated and one.vllm_env(None) == {"CUDA_VISIBLE_DEVICES": "1,2,3"}
    big = dedicated_placement([0, 1, 2, 3], [4, 5, 6, 7], 8, 140 * GIB, 80 * GIB, in_process=False)
    assert (big.tensor_parallel_size, big.data_parallel_size) == (4, 1)  # 70B in bf16: 4 x 80 GB hold it
    assert str(big).endswith("FSDP trainer on GPUs [0, 1, 2, 3] (4 ranks)")
    # the FSDP trainer's ranks take any GPUs; the in-process trainers train on this process's GPU 0
    assert dedicated_placement([2, 3], [0, 1], 4, GIB, 80 * GIB, in_process=False).train_gpus == (2, 3)
    with pytest.raises(ValueError, match=r"trainer_gpu_ids=\[1\]: .* must start with 0 .*trainer='fsdp'"):
        dedicated_placement([1], [0], 2, GIB, 80 * GIB, in_process=True)
    with pytest.raises(ValueError, match=r"GPU 2 is not one of this process's 2 GPUs \(numbered 0-1"):
        dedicated_placement([0], [2], 2, GIB, 80 * GIB, in_process=True)
    with pytest.raises(
        ValueError, match="do not fit half the memory of the 1 serving GPUs.*more inference_gpu_ids"
    ):
        dedicated_placement([0], [1], 2, 50 * GIB, 80 * GIB, in_process=True)
    # the model's own engine_args sizes: replicas of tensor x pipeline GPUs, which must divide the serving GPUs
    sized = dedicated_placement([0], [1, 2, 3, 4], 5, GIB, 80 * GIB, in_process=True, engine_parallel=(2, 1))
    assert (sized.tensor_parallel_size, sized.data_parallel_size) == (2, 2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 x pipeline_parallel_size=1 .* does not divide"
    ):
        dedicated_placement([0], [1, 2, 3, 4], 5, GIB, 80 * GIB, in_process=True, engine_parallel=(3, 1))


async def test_dedicated_mode_reaches_vllms_command_line_the_hf_engines_device_and_the_trainer(
    tiny, tmp_path, monkeypatch, capsys
):
    """An ART notebook's dedicated mode on a 4-GPU machine whose process sees physical GPUs 4-7: vLLM runs awake
    on GPUs 1-3 (physical 5-7) with its model's own flags after the placement's, the HF engine (where it serves
    instead) decodes on GPU 1, and the PEFT trainer, in this process, says where everything went."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = art.dev.InternalModelConfig(
        trainer_gpu_ids=[0],
        inference_gpu_ids=[1, 2, 3],
        engine_args=art.dev.EngineArgs(max_num_seqs=8, gpu_memory_utilization=0.8),
    )
    settings = resolve_internal_config(config, on_cuda=True)
    assert settings.dedicated_gpus == ((0,), (1, 2, 3))
    apply_placement(settings, "auto", tiny, TrainerConfig(), on_cuda=True, gpus=(4, 80 * GIB))
    assert settings.placement is not None and settings.placement.in_process
    model = art.TrainableModel(name="m", project="p", base_model=tiny)
    store = RunStore(tmp_path, "p", "m")
    launcher = art.LocalBackend(path=tmp_path).launcher
    with pytest.warns(UserWarning, match=r"\(--max-num-seqs --gpu-memory-utilization are vLLM's\)"):
        hf = launcher.make("hf", tiny, model, store, settings)  # the placement's own flags are not reported
    assert hf.device == "cuda:1"  # type: ignore[attr-defined]
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm = launcher.make("vllm", tiny, model, store, settings)
    assert vllm.env["CUDA_VISIBLE_DEVICES"] == "5,6,7"  # type: ignore[attr-defined]
    command = vllm.command(on_cuda=True)  # type: ignore[attr-defined]
    flags = command[command.index("--enable-sleep-mode") :]  # artnb's CUDA defaults, then the extra args
    args = arg_utils.AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    assert (args.enable_sleep_mode, args.tensor_parallel_size, args.data_parallel_size) == (False, 1, 3)
    assert (args.gpu_memory_utilization, args.max_num_seqs) == (0.8, 8)  # the model's engine_args win
    trainer = make_trainer(
        "peft", tiny, LoRAConfig(r=2), TrainerConfig(device="cpu"), placement=settings.placement
    )
    assert type(trainer).__name__ == "PeftTrainer"
    assert (
        "artnb: placement: split (vLLM stays awake while the trainer steps); vLLM on GPUs [1, 2, 3] (tensor "
        "parallel 1 x data parallel 3), the trainer on GPU 0 (in this process)"
    ) in capsys.readouterr().out


def test_dedicated_mode_with_two_trainer_gpus_says_only_fsdp_uses_both(tiny):
    settings = resolve_internal_config({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [2]}, on_cuda=True)
    with pytest.warns(UserWarning, match=r"trains in this process, on GPU 0 alone; .*trainer='fsdp'"):
        apply_placement(settings, "peft", tiny, TrainerConfig(), on_cuda=True, gpus=(3, 80 * GIB))
    settings = resolve_internal_config({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [2]}, on_cuda=True)
    apply_placement(settings, "fsdp", tiny, TrainerConfig(), on_cuda=True, gpus=(3, 80 * GIB))
    assert settings.placement is not None and settings.placement.train_gpus == (0, 1)
    env = rank_environment(1, 2, gpus=settings.placement.train_gpus, parent={}, extra={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_ranks_that_torchrun_started_refuse_to_share_their_gpus_with_an_awake_vllm(tiny, monkeypatch):
    """On a multi-node cluster torchrun gives the ranks every GPU; split or dedicated GPUs would put an awake vLLM
    on them, so register refuses, naming what to leave out. Colocated (vLLM sleeps) is the cluster's placement."""
    monkeypatch.setenv(placement_module.FSDP_CONTROL_ENV, "127.0.0.1:29600")
    for internal, config in (
        ({}, TrainerConfig(placement="split")),
        ({"trainer_gpu_ids": [4, 5, 6, 7], "inference_gpu_ids": [0, 1, 2, 3]}, TrainerConfig()),
    ):
        settings = resolve_internal_config(internal, on_cuda=True)
        with pytest.raises(ValueError, match=r"started by torchrun .* Leave placement at 'colocated'"):
            apply_placement(settings, "fsdp", tiny, config, on_cuda=True, gpus=(8, 80 * GIB))
    settings = resolve_internal_config({}, on_cuda=True)
    apply_placement(settings, "fsdp", tiny, TrainerConfig(), on_cuda=True, gpus=(8, 80 * GIB))
    assert settings.placement is not None and settings.placement.colocated
    assert str(settings.placement).endswith(  # not "8 ranks": torchrun's ranks span the nodes
        "FSDP trainer on the ranks torchrun started, every GPU of each node (rank 0 at 127.0.0.1:29600)"
    )
    apply_placement(settings, "fsdp", tiny, TrainerConfig(), on_cuda=False)
    assert str(settings.placement) == (
        "placement: no GPU; the engine and the gloo ranks torchrun started (rank 0 at 127.0.0.1:29600)"
    )
