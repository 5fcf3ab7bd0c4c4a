"""Data parallelism: two ranks (torchrun, gloo on CPU; NCCL on two GPUs) train an attached model
like one process averaging the two halves of each global batch; DDP wrapping, no_sync, clipping,
mismatched settings and checkpoints written at world size 2 and resumed at 1 and 2.

One ``torchrun`` launch runs every case (tests/runtime/dp_worker.py); the tests read its report.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dp_fault_worker import TIMEOUT_S as FAULT_TIMEOUT_S
from dp_worker import STEPS, resume_in_one_process
from torchrun import launch as launch_worker

WORKER = Path(__file__).with_name("dp_worker.py")
# fp32, same kernels and the same summation order as the averaged reference: last-bit noise
# only. A gradient not averaged (or averaged twice) moves weights by ~lr = 1e-2 in 10 steps.
TOL = 1e-5


def launch(
    out: Path, device: str, dtype: str = "float32", backend: str | None = None
) -> list[dict]:
    """Run the worker on two ranks; each rank's report."""
    args = [f"--device={device}", f"--dtype={dtype}"]
    return launch_worker(WORKER, out, *args, *([f"--backend={backend}"] if backend else []))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("dp")
    return launch(out, "cpu"), out


def test_two_ranks_train_like_one_process_averaging_the_halves(cpu_run):
    reports, _ = cpu_run
    for report in reports:
        assert report["world"] == 2
        # Every forward, every backward's start and end exchanged (runtime/parallel/lockstep.py).
        assert report["sharding"]["lockstep_exchanges"] == 3 * STEPS
        assert report["replicated"]["lockstep_exchanges"] == 0
        assert report["dp_vs_averaged"] < TOL
        assert report["dp_ranks_identical"]
        # Against the whole batch in one process, the difference is the one plain torch has
        # between averaged halves and the whole batch (Adam amplifies last-bit differences).
        assert report["dp_vs_whole_batch"] < 2 * report["averaged_vs_whole_batch"] + TOL


@pytest.mark.parametrize("case", ["sharding", "replicated", "forced"])
def test_offloaded_chunks_are_updated_in_the_backward_under_data_parallelism(cpu_run, case):
    """The plain loop takes the update in the backward (auto, or =1): each rank's CPU updates
    the chunks it updates as their averaged gradients arrive, and trains like the averaged
    reference; =0 keeps every update at step() and trains alike."""
    reports, _ = cpu_run
    for report in reports:
        facts = report[case]
        assert facts["update_in_backward"]
        # 9 steps after the first (which decides): every chunk this rank updates, each step.
        assert facts["updates_in_backward"] == 9 * facts["updated_chunks"] > 0
        assert report["at_step"]["updates_in_backward"] == 0
        assert not report["at_step"]["update_in_backward"]
        for key in ("dp", "replicated", "forced", "at_step"):
            assert report[f"{key}_vs_averaged"] < TOL


def test_the_lowest_chunks_are_updated_by_their_owners_device_in_the_backward(cpu_run):
    """AUTOOFFLOAD_GPU_UPDATE_IN_BACKWARD=2 under sharded state: each of the two lowest
    offloaded chunks is updated by its owner's device path (the kernels on the averaged
    gradients, behind their collective) in 9 of 10 steps, the rest by the CPUs in the
    backward, and training equals the averaged reference."""
    reports, _ = cpu_run
    facts = [report["on_device"] for report in reports]
    assert sum(f["gpu_updates_in_backward"] for f in facts) == 9 * 2
    assert all(f["gpu_updates_in_backward"] == 9 for f in facts)  # owned round-robin
    owned = sum(f["updated_chunks"] for f in facts)
    assert sum(f["updates_in_backward"] for f in facts) == 9 * (owned - 2)
    for report in reports:
        assert report["on_device_vs_averaged"] < TOL


@pytest.mark.parametrize("case", ["sharding", "replicated"])
def test_the_gradient_collective_is_measured_at_attach_and_agreed(cpu_run, case):
    """reduce (sharded) or all-reduce (replicated) of a chunk's gradients, and the all-reduce
    of persistent ones, timed at attach; every rank keeps the slowest rank's figure, so their
    cost models agree."""
    reports, _ = cpu_run
    measured = [report[case]["gradient_bps"] for report in reports]
    assert 0 < measured[0] < float("inf")
    assert measured[0] == measured[1]
    # The all-reduce of persistent chunks' gradients (either state), timed alike.
    allreduce = [report[case]["allreduce_bps"] for report in reports]
    assert 0 < allreduce[0] < float("inf") and allreduce[0] == allreduce[1]
    if case == "replicated":
        assert allreduce == measured


def test_sharded_state_each_rank_keeps_its_half_and_saving_needs_consolidate(cpu_run):
    reports, _ = cpu_run
    facts = [report["sharding"] for report in reports]
    assert all(f["sharded"] for f in facts)
    offloaded = facts[0]["offloaded"]
    assert offloaded > 2
    # Chunks are owned round-robin: every master exists on exactly one rank.
    assert sum(f["masters"] for f in facts) == offloaded
    assert all(0 < f["masters"] < offloaded for f in facts)
    for f in facts:
        assert "autooffload.consolidate(model) on every rank" in f["unconsolidated_error"]
    # consolidate(to=0) copies the other rank's chunks to rank 0 alone.
    assert facts[0]["consolidated_to_0_error"] is None
    assert "to=1 for this rank" in facts[1]["consolidated_to_0_error"]


def test_a_long_first_profiling_step_is_measured_on_every_rank_as_rank_0_decides(cpu_run):
    """Rank 0 finds its first profiling step long, rank 1 does not: both measure it (one
    profiling step; the plan read before each forward, which switches), no rank waits in a
    collective the other skipped, and training is the averaged reference's."""
    reports, _ = cpu_run
    for report in reports:
        sources = report["long_first_step_sources"]
        assert sources[:2] == ["profiling step"] * 2, sources
        assert all(source.startswith("search") for source in sources[2:]), sources
        assert report["long_first_step_vs_averaged"] < TOL


def test_the_fused_head_trains_like_the_averaged_reference(cpu_run):
    """AUTOOFFLOAD_FUSED_HEAD=1 on both ranks (sharded state): every step of each rank is
    fused, and the replicas train like one process averaging the halves."""
    reports, _ = cpu_run
    for report in reports:
        assert report["fused_head"]["fused_steps"] == STEPS
        assert report["sharding"]["fused_steps"] == 0
        assert report["fused_head_vs_averaged"] < TOL


def test_lora_shards_the_frozen_base_and_trains_like_the_averaged_reference(cpu_run):
    """LoRA: every chunk is frozen; each rank hosts its own half of the base model and gathers
    the other half by broadcast, the resident adapters are averaged, and the replicas (built
    from different seeds) train like one process averaging the halves."""
    reports, _ = cpu_run
    facts = [report["lora"] for report in reports]
    assert all(f["sharded"] and f["resident"] > 0 for f in facts)
    assert all(f["gradient_bps"] == float("inf") for f in facts)
    assert facts[0]["frozen_chunks"] == facts[0]["chunks"] >= 2
    assert_each_rank_hosts_its_share(facts)
    for report in reports:
        assert report["lora_vs_averaged"] < TOL


def assert_each_rank_hosts_its_share(facts: list[dict]) -> None:
    """Every chunk is hosted once across the ranks, and each rank hosts part of the model."""
    total = facts[0]["total_bytes"]
    assert sum(f["host_store_bytes"] for f in facts) == total
    assert all(0 < f["host_store_bytes"] < total for f in facts)


def test_qlora_base_is_sharded_with_its_quant_states_and_trains_like_one_process(cpu_run):
    """QLoRA (bitsandbytes nf4, double quantization) under data parallelism: the packed 4-bit
    weights and every quant-state tensor travel in their chunks, each rank hosts its own
    chunks' part, rank 1's base (quantized from another seed) is replaced by rank 0's at
    attach, and the adapters train like one process averaging the halves."""
    reports, _ = cpu_run
    facts = [report["qlora"] for report in reports]
    for f in facts:
        assert f["sharded"] and f["quant_state_tensors_chunked"]
        # All but the one persistent chunk's (n_persist=1) quantized weights are offloaded.
        assert 0 < f["quantized_offloaded"] < f["quantized"]
    assert_each_rank_hosts_its_share(facts)
    for report in reports:
        assert report["qlora_vs_averaged"] < TOL


def test_sharded_state_each_rank_hosts_only_its_own_trainable_chunks(cpu_run):
    """The bf16 (here fp32) host copies are sharded too: a trainable chunk's bytes live on its
    owner's host alone, so the ranks' host stores together hold each trainable chunk once."""
    reports, _ = cpu_run
    facts = [report["sharding"] for report in reports]
    trainable = facts[0]["trainable_bytes"]
    assert sum(f["hosted_trainable_bytes"] for f in facts) == trainable > 0
    for f in facts:
        assert 0 < f["hosted_trainable_bytes"] < trainable
        # Every chunk of this model trains: the host store holds this rank's chunks only.
        assert f["host_store_bytes"] == f["hosted_trainable_bytes"]
    # Replicated state keeps every chunk on every host.
    for report in reports:
        replicated = report["replicated"]
        assert replicated["hosted_trainable_bytes"] == replicated["trainable_bytes"]


def test_a_vocabulary_chunk_counts_as_its_bytes_in_chunk_ownership(cpu_run):
    """Chunk ownership is balanced by bytes at attach: the rank owning an embedding three
    blocks large hosts about as many bytes as the other (round robin: 2.5 blocks more)."""
    reports, _ = cpu_run
    facts = [report["vocab_ownership"] for report in reports]
    sizes = facts[0]["chunk_bytes"]
    block = max(sizes[1:-1])
    assert sizes[0] > 2.5 * block  # the embedding, an oversized chunk
    hosted = [f["host_store_bytes"] for f in facts]
    assert sorted(facts[0]["hosted"] + facts[1]["hosted"]) == list(range(len(sizes)))
    assert sum(hosted) == sum(sizes)
    assert max(hosted) - min(hosted) <= 1.5 * block, hosted
    round_robin = [sum(sizes[rank::2]) for rank in range(2)]
    assert max(round_robin) - min(round_robin) > 2 * block


def test_chunks_made_persistent_take_their_owners_optimizer_state(cpu_run):
    reports, _ = cpu_run
    for report in reports:
        assert report["promoted_params"] > 0
        assert report["promote_vs_averaged"] < TOL


def test_chunks_moved_back_to_the_cpu_give_their_state_to_their_owners_twins(cpu_run):
    """A re-plan with fewer persistent chunks under sharded state: each demoted chunk's owner
    makes masters and takes the optimizer state, the other rank drops its replica of it, and
    training goes on like one process averaging the halves."""
    reports, _ = cpu_run
    facts = [report["demoted"] for report in reports]
    assert facts[0]["demoted_params"] == facts[1]["demoted_params"] > 0
    # Two chunks demoted, one owned by each rank.
    assert all(0 < f["new_masters"] < f["demoted_params"] for f in facts)
    assert sum(f["new_masters"] for f in facts) == facts[0]["demoted_params"]
    assert all(f["state_left_in_optimizer"] == 0 for f in facts)
    for report in reports:
        assert report["demote_vs_averaged"] < TOL


def test_calibration_under_data_parallelism_takes_every_ranks_peak_and_one_plan(cpu_run):
    """Only rank 1 measured a peak over the prediction; both ranks calibrate and re-plan alike
    (rank 0 alone would have kept its plan), and the trajectory is unchanged."""
    reports, _ = cpu_run
    facts = [report["calibration"] for report in reports]
    assert all(f["room"] for f in facts), "the plan is already the smallest: nothing to test"
    assert all(f["source"].endswith("calibrated") and f["replanned"] for f in facts), facts
    assert facts[0]["knobs"] == facts[1]["knobs"] != facts[0]["planned_knobs"]
    # The auto mode's decision and choice after the profiling steps: rank 0's, on both.
    assert facts[0]["update_in_backward"] == facts[1]["update_in_backward"]
    assert facts[0]["predicted_with_without"] == facts[1]["predicted_with_without"] is not None
    assert facts[0]["fragmentation"] == facts[1]["fragmentation"] > 1.1
    for report in reports:
        assert report["calibrate_vs_averaged"] < TOL


def test_replicated_state_still_trains_like_one_process(cpu_run):
    reports, _ = cpu_run
    for report in reports:
        facts = report["replicated"]
        assert not facts["sharded"] and facts["masters"] == facts["offloaded"]
        assert facts["unconsolidated_error"] is None
        assert report["replicated_vs_averaged"] < TOL


def test_ddp_wrapper_no_sync_accumulation_clipping_and_start_up_broadcast(cpu_run):
    # Rank 1 built its model from another seed: DDP's start-up broadcast made it rank 0's.
    reports, _ = cpu_run
    for report in reports:
        assert report["ddp_vs_averaged"] < TOL
        assert report["ddp_ranks_identical"]


def test_autooffload_no_sync_without_ddp_accumulates_then_averages(cpu_run):
    reports, _ = cpu_run
    for report in reports:
        assert report["no_sync_vs_averaged"] < TOL


@pytest.mark.parametrize("shard", ["on", "off"])
def test_params_no_rank_uses_are_left_alone_as_ddp_leaves_them(cpu_run, shard):
    """Unused params in a persistent, an offloaded and the post part's chunk: they took part
    in the average with zero gradients, and AdamW's weight decay moved them (by ~1e-3 here)."""
    reports, _ = cpu_run
    for report in reports:
        assert "error" not in report, report["error"]
        assert report[f"unused_shard_{shard}_moved"] == 0
        assert report[f"unused_shard_{shard}_vs_averaged"] < TOL


def test_a_module_run_on_one_rank_only_trains_like_the_averaged_reference(cpu_run):
    """Rank 1 never runs the branch's chunk: its collectives went out in another order and
    the job failed (gloo: mismatched sizes). Replicated state only: under sharding every
    gather of an offloaded chunk is a collective, which such a forward does not pair up."""
    reports, _ = cpu_run
    for report in reports:
        assert "error" not in report, report["error"]
        assert report["branch_vs_averaged"] < TOL


def test_a_module_run_by_a_forward_hook_is_averaged_after_its_backward(cpu_run):
    reports, _ = cpu_run
    for report in reports:
        assert "error" not in report, report["error"]
        assert report["hooked_branch_vs_averaged"] < TOL


def test_mismatched_settings_raise_the_same_error_on_every_rank(cpu_run):
    reports, _ = cpu_run
    errors = {report["mismatch_error"] for report in reports}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("ranks disagree on") and "n_persist" in error
    errors = {report["shard_mismatch_error"] for report in reports}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("ranks disagree on") and "shard_optimizer" in error


def test_host_memory_short_on_one_rank_fails_every_ranks_attach(cpu_run):
    """A rank whose host check fails would leave the others waiting in the attach's next
    collective: every rank raises it, naming the rank and the setting."""
    reports, _ = cpu_run
    errors = [report["host_budget_error"] for report in reports]
    assert errors[1].startswith("autooffload needs") and "AUTOOFFLOAD_HOST_BUDGET=1000" in errors[1]
    assert errors[0] == f"rank 1: {errors[1]}"


def test_generate_to_different_lengths_on_each_rank_keeps_the_ranks_in_step(cpu_run):
    """Under sharded state ``generate`` runs with ``synced_gpus`` (as for ZeRO-3): the rank
    that stops first keeps gathering until the other is done, so both issue the same
    collectives, and each rank's greedy tokens are plain generate's."""
    reports, _ = cpu_run
    facts = [report["generate"] for report in reports]
    assert [f["new_tokens"] for f in facts] == [3, 7]
    assert all(f["same_tokens"] for f in facts)
    assert facts[0]["gathers"] == facts[1]["gathers"] > 0


def test_checkpoint_of_two_ranks_resumes_at_two_and_at_one(cpu_run):
    reports, out = cpu_run
    for report in reports:
        assert report["resume2_vs_averaged"] < TOL
    # World size 1: this process, attached, the two halves as gradient accumulation.
    resumed = resume_in_one_process(out / "world2.pt", 2)
    expected = torch.load(out / "averaged.pt", weights_only=True)
    for name, weight in expected.items():
        torch.testing.assert_close(resumed[name], weight, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_an_exception_on_one_rank_surfaces_on_the_other_without_a_hang(tmp_path, mode):
    """Rank 1 raises mid-forward and exits (or stays alive, hung): rank 0, at the start of its
    backward, raises too, at once or at the process group's timeout, never hangs."""
    worker = WORKER.with_name("dp_fault_worker.py")
    rank0, rank1 = launch_worker(worker, tmp_path, f"--mode={mode}", expect_failure=True)
    assert rank1["outcome"].startswith("Boom")
    # At the start of its backward, rank 0 waits for rank 1 to start one too: gloo's error if
    # it sees rank 1's connection close, else ours at the timeout.
    if not rank0["outcome"].startswith("RuntimeError"):
        assert rank0["outcome"].startswith("OutOfStepError")
        assert "process group's timeout" in rank0["outcome"] and "a backward" in rank0["outcome"]
    assert rank0["seconds"] < FAULT_TIMEOUT_S + 20  # the group's timeout, plus start-up slack


def same_error_at_once(out: Path, mode: str) -> str:
    """The fault worker's ``mode`` on two ranks: both failed with one outcome, before the
    process group's timeout; that outcome."""
    worker = WORKER.with_name("dp_fault_worker.py")
    rank0, rank1 = launch_worker(worker, out, f"--mode={mode}", expect_failure=True)
    assert rank0["outcome"] == rank1["outcome"] != "finished"
    assert rank0["seconds"] < FAULT_TIMEOUT_S and rank1["seconds"] < FAULT_TIMEOUT_S
    return rank0["outcome"]


def test_a_forward_on_one_rank_only_is_a_clear_error_on_every_rank(tmp_path):
    """Under sharded state, rank 0 evaluates a batch (no grad) while rank 1 starts its next
    training forward: their gathers would pair up (and later send one chunk's bytes into
    another's storage). Both ranks raise the same error at once, before any gather."""
    outcome = same_error_at_once(tmp_path, "alone")
    assert outcome.startswith("OutOfStepError: autooffload: the ranks are out of")
    assert "rank 0: a forward without gradients" in outcome
    assert "rank 1: a forward with gradients" in outcome
    assert "AUTOOFFLOAD_SHARD_OPTIMIZER=off" in outcome


def test_chunk_collectives_that_differ_between_ranks_are_a_clear_error_on_every_rank(tmp_path):
    """Each exchange carries a hash of the chunk gathers and reduces issued since the last one:
    rank 1 counts one more before its forward, and both ranks raise the same error there."""
    outcome = same_error_at_once(tmp_path, "sequence")
    assert outcome.startswith("OutOfStepError: autooffload: the ranks issued")
    assert "before a forward with gradients" in outcome
    assert "a module ran on some ranks only" in outcome


def test_a_module_run_on_one_rank_under_sharded_state_fails_both_ranks_without_a_hang(
    tmp_path,
):
    """Its gathers leave the ranks' broadcasts unpaired: the rank in the broadcast fails at
    the timeout, the other at its next exchange (documented: replicated state runs it)."""
    worker = WORKER.with_name("dp_fault_worker.py")
    rank0, rank1 = launch_worker(worker, tmp_path, "--mode=branch", expect_failure=True)
    for report in (rank0, rank1):
        assert report["outcome"] != "finished"
        assert report["outcome"].startswith(("RuntimeError", "OutOfStepError"))
        assert report["seconds"] < FAULT_TIMEOUT_S + 20


def test_a_forward_while_the_other_rank_waits_warns_then_fails_at_the_timeout(tmp_path):
    """Rank 0 evaluates alone while rank 1 waits in a barrier (``if rank == 0: generate``):
    rank 0 warns once after STALL_WARNING_S, and raises at the process group's timeout."""
    worker = WORKER.with_name("dp_fault_worker.py")
    rank0, rank1 = launch_worker(worker, tmp_path, "--mode=barrier", expect_failure=True)
    assert rank0["outcome"].startswith("OutOfStepError")
    assert "a forward without gradients" in rank0["outcome"]
    assert FAULT_TIMEOUT_S - 1 < rank0["seconds"] < FAULT_TIMEOUT_S + 20
    assert len(rank0["warnings"]) == 1 and "has waited 1 s" in rank0["warnings"][0]
    assert rank1["outcome"] != "finished"


def check_cuda_ranks(out: Path, backend: str) -> None:
    """fp32 and bf16 runs of the worker on CUDA tensors match the averaged reference."""
    reports = launch(out / "fp32", "cuda", "float32", backend)
    for report in reports:
        # CUDA kernels of one process vs two: same math, last-bit differences amplified by Adam.
        assert report["dp_vs_averaged"] < 1e-4
        assert report["ddp_vs_averaged"] < 1e-4
        assert report["resume2_vs_averaged"] < 1e-4
        assert report["dp_ranks_identical"] and report["ddp_ranks_identical"]
        # Sharded (the default) and replicated CPU optimizer state, and a re-plan promoting
        # sharded chunks, all train like one process.
        assert report["sharding"]["sharded"] and report["sharding"]["masters"] > 0
        assert report["replicated_vs_averaged"] < 1e-4
        # The update in the backward: on by default for this loop, exact, and =0.
        assert report["sharding"]["updates_in_backward"] > 0
        assert report["forced_vs_averaged"] < 1e-4 and report["at_step_vs_averaged"] < 1e-4
        assert report["on_device"]["gpu_updates_in_backward"] == 9
        assert report["on_device_vs_averaged"] < 1e-4
        assert report["promoted_params"] > 0 and report["promote_vs_averaged"] < 1e-4
        assert report["demoted"]["demoted_params"] > 0 and report["demote_vs_averaged"] < 1e-4
        # Frozen chunks sharded (LoRA), unused params, a branch, generate, errors.
        assert report["lora"]["sharded"] and report["lora_vs_averaged"] < 1e-4
        assert report["qlora"]["quant_state_tensors_chunked"]
        assert report["qlora"]["sharded"] and report["qlora_vs_averaged"] < 1e-4
        for shard in ("on", "off"):
            assert report[f"unused_shard_{shard}_moved"] == 0
            assert report[f"unused_shard_{shard}_vs_averaged"] < 1e-4
        assert report["branch_vs_averaged"] < 1e-4
        assert report["mismatch_error"].startswith("ranks disagree on")
        assert "came after its gradients were averaged" in report["hooked_branch_error"]
    facts = [report["sharding"] for report in reports]
    assert sum(f["hosted_trainable_bytes"] for f in facts) == facts[0]["trainable_bytes"] > 0
    generated = [report["generate"] for report in reports]
    assert [f["new_tokens"] for f in generated] == [3, 7]
    assert all(f["same_tokens"] for f in generated)
    assert generated[0]["gathers"] == generated[1]["gathers"] > 0
    if backend == "nccl-emulated":
        # The NCCL branches ran, every collective on this rank's device (else an error above).
        calls = [report["nccl_emulated_calls"] for report in reports]
        assert all(report["emulation_rejects_host_tensors"] for report in reports)
        assert all(c["broadcast"] > 0 and c["reduce"] > 0 and c["all_reduce"] > 0 for c in calls)
        # Consolidating to one rank (the checkpoint) sends point to point.
        assert sum(c.get("send", 0) for c in calls) == sum(c.get("recv", 0) for c in calls) > 0
    reports = launch(out / "bf16", "cuda", "bfloat16", backend)
    for report in reports:
        assert report["dp_ranks_identical"] and report["ddp_ranks_identical"]
        # bf16: both references are a few bf16 ulps (~0.008 at 1.0) from any other rounding
        # of the same math; the yardstick is plain torch's whole-batch vs averaged-halves gap.
        assert report["dp_vs_averaged"] <= 2 * report["averaged_vs_whole_batch"] + 1e-3


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_nccl_fp32_and_bf16(tmp_path):
    check_cuda_ranks(tmp_path, "nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["gloo", "nccl-emulated"])
def test_two_ranks_sharing_one_gpu_fp32_and_bf16(tmp_path, backend):
    """The CUDA side of data parallelism on one GPU: chunk buffers, side streams, the owner's
    GPU update and the update in the backward. NCCL refuses two ranks on one device, so the
    collectives run over gloo: in gloo's branches, and in NCCL's with its tensor contract
    checked (``nccl_emulation.py``); NCCL's own stream and transport are left out."""
    check_cuda_ranks(tmp_path, backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_lockstep_group_takes_the_timeout_of_an_nccl_default_group(tmp_path, backend):
    """The exchange's gloo group (made under torchrun's NCCL group, or accelerate's mixed one)
    times out with the user's group, not gloo's 30 min default; one rank, since NCCL refuses
    two on one GPU."""
    worker = Path(__file__).with_name("lockstep_nccl_worker.py")
    (report,) = launch_worker(worker, tmp_path, f"--backend={backend}", nproc=1)
    assert "nccl" in report["backend"]
    assert report["timeout_s"] == report["lockstep_timeout_s"] == 17
    assert report["exchanges"] == 1


@pytest.mark.parametrize(
    ("local_world", "threads", "expected"), [("1", 1, 1), ("2", 1, 4), ("2", 6, 6), ("4", 1, 2)]
)
def test_each_rank_takes_its_share_of_the_cores(monkeypatch, local_world, threads, expected):
    """torchrun's OMP_NUM_THREADS=1 would leave the CPU optimizer on one core: each of the
    node's ranks takes cores // local_world_size, unless the user set more."""
    from autooffload.runtime.parallel import distributed

    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        distributed.share_cpu_threads()
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_the_reduce_order_follows_completion_in_the_backward():
    """By each chunk's earliest user in the forward, latest first (ties: higher index first);
    frozen chunks are left out; a chunk with a group that did not run completes only at the
    end of a backward, so it comes last."""
    from autooffload.runtime.chunks.layout import Chunk, ChunkLayout, ParamSlot
    from autooffload.runtime.hooks import reduce_order

    def chunk(index: int, groups: set[int], trainable: bool = True) -> Chunk:
        param = torch.nn.Parameter(torch.zeros(1), requires_grad=trainable)
        slot = ParamSlot(param, f"p{index}", 0, 4, param.shape, param.dtype)
        return Chunk(index, 4, [slot], groups)

    chunks = [
        chunk(0, {0, 5}),  # a tied embedding: its earliest user runs first
        chunk(1, {1}),
        chunk(2, {2}, trainable=False),
        chunk(3, {2, 3}),
        chunk(4, {3}),
        chunk(5, {4, 9}),  # group 9 did not run in that forward
        chunk(6, {5}),
    ]
    layout = ChunkLayout(4, chunks, {})
    positions = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    assert reduce_order(layout, positions) == [6, 4, 3, 1, 0, 5]
