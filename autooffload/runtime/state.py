"""State dicts of attached models and optimizers: full, correct tensors whatever the residency.

An offloaded parameter's ``.data`` is a view into a chunk whose device storage is freed while the
chunk lives on the host, so torch's own ``state_dict`` would hand out 0-byte tensors. The module
hooks here replace those entries with CPU tensors over the host store's bytes (copied on write,
so saving costs no host memory and a held state dict keeps its values). Persistent params get
device tensors over their bytes in the chunk, each with a storage of its own: a view would carry
the chunk's whole storage, and storage-identity checks (accelerate's ``save_state``) would take a
chunk's params for one tied tensor and save only one of them. ``load_state_dict`` values of
chunked params go around torch's in-place copy, into the place that holds them (host store,
persistent chunk, fp32 master). The optimizer functions merge the CPU twins' state into the
user's optimizer state dict in torch's layout, and split a loaded one back, so checkpoints move
freely between autooffload and plain torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils.hooks import RemovableHandle

from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import Residency
from autooffload.runtime.parallel.sharding import consolidated_states

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime


class ModelStateHooks:
    """``state_dict`` / ``load_state_dict`` hooks on the modules of one attached model."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.slots: dict[int, tuple[Chunk, ParamSlot]] = runtime.layout.slot_of()
        # Entries made during one (outermost) state_dict call, per param id: tied weights get one
        # tensor under all their names, as torch gives them, so save_pretrained sees the tie.
        self._entries: dict[int, torch.Tensor] = {}
        self._depth = 0
        self._destination: int | None = None
        # Keys a load pre-hook wrote itself, per module id, for its post-hook to un-miss.
        self._consumed: dict[int, list[str]] = {}

    def install(self) -> list[RemovableHandle]:
        """Register the hooks; the returned handles remove them (``Runtime.detach``)."""
        handles = []
        root = self.runtime.model
        for module in root.modules():
            owns = any(p is not None and id(p) in self.slots for p in module._parameters.values())
            if not owns and module is not root:
                continue
            handles.append(module.register_state_dict_pre_hook(self._state_dict_pre))
            # A function of its own: torch marks public post-hooks with an attribute.
            handles.append(module.register_state_dict_post_hook(functools.partial(self._post)))
            if owns:
                handles.append(module.register_load_state_dict_pre_hook(self._load_pre))
                handles.append(module.register_load_state_dict_post_hook(self._load_post))
        return handles

    # ---- state_dict -------------------------------------------------------------------------

    def _state_dict_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._depth == 0:
            self._entries.clear()
            self._destination = None
            manager = self.runtime.manager
            sharding = manager.sharding
            if sharding is not None and not sharding.readable(manager.persistent):
                raise sharding.not_consolidated("model.state_dict()")
            # Pending CPU updates write the host store: the state dict shows the stepped weights.
            self.runtime.synchronize()
        self._depth += 1

    def _post(
        self, module: nn.Module, destination: dict, prefix: str, local_metadata: dict
    ) -> None:
        if self._destination != id(destination):
            if self._destination is not None:
                self.runtime.synchronize()  # an earlier call ended without its post-hooks
            self._entries.clear()
            self._destination = id(destination)
        try:
            for name, param in module._parameters.items():
                key = prefix + name
                if param is None or key not in destination or id(param) not in self.slots:
                    continue
                keep_vars = destination[key] is param  # keep_vars=True hands out Parameters
                offloaded = self._offloaded(param)
                if keep_vars and not offloaded:
                    continue  # the resident Parameter itself, as torch gives it
                entry = self._entries.get(id(param))
                if entry is None:
                    chunk, slot = self.slots[id(param)]
                    manager = self.runtime.manager
                    if offloaded:
                        entry = manager.host_alias(slot, chunk)
                    else:
                        entry = manager.device_alias(slot, chunk)
                    if keep_vars:
                        entry = nn.Parameter(entry, requires_grad=param.requires_grad)
                        manager.watch_alias(chunk.index, entry)
                    self._entries[id(param)] = entry
                destination[key] = entry
        finally:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._entries.clear()
                self._destination = None

    def _offloaded(self, param: torch.Tensor) -> bool:
        entry = self.slots.get(id(param))
        return entry is not None and entry[0].index not in self.runtime.manager.persistent

    # ---- load_state_dict --------------------------------------------------------------------

    def _load_pre(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        consumed = []
        synchronized = False
        for name, param in module._parameters.items():
            key = prefix + name
            if param is None or id(param) not in self.slots or key not in state_dict:
                continue
            value = state_dict[key]
            # Wrong types and shapes are left to torch, which reports them as usual.
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                continue
            if local_metadata.get("assign_to_params_buffers") and value.dtype != param.dtype:
                # torch would make the param the checkpoint's tensor, dtype and all; a chunk's
                # bytes are laid out for the dtype it was attached with. Reported as torch
                # reports a size mismatch: torch raises once every module is loaded.
                error_msgs.append(
                    f"autooffload: load_state_dict(assign=True) would change {key} from"
                    f" {param.dtype} to {value.dtype}, and an attached model's chunked"
                    " parameters keep the dtype they were attached with: load with"
                    " assign=False (the values are cast), cast the state dict first, or load"
                    " before attaching (autooffload.disable() detaches)"
                )
                del state_dict[key]
                consumed.append(key)
                continue
            if not synchronized:
                self.runtime.synchronize()
                synchronized = True
            chunk, slot = self.slots[id(param)]
            write_param(self.runtime, chunk, slot, value)
            # torch would copy_ into the (possibly freed) chunk view, or assign over it.
            del state_dict[key]
            consumed.append(key)
        if consumed:
            self._consumed.setdefault(id(module), []).extend(consumed)

    def _load_post(self, module: nn.Module, incompatible_keys: _IncompatibleKeys) -> None:
        consumed = set(self._consumed.pop(id(module), ()))
        if consumed:
            missing = incompatible_keys.missing_keys
            missing[:] = [k for k in missing if k not in consumed]


def write_param(runtime: Runtime, chunk: Chunk, slot: ParamSlot, value: torch.Tensor) -> None:
    """Set a chunked param to ``value`` wherever its bytes live (call after synchronize)."""
    manager = runtime.manager
    with torch.no_grad():
        if chunk.index in manager.persistent:
            slot.param.data.copy_(value)
            return
        if not manager.hosts(chunk.index):
            # Its owner stores it (every rank loads the same state dict); a consolidated copy
            # of it held here is stale now.
            manager.sharding.drop_consolidated(chunk.index)  # type: ignore[union-attr]
            if manager.state[chunk.index] != Residency.HOST:
                slot.param.data.copy_(value)
            return
        manager.before_host_write(chunk.index)
        host = manager.host_view(slot, chunk)
        host.copy_(value)
        if manager.state[chunk.index] != Residency.HOST:
            slot.param.data.copy_(host)
        master = runtime.cpu_optim.masters.get(id(slot.param))
        if master is not None and master.data_ptr() != host.data_ptr():
            master.copy_(value)


# ---- optimizer state ------------------------------------------------------------------------


def param_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Param id -> its index in ``optimizer.state_dict()``, numbered as torch numbers them."""
    indices: dict[int, int] = {}
    start = 0
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"], start):
            indices.setdefault(id(param), index)
        start += len(group["params"])
    return indices


def _offloaded_owned(runtime: Runtime, optimizer: torch.optim.Optimizer) -> dict[int, Chunk]:
    """Offloaded params whose state ``optimizer`` owns (kept by a CPU twin): id -> chunk.
    Another optimizer holding some of them keeps its own state of them."""
    cpu_optim = runtime.cpu_optim
    mine = cpu_optim.twins.params_of(optimizer)
    owned = {}
    for chunk in runtime.layout.chunks:
        if chunk.index in runtime.manager.persistent:
            continue
        for slot in chunk.trained_slots:
            pid = id(slot.param)
            if pid in cpu_optim.offloaded_ids and pid in mine:
                owned[pid] = chunk
    return owned


def add_offloaded_state(
    runtime: Runtime, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Add the twins' state of ``optimizer``'s offloaded params to its ``state_dict`` in place.

    Tensors stay on the CPU (torch moves them to the param's device on load) in the twin's dtype:
    the param's dtype, or fp32 with master weights (a plain optimizer casts it on load).
    """
    owned = _offloaded_owned(runtime, optimizer)
    if not owned:
        return
    runtime.synchronize()
    indices = param_indices(optimizer)
    packed = state_dict["state"]
    if runtime.manager.sharding is not None:
        gathered = consolidated_states(runtime, optimizer)
        for pid, state in gathered.items():
            if pid in owned and pid in indices:
                packed[indices[pid]] = state
        owned = {p: c for p, c in owned.items() if not runtime.manager.is_sharded(c.index)}
    for pid, chunk in owned.items():
        twin = runtime.cpu_optim.twins.get(chunk.index, optimizer)
        master = runtime.cpu_optim.masters[pid]
        if twin is not None and master in twin.state and pid in indices:
            packed[indices[pid]] = dict(twin.state[master])
    state_dict["state"] = dict(sorted(packed.items(), key=lambda item: _sort_key(item[0])))


def _sort_key(key: object) -> tuple[int, str]:
    return (key, "") if isinstance(key, int) else (1 << 62, str(key))


def split_offloaded_state(
    runtime: Runtime, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[int, dict]]:
    """Split a loaded optimizer state dict: the part for the user's optimizer (persistent and
    resident params), and the offloaded params' state per param id, for the twins."""
    owned = _offloaded_owned(runtime, optimizer)
    saved_groups = state_dict["param_groups"]
    saved_ids = [i for group in saved_groups for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not owned or len(saved_ids) != len(params):
        return dict(state_dict), {}  # torch reports mismatched groups itself
    param_of_saved = dict(zip(saved_ids, params, strict=True))
    kept: dict[Any, Any] = {}
    offloaded: dict[int, dict] = {}
    for key, value in state_dict["state"].items():
        param = param_of_saved.get(key)
        if param is not None and id(param) in owned:
            offloaded[id(param)] = value
        else:
            kept[key] = value
    return {**state_dict, "state": kept}, offloaded


def adopt_existing_state(runtime: Runtime, optimizer: torch.optim.Optimizer) -> None:
    """Move the state ``optimizer`` already holds for offloaded params to the CPU twins: it
    stepped before the model was attached (or re-attached after ``disable()``), or a state dict
    was loaded into it before it was bound. The twins would otherwise start from zero (Adam's
    step count and moments) where plain torch goes on."""
    owned = _offloaded_owned(runtime, optimizer)
    states = {
        id(p): optimizer.state.pop(p)
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in owned and optimizer.state.get(p)
    }
    if states:
        load_offloaded_state(runtime, optimizer, states, replace=False)


def twin_states(runtime: Runtime, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The state ``optimizer``'s CPU twins hold, per offloaded param id."""
    cpu_optim = runtime.cpu_optim
    cpu_optim.wait()
    states: dict[int, dict] = {}
    for chunk in runtime.layout.chunks:
        twin = cpu_optim.twins.get(chunk.index, optimizer)
        if twin is None:
            continue
        for slot in chunk.trained_slots:
            master = cpu_optim.masters.get(id(slot.param))
            state = twin.state.get(master) if master is not None else None
            if state:
                states[id(slot.param)] = state
    return states


def load_offloaded_state(
    runtime: Runtime,
    optimizer: torch.optim.Optimizer,
    states: dict[int, dict],
    replace: bool = True,
) -> None:
    """Give the twins of ``optimizer`` the loaded state of its offloaded params; twins are built
    for chunks that get state. ``replace``: params without state in ``states`` lose theirs, as
    torch's ``load_state_dict`` does."""
    cpu_optim = runtime.cpu_optim
    # Sharded: each rank keeps the state of the chunks it owns (masters exist only there).
    owned = {
        pid: chunk
        for pid, chunk in _offloaded_owned(runtime, optimizer).items()
        if pid in cpu_optim.masters
    }
    if not owned:
        return
    runtime.synchronize()
    chunks = {chunk.index: chunk for chunk in owned.values()}
    for index, chunk in chunks.items():
        needs_state = any(id(s.param) in states for s in chunk.trained_slots)
        twin = cpu_optim.twins.get(index, optimizer)
        if twin is None and needs_state:
            twin = cpu_optim.twins.twin(chunk, optimizer)
        if twin is None:
            continue
        for slot in chunk.trained_slots:
            pid = id(slot.param)
            if pid not in owned:
                continue
            master = cpu_optim.masters[pid]
            state = states.get(pid)
            if state is None:
                if replace:
                    twin.state.pop(master, None)
            else:
                twin.state[master] = {k: _to_twin(k, v, master) for k, v in state.items()}


def _to_twin(key: str, value: Any, master: torch.Tensor) -> Any:
    """A loaded state value as the CPU twin keeps it (torch's casting rules for a CPU param)."""
    if key == "step":
        # The twin runs fused on the CPU: its step is a CPU fp32 tensor (a number in old files).
        step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        return step.to(device="cpu", dtype=torch.float32, copy=True)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point() and master.is_floating_point():
        return value.to(device="cpu", dtype=master.dtype, copy=True)
    return value.to(device="cpu", copy=True)
