"""Whether an LM head can be fused with the causal-LM loss exactly: the model's ``forward``,
read from its source, passes ``self.lm_head``'s output straight to ``self.loss_function`` as its
logits, and the head is a plain ``nn.Linear`` (``fused_head.py``)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

_FORWARD_CHECKS: dict[type, str | None] = {}


def _names(node: ast.AST) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name)]


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _head_assignment(statement: ast.stmt) -> str | None:
    """The variable a ``x = self.lm_head(...)`` statement assigns, else None."""
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and isinstance(statement.value, ast.Call)
        and _is_self_attr(statement.value.func, "lm_head")
    ):
        return statement.targets[0].id
    return None


def _loss_calls(node: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and _is_self_attr(n.func, "loss_function")
    ]


def forward_check(cls: type) -> str | None:
    """None when ``cls.forward`` passes ``self.lm_head``'s output straight to
    ``self.loss_function`` as its ``logits`` (the output read nowhere in between, one head call,
    one loss call), else why not. Read from the source once per class."""
    if cls in _FORWARD_CHECKS:
        return _FORWARD_CHECKS[cls]
    _FORWARD_CHECKS[cls] = reason = _forward_reason(cls)
    return reason


def _forward_reason(cls: type) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as error:
        return f"its forward's source cannot be read ({error})"
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return "its forward is not a function"
    body = function.body
    heads = [(i, name) for i, s in enumerate(body) if (name := _head_assignment(s)) is not None]
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    head_calls = [n for n in calls if _is_self_attr(n.func, "lm_head")]
    if len(heads) != 1 or len(head_calls) != 1:
        return "its forward does not call self.lm_head once, as `logits = self.lm_head(...)`"
    index, name = heads[0]
    loss_at = [i for i, s in enumerate(body) if _loss_calls(s)]
    if len(loss_at) != 1 or loss_at[0] <= index or len(_loss_calls(body[loss_at[0]])) != 1:
        return "its forward does not call self.loss_function once after the head"
    (call,) = _loss_calls(body[loss_at[0]])
    passed = [k.value for k in call.keywords if k.arg == "logits"] + call.args[:1]
    if len(passed) != 1 or not (isinstance(passed[0], ast.Name) and passed[0].id == name):
        return f"its loss function is not given the head's output `{name}` as its logits"
    for statement in body[index + 1 : loss_at[0]]:
        if any(n.id == name for n in _names(statement)):
            return f"its forward uses the head's output `{name}` before the loss (a transform)"
    # In the loss's statement, the name may appear only as the loss call's logits argument.
    in_statement = [n for n in _names(body[loss_at[0]]) if n.id == name]
    if len(in_statement) != 1 or in_statement[0] is not passed[0]:
        return f"its forward uses the head's output `{name}` beside the loss call"
    return None


def fusable_reason(model: nn.Module) -> str | None:
    """None when ``model`` (a transformers causal LM) can have its head fused, else why not."""
    head = getattr(model, "lm_head", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if head is None or get_head is None:
        return "it has no lm_head"
    if type(head) is not nn.Linear:
        return f"its lm_head is a {type(head).__name__}, not a plain nn.Linear"
    if get_head() is not head:
        return "its output embeddings are not its lm_head"
    return forward_check(type(model))


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The outermost module of ``model`` with an ``lm_head`` and a ``loss_function`` (the
    transformers causal LM itself, or the one a PEFT model wraps)."""
    for module in model.modules():
        if hasattr(module, "lm_head") and hasattr(type(module), "loss_function"):
            return module
    return None
