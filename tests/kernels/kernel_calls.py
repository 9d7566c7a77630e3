"""Calling a kernel as the kernel tests write it: tensors, then the op's attributes by
position or name (`rmsnorm(x, w, 1e-6, group=8)`), which become the op's attribute object
(`a=Norm(eps=1e-6, group=8)`), so a test reads like the maths it checks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from kiln.core.opdef import OpDef


def with_attrs(definition: OpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    return functools.partial(_call, definition, fn)


def _call(definition: OpDef, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    lead = 1 if definition.needs_ctx else 0
    fixed = [i for i in definition.inputs if not i.variadic]
    n = lead
    while n < len(args) and n - lead < len(fixed):
        if not (isinstance(args[n], (torch.Tensor, tuple)) or args[n] is None):
            break
        n += 1
    names = [f for f in definition.attr_names if f not in kw]
    attrs = {**dict(zip(names, args[n:], strict=False)), **kw}
    if not definition.attr_names:
        return fn(*args[:n])
    defaults = {name: d for name, _, d in definition.fields if d is not dataclasses.MISSING}
    return fn(*args[:n], a=definition.attrs(**{**defaults, **attrs}))
