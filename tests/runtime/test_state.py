"""Checkpoints of attached models and their optimizers: full tensors, plain-torch layout, resume.

Every round trip goes through a file (``torch.save`` / ``save_pretrained``) and, where it says
so, into a plain model or optimizer that autooffload never touched, because that is what a user
loads a checkpoint into later.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_models import batches, enable_cpu, n_chunks, tiny_llama
from torch import nn
from transformers import LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.errors import DetachStateError
from autooffload.runtime.update.cpu_optimizer import CpuOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")

# The attached model does the same fp32 math as the plain one (see test_offload_equivalence.py);
# a lost optimizer state or a stale chunk after resume moves weights by ~lr = 1e-2.
RTOL = 1e-5
ATOL = 1e-5
STEPS = 10


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def scheduler_of(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))


def attach(model: nn.Module, **settings) -> rt.Runtime:
    """Enable the CPU simulation with ``settings`` and attach ``model`` by moving it."""
    enable_cpu(**settings)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    assert runtime is not None, "the move to cpu did not attach the model"
    return runtime


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: list[torch.Tensor],
) -> list[float]:
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=name)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained_pair(n_persist: int, steps: int = 3, **settings) -> tuple[nn.Module, nn.Module, list]:
    """A plain model and an attached copy, both trained ``steps`` steps on the same data; the
    attached one's optimizer is returned with it."""
    data = batches(steps)
    plain = tiny_llama(tied=settings.pop("tied", True))
    attached = copy.deepcopy(plain)
    optimizer = adamw(plain)
    train(plain, optimizer, scheduler_of(optimizer), data)
    attach(attached, n_persist=n_persist, **settings)
    attached_optimizer = adamw(attached)
    train(attached, attached_optimizer, scheduler_of(attached_optimizer), data)
    return plain, attached, [optimizer, attached_optimizer]


# ---- model state dict ---------------------------------------------------------------------------


@pytest.mark.parametrize("persist", ["none", "mix", "all"])
def test_state_dict_of_an_attached_model_holds_the_trained_weights(persist: str) -> None:
    total = n_chunks(tiny_llama())
    n_persist = {"none": 0, "mix": total // 2, "all": total}[persist]
    plain, attached, _ = trained_pair(n_persist)
    state = attached.state_dict()
    assert_same_weights(state, plain.state_dict())
    assert all(t.device.type == "cpu" for t in state.values())


def test_torch_save_of_an_attached_model_loads_into_a_plain_model(tmp_path: Path) -> None:
    plain, attached, _ = trained_pair(n_persist=1)
    path = tmp_path / "model.pt"
    torch.save(attached.state_dict(), path)
    fresh = tiny_llama(seed=7)
    fresh.load_state_dict(torch.load(path))
    ids = batches(1, seed=5)[0]
    torch.testing.assert_close(logits(fresh, ids), logits(plain, ids), rtol=RTOL, atol=ATOL)
    # Each tensor is saved on its own, not the whole host store behind a view of it.
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert path.stat().st_size < 1.5 * model_bytes


def test_offloaded_entries_share_the_host_store_but_own_their_bytes() -> None:
    _, attached, _ = trained_pair(n_persist=0, steps=1)
    arena = rt.runtime_of(attached).manager.host
    for name, value in attached.state_dict().items():
        assert arena.contains(value), f"{name} is a copy, not the host store's bytes"
        storage = value.untyped_storage()
        assert storage.nbytes() == value.numel() * value.element_size(), name


def test_resident_entries_own_their_storage_over_the_chunk_bytes() -> None:
    """Entries of persistent params point into their chunk without a copy, each with a storage
    of its own: a view would carry the whole chunk, and storage-identity checks would take the
    chunk's params for one tied tensor."""
    _, attached, _ = trained_pair(n_persist=n_chunks(tiny_llama(tied=False)), tied=False, steps=1)
    manager = rt.runtime_of(attached).manager
    bounds = [(f.data_ptr(), f.data_ptr() + f.numel()) for f in manager.gpu_flat]
    state = attached.state_dict()
    params = dict(attached.named_parameters())
    storages = set()
    for name, value in state.items():
        assert any(lo <= value.data_ptr() < hi for lo, hi in bounds), f"{name} is a copy"
        assert value.data_ptr() == params[name].data_ptr(), name
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), name
        storages.add(value.untyped_storage().data_ptr())
    assert len(storages) == len(state)


def test_accelerate_safetensors_save_keeps_every_resident_weight(tmp_path: Path) -> None:
    """accelerate's ``save_state`` writes the model with ``accelerate.utils.save``, which drops
    all but one name of tensors sharing a storage: every weight of an all-persistent model must
    reach the file and reload into a plain model (the GPU e2e test's regression)."""
    from accelerate.utils import save

    plain, attached, _ = trained_pair(n_persist=n_chunks(tiny_llama(tied=False)), tied=False)
    save(attached.state_dict(), tmp_path / "model.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == plain.state_dict().keys()
    assert_same_weights(saved, plain.state_dict())


def test_a_held_resident_entry_follows_updates_and_keeps_its_values_after_offload() -> None:
    """A persistent param's entry follows its updates (torch's entries are views too), and keeps
    its last values when a re-plan offloads the chunk and when ``disable()`` frees it."""
    model = tiny_llama()
    total = n_chunks(model)
    runtime = attach(model, n_persist=total)
    optimizer = adamw(model)
    train(model, optimizer, scheduler_of(optimizer), batches(1))
    name = "model.layers.1.mlp.up_proj.weight"
    held = model.state_dict()[name]
    train(model, optimizer, scheduler_of(optimizer), batches(1, seed=3))
    stepped = dict(model.named_parameters())[name].detach().clone()
    torch.testing.assert_close(held, stepped, rtol=0, atol=0)
    runtime.manager.set_persistent([], n_buffer=1)
    assert held.untyped_storage().nbytes() == held.numel() * held.element_size()
    torch.testing.assert_close(held, stepped, rtol=0, atol=0)
    runtime.manager.set_persistent(range(total), n_buffer=1)
    again = model.state_dict()[name]
    autooffload.disable()
    torch.testing.assert_close(again, stepped, rtol=0, atol=0)
    torch.testing.assert_close(held, stepped, rtol=0, atol=0)


def test_a_held_state_dict_keeps_its_values_through_steps_loads_and_disable() -> None:
    model = tiny_llama()
    runtime = attach(model, n_persist=0)
    optimizer = adamw(model)
    train(model, optimizer, scheduler_of(optimizer), batches(1))
    held = model.state_dict()
    held_vars = model.state_dict(keep_vars=True)
    expected = {k: v.clone() for k, v in held.items()}
    train(model, optimizer, scheduler_of(optimizer), batches(2, seed=3))
    moved = model.state_dict()
    assert any(not torch.equal(moved[k], expected[k]) for k in expected), "training moved nothing"
    assert_same_weights(held, expected)
    assert_same_weights({k: v.detach() for k, v in held_vars.items()}, expected)
    before_load = model.state_dict()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in expected.items()})
    assert all(not v.any() for v in model.state_dict().values())
    assert_same_weights(before_load, moved)
    # The held entries no longer alias the store: disable() frees it whole.
    arena = runtime.manager.host
    assert not any(arena.contains(v) for v in held.values())
    last = model.state_dict()
    autooffload.disable()
    assert all(not v.any() for v in last.values())


def test_state_dicts_of_frozen_chunks_leave_no_growing_bookkeeping() -> None:
    model = tiny_llama()
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)  # a trainable model attaches; the rest is frozen
    runtime = attach(model, n_persist=0)
    for _ in range(50):
        model.state_dict()  # dropped at once, as a per-step EMA or logging call would
    chunks = runtime.layout.chunks
    watched = {index: len(refs) for index, refs in runtime.manager._aliases.items()}
    assert all(watched[c.index] <= 2 * len(c.slots) for c in chunks if c.index in watched)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _rss_kib("VmHWM") <= _rss_kib("VmRSS") + 1024


@pytest.mark.parametrize("how", ["save_pretrained", "torch.save"])
def test_saving_adds_no_host_copy_of_the_offloaded_weights(tmp_path: Path, how: str) -> None:
    model = tiny_llama(hidden=512, n_layers=4)  # ~27 MB of fp32 weights, 6.5 M params
    attach(model, n_persist=0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not _reset_peak_rss():
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs)")
    before = _rss_kib("VmRSS")
    if how == "save_pretrained":
        model.save_pretrained(tmp_path)
    else:
        torch.save(model.state_dict(), tmp_path / "model.pt")
    grew = (_rss_kib("VmHWM") - before) * 1024
    # A copy of the offloaded weights (the former state dict) grows the peak by model_bytes.
    assert grew < 0.25 * model_bytes, f"saving grew peak RSS by {grew} B of {model_bytes} B"


def test_state_dict_keeps_tied_weights_as_one_tensor() -> None:
    _, attached, _ = trained_pair(n_persist=0, steps=1)
    state = attached.state_dict()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]


def test_state_dict_keep_vars_returns_parameters_with_their_requires_grad() -> None:
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    attach(model, n_persist=0)
    state = model.state_dict(keep_vars=True)
    assert isinstance(state["model.layers.0.mlp.up_proj.weight"], nn.Parameter)
    assert state["model.layers.0.mlp.up_proj.weight"].requires_grad
    assert not state["model.norm.weight"].requires_grad


def test_state_dict_of_a_wrapper_around_an_attached_model() -> None:
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.head = nn.Linear(4, 4)

    plain, attached, _ = trained_pair(n_persist=1)
    wrapper = Wrapper(attached)
    state = wrapper.state_dict()
    assert "head.weight" in state
    inner = {k.removeprefix("inner."): v for k, v in state.items() if k.startswith("inner.")}
    assert_same_weights(inner, plain.state_dict())


def test_state_dict_after_detach_is_the_ordinary_one() -> None:
    plain, attached, _ = trained_pair(n_persist=0, steps=1)
    autooffload.disable()
    assert_same_weights(attached.state_dict(), plain.state_dict())
    assert attached.state_dict()["model.norm.weight"].untyped_storage().nbytes() > 0


@pytest.mark.parametrize("n_persist", [0, 2])
def test_training_goes_on_after_detach_with_the_same_optimizer(n_persist: int) -> None:
    """``disable()`` hands the offloaded params' optimizer state (kept by the CPU side) to the
    user's optimizer: the next steps of the returned model are those of plain training."""
    plain, attached, (optimizer, attached_optimizer) = trained_pair(n_persist=n_persist)
    autooffload.disable()
    more = batches(3, seed=11)
    train(plain, optimizer, scheduler_of(optimizer), more)
    train(attached, attached_optimizer, scheduler_of(attached_optimizer), more)
    assert_same_weights(attached.state_dict(), plain.state_dict())


@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_save_pretrained_reloads_into_a_plain_model(tmp_path: Path, shard: bool) -> None:
    plain, attached, _ = trained_pair(n_persist=2, tied=False)
    attached.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "5GB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 if shard else files == ["model.safetensors"]
    autooffload.disable()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = batches(1, seed=5)[0]
    torch.testing.assert_close(logits(reloaded, ids), logits(plain, ids), rtol=RTOL, atol=ATOL)


def test_save_pretrained_of_a_tied_model_keeps_the_tie(tmp_path: Path) -> None:
    plain, attached, _ = trained_pair(n_persist=0)
    attached.save_pretrained(tmp_path)
    autooffload.disable()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = batches(1, seed=5)[0]
    torch.testing.assert_close(logits(reloaded, ids), logits(plain, ids), rtol=RTOL, atol=ATOL)


def test_peft_lora_on_an_attached_model_saves_full_state_and_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    reference = copy.deepcopy(base)
    attach(base, n_persist=0)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    state = lora.state_dict()
    base_weight = "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"
    torch.testing.assert_close(
        state[base_weight], reference.model.layers[1].self_attn.q_proj.weight
    )
    lora.save_pretrained(tmp_path)
    saved = peft.utils.load_peft_weights(str(tmp_path))
    assert saved and all("lora_" in k for k in saved)


# ---- model load_state_dict ----------------------------------------------------------------------


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_into_an_attached_model_sets_every_weight(assign: bool) -> None:
    plain, _, _ = trained_pair(n_persist=0, steps=2)
    model = tiny_llama(seed=3)
    runtime = attach(model, n_persist=2)
    result = model.load_state_dict(copy.deepcopy(plain.state_dict()), assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    assert rt.runtime_of(model) is runtime
    assert_same_weights(weights(model), plain.state_dict())
    ids = batches(1, seed=5)[0]
    torch.testing.assert_close(logits(model, ids), logits(plain, ids), rtol=RTOL, atol=ATOL)


def test_load_state_dict_reports_missing_and_mismatched_keys_as_torch_does() -> None:
    model = tiny_llama()
    attach(model, n_persist=0)
    state = tiny_llama(seed=3).state_dict()
    del state["model.layers.0.mlp.up_proj.weight"]
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["model.layers.0.mlp.up_proj.weight"]
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match="size mismatch for model.norm.weight"):
        model.load_state_dict(state, strict=False)


def test_load_state_dict_refreshes_fp32_master_weights() -> None:
    model = tiny_llama().to(torch.bfloat16)
    runtime = attach(model, n_persist=0, master_weights=True)
    source = tiny_llama(seed=3).to(torch.bfloat16).state_dict()
    model.load_state_dict(source)
    param = model.model.layers[1].mlp.down_proj.weight
    master = runtime.cpu_optim.masters[id(param)]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, source["model.layers.1.mlp.down_proj.weight"].float())


# ---- optimizer state dict -----------------------------------------------------------------------


def assert_same_optimizer_state(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        assert actual["state"][index].keys() == state.keys()
        for key, value in state.items():
            got = actual["state"][index][key]
            assert got.dtype == value.dtype, (index, key)
            torch.testing.assert_close(got.cpu(), value.cpu(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n_persist", [0, 3])
def test_optimizer_state_dict_holds_every_param_in_torch_layout(n_persist: int) -> None:
    _, _, (plain_optimizer, optimizer) = trained_pair(n_persist=n_persist)
    state = optimizer.state_dict()
    assert_same_optimizer_state(state, plain_optimizer.state_dict())
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_optimizer_state_dict_round_trips_into_a_plain_optimizer(tmp_path: Path) -> None:
    _, attached, (plain_optimizer, optimizer) = trained_pair(n_persist=1)
    torch.save(optimizer.state_dict(), tmp_path / "optim.pt")
    fresh = adamw(tiny_llama())
    fresh.load_state_dict(torch.load(tmp_path / "optim.pt"))
    assert_same_optimizer_state(fresh.state_dict(), plain_optimizer.state_dict())


def test_loaded_optimizer_state_reaches_the_cpu_twins() -> None:
    _, _, (plain_optimizer, _) = trained_pair(n_persist=0)
    model = tiny_llama()
    runtime = attach(model, n_persist=0)
    optimizer = adamw(model)
    optimizer.load_state_dict(plain_optimizer.state_dict())
    assert not optimizer.state, "offloaded params' state must stay off the device"
    assert any(runtime.cpu_optim.twins.of_chunk(c) for c in runtime.layout.chunks)
    assert_same_optimizer_state(optimizer.state_dict(), plain_optimizer.state_dict())


def _set_layer_trainable(model: nn.Module, trainable: bool) -> None:
    model.model.layers[1].requires_grad_(trainable)


@pytest.mark.parametrize("then", ["state_dict", "load_state_dict", "add_param_group", "detach"])
def test_optimizer_state_of_a_layer_frozen_mid_training_is_kept(then: str) -> None:
    """A layer trainable at attach, frozen after some steps: its optimizer state is saved,
    loaded, kept through ``add_param_group`` and handed back at detach, as torch keeps it, so
    training after unfreezing it equals plain."""
    data = batches(6)
    base = tiny_llama(tied=False)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        # Added later by ``add_param_group``; the other cases train it from the start.
        extra = model.lm_head.weight if then == "add_param_group" else None
        if attached:
            attach(model, n_persist=0)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p is not extra], lr=1e-2, fused=True
        )
        scheduler = scheduler_of(optimizer)
        train(model, optimizer, scheduler, data[:2])
        _set_layer_trainable(model, False)
        train(model, optimizer, scheduler, data[2:3])
        saved = copy.deepcopy(optimizer.state_dict())
        if then == "load_state_dict":
            optimizer.load_state_dict(copy.deepcopy(saved))
        if then == "add_param_group":
            optimizer.add_param_group({"params": [extra], "lr": 1e-3})
            scheduler = scheduler_of(optimizer)
        if then == "detach" and attached:
            autooffload.disable()
        _set_layer_trainable(model, True)
        train(model, optimizer, scheduler, data[3:])
        runs.append((weights(model), saved))
        autooffload.disable()
    (plain_weights, plain_state), (attached_weights, attached_state) = runs
    assert_same_weights(attached_weights, plain_weights)
    assert_same_optimizer_state(attached_state, plain_state)


# ---- resume -------------------------------------------------------------------------------------


def save_checkpoint(path: Path, model, optimizer, scheduler) -> None:
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        },
        path,
    )


def run_half(settings: dict | None, data: list, checkpoint: Path | None, save_to: Path | None):
    """Build a fresh model (attached with ``settings`` unless None), optionally resume from
    ``checkpoint``, train on ``data``, optionally save; return the final weights."""
    model = tiny_llama(seed=11)  # different init: only a correct load gives the right result
    if settings is not None:
        attach(model, **settings)
    optimizer = adamw(model)
    scheduler = scheduler_of(optimizer)
    if checkpoint is not None:
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
    train(model, optimizer, scheduler, data)
    if save_to is not None:
        save_checkpoint(save_to, model, optimizer, scheduler)
    final = weights(model)
    autooffload.disable()
    return final


def uninterrupted(data: list) -> dict[str, torch.Tensor]:
    model = tiny_llama(seed=11)
    optimizer = adamw(model)
    train(model, optimizer, scheduler_of(optimizer), data)
    return weights(model)


RESUMES: dict[str, tuple[dict | None, dict | None]] = {
    "attached-to-attached": ({"n_persist": 0}, {"n_persist": 0}),
    "plain-to-attached": (None, {"n_persist": 2}),
    "attached-to-plain": ({"n_persist": 2}, None),
    "other-n_persist": ({"n_persist": 1}, {"n_persist": 4}),
    "fewer-persistent": ({"n_persist": 4}, {"n_persist": 0}),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_resume_from_a_checkpoint_equals_uninterrupted_training(tmp_path: Path, case: str) -> None:
    first, second = RESUMES[case]
    data = batches(2 * STEPS)
    expected = uninterrupted(data)
    checkpoint = tmp_path / "checkpoint.pt"
    run_half(first, data[:STEPS], None, checkpoint)
    resumed = run_half(second, data[STEPS:], checkpoint, None)
    assert_same_weights(resumed, expected)


def test_resume_in_a_new_process_equals_uninterrupted_training(
    tmp_path: Path, run_python: Callable[..., str]
) -> None:
    data = batches(2 * STEPS)
    expected = uninterrupted(data)
    checkpoint = tmp_path / "checkpoint.pt"
    run_half({"n_persist": 1}, data[:STEPS], None, checkpoint)
    out = tmp_path / "resumed.pt"
    run_python(
        "from test_state import batches, run_half, STEPS\n"
        "import torch, sys\n"
        "torch.set_num_threads(1)\n"
        f"final = run_half({{'n_persist': 3}}, batches(2 * STEPS)[STEPS:], {str(checkpoint)!r},"
        " None)\n"
        f"torch.save(final, {str(out)!r})\n"
    )
    assert_same_weights(torch.load(out), expected)


@pytest.fixture
def run_python() -> Callable[..., str]:
    """Run a Python snippet in a fresh interpreter with this test folder importable."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent

    def run(code: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD")}
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parents[1])])
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout

    return run


def test_optimizer_state_that_does_not_fit_at_detach_leaves_a_whole_model(monkeypatch) -> None:
    """Detach hands the CPU optimizer state over after the model is whole: an OOM there raises
    ``DetachStateError`` naming the way out, and the returned model has its trained weights."""
    plain, attached, _ = trained_pair(n_persist=0)
    runtime = rt.runtime_of(attached)
    worker = runtime.cpu_optim.worker

    def no_room(self, chunk, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(CpuOptimizer, "promote_chunk", no_room)
    with pytest.raises(DetachStateError, match="detach to the CPU instead"):
        autooffload.disable()
    assert rt.runtime_of(attached) is None
    assert not any(t.is_alive() for t in worker._threads), "CPU optimizer thread not joined"
    assert_same_weights(attached.state_dict(), plain.state_dict())


def test_load_state_dict_assign_of_another_dtype_is_a_clear_error() -> None:
    """``assign=True`` would give a param the checkpoint's dtype; a chunked param keeps the
    dtype it was attached with, so that is refused, as torch refuses a size mismatch, naming
    the key and both dtypes; ``assign=False`` casts, as for a plain model."""
    model = tiny_llama()
    attach(model, n_persist=1)
    state = {k: v.to(torch.bfloat16) for k, v in tiny_llama(seed=3).state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"would change .*weight from torch.float32 to torch.bfloat16"
    ):
        model.load_state_dict(copy.deepcopy(state), assign=True)
    model.load_state_dict(copy.deepcopy(state), assign=False)
    plain = tiny_llama()
    plain.load_state_dict(copy.deepcopy(state), assign=False)
    assert_same_weights(weights(model), plain.state_dict())
