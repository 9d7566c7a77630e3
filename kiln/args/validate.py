"""Checks on a built ServerArgs, in the order a user can act on them:
choices, ranges, cross-field rules (the command is inconsistent), then support status
(the command is fine but kiln or this machine cannot do it yet)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.args.flags import Flag
from kiln.args.spec import FLAGS, ArgError

if TYPE_CHECKING:
    from kiln.args.server_args import ServerArgs

log = logging.getLogger("kiln.args")

# Deprecated flag -> (flag it sets, value; None means "the value of --tp-size").
_DEPRECATED_TO: dict[str, tuple[str, Any]] = {
    "enable_ep_moe": ("ep_size", None),
    "enable_deepep_moe": ("moe_a2a_backend", "deepep"),
    "enable_flashinfer_cutlass_moe": ("moe_runner_backend", "flashinfer_cutlass"),
    "enable_flashinfer_cutedsl_moe": ("moe_runner_backend", "flashinfer_cutedsl"),
    "enable_flashinfer_trtllm_moe": ("moe_runner_backend", "flashinfer_trtllm"),
    "enable_triton_kernel_moe": ("moe_runner_backend", "triton_kernel"),
    "enable_flashinfer_mxfp4_moe": ("moe_runner_backend", "flashinfer_mxfp4"),
}

POSITIVE = (
    "page_size",
    "max_total_tokens",
    "max_running_requests",
    "max_queued_requests",
    "max_prefill_tokens",
    "context_length",
    "tp_size",
    "pp_size",
    "dp_size",
    "ep_size",
    "nnodes",
    "num_continuous_decode_steps",
    "stream_interval",
    "watchdog_timeout",
    "soft_watchdog_timeout",
    "tokenizer_worker_num",
    "max_loras_per_batch",
    "max_loaded_loras",
    "max_lora_rank",
    "torch_compile_max_bs",
    "cuda_graph_max_bs",
    "decode_log_interval",
    "watchdog_timeout",
    "prefill_max_requests",
    "max_request_body_bytes",
    "threads",
)
FRACTIONS = (
    "swa_full_tokens_ratio",
    "hybrid_kvcache_ratio",
    "eplb_min_rebalancing_utilization_threshold",
)
PORTS = ("port", "nccl_port")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# A flag whose value is a JSON object (--json-model-override-args,
# --preferred-sampling-params): at most this many bytes.
MAX_JSON_FLAG_BYTES = 65536


def json_object(flag: str, text: str) -> dict[str, Any]:
    """A flag's value that must be a JSON object, parsed; ArgError naming the flag."""
    if len(text.encode()) > MAX_JSON_FLAG_BYTES:
        raise ArgError(f"{flag}: longer than {MAX_JSON_FLAG_BYTES} bytes")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArgError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ArgError(f"{flag}: a JSON object, got {type(value).__name__}")
    return value


# --collect-tokens-histogram's default buckets (tokens), SGLang's for both histograms.
TOKEN_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000,
    12000, 15000, 20000, 22000, 25000, 30000, 35000, 40000, 66000, 99000, 132000, 300000,
    600000, 900000, 1100000,
)  # fmt: skip


def token_buckets(flag: str, rule: list[str] | None) -> list[float]:
    """SGLang's bucket rules (--prompt-tokens-buckets, --generation-tokens-buckets):
    `default`; `tse MIDDLE BASE COUNT`, buckets at MIDDLE and MIDDLE +- BASE^i for i in
    1..ceil(COUNT / 2), none below 0; `custom V1 V2 ...`. ArgError naming the flag
    otherwise."""
    rule = rule or ["default"]
    kind, values = rule[0], rule[1:]
    try:
        if kind == "default" and not values:
            return sorted(set(map(float, TOKEN_BUCKETS)))
        if kind == "tse" and len(values) == 3:
            middle, base, count = float(values[0]), float(values[1]), int(values[2])
            if base > 1 and count >= 1:
                points, distance = {middle}, 1.0
                for _ in range(math.ceil(count / 2)):
                    distance *= base
                    points |= {middle + distance, max(0.0, middle - distance)}
                return sorted(points)
        if kind == "custom" and values:
            return sorted({float(v) for v in values})
    except ValueError:
        pass
    raise ArgError(
        f"{flag}: 'default', 'tse MIDDLE BASE COUNT' (BASE > 1, COUNT >= 1) or 'custom V1 "
        f"V2 ...', got {' '.join(rule)!r}"
    )


def _token_buckets(v: dict[str, Any]) -> None:
    token_buckets("--prompt-tokens-buckets", v["prompt_tokens_buckets"])
    token_buckets("--generation-tokens-buckets", v["generation_tokens_buckets"])


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def flag_true(value: str | bool) -> bool:
    """A flag SGLang types as text but reads as on or off (--crash-on-nan)."""
    if isinstance(value, bool):
        return value
    return value.strip().lower() in _TRUE


def translate_deprecated(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Print each deprecated flag's advice and apply the setting it stands for.

    Returns the values and, for each value set on the user's behalf, the flag that set it
    (so an error can name what the user typed)."""
    out, origin = dict(values), {}
    for old, (new, value) in _DEPRECATED_TO.items():
        if out.pop(old, False):
            log.warning("%s is deprecated: %s", FLAGS[old].name, FLAGS[old].deprecated)
            if new not in out:
                out[new] = out.get("tp_size", 1) if value is None else value
                origin[new] = FLAGS[old].name
    if out.get("lora_paths") and not out.get("enable_lora"):
        out["enable_lora"] = True  # as SGLang: giving adapters turns LoRA on
        origin["enable_lora"] = "--lora-paths"
    return out, origin


def validate(args: ServerArgs, origin: dict[str, str] | None = None) -> None:
    values = args.to_dict()
    for dest, flag in FLAGS.items():
        _check_choice(flag, values[dest])
    _check_ranges(values)
    for rule in RULES:
        rule(values)
    for dest, flag in FLAGS.items():
        _check_status(flag, values[dest], (origin or {}).get(dest))


def _fail(message: str) -> None:
    raise ArgError(message)


def _check_choice(flag: Flag, value: Any) -> None:
    if flag.choices is None or value is None:
        return
    for v in value if flag.is_list else (value,):
        if v not in flag.choices:
            _fail(f"{flag.name}: {v!r} is not one of {', '.join(map(str, flag.choices))}")


def _check_status(flag: Flag, value: Any, origin: str | None = None) -> None:
    if value == flag.default or (flag.type == "bool" and not value):
        return
    problem = flag.status_of(value).problem()
    if problem:
        shown = (
            ""
            if flag.type == "bool"
            else " " + (" ".join(map(str, value)) if flag.is_list else str(value))
        )
        if flag.type == "bool" or flag.default is None:
            hint = "leave it unset"
        else:
            hint = f"leave it at its default, {flag.default}"
        if origin:
            _fail(f"{flag.name}{shown} (set by {origin}): {problem}")
        _fail(f"{flag.name}{shown}: {problem} ({hint})")


def _check_ranges(v: dict[str, Any]) -> None:
    for dest in POSITIVE:
        if v[dest] is not None and v[dest] <= 0:
            _fail(f"{FLAGS[dest].name}: must be > 0, got {v[dest]}")
    for dest in FRACTIONS:
        if v[dest] is not None and not 0.0 <= v[dest] <= 1.0:
            _fail(f"{FLAGS[dest].name}: must be in [0, 1], got {v[dest]}")
    for dest in PORTS:
        if v[dest] is not None and not 0 < v[dest] < 65536:
            _fail(f"{FLAGS[dest].name}: must be a port in 1..65535, got {v[dest]}")
    if v["mem_fraction_static"] is not None and not 0.0 < v["mem_fraction_static"] <= 1.0:
        _fail(f"--mem-fraction-static: must be in (0, 1], got {v['mem_fraction_static']}")
    chunk = v["chunked_prefill_size"]
    if chunk is not None and chunk != -1 and chunk <= 0:
        _fail(f"--chunked-prefill-size: must be -1 (off) or > 0, got {v['chunked_prefill_size']}")
    if v["shutdown_timeout"] < 0:
        _fail(f"--shutdown-timeout: must be >= 0 seconds, got {v['shutdown_timeout']}")
    if str(v["crash_on_nan"]).strip().lower() not in _TRUE + _FALSE:
        _fail(f"--crash-on-nan: true or false, got {v['crash_on_nan']!r}")
    if v["max_stored_response_bytes"] < 0:
        _fail(
            "--max-stored-response-bytes: must be >= 0 (0: keep no responses), "
            f"got {v['max_stored_response_bytes']}"
        )
    if v["max_session_tokens"] < 0:
        _fail(
            f"--max-session-tokens: must be >= 0 (0: sessions off), got {v['max_session_tokens']}"
        )
    if v["gc_warning_threshold_secs"] < 0:
        _fail(
            "--gc-warning-threshold-secs: must be >= 0 seconds (0: off), "
            f"got {v['gc_warning_threshold_secs']}"
        )
    if v["schedule_conservativeness"] < 0:
        _fail(f"--schedule-conservativeness: must be >= 0, got {v['schedule_conservativeness']}")
    if v["log_level"].lower() not in LOG_LEVELS:
        _fail(f"--log-level: {v['log_level']!r} is not one of {', '.join(LOG_LEVELS)}")
    if not 0 <= v["node_rank"] < v["nnodes"]:
        _fail(f"--node-rank: must be in [0, --nnodes={v['nnodes']}), got {v['node_rank']}")


# -- cross-field rules (each names every flag involved) ---------------------------------------
def _loras(v: dict[str, Any]) -> None:
    if v["max_loaded_loras"] is not None and v["max_loaded_loras"] < v["max_loras_per_batch"]:
        _fail(
            f"--max-loaded-loras ({v['max_loaded_loras']}) must be >= --max-loras-per-batch "
            f"({v['max_loras_per_batch']})"
        )
    if v["max_lora_chunk_size"] != 16 and v["lora_backend"] != "csgmv":
        _fail("--max-lora-chunk-size: only used with --lora-backend csgmv")


def _dp_attention(v: dict[str, Any]) -> None:
    if v["enable_dp_attention"] and v["dp_size"] != v["tp_size"]:
        _fail(
            f"--enable-dp-attention: needs --dp-size equal to --tp-size "
            f"(got dp {v['dp_size']}, tp {v['tp_size']})"
        )
    if v["load_balance_method"] == "minimum_tokens" and not v["enable_dp_attention"]:
        _fail("--load-balance-method minimum_tokens: needs --enable-dp-attention")


def _priority(v: dict[str, Any]) -> None:
    if v["schedule_low_priority_values_first"] and not v["enable_priority_scheduling"]:
        _fail("--schedule-low-priority-values-first: only with --enable-priority-scheduling")


def _dynamic_batch_tokenizer(v: dict[str, Any]) -> None:
    if v["enable_dynamic_batch_tokenizer"]:
        return
    for dest in ("dynamic_batch_tokenizer_batch_size", "dynamic_batch_tokenizer_batch_timeout"):
        if v[dest] != FLAGS[dest].default:
            _fail(f"{FLAGS[dest].name}: only with --enable-dynamic-batch-tokenizer")


def _speculative(v: dict[str, Any]) -> None:
    if v["speculative_algorithm"] is not None:
        return
    for dest, flag in FLAGS.items():
        if dest.startswith("speculative_") and v[dest] != flag.default:
            _fail(f"{flag.name}: only with --speculative-algorithm")


def _mixed_chunk(v: dict[str, Any]) -> None:
    if v["enable_mixed_chunk"] and v["chunked_prefill_size"] == -1:
        _fail("--enable-mixed-chunk: needs chunked prefill (--chunked-prefill-size is -1)")


def hicache_extra_config(text: str | None) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config for the file backend: a JSON object with
    `storage_dir` (a folder) and `capacity_gb` (a positive number), both optional."""
    if not text:
        return {}
    flag = "--hicache-storage-backend-extra-config"
    try:
        extra = json.loads(text)
    except ValueError as e:
        _fail(f"{flag}: not JSON ({e})")
    if not isinstance(extra, dict):
        _fail(f"{flag}: a JSON object, not {type(extra).__name__}")
    unknown = sorted(set(extra) - {"storage_dir", "capacity_gb"})
    if unknown:
        _fail(f"{flag}: the file backend takes storage_dir and capacity_gb, not {unknown}")
    folder = extra.get("storage_dir", "-")
    if not (isinstance(folder, str) and folder):
        _fail(f"{flag}: storage_dir must be a folder's path")
    gb = extra.get("capacity_gb")
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, int | float) or gb <= 0):
        _fail(f"{flag}: capacity_gb must be a positive number")
    return extra


def _hicache(v: dict[str, Any]) -> None:
    if v["hicache_storage_backend"] is None:
        return
    hicache_extra_config(v["hicache_storage_backend_extra_config"])
    if not v["enable_hierarchical_cache"]:
        _fail("--hicache-storage-backend: needs --enable-hierarchical-cache")
    if v["disable_radix_cache"]:
        _fail(
            "--hicache-storage-backend: keeps the prefix cache's K/V, so not with "
            "--disable-radix-cache"
        )


RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    _loras,
    _hicache,
    _dp_attention,
    _priority,
    _dynamic_batch_tokenizer,
    _speculative,
    _mixed_chunk,
    _token_buckets,
)
