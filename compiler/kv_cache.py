"""--kv-cache-dtype and --quantization-param-path: the element type of the paged KV pool and
the per-layer scales attention stores it with (stored = value / scale, read = stored * scale).

The scales file has the layout vLLM's and SGLang's calibration tools write:
{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp rank>": {"<layer>": s}}}}.
kiln compiles for one rank, so it reads rank "0"'s, one positive scale for every layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kiln.args import ArgError, ServerArgs

# --kv-cache-dtype -> the pool's torch dtype name (the manifest's runtime.kv_dtype).
KV_DTYPES = {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn"}


def kv_cache_options(args: ServerArgs, num_layers: int) -> dict | None:
    """{"dtype": torch dtype name, "scales": one per layer}, or None for a pool in the
    model's dtype; ArgError names the flag when the arguments or the scales file are wrong."""
    path = args.quantization_param_path
    if args.kv_cache_dtype == "auto":
        if path:
            raise ArgError(
                "--quantization-param-path: holds KV cache scales, which only "
                "--kv-cache-dtype fp8_e4m3 or fp8_e5m2 uses"
            )
        return None
    dtype = KV_DTYPES[args.kv_cache_dtype]
    if not path:
        return {"dtype": dtype, "scales": [1.0] * num_layers}
    return {"dtype": dtype, "scales": read_scales(Path(path), dtype, num_layers)}


def read_scales(path: Path, dtype: str, num_layers: int) -> list[float]:
    flag = "--quantization-param-path"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgError(f"{flag}: cannot read {path}: {e}") from None
    kv = data.get("kv_cache") if isinstance(data, dict) else None
    factors = kv.get("scaling_factor") if isinstance(kv, dict) else None
    rank0 = factors.get("0") if isinstance(factors, dict) else None
    if not isinstance(rank0, dict):
        raise ArgError(f'{flag}: {path} has no kv_cache.scaling_factor for rank "0"')
    stored = kv.get("dtype") if isinstance(kv, dict) else None
    if stored not in (None, "auto", dtype):
        raise ArgError(
            f"{flag}: {path} holds scales for {stored}; --kv-cache-dtype asks for {dtype}"
        )
    extra = sorted(set(rank0) - {str(i) for i in range(num_layers)})
    if extra:
        raise ArgError(f"{flag}: {path} names layers the model lacks: {', '.join(extra[:5])}")
    scales = []
    for layer in range(num_layers):
        given = s = rank0.get(str(layer))
        if isinstance(s, bool) or not isinstance(s, int | float):
            s = math.nan
        if not (math.isfinite(s) and s > 0):
            raise ArgError(
                f"{flag}: {path}: layer {layer} has scale {given!r}; every one of the model's "
                f"{num_layers} layers needs a positive number"
            )
        scales.append(float(s))
    return scales
