"""Every backend's kernels, registered: import this (not the registry) to look one up."""

from __future__ import annotations

# Importing the backend modules runs their @register decorators.
from kiln.kernels import cpu, triton_ops  # noqa: F401
from kiln.kernels.registry import Kernel, available, get, kernels

__all__ = ["Kernel", "available", "get", "kernels"]
