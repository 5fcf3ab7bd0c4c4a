"""Out-of-memory retry: a device OOM inside the attached model's step is retried once under a
smaller plan, and a second one raises an error that names the budget, the plan and the knobs.

What is retried, and why only that: autooffload cannot re-run the user's code, but it owns the
root model's ``forward`` (a wrapper installed here) and sees every ``torch.autograd.backward``
(``patches/torch_optim.py``).

- An OOM inside the model's forward: the runtime is recovered (chunks released, cached blocks
  freed), the plan shrunk, and the forward re-run with the same inputs and RNG state. A KV
  cache among the inputs (``generate``) is first rewound to its length before the failed pass
  (``kv_cache.py``); one that cannot be rewound is not retried.
- An OOM inside ``backward()``: retried when the tensor handed to ``backward`` is one of the
  model's own outputs of its last forward (HF ``outputs.loss``), optionally times or divided by
  constants (``loss / accum``, ``GradScaler.scale(loss)``), and no parameter of the model had a
  gradient when that backward started (the first backward after ``zero_grad()``): then the
  partial gradients the failed backward left are discarded exactly (``.grad`` set back to None,
  host gradients forgotten), the forward is re-run with the saved inputs, RNG and autocast state,
  and the backward runs once more. Anything else (a loss computed outside the model from its
  logits, a later micro-batch of gradient accumulation whose partial sum cannot be told apart)
  raises :class:`OutOfMemoryRetryError` at once.

The smaller plan comes from ``oom_plan.py``. Each failed pass (a forward, or a backward with
the forward it re-runs) is retried once; a later OOM gets its own retry, each under a smaller
plan than the last.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from autooffload.errors import AutoOffloadError
from autooffload.log import logger
from autooffload.plan.types import GiB, Plan
from autooffload.runtime import registry
from autooffload.runtime.control.kv_cache import CacheRewind
from autooffload.runtime.control.oom_plan import failed_allocation_bytes, shrunk_plan
from autooffload.runtime.control.planning import REPROFILE_SOURCE
from autooffload.runtime.forward_wrap import install_forward, remove_forward
from autooffload.runtime.hooks import in_backward

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

# Mul/Div by constants between an output of the model and the tensor handed to backward().
_SCALE_NODES = {"MulBackward0": "mul", "MulBackward1": "mul", "DivBackward0": "div"}
_MAX_SCALE_NODES = 4
_KEY = "_autooffload_oom_retry"


class OutOfMemoryRetryError(AutoOffloadError, torch.OutOfMemoryError):
    """The device ran out of memory inside an attached step and could not be retried, or ran out
    again after the retry; still a ``torch.OutOfMemoryError`` for code that catches those."""


@dataclass
class _ForwardCall:
    """What the last grad-enabled forward of the root model needs to run again."""

    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    autocast: tuple[bool, torch.dtype]
    # The grad_fn of each output tensor (flattened order): how a loss is traced back to it.
    # Dropped after the backward and at the next forward, so no graph outlives its step.
    output_nodes: list[Any]
    # Device bytes allocated when the forward began: what a retried backward measures the failed
    # graph's leftovers against.
    allocated: int = 0


@dataclass
class _Replay:
    """A backward that can be run again: output ``index`` of ``call``, scaled as the user did."""

    call: _ForwardCall
    index: int
    scale: list[tuple[str, Any]]


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "unbounded"
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"


def _describe(plan: Plan, activation_mode: str) -> str:
    budget = _size(plan.budget_bytes)
    # A plan without block policies leaves the blocks as the start put them: checkpointed in
    # the profiling steps (a long batch's inputs on the host), else the fixed mode's policy.
    if plan.block_policies:
        activations = f"{plan.n_checkpoint} blocks checkpointed, {plan.n_swap} swapped"
    elif activation_mode == "auto":
        activations = "every block checkpointed (profiling)"
    else:
        activations = f"activation_mode={activation_mode}"
    return f"budget {budget}, n_persist={plan.n_persist}, n_buffer={plan.n_buffer}, {activations}"


class OomRetry:
    """The OOM retry of one runtime: a wrapper on the root model's ``forward`` and the
    backward-side entry :meth:`run_backward`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # True while a retried pass runs: an OOM in it is the second one.
        self.retrying = False
        self.last_call: _ForwardCall | None = None
        self.retries = 0
        # Elements of the model's input tensors in the profiling step, and in the last forward:
        # a longer batch than the profiled one scales the profile's activations at a retry.
        self.profiled_numel = 0
        self.input_numel = 0

    def install(self) -> OomRetry:
        model = self.runtime.model
        state = SimpleNamespace(
            inner_forward=model.forward,
            prior_forward=model.__dict__.get("forward"),
            active=True,
        )
        install_forward(model, _KEY, state, self._forward)
        return self

    def remove(self) -> None:
        """Restore the model's ``forward`` and forget the runtime (on detach)."""
        remove_forward(self.runtime.model, _KEY)
        self.last_call = None
        # A cycle through the runtime otherwise, keeping a dropped model alive until a cyclic gc.
        del self.runtime

    # ---- forward ----------------------------------------------------------------------------

    def _forward(self, state: SimpleNamespace, args: tuple, kwargs: dict) -> Any:
        if not state.active or in_backward():
            return state.inner_forward(*args, **kwargs)
        call = self._save_call(args, kwargs)
        inputs = tree_flatten((args, kwargs))[0]
        self.input_numel = sum(t.numel() for t in inputs if isinstance(t, torch.Tensor))
        if self.runtime.control.profiling:
            self.profiled_numel = self.input_numel
        self.runtime.backward_update.note_forward(self.input_numel)
        self.last_call = None
        caches = CacheRewind.mark(inputs)
        try:
            output = state.inner_forward(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            message = str(error)
        else:
            return self._remember(call, output)
        # Out of the except block: the traceback (and the activations its frames hold) is gone.
        if caches is not None and caches.unsupported and not self.retrying:
            self.runtime.hooks.recover_interrupted()
            self._restart_profiler()
            names = ", ".join(caches.unsupported)
            raise self._error(
                f"in forward, not retried because its KV cache ({names}) was already partly"
                " updated and cannot be rewound (generate with use_cache=False, or a"
                " DynamicCache or StaticCache, to keep it retryable),",
                message,
            )
        self.recover("forward", message)
        if caches is not None:
            caches.rewind()
        self._restore_rng(call)
        self._resume_root_group(args, kwargs)
        self.retrying = True
        try:
            output = state.inner_forward(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            message = str(error)
        else:
            return self._remember(call, output)
        finally:
            self.retrying = False
        self.runtime.hooks.recover_interrupted()
        self._restart_profiler()
        raise self._error("again after the retry", message)

    def _save_call(self, args: tuple, kwargs: dict) -> _ForwardCall:
        device = self.runtime.device
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        autocast = (
            torch.is_autocast_enabled(device.type),
            torch.get_autocast_dtype(device.type),
        )
        return _ForwardCall(
            args, dict(kwargs), torch.get_rng_state(), device_rng, autocast, [], self._allocated()
        )

    def _allocated(self) -> int:
        """Device bytes the allocator has handed out (0 off CUDA): no synchronisation."""
        runtime = self.runtime
        return torch.cuda.memory_allocated(runtime.device) if runtime.manager.is_cuda else 0

    def _remember(self, call: _ForwardCall, output: Any) -> Any:
        if torch.is_grad_enabled():
            call.output_nodes = [
                t.grad_fn if isinstance(t, torch.Tensor) else None for t in tree_flatten(output)[0]
            ]
            self.last_call = call
        return output

    def _restore_rng(self, call: _ForwardCall) -> None:
        torch.set_rng_state(call.cpu_rng)
        if call.device_rng is not None:
            torch.cuda.set_rng_state(call.device_rng, self.runtime.device)

    def _resume_root_group(self, args: tuple, kwargs: dict) -> None:
        """The root model's own group hook ran before the failed forward; run it again."""
        runtime = self.runtime
        for group in runtime.groups:
            if group.module is runtime.model:
                runtime.hooks.resume_group(group, args, kwargs)

    # ---- recovery and re-plan -----------------------------------------------------------------

    def recover(self, where: str, message: str, since: int | None = None) -> None:
        """Clean up after the OOM, shrink the plan and log it; raise if no retry is left.

        ``since``: for a backward, the device bytes allocated when its forward began. The
        failed backward's graph stays referenced (by the loss the script holds) through the
        retry, with the saved tensors of every node it had not reached yet; what is allocated
        beyond ``since`` once the runtime is cleaned up is that, and the retry's plan must fit
        beside it (8B LoRA at seq 49152: ~4.6 GiB)."""
        runtime = self.runtime
        if self.retrying:
            runtime.hooks.recover_interrupted()
            self._restart_profiler()
            raise self._error("again after the retry", message)
        runtime.hooks.drop_partial_trace()
        runtime.hooks.recover_interrupted()
        if runtime.activations.swapper is not None:
            # Even when no chunk was left resident (an OOM in the loss, after the last block).
            runtime.activations.swapper.forget()
        if runtime.data_parallel is not None:
            # One rank re-planning alone would issue other collectives than the rest: hang.
            raise self._error(
                f"on rank {runtime.data_parallel.rank} of {runtime.data_parallel.world_size}"
                " (no retry under data parallelism: every rank must keep the same plan)",
                message,
            )
        runtime.hooks.drop_active_groups()
        runtime.manager.release_all()
        self._restart_profiler()
        self._free_cached_memory()
        old = runtime.plan
        held = max(0, self._allocated() - since) if since is not None else 0
        plan = shrunk_plan(runtime, failed_allocation_bytes(message), self.batch_ratio, held)
        if plan is None:
            raise self._error("and no smaller plan keeps the persistent chunks", message)
        runtime.apply_plan(plan)
        if plan.source == REPROFILE_SOURCE:
            # The retried pass is a measured profiling step of the real batch (the worker idle
            # at its start, as for the first profile); the next forward switches to the plan
            # searched from it.
            runtime.control.reprofile()
        self.retries += 1
        mode = runtime.settings.activation_mode
        logger.warning(
            "device out of memory in %s (step %d); retrying it once under a smaller plan: %s"
            " (was %s)%s",
            where,
            runtime.steps_taken,
            _describe(plan, mode),
            _describe(old, mode),
            f"; the failed backward's graph holds {_size(held)} through the retry" if held else "",
        )

    @property
    def batch_ratio(self) -> float:
        """The last forward's input size over the profiled one's (1.0 before a profile)."""
        return self.input_numel / self.profiled_numel if self.profiled_numel else 1.0

    def _restart_profiler(self) -> None:
        """A failed pass left a profiling step's marks partial: that step starts over."""
        self.runtime.control.restart_profiling()

    def _free_cached_memory(self) -> None:
        if self.runtime.manager.is_cuda:
            gc.collect()
            torch.cuda.synchronize(self.runtime.device)
            torch.cuda.empty_cache()

    def _error(self, what: str, message: str) -> OutOfMemoryRetryError:
        budget = self.runtime.settings.budget
        setting = "unset" if budget is None else budget
        first = message.splitlines()[0] if message else "out of memory"
        return OutOfMemoryRetryError(
            f"device out of memory {what} under the plan"
            f" ({_describe(self.runtime.plan, self.runtime.settings.activation_mode)}):"
            f" {first}; lower AUTOOFFLOAD_BUDGET (now {setting}), set a smaller"
            " AUTOOFFLOAD_N_PERSIST or AUTOOFFLOAD_N_BUFFER,"
            " AUTOOFFLOAD_ACTIVATION_MODE=checkpoint, or use a smaller batch or sequence length"
        )

    # ---- backward -----------------------------------------------------------------------------

    def replay_for(self, args: tuple, kwargs: dict) -> _Replay | str:
        """How to re-run the backward ``torch.autograd.backward(*args, **kwargs)`` from this
        model's last forward, or why it cannot be."""
        call = self.last_call
        if call is None:
            return "the tensor handed to backward() is not an output of the attached model"
        names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables")
        bound = dict(zip(names, args, strict=False)) | kwargs
        tensors = bound.get("tensors")
        if isinstance(tensors, (tuple, list)) and len(tensors) == 1:
            tensors = tensors[0]
        if not isinstance(tensors, torch.Tensor) or bound.get("create_graph"):
            return "backward() of several tensors or with create_graph"
        if bound.get("retain_graph") or bound.get("inputs") is not None:
            return "backward() with retain_graph or inputs"
        node, scale = tensors.grad_fn, []
        while node is not None and not any(node is n for n in call.output_nodes):
            kind = _SCALE_NODES.get(type(node).__name__)
            if kind is None or len(scale) == _MAX_SCALE_NODES:
                return "the loss is computed outside the model from its outputs"
            (first, _), (second, _) = node.next_functions
            if kind == "div" and first is not None and second is None:
                scale.append(("div", node._saved_other))
                node = first
            elif kind == "mul" and first is not None and second is None:
                scale.append(("mul", node._saved_other))
                node = first
            elif kind == "mul" and first is None and second is not None:
                scale.append(("mul", node._saved_self))
                node = second
            else:
                return "the loss is computed outside the model from its outputs"
        if node is None:
            return "the tensor handed to backward() is not an output of the attached model"
        index = next(i for i, n in enumerate(call.output_nodes) if n is node)
        inputs = tree_flatten((call.args, call.kwargs))[0]
        if CacheRewind.mark(inputs) is not None:
            return "the forward was given a KV cache (past_key_values), which it extended"
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            # Their partial gradients, outside the model, could not be discarded.
            return "an input of the model requires grad"
        runtime = self.runtime
        if any(p.grad is not None for p in runtime.model.parameters()) or (
            runtime.cpu_optim.staging.accumulations
        ):
            return (
                "gradients from an earlier backward (gradient accumulation) cannot be told apart"
                " from the failed backward's partial ones"
            )
        return _Replay(call, index, list(reversed(scale)))

    def retry_backward(
        self, replay: _Replay | str, message: str, run: Callable[[torch.Tensor], Any]
    ) -> Any:
        """After an OOM in backward: discard its partial gradients, re-plan, re-run the forward
        and ``run`` the backward of the new loss (once)."""
        early = self.runtime.cpu_optim.early.count
        if early and not isinstance(replay, str):
            replay = (
                f"the update in the backward had already updated {early} chunks with"
                " this backward's gradients (a retry would update them twice; set"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0 to keep OOMs in the backward retryable)"
            )
        if isinstance(replay, str):
            self.runtime.hooks.recover_interrupted()
            raise self._error(f"in backward, not retried because {replay},", message)
        call = replay.call
        for param in self.runtime.model.parameters():
            param.grad = None  # before measuring what the failed graph still holds
        self.recover("backward", message, since=call.allocated)
        self._discard_gradients()
        self._restore_rng(call)
        device_type = self.runtime.device.type
        enabled, dtype = call.autocast
        self.retrying = True
        try:
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                output = self.runtime.model(*call.args, **call.kwargs)
            loss = tree_flatten(output)[0][replay.index]
            del output
            for kind, value in replay.scale:
                loss = loss * value if kind == "mul" else loss / value
            return run(loss)
        except torch.OutOfMemoryError as error:
            if isinstance(error, OutOfMemoryRetryError):
                raise
            message = str(error)
        finally:
            self.retrying = False
        self._discard_gradients()
        self._restart_profiler()
        raise self._error("again after the retry", message)

    def _discard_gradients(self) -> None:
        """Back to no gradient at all, as when the failed backward started (checked by
        :meth:`replay_for`): partial device and host gradients are dropped."""
        runtime = self.runtime
        runtime.hooks.recover_interrupted()
        for param in runtime.model.parameters():
            param.grad = None
        # The retry's own zero_grad, not the loop's: no reason against the update in the backward.
        runtime.cpu_optim.early.discard_backward()
        runtime.cpu_optim.zero_grad(set_to_none=True)

    def backward_done(self) -> None:
        """A backward of this model's output finished: nothing to replay any more."""
        self.last_call = None


def run_backward(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.backward`` with the OOM retry of the runtime whose output it runs
    from, and the clean-up of every runtime when it raises (or Ctrl-C)."""
    outermost = not in_backward()
    replays: list[tuple[OomRetry, _Replay | str]] = []
    if outermost:
        for runtime in registry.runtimes():
            guard = getattr(runtime, "oom", None)
            if guard is not None and guard.last_call is not None:
                replays.append((guard, guard.replay_for(args, kwargs)))
    try:
        result = wrapped(*args, **kwargs)
    except torch.OutOfMemoryError as error:
        if not outermost or not replays:
            _recover_all()
            raise
        message = str(error)
    except BaseException:
        if outermost:
            _recover_all()
        raise
    else:
        for guard, _ in replays:
            guard.backward_done()
        return result
    guard, replay = next(
        ((g, r) for g, r in replays if not isinstance(r, str)), replays[0]
    )  # the runtime whose output the loss is, else the first one's reason

    def run_again(loss: torch.Tensor) -> Any:
        if "tensors" in kwargs:
            return wrapped(*args, **(kwargs | {"tensors": loss}))
        return wrapped(loss, *args[1:], **kwargs)

    result = guard.retry_backward(replay, message, run_again)
    guard.backward_done()
    return result


def _recover_all() -> None:
    for runtime in registry.runtimes():
        runtime.hooks.recover_interrupted()
