"""The sequence-length sweep (``--seq 8192,16384``): parsing, the runs planned, the summary and
table per length, the plot, and the MFU column's FLOPs count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autooffload.bench import plots, report
from autooffload.bench.__main__ import main
from autooffload.bench.cli_values import parse_seqs
from autooffload.bench.flops import mfu, model_flops_per_token, peak_flops
from autooffload.bench.runner import PeerSpec, plan_runs
from autooffload.bench.table import format_table
from autooffload.bench.workloads import get_workload

GiB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- parsing -------------------------------------------------------------------------------


def test_seq_takes_one_length_or_a_comma_list() -> None:
    assert parse_seqs(None) is None
    assert parse_seqs("8192") == [8192]
    assert parse_seqs("8192,16384, 32768") == [8192, 16384, 32768]


@pytest.mark.parametrize("text", ["0", "-8", "8k", "1.5", "8192,", "8192,0", "64,64", ""])
def test_a_bad_length_is_an_error_naming_seq_and_what_is_valid(text: str) -> None:
    with pytest.raises(ValueError, match="--seq") as info:
        parse_seqs(text)
    assert "positive integers" in str(info.value)


def test_a_bad_length_on_the_command_line_is_a_clear_error(capsys) -> None:
    assert main(["--workload", "llama-tiny", "--seq", "64,-1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "invalid --seq '64,-1'" in err and "positive integers" in err


# --- planning ------------------------------------------------------------------------------


def test_each_length_is_its_own_set_of_runs() -> None:
    w = get_workload("llama-tiny")
    peers = [PeerSpec("vanilla"), PeerSpec("autooffload")]
    runs = plan_runs([w], [GiB], peers, 2, vanilla_caps=[None], seqs=[64, 128])
    order = [(r.workload.seq, r.peer.name, r.cap, r.repeat) for r in runs]
    assert order == [
        (64, "vanilla", None, 0),
        (64, "autooffload", GiB, 0),
        (128, "vanilla", None, 0),
        (128, "autooffload", GiB, 0),
        (64, "vanilla", None, 1),
        (64, "autooffload", GiB, 1),
        (128, "vanilla", None, 1),
        (128, "autooffload", GiB, 1),
    ]
    assert all(r.seq_sweep for r in runs)
    assert runs[2].describe() == "llama-tiny | seq 128 | cap none | vanilla | rep 0"
    single = plan_runs([w], [GiB], peers, 1)
    assert [r.workload for r in single] == [w, w] and not any(r.seq_sweep for r in single)
    assert single[0].describe() == "llama-tiny | cap 1GiB | vanilla | rep 0"


def test_a_peer_with_its_own_cap_runs_once_per_length_beside_the_swept_caps() -> None:
    """``hf_gc[cap=78GiB]``: HF's reference at the cap of an 80 GB card beside autooffload at
    smaller caps, in one command; any peer takes it; a bad size names the peer."""
    from autooffload.bench.runner import parse_peers
    from autooffload.bench.workloads import UnknownNameError

    peers = parse_peers("hf_gc[cap=78GiB],save_on_cpu[cap=none],autooffload[n_persist=0]")
    assert [(p.name, p.options, p.cap) for p in peers] == [
        ("hf_gc", {}, "78GiB"),
        ("save_on_cpu", {}, "none"),
        ("autooffload", {"n_persist": 0}, None),
    ]
    assert peers[0].label == "hf_gc[cap=78GiB]"
    w = get_workload("llama-tiny")
    runs = plan_runs([w], [16 * GiB, 24 * GiB], peers, 1, seqs=[64, 128])
    order = [(r.workload.seq, r.peer.label, r.cap) for r in runs]
    assert order == [
        (64, "hf_gc[cap=78GiB]", 78 * GiB),
        (64, "save_on_cpu[cap=none]", None),
        (64, "autooffload[n_persist=0]", 16 * GiB),
        (64, "autooffload[n_persist=0]", 24 * GiB),
        (128, "hf_gc[cap=78GiB]", 78 * GiB),
        (128, "save_on_cpu[cap=none]", None),
        (128, "autooffload[n_persist=0]", 16 * GiB),
        (128, "autooffload[n_persist=0]", 24 * GiB),
    ]
    assert all("cap" not in r.peer.options for r in runs)  # the peer never sees it
    with pytest.raises(UnknownNameError, match="hf_gc\\[cap=78G\\]': cap: invalid size"):
        parse_peers("hf_gc[cap=78G]")


def test_dry_run_lists_the_runs_of_every_length(capsys) -> None:
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla,autooffload"]
    assert main([*argv, "--seq", "64,128", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run: 4 runs" in text
    assert "bs 2 seq 64 no-gc" in text and "bs 2 seq 128 no-gc" in text
    for seq in (64, 128):
        for peer in ("vanilla", "autooffload"):
            assert f"llama-tiny | seq {seq} | cap none | {peer} | rep 0" in text
    # One length overrides the workload's, as before: no sweep, runs named as before.
    assert main([*argv, "--seq", "64", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run: 2 runs" in text and "bs 2 seq 64 no-gc" in text
    assert "[0] llama-tiny | cap none | vanilla | rep 0" in text


# --- summary, table ------------------------------------------------------------------------


def _ok(peer: str, seq: int, tps: float, peak: float, cap: str = "none", **extra) -> dict:
    return {
        "workload": "w",
        "seq": seq,
        "peer": peer.split("[")[0],
        "peer_label": peer,
        "cap": cap,
        "status": "ok",
        "tokens_per_s": tps,
        "step_s_median": seq / tps,
        "peak_allocated_gib": peak,
        "peak_reserved_gib": peak,
        "host_rss_peak_gib": 1.0,
        "loss_first": 10.0,
        "loss_final": 8.0,
        **extra,
    }


def _oom(peer: str, seq: int, cap: str = "none") -> dict:
    message = "OutOfMemoryError: CUDA out of memory"
    run = {"workload": "w", "seq": seq, "peer": peer, "peer_label": peer, "cap": cap}
    return {**run, "status": "OOM", "reason": message, "message": message}


def sweep_results() -> list[dict]:
    return [
        _ok("vanilla", 8192, 4000.0, 30.0),
        _ok("autooffload", 8192, 3000.0, 12.0),
        _oom("vanilla", 16384),
        _ok("autooffload", 16384, 2500.0, 20.0),
        _ok("hf_gc", 8192, 3500.0, 18.0),
        _ok("hf_gc", 16384, 3000.0, 25.0),
    ]


def test_rows_and_the_vanilla_reference_are_per_length() -> None:
    results = sweep_results()
    report.annotate(results)
    assert results[1]["tput_ratio"] == pytest.approx(3000 / 4000)
    # Vanilla ran out of memory at 16k: no reference there (never vanilla's 8k numbers).
    assert results[3]["ref_cap"] is None and results[3]["tput_ratio"] is None
    rows = report.summarise(results)
    assert [(r["peer_label"], r["seq"]) for r in rows] == [
        ("vanilla", 8192),
        ("autooffload", 8192),
        ("vanilla", 16384),
        ("autooffload", 16384),
        ("hf_gc", 8192),
        ("hf_gc", 16384),
    ]
    assert rows[3]["tokens_per_s"] == 2500.0  # not pooled with the 8k row


def test_the_table_shows_the_length_when_several_are_swept() -> None:
    results = sweep_results()
    report.annotate(results)
    table = format_table(report.summarise(results))
    lines = table.splitlines()
    assert lines[0].startswith("| workload | seq | cap | peer | status | tok/s | x vanilla |")
    assert lines[0].count(" | ") + 1 == lines[1].count("---|")
    assert "| w | 8192 | none | autooffload | ok | 3000 | 0.75 |" in table
    assert "| w | 16384 | none | vanilla | OOM |" in table
    assert "- w seq 16384 / none / vanilla: OOM: OutOfMemoryError" in table
    assert "MFU" not in table  # no row has one
    one_length = [r for r in results if r["seq"] == 8192]
    single = format_table(report.summarise(one_length))
    assert single.startswith("| workload | cap | peer |")
    assert "| w | none | autooffload | ok | 3000 | 0.75 |" in single


def test_the_mfu_column_appears_when_a_row_has_one() -> None:
    results = [
        _ok("vanilla", 8192, 4000.0, 30.0, mfu=0.4123),
        _ok("autooffload", 8192, 3000.0, 12.0, mfu=None),
    ]
    report.annotate(results)
    table = format_table(report.summarise(results))
    lines = table.splitlines()
    assert lines[0].startswith("| workload | cap | peer | status | tok/s | x vanilla | MFU % |")
    assert lines[0].count(" | ") + 1 == lines[1].count("---|")
    assert "| w | none | vanilla | ok | 4000 | 1.00 | 41.2 |" in table
    assert "| w | none | autooffload | ok | 3000 | 0.75 | - |" in table


# --- plot ----------------------------------------------------------------------------------


def test_the_lines_leave_failed_points_out_and_name_the_cap_when_several() -> None:
    results = sweep_results()
    report.annotate(results)
    lines = plots.seq_lines(report.summarise(results))
    assert {label: [r["seq"] for r in rows] for label, rows in lines.items()} == {
        "vanilla": [8192],
        "autooffload": [8192, 16384],
        "hf_gc": [8192, 16384],
    }
    capped = [_ok("autooffload", 16384, 1.0, 1.0, cap="24GiB"), _ok("autooffload", 8192, 2.0, 1.0)]
    assert list(plots.seq_lines(capped)) == ["autooffload (cap 24GiB)", "autooffload (cap none)"]


def test_the_sequence_plot_is_written_for_a_sweep_only(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = sweep_results()
    report.annotate(results)
    rows = report.summarise(results)
    path = tmp_path / "bench.png"
    written = plots.write_plots({"summary": rows, "runs": results}, path, "title")
    assert written == [path, tmp_path / "bench.seq.png"]
    for png in written:
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert not plots.plot_seq([r for r in rows if r["seq"] == 8192], tmp_path / "one.png")
    assert not (tmp_path / "one.png").exists()


# --- FLOPs, MFU ----------------------------------------------------------------------------


def test_model_flops_per_token_of_the_tiny_llama_by_hand() -> None:
    # llama-tiny: hidden 64, intermediate 128, 2 layers, 4 heads (head_dim 16), 2 KV heads,
    # vocab 256, untied. Per block: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down
    # 3 x 64x128 = 4096 + 2048 + 2048 + 4096 + 3 x 8192 = 36864; with the LM head 256 x 64:
    # N = 2 x 36864 + 16384 = 90112 (the input embedding is a lookup, the norms element-wise).
    n = 90112
    # Causal attention, fwd + bwd: 3 x (2 x 2 x seq x 64 x 0.5) per layer, 2 layers.
    attention = 3 * 2 * 2 * 32 * 64 // 2 * 2
    assert attention == 24576
    assert model_flops_per_token(get_workload("llama-tiny")) == 6 * n + attention == 565248
    # LoRA r16 on the 7 linears: r x (in + out) each, per block 16 x 1024, two blocks.
    adapters = 2 * 16 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert adapters == 32768
    lora = get_workload("llama-tiny-lora")
    assert model_flops_per_token(lora) == 4 * n + 6 * adapters + attention == 581632
    # The attention term grows with the sequence length; the weights' terms do not.
    longer = get_workload("llama-tiny-lora", seq=64)
    assert model_flops_per_token(longer) == 581632 + attention
    assert model_flops_per_token(get_workload("qwen2vl-tiny-lora")) is None


def test_the_matmul_weights_are_the_built_models_less_embedding_and_norms() -> None:
    workload = get_workload("llama-8b-full", seq=1)
    d = workload.text_dims
    tensors = workload.parameter_tensors()
    assert tensors is not None
    h = d["hidden_size"]
    norms = (2 * d["num_hidden_layers"] + 1) * h
    n = sum(t.numel for t in tensors) - d["vocab_size"] * h - norms
    attention = 6 * d["num_hidden_layers"] * 1 * h
    assert model_flops_per_token(workload) == 6 * n + attention


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA H100 PCIe", None),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_peak_flops_by_gpu_name(name: str | None, peak: float | None) -> None:
    assert peak_flops(name) == peak


def test_mfu_is_the_achieved_model_flops_over_the_peak() -> None:
    workload = get_workload("llama-8b-lora", bs=1, seq=8192)
    per_token = model_flops_per_token(workload)
    assert per_token is not None
    out = mfu(workload, 1000.0, "NVIDIA H100 80GB HBM3")
    assert out == {
        "model_flops_per_token": per_token,
        "peak_flops": 989e12,
        "mfu": pytest.approx(1000.0 * per_token / 989e12),
    }
    assert 0.0 < out["mfu"] < 1.0
    assert mfu(workload, 1000.0, None)["mfu"] is None  # CPU run or unknown GPU


# --- end to end on the CPU -----------------------------------------------------------------


def test_a_cpu_sweep_runs_each_length_and_plots_it(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "seq.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla"]
    argv += ["--seq", "16,32", "--steps", "1", "--warmup", "1", "--out", str(out), "--plot"]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["args"]["seqs"] == [16, 32]
    assert payload["workloads"]["llama-tiny"]["seq"] == [16, 32]
    runs = payload["runs"]
    assert [(r["seq"], r["status"]) for r in runs] == [(16, "ok"), (32, "ok")]
    for run in runs:
        assert run["model_flops_per_token"] == model_flops_per_token(
            get_workload("llama-tiny", seq=run["seq"])
        )
        assert run["mfu"] is None and run["peak_flops"] is None  # no GPU peak on the CPU
    assert [r["seq"] for r in payload["summary"]] == [16, 32]
    printed = capsys.readouterr().out
    assert "| llama-tiny | 16 | none | vanilla | ok |" in printed
    assert "| llama-tiny | 32 | none | vanilla | ok |" in printed
    assert out.with_suffix(".seq.png").read_bytes()[:8] == PNG_MAGIC
