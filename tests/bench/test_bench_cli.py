"""End to end on the CPU: `python -m autooffload.bench` runs llama-tiny through every CPU peer."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import autooffload
from autooffload.bench.__main__ import main
from autooffload.bench.deepspeed_configs import HOST_OOM
from autooffload.bench.peer_autooffload import _planned_profile, search_request_from_dict
from autooffload.bench.runner import exit_reason, sweep_outcome, worker_env
from autooffload.plan.configuration import with_checkpoint_inputs_on_cpu
from autooffload.plan.cost_memory import predict_peak_bytes
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.search import make_plan
from autooffload.plan.types import Knobs
from tests.plan.plan_profiles import make_hardware, make_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_KEYS = {
    "workload": str,
    "peer": str,
    "peer_label": str,
    "cap": str,
    "status": str,
    "repeat": int,
    "bs": int,
    "seq": int,
}
OK_KEYS = {
    "tokens_per_s": float,
    "step_s_median": float,
    "step_s": list,
    "losses": list,
    "loss_first": float,
    "loss_final": float,
    "host_rss_peak_gib": float,
    "versions": dict,
    "device_name": str,
    "date": str,
    "loss_check": str,
}


def _runtime_landed() -> bool:
    """True once the autooffload runtime exists: then its peer must run ok, not be skipped."""
    package = Path(autooffload.__file__ or "").parent if autooffload.__file__ else None
    has_runtime = package is not None and (package / "runtime" / "__init__.py").exists()
    return has_runtime and callable(getattr(autooffload, "enable", None))


def check_schema(payload: dict) -> None:
    """The JSON document the bench writes: top-level metadata, runs and summary rows."""
    assert payload["schema"] == "autooffload.bench/1"
    for key in ("command", "date", "device", "args", "workloads", "environment", "summary"):
        assert key in payload, key
    assert payload["command"].startswith("python -m autooffload.bench")
    for run in payload["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (key, run[key])
        assert run["status"] in ("ok", "OOM", "error", "skipped", "timeout")
        if run["status"] == "ok":
            for key, kind in OK_KEYS.items():
                assert isinstance(run[key], kind), (key, run.get(key))
            assert run["tokens_per_s"] > 0
            assert len(run["step_s"]) == run["warmup"] + run["steps"]
        else:
            assert run["reason"], run
    for row in payload["summary"]:
        assert {"workload", "cap", "peer_label", "status", "tokens_per_s"} <= set(row)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    peers = "vanilla,fsdp2_offload,deepspeed_offload,autooffload,_oom,_error,_crash,vanilla"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", peers]
    argv += ["--steps", "2", "--warmup", "1", "--out", str(out), "--plot"]
    assert main(argv) == 0
    return json.loads(out.read_text()), str(out), out.with_suffix(".png")


def _run(payload: dict, label: str) -> dict:
    return next(r for r in payload["runs"] if r["peer_label"] == label)


def test_writes_valid_json_and_png(tiny_run: tuple[dict, str, Path]) -> None:
    payload, _, png = tiny_run
    check_schema(payload)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_vanilla_and_fsdp2_run_ok_on_cpu_and_losses_agree(
    tiny_run: tuple[dict, str, Path],
) -> None:
    payload, _, _ = tiny_run
    vanilla = _run(payload, "vanilla")
    assert vanilla["status"] == "ok", vanilla.get("reason")
    assert vanilla["loss_final"] < vanilla["loss_first"]  # the repeated batch is being learnt
    fsdp2 = _run(payload, "fsdp2_offload")
    assert fsdp2["status"] == "ok", fsdp2.get("reason")
    assert fsdp2["loss_check"] == "ok"


def test_autooffload_peer_ok_once_runtime_landed(tiny_run: tuple[dict, str, Path]) -> None:
    payload, _, _ = tiny_run
    run = _run(payload, "autooffload")
    if _runtime_landed():
        assert run["status"] == "ok", run.get("reason")
        assert run["loss_check"] == "ok", (run["loss_final"], run["loss_vs_vanilla"])
        assert "plan" in run and "breakdown" in run
        # The CPU worker's work step by step, warm-up included: the profiling steps update
        # every offloaded param for real.
        per_step = run["cpu_per_step"]
        assert len(per_step) == len(run["step_s"])
        assert sum(step["params"] for step in per_step) > 0, per_step
        # The kernels are part of the worker's busy time.
        assert 0 < sum(s["kernel_s"] for s in per_step) <= sum(s["busy_s"] for s in per_step)
        # The feasible set the plan came from, summarised, with the plan on its frontier.
        summary = run["candidates"]
        assert summary["count"] >= len(summary["frontier"]) >= 1, summary
        assert summary["chosen_on_frontier"] is True
        assert summary["chosen"][2:] == [run["plan"][k] for k in summary["columns"][2:]]
        # What the plan was searched on: the cost model re-run offline on the JSON's profile
        # and hardware gives the plan's predictions back.
        profile = ModelProfile.from_dict(run["model_profile"])
        hw = HardwareProfile.from_dict(run["hardware"])
        names = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")
        knobs = Knobs(*(run["plan"][k] for k in names))
        step_s, breakdown, _ = predict_step_time(profile, hw, knobs)
        assert step_s == pytest.approx(run["predicted_step_s"], rel=1e-9)
        assert predict_peak_bytes(profile, hw, knobs) == run["predicted_peak_bytes"]
        assert run["predicted_breakdown"]["h2d_bytes"] == pytest.approx(breakdown["h2d_bytes"])
        # The search itself, from the measured profile: re-run offline, it finds the plan.
        request = search_request_from_dict(run["search_request"], run["hardware"])
        again = request.plan()
        assert [getattr(again, k) for k in names] == [run["plan"][k] for k in names]
        assert again.predicted_step_s == pytest.approx(run["predicted_step_s"], rel=1e-9)
    else:
        assert run["status"] in ("error", "skipped")
        assert "autooffload" in run["reason"]


def test_oom_is_reported_and_the_harness_goes_on(tiny_run: tuple[dict, str, Path]) -> None:
    payload, _, _ = tiny_run
    run = _run(payload, "_oom")
    assert run["status"] == "OOM"
    assert "out of memory" in run["reason"].lower()
    # Where it failed: in the peer's set-up (no step yet), and the innermost frames.
    assert run["failed_step"] is None and "OutOfMemoryError" in run["traceback_tail"][-1]
    assert "_setup_oom" in "\n".join(run["traceback_tail"])
    labels = [r["peer_label"] for r in payload["runs"]]
    assert labels.index("_oom") < len(labels) - 1  # later runs still happened
    assert payload["runs"][-1]["status"] == "ok"


def test_errors_and_dead_workers_are_statuses(tiny_run: tuple[dict, str, Path]) -> None:
    payload, _, _ = tiny_run
    error = _run(payload, "_error")
    assert error["status"] == "error"
    assert "simulated failure" in error["reason"] and "Traceback" in error["reason"]
    crash = _run(payload, "_crash")
    assert crash["status"] == "error"
    assert "exited with code 7" in crash["reason"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed here")
def test_missing_deepspeed_is_skipped_with_reason(tiny_run: tuple[dict, str, Path]) -> None:
    payload, _, _ = tiny_run
    run = _run(payload, "deepspeed_offload")
    assert run["status"] == "skipped"
    assert "deepspeed not importable" in run["reason"]


def test_table_marks_failures(tiny_run: tuple[dict, str, Path], capsys) -> None:
    _, out, _ = tiny_run
    assert main(["--from-json", out]) == 0
    table = capsys.readouterr().out
    assert "| llama-tiny | none | vanilla | ok |" in table
    assert "skipped: deepspeed not importable" in table
    assert "_oom: OOM: OutOfMemoryError" in table


def test_dry_run_prints_runs_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "never.json"
    argv = ["--workload", "llama-8b-lora,llama-8b-qlora", "--cap", "8GiB,none", "--dry-run"]
    argv += ["--peers", "vanilla,fsdp2_offload,autooffload[n_persist=0,n_buffer=4]"]
    argv += ["--repeat", "2", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "dry run: 24 runs" in text
    assert "autooffload[n_persist=0,n_buffer=4]" in text
    assert "skipped: FSDP2 cannot shard bitsandbytes" in text
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--workload", "llama-99b"], ["unknown workload 'llama-99b'", "llama-1b-full"]),
        (["--workload", "llama-tiny", "--peers", "vanilla,zero9"], ["unknown peer", "autooffload"]),
        (["--workload", "llama-tiny", "--cap", "12 bananas"], ["invalid size", "12GiB"]),
    ],
)
def test_bad_names_are_clear_errors(argv: list[str], names: list[str], capsys) -> None:
    assert main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err


def test_nproc_runs_each_peer_data_parallel_and_reports_scaling(tmp_path: Path) -> None:
    """``--nproc 1,2``: the two-rank runs go through torchrun (DDP for vanilla, autooffload's
    own averaging), train the same model to the same loss, and get a scaling efficiency."""
    out = tmp_path / "dp.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla,autooffload"]
    argv += ["--nproc", "1,2", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    check_schema(payload)
    for label in ("vanilla x2", "autooffload x2"):
        run = _run(payload, label)
        assert run["status"] == "ok", run.get("reason")
        assert run["nproc"] == 2
        assert run["tokens_per_s"] == pytest.approx(2 * run["tokens_per_s_per_gpu"])
    # Same batch on every rank: the averaged gradient is the one-rank gradient.
    for peer in ("vanilla", "autooffload"):
        one, two = _run(payload, peer), _run(payload, f"{peer} x2")
        assert two["loss_final"] == pytest.approx(one["loss_final"], abs=1e-4)
    rows = {row["peer_label"]: row for row in payload["summary"]}
    assert rows["autooffload x2"]["scaling"] > 0
    assert rows["autooffload"]["scaling"] is None
    # The host holds both ranks: each one's peak RSS is recorded, rank 0's first.
    two = _run(payload, "vanilla x2")
    assert len(two["host_rss_ranks_gib"]) == 2
    assert two["host_rss_ranks_gib"][0] == two["host_rss_peak_gib"]
    assert two["host_rss_total_gib"] == pytest.approx(sum(two["host_rss_ranks_gib"]))


def test_bad_nproc_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--workload", "llama-tiny", "--nproc", "0", "--dry-run"])
    assert "invalid --nproc" in capsys.readouterr().err


def test_runs_after_the_deadline_are_recorded_as_skipped(tmp_path: Path) -> None:
    out = tmp_path / "late.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla,autooffload"]
    argv += ["--cap", "1GiB,none", "--deadline", "0", "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    check_schema(payload)
    assert len(payload["runs"]) == 4
    assert {r["status"] for r in payload["runs"]} == {"skipped"}
    assert all("--deadline" in r["reason"] for r in payload["runs"])


def test_a_run_still_going_at_the_end_is_killed(tmp_path: Path) -> None:
    out = tmp_path / "end.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla"]
    assert main([*argv, "--end-by", "0", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["status"], run["reason"]) == ("timeout", "killed after 0 s")


def test_each_rank_gets_its_share_of_the_cores(monkeypatch) -> None:
    """torchrun would leave every rank's CPU optimizer one OpenMP thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert worker_env(2)["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert "OMP_NUM_THREADS" not in worker_env(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_env(2)["OMP_NUM_THREADS"] == "3"


def test_a_rank_killed_under_torchrun_reads_as_a_host_oom() -> None:
    tail = "rank      : 1 (local_rank: 1)\nexitcode  : -9 (pid: 4321)\n"
    tail += "traceback : Signal 9 (SIGKILL) received by PID 4321"
    reason = exit_reason(1, tail, nproc=2)
    assert reason.endswith("(a rank was killed by SIGKILL; host out of memory?)")
    assert sweep_outcome({"status": "error", "message": reason}) == HOST_OOM
    assert exit_reason(-9, "", nproc=1).endswith("(killed by SIGKILL; host out of memory?)")
    assert "SIGKILL" not in exit_reason(1, "ValueError: boom", nproc=2)


def test_the_recorded_profile_is_the_planned_layout_variant() -> None:
    # A plan with checkpointed inputs in host memory was costed on the variant profile: the JSON
    # records that one, so the offline re-run above holds for such plans too.
    profile, hw = make_profile(), make_hardware()
    runtime = SimpleNamespace(profile=profile, search_request=SimpleNamespace(hw=hw))
    knobs = Knobs(0, 2, 0, 2)
    assert _planned_profile(runtime, make_plan(profile, hw, knobs, None)) is profile
    on_cpu = make_plan(with_checkpoint_inputs_on_cpu(profile, hw), hw, knobs, None)
    assert "checkpoint_cpu" in on_cpu.block_policies
    recorded = _planned_profile(runtime, on_cpu)
    assert recorded.checkpoint_inputs_on_cpu
    assert predict_step_time(recorded, hw, knobs)[0] == pytest.approx(on_cpu.predicted_step_s)


def test_a_run_that_fails_in_a_step_records_what_its_peer_planned_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An OOM in a step keeps the peer's failure report (autooffload: the plan's breakdown and
    its search request) beside the failure, for an offline re-plan."""
    import torch

    from autooffload.bench import _worker, peers
    from autooffload.bench.trainee import Trainee

    class FailingTrainee(Trainee):
        def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def failure_report(self) -> dict:
            return {"search_request": {"budget_bytes": 123}}

    def setup(ctx: peers.PeerContext) -> Trainee:
        model = torch.nn.Linear(2, 2)
        return FailingTrainee(model, torch.optim.SGD(model.parameters(), lr=0.1))

    monkeypatch.setattr(peers, "get_peer", lambda name: peers.PeerDef(setup, "test"))
    result = _worker.run(
        {
            "workload": "llama-tiny",
            "device": "cpu",
            "seed": 0,
            "warmup": 1,
            "steps": 1,
            "peer": "failing",
            "options": {},
        }
    )
    assert result["status"] == "OOM", result.get("reason")
    assert result["failed_step"] == 0
    assert result["search_request"] == {"budget_bytes": 123}
