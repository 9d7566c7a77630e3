"""Kernels: a registry of op implementations per backend (see `kiln.kernels.registry`)."""
