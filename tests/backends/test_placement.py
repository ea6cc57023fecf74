"""The split placement (`TrainerConfig(placement="split")`): the setting, where it is refused, and the GPUs each
process is given. GPUs are absent here, so what is checked is every pure step from the setting to the
environment of vLLM's process and of each trainer rank; nothing was run on GPUs."""

import doctest

import pytest
from pydantic import ValidationError

import artnb as art
from artnb import models
from artnb.backends import placement as placement_module
from artnb.backends.model_setup import apply_placement, trainer_config_for
from artnb.backends.placement import plan_placement, visible_devices
from artnb.backends.trainers import fsdp_trainer
from artnb.backends.trainers.choice import check_placement
from artnb.backends.trainers.fsdp_trainer import local_placement, rank_environment
from artnb.core.config import TrainerConfig
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
    assert (settings.vllm_args, settings.vllm_env) == ([], {})


def test_split_placement_gives_vllm_the_first_half_and_the_ranks_the_second(tiny):
    """placement="split" reaches local_placement; on 4 GPUs of a process that sees physical GPUs 4-7, vLLM gets
    4,5 (awake: no sleep mode) and each of the 2 ranks sees 6,7, rank r using the r-th."""
    split = local_placement(tiny, TrainerConfig(placement="split"), gpus=(4, 80 * GIB))
    assert (split.serve_gpus, split.train_gpus) == ((0, 1), (2, 3))
    assert str(split).startswith(
        "placement: split (vLLM stays awake while the trainer steps); vLLM on GPUs [0, 1]"
    )
    assert split.vllm_args() == [
        "--tensor-parallel-size", "1", "--data-parallel-size", "2", "--no-enable-sleep-mode"
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
    args = parser.parse_args(["--enable-sleep-mode", *split.vllm_args()])
    assert (args.enable_sleep_mode, args.tensor_parallel_size, args.data_parallel_size) == (False, 1, 2)
