"""The arithmetic behind docs/scaling.md: tensor / expert parallelism of real model shapes on
H100s, on paper (no GPU ran this). Reads ../shared/model-configs (or --configs) and prints,
per model and parallel size: weight bytes per rank, all-reduce bytes per token, a decode
step's time floors (weights from HBM, all-reduces over NVLink, their latency) and the KV
capacity per rank.

    python benchmarks/scaling_arith.py [--configs DIR] [--batch 1 32] [--markdown]

Hardware figures are NVIDIA's H100 SXM5 datasheet numbers, and the all-reduce latency an
assumption stated with them (see docs/scaling.md); change them with the flags.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent.parent / "shared" / "model-configs"


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    inter: int  # dense MLP width, or one expert's
    experts: int  # 1 for a dense model
    top_k: int
    tied: bool

    @classmethod
    def load(cls, path: Path) -> Shape:
        c = json.loads(path.read_text())
        heads = c["num_attention_heads"]
        experts = c.get("num_local_experts") or c.get("num_experts") or 1
        return cls(
            name=path.stem,
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
            inter=c.get("moe_intermediate_size") or c["intermediate_size"],
            experts=experts,
            top_k=c.get("num_experts_per_tok") or 1,
            tied=bool(c.get("tie_word_embeddings")),
        )

    def attn_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv  # q and o, k and v

    def expert_params(self) -> int:
        return 3 * self.hidden * self.inter  # gate, up, down

    def table_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        per_layer = self.attn_params() + self.experts * self.expert_params()
        return self.layers * per_layer + self.table_params() * (1 if self.tied else 2)

    def active_params(self) -> int:
        per_layer = self.attn_params() + self.top_k * self.expert_params()
        return self.layers * per_layer + self.table_params()


@dataclass(frozen=True)
class H100:
    hbm_gbs: float = 3350.0  # HBM3, SXM5 datasheet
    nvlink_gbs: float = 450.0  # per direction (900 GB/s bidirectional), SXM5 datasheet
    bf16_tflops: float = 989.0  # dense, SXM5 datasheet
    memory_gb: float = 80.0
    allreduce_us: float = 10.0  # assumed latency of one small all-reduce within a node


def rank_weight_bytes(s: Shape, tp: int, dtype_bytes: int = 2) -> float:
    """Bytes of weights one rank holds: attention and dense MLP split tp ways, experts split
    ep ways (each expert whole) and tp / ep ways within an expert group, so 1 / tp of them
    either way; vocabulary-parallel embedding and lm_head."""
    layers = s.layers * (s.attn_params() + s.experts * s.expert_params()) / tp
    tables = s.table_params() / tp * (1 if s.tied else 2)
    return (layers + tables) * dtype_bytes


def rank_active_bytes(s: Shape, tp: int, ep: int, batch: int, dtype_bytes: int = 2) -> float:
    """Weight bytes the busiest rank reads in a decode step of `batch` tokens: its
    attention part, and of its experts those the step's tokens route to (batch x top_k
    choices spread evenly, at least one on the busiest rank, at most all of its experts)."""
    if s.experts == 1:
        routed = 1.0
    elif ep == 1:
        routed = min(s.experts, batch * s.top_k)
    else:
        routed = min(s.experts // ep, max(1, math.ceil(batch * s.top_k / ep)))
    layers = s.layers * (s.attn_params() / tp + routed * s.expert_params() / (tp // ep))
    tables = s.table_params() / tp
    return (layers + tables) * dtype_bytes


def kv_bytes_per_token(s: Shape, tp: int, dtype_bytes: int = 2) -> float:
    """One rank's K and V bytes for one token over all layers (KV heads split, replicated
    when fewer than ranks)."""
    heads = max(1, s.kv_heads // tp)
    return 2 * s.layers * heads * s.head_dim * dtype_bytes


def collectives(s: Shape, tp: int, ep: int, batch: int, dtype_bytes: int = 2) -> tuple[int, float]:
    """(collectives per decode step, bytes each rank sends per step). TP: an all-reduce of
    the hidden state after attention and one after the MLP (ring: 2 (T-1)/T of the message
    leaves each rank). EP replaces the MoE's all-reduce with a dispatch and a combine of each
    token's top_k hidden vectors (all-to-all: (ep-1)/ep of them leave the rank), plus an
    all-reduce inside an expert group when tp > ep."""
    msg = batch * s.hidden * dtype_bytes
    ring = 2 * (tp - 1) / tp
    n, sent = 0, 0.0
    if tp > 1:  # after attention
        n += s.layers
        sent += s.layers * msg * ring
    if ep > 1 and s.experts > 1:
        n += 2 * s.layers
        sent += 2 * s.layers * msg * s.top_k * (ep - 1) / ep
        group = tp // ep
        if group > 1:
            n += s.layers
            sent += s.layers * msg * s.top_k / ep * 2 * (group - 1) / group
    elif tp > 1:  # after the MLP / MoE
        n += s.layers
        sent += s.layers * msg * ring
    return n, sent


def rows(shapes: list[Shape], sizes: list[tuple[int, int]], batches: list[int], hw: H100):
    for s in shapes:
        for tp, ep in sizes:
            if s.experts == 1 and ep > 1:
                continue
            if s.heads % tp or (s.experts > 1 and s.experts % ep):
                continue
            w = rank_weight_bytes(s, tp)
            free = hw.memory_gb * 1e9 * 0.9 - w  # SGLang's --mem-fraction-static ~0.9
            kv = kv_bytes_per_token(s, tp)
            for b in batches:
                read = rank_active_bytes(s, tp, ep, b)
                hbm_ms = read / (hw.hbm_gbs * 1e9) * 1e3
                flops = 2 * s.active_params() / tp * b
                compute_ms = flops / (hw.bf16_tflops * 1e12) * 1e3
                n, sent = collectives(s, tp, ep, b)
                link_ms = sent / (hw.nvlink_gbs * 1e9) * 1e3
                lat_ms = n * hw.allreduce_us / 1e3
                yield {
                    "model": s.name,
                    "tp": tp,
                    "ep": ep,
                    "batch": b,
                    "weights_gb": w / 1e9,
                    "fits": free > 0,
                    "kv_tokens_k": max(0.0, free) / kv / 1e3,
                    "hbm_ms": hbm_ms,
                    "compute_ms": compute_ms,
                    "collectives": n,
                    "link_ms": link_ms,
                    "latency_ms": lat_ms,
                    "step_ms": max(hbm_ms, compute_ms) + link_ms + lat_ms,
                }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", type=Path, default=CONFIGS)
    p.add_argument("--models", nargs="+", default=["llama-3-8b", "mixtral-8x7b", "qwen3-30b-a3b"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--allreduce-us", type=float, default=H100.allreduce_us)
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args()
    hw = H100(allreduce_us=args.allreduce_us)
    shapes = [Shape.load(args.configs / f"{m}.json") for m in args.models]
    for s in shapes:
        print(
            f"{s.name}: {s.total_params() / 1e9:.2f} B parameters, "
            f"{s.active_params() / 1e9:.2f} B active a token"
        )
    sizes = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 8), (4, 4)]
    head = (
        "model", "tp", "ep", "batch", "weights GB/rank", "KV k-tokens/rank", "HBM ms",
        "compute ms", "collectives", "NVLink ms", "latency ms", "step ms",
    )  # fmt: skip
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print("  ".join(head))
    for r in rows(shapes, sizes, args.batch, hw):
        kv = f"{r['kv_tokens_k']:.0f}" if r["fits"] else "does not fit"
        cells = (
            r["model"], r["tp"], r["ep"], r["batch"], f"{r['weights_gb']:.1f}", kv,
            f"{r['hbm_ms']:.2f}", f"{r['compute_ms']:.3f}", r["collectives"],
            f"{r['link_ms']:.3f}", f"{r['latency_ms']:.2f}", f"{r['step_ms']:.2f}",
        )  # fmt: skip
        sep = " | " if args.markdown else "  "
        line = sep.join(str(c) for c in cells)
        print(f"| {line} |" if args.markdown else line)


if __name__ == "__main__":
    main()
