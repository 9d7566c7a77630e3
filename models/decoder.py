"""The decoder-only transformer behind Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 1, 2 and 3,
Phi-3 and Phi-4-mini, Granite, SmolLM3, OLMo 2, ERNIE 4.5, EXAONE 4, and the mixtures of
experts Mixtral, Granite MoE, Qwen3-MoE, GPT-OSS and DeepSeek V2 / V3 (with multi-head
latent attention); docs/models.md lists every family.

Written for one device and traced, never run eagerly: build it on the meta device and
hand it to `kiln.core.trace.trace`. Parameter names match the Hugging Face
checkpoints, so weights are loaded by name. Activations are [tokens, features] for the
whole batch; attention knows where each sequence begins from the runtime's metadata.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kiln.core import ops
from kiln.core.trace import Value
from kiln.models.config import EagleTap, ModelConfig
from kiln.models.rope import inv_freq


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _norm(cfg: ModelConfig, x: Value, norm: nn.Module, group: int = 0) -> Value:
    """RMSNorm with the checkpoint's weight, plus the model's offset (Gemma's 1 + w); a
    LayerNorm with its weight and bias (StarCoder 2's)."""
    w = cast(nn.Parameter, norm.weight)
    weight = ops.shifted(w, cfg.norm_offset) if cfg.norm_offset else w
    if isinstance(norm, nn.LayerNorm):  # Nemotron's LayerNorm1P: 1 + w as well
        return ops.layernorm(x, weight, norm.bias, eps=cfg.rms_norm_eps)
    return ops.rmsnorm(x, weight, eps=cfg.rms_norm_eps, group=group)


def _hidden_norm(cfg: ModelConfig) -> nn.Module:
    """A norm over the hidden state: RMSNorm, or LayerNorm with a bias where the model has it."""
    if cfg.layer_norm:
        return nn.LayerNorm(cfg.hidden_size, bias=cfg.norm_bias)
    return nn.RMSNorm(cfg.hidden_size)


# LayerNorms over each head of q and k, by their checkpoints' module names (%s: q or k).
_QK_LAYERNORMS = {"phi": "%s_layernorm", "stablelm": "%s_layernorm", "cohere": "%s_norm"}


def _qk_layernorm(cfg: ModelConfig, heads: int) -> nn.Module:
    """Phi's: one LayerNorm (weight and bias) every head shares. StableLM's: a bias-free
    LayerNorm a head (`norms.<h>.weight`). Cohere's: one bias-free [heads, head_dim] weight."""
    if cfg.model_type == "phi":
        return nn.LayerNorm(cfg.head_dim)
    module = nn.Module()
    if cfg.model_type == "stablelm":
        module.norms = nn.ModuleList(nn.LayerNorm(cfg.head_dim, bias=False) for _ in range(heads))
    else:
        module.weight = _weight(heads, cfg.head_dim)
    return module


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, in_features: int = 0) -> None:
        """`in_features`: what q, k and v read, where not the hidden size (EAGLE-3's draft
        layer reads its token's and its hidden state's norms side by side)."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h = cfg.hidden_size
        width = in_features or h
        if cfg.fused_qkv:  # Phi-3: one [q; k; v] tensor in the checkpoint
            self.qkv_proj = nn.Linear(width, cfg.q_size + 2 * cfg.kv_size, bias=False)
        else:
            self.q_proj = nn.Linear(width, cfg.q_size, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(width, cfg.kv_size, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(width, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_name = "dense" if cfg.model_type == "phi" else "o_proj"  # Phi-2's name
        setattr(self, self.o_name, nn.Linear(cfg.q_size, h, bias=cfg.o_bias))
        if cfg.attn_sinks:
            self.sinks = _weight(cfg.num_heads)
        if cfg.qk_norm:  # per head, or (OLMo 2) over the whole projection
            per_head = cfg.qk_norm_heads
            self.q_norm = nn.RMSNorm(cfg.head_dim if per_head else cfg.q_size)
            self.k_norm = nn.RMSNorm(cfg.head_dim if per_head else cfg.kv_size)
        if cfg.qk_layernorm:
            for which, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
                setattr(self, _QK_LAYERNORMS[cfg.model_type] % which, _qk_layernorm(cfg, heads))

    def projections(self) -> list[tuple[Value | torch.Tensor, Value | torch.Tensor | None]]:
        """(weight, bias) of q, k and v. A partial rotary's q and k rows (biases too) are
        reordered so that rope turns the whole head, and interleaved rope pairs (ERNIE's,
        GLM's) stored as halves (kiln.core.recipes.rotary_order)."""
        cfg = self.cfg
        if cfg.fused_qkv:
            rotary = (cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim else (0, 0)
            nq, nkv = cfg.q_size, cfg.kv_size
            w = self.qkv_proj.weight
            return [
                (ops.rows(w, "q_proj", 0, nq, rotary), None),
                (ops.rows(w, "k_proj", nq, nq + nkv, rotary), None),
                (ops.rows(w, "v_proj", nq + nkv, nq + 2 * nkv), None),
            ]
        plain: list[tuple[Value | torch.Tensor, Value | torch.Tensor | None]] = [
            (m.weight, m.bias) for m in (self.q_proj, self.k_proj, self.v_proj)
        ]
        if not self._reordered:
            return plain
        for i, (m, part) in enumerate(((self.q_proj, "q_proj"), (self.k_proj, "k_proj"))):
            bias = None if m.bias is None else self._in_rope_order(m.bias, part)
            plain[i] = (self._in_rope_order(m.weight, part), bias)
        return plain

    @property
    def _reordered(self) -> bool:
        """Each head's q and k features are stored in rope order (a partial rotary, or
        interleaved rope pairs), not as the checkpoint has them."""
        return bool(self.cfg.rotary_dim or self.cfg.rope_interleave)

    @property
    def _rotary(self) -> tuple[int, int]:
        """(head_dim, the part rope turns) of each head, as the rope-order recipes take it."""
        return self.cfg.head_dim, self.cfg.rotary_dim or self.cfg.head_dim

    def _in_rope_order(self, t: torch.Tensor, part: str) -> Value:
        """A q or k weight, bias or per-head norm weight with each head's rows in
        kiln.core.recipes.rotary_order, as module `part`'s own."""
        return ops.rows(t, part, rotary=self._rotary, interleaved=self.cfg.rope_interleave)

    def _qk_norm(self, x: Value, norm: nn.Module, part: str) -> Value:
        """q's or k's norm, per head or (OLMo 2) over the whole projection; with the heads'
        features in rope order, its weight in that order too (GLM-4.5's)."""
        cfg = self.cfg
        if not cfg.qk_norm_heads:
            return _norm(cfg, x, norm)
        if not self._reordered:
            return _norm(cfg, x, norm, group=cfg.head_dim)
        if cfg.norm_offset:
            raise ValueError("q/k norms with a weight offset under a reordered rotary")
        w = self._in_rope_order(cast(nn.Parameter, norm.weight), part)
        return ops.rmsnorm(x, w, eps=cfg.rms_norm_eps, group=cfg.head_dim)

    def _qk_layernorm(self, x: Value, which: str) -> Value:
        """A LayerNorm over each head of q or k (before rope): one all heads share, with a
        bias (Phi's), or a weight for each head (StableLM's one LayerNorm a head, Cohere's
        one [heads, head_dim] weight), in the heads' rope order."""
        cfg = self.cfg
        part = _QK_LAYERNORMS[cfg.model_type] % which
        norm = getattr(self, part)
        rotary = self._rotary if self._reordered else (0, 0)
        weight: Value | torch.Tensor
        bias: Value | torch.Tensor | None
        if isinstance(norm, nn.LayerNorm):
            weight, bias = norm.weight, norm.bias
            if self._reordered:
                weight, bias = (self._in_rope_order(t, part) for t in (norm.weight, norm.bias))
        else:
            norms = getattr(norm, "norms", None)
            weights = [n.weight for n in norms] if norms is not None else [norm.weight]
            weight = ops.joined(weights, part, rotary, cfg.rope_interleave)
            bias = None
        return ops.layernorm(x, weight, bias, eps=cfg.rms_norm_eps, group=cfg.head_dim)

    def forward(self, x: Value, cos_sin: Value) -> Value:
        cfg = self.cfg
        q, k, v = (ops.linear(x, w, b) for w, b in self.projections())
        if cfg.qk_norm:
            q, k = self._qk_norm(q, self.q_norm, "q_norm"), self._qk_norm(k, self.k_norm, "k_norm")
        if cfg.qk_layernorm:
            q, k = self._qk_layernorm(q, "q"), self._qk_layernorm(k, "k")
        if not cfg.rope_layers or cfg.rope_layers[self.layer]:  # SmolLM3's NoPE layers: none
            q = ops.rope(q, cos_sin, head_dim=cfg.head_dim)
            k = ops.rope(k, cos_sin, head_dim=cfg.head_dim)
        o = ops.attention(
            q,
            k,
            v,
            self.sinks if cfg.attn_sinks else None,
            layer=self.layer,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=cfg.attention_scale,
            sliding_window=cfg.sliding_windows[self.layer],
            softcap=cfg.attn_softcap,
            sinks=int(cfg.attn_sinks),
        )
        out = getattr(self, self.o_name)
        return ops.linear(o, out.weight, out.bias)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, as its checkpoints name it. Each layer's KV
    pool holds the normed latent and the turned rope part of the key per token
    (kiln/core/ops/mla.py); passes/absorb_mla.py folds kv_b_proj into the query and the
    output. q and the latent projection's rows are stored reordered: q as [every head's
    part without rope | every head's rope part], and rope pairs that the checkpoint
    interleaves (x0, x1), (x2, x3)... as halves, so that kiln's rotate-half rope turns
    them (both q and k alike: their dot products do not change)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, heads = cfg.hidden_size, cfg.num_heads
        q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank)
        kv_width = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, kv_width, bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)

    def forward(self, x: Value, cos_sin: Value) -> Value:
        cfg = self.cfg
        heads, nope, rope = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        latent_dim = cfg.kv_lora_rank
        if cfg.q_lora_rank:
            x_q = _norm(cfg, ops.linear(x, self.q_a_proj.weight), self.q_a_layernorm)
            w_q = self.q_b_proj.weight
        else:
            x_q, w_q = x, self.q_proj.weight
        q = ops.linear(x_q, ops.head_parts(w_q, heads, (nope, rope), cfg.rope_interleave))
        q_nope, q_rope = ops.split(q, sizes=[heads * nope, heads * rope])
        w_kv = ops.head_parts(
            self.kv_a_proj_with_mqa.weight, 1, (latent_dim, rope), cfg.rope_interleave
        )
        latent, k_rope = ops.split(ops.linear(x, w_kv), sizes=[latent_dim, rope])
        o = ops.mla_attention(
            q_nope,
            ops.rope(q_rope, cos_sin, head_dim=rope),
            _norm(cfg, latent, self.kv_a_layernorm),
            ops.rope(k_rope, cos_sin, head_dim=rope),
            self.kv_b_proj.weight,
            layer=self.layer,
            num_heads=heads,
            num_kv_heads=1,
            head_dim=latent_dim + rope,
            scale=cfg.mla_scale,
            latent_dim=latent_dim,
            rope_dim=rope,
            nope_dim=nope,
            v_dim=cfg.v_head_dim,
        )
        return ops.linear(o, self.o_proj.weight)


# A plain (not gated) MLP's up and down projections, where a family names them its own way.
_PLAIN_MLP_NAMES = {"starcoder2": ("c_fc", "c_proj"), "phi": ("fc1", "fc2")}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        self.act = ops.OPS[cfg.hidden_act]
        h, width = cfg.hidden_size, width or cfg.intermediate_size
        self.fused, self.gated = cfg.fused_gate_up, cfg.gated_mlp
        if not self.gated:  # up, the activation, down (StarCoder 2 names them c_fc, c_proj)
            self.up_name, self.down_name = _PLAIN_MLP_NAMES.get(
                cfg.model_type, ("up_proj", "down_proj")
            )
            setattr(self, self.up_name, nn.Linear(h, width, bias=cfg.mlp_bias))
            setattr(self, self.down_name, nn.Linear(width, h, bias=cfg.mlp_bias))
            return
        if self.fused:  # Phi-3, GLM: one [gate; up] tensor in the checkpoint
            self.gate_up_proj = nn.Linear(h, 2 * width, bias=False)
        else:
            self.gate_proj = nn.Linear(h, width, bias=False)
            self.up_proj = nn.Linear(h, width, bias=False)
        self.down_proj = nn.Linear(width, h, bias=False)

    def forward(self, x: Value) -> Value:
        if not self.gated:
            up, down = getattr(self, self.up_name), getattr(self, self.down_name)
            return ops.linear(self.act(ops.linear(x, up.weight, up.bias)), down.weight, down.bias)
        if self.fused:
            w, width = self.gate_up_proj.weight, self.down_proj.weight.shape[1]
            gate_w: Value | torch.Tensor = ops.rows(w, "gate_proj", 0, width)
            up_w: Value | torch.Tensor = ops.rows(w, "up_proj", width, 2 * width)
        else:
            gate_w, up_w = self.gate_proj.weight, self.up_proj.weight
        gate = self.act(ops.linear(x, gate_w))
        return ops.linear(ops.mul(gate, ops.linear(x, up_w)), self.down_proj.weight)


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


class Expert(nn.Module):
    """One expert's MLP, under Qwen3-MoE's names (gate_proj, up_proj, down_proj) or
    Mixtral's (w1 gate, w3 up, w2 down)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, width = cfg.hidden_size, cfg.moe_intermediate_size
        self.names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else _MLP_NAMES
        for name, shape in zip(self.names, ((width, h), (width, h), (h, width)), strict=True):
            setattr(self, name, nn.Linear(shape[1], shape[0], bias=False))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gate, up, down = (getattr(self, n).weight for n in self.names)
        return gate, up, down


class Router(nn.Module):
    """A mixture's router: `weight` [experts, hidden], with GPT-OSS a `bias` on its logits,
    with DeepSeek V3 an `e_score_correction_bias` that picks experts and weighs nothing."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = _weight(cfg.num_experts, cfg.hidden_size)
        if cfg.router_bias:
            self.bias = _weight(cfg.num_experts)
        if cfg.score_correction_bias:
            self.e_score_correction_bias = _weight(cfg.num_experts)


class SparseMoE(nn.Module):
    """A router (`gate`) over `experts`; each token runs its top-k (ops.moe). DeepSeek's
    also has `shared_experts`, an MLP every token runs, added; Qwen2-MoE's `shared_expert`,
    added times sigmoid(`shared_expert_gate`(x)), one gate value a token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
        if cfg.shared_expert_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: Value) -> Value:
        experts = [cast(Expert, e).weights() for e in self.experts]
        cfg = self.cfg
        routed = ops.moe(
            x,
            self.gate.weight,
            experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            correction_bias=getattr(self.gate, "e_score_correction_bias", None),
            scoring=cfg.moe_scoring,
            groups=(cfg.n_group, cfg.topk_group),
            routed_scaling=cfg.routed_scaling_factor,
        )
        if cfg.n_shared_experts:
            return ops.add(routed, self.shared_experts(x))
        if cfg.shared_expert_size:
            # one gate value a token, computed whole on every tensor-parallel rank
            gate = ops.linear(x, self.shared_expert_gate.weight, role="expert_gate")
            return ops.add(routed, ops.sigmoid_gate(self.shared_expert(x), gate))
        return routed


class StackedExperts(nn.Module):
    """GPT-OSS's experts, one tensor each across them: gate and up interleaved by column
    in gate_up_proj [experts, hidden, 2 * width], down_proj [experts, width, hidden], and
    their biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = _weight(e, h, 2 * width)
        self.gate_up_proj_bias = _weight(e, 2 * width)
        self.down_proj = _weight(e, width, h)
        self.down_proj_bias = _weight(e, h)

    def expert(self, e: int) -> tuple[Value, ...]:
        """(gate, up, down, gate bias, up bias, down bias) of expert e, in kiln's layout."""
        gu, gub = self.gate_up_proj, self.gate_up_proj_bias
        return (
            ops.expert_part(gu, "gate", e, (0, 2), transpose=True),
            ops.expert_part(gu, "up", e, (1, 2), transpose=True),
            ops.expert_part(self.down_proj, "down", e, transpose=True),
            ops.expert_part(gub, "gate", e, (0, 2)),
            ops.expert_part(gub, "up", e, (1, 2)),
            ops.expert_part(self.down_proj_bias, "down", e),
        )


class StackedMoE(nn.Module):
    """GPT-OSS's MLP: `router` (weight and bias) over `experts` (StackedExperts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = StackedExperts(cfg)

    def forward(self, x: Value) -> Value:
        cfg = self.cfg
        experts = cast(StackedExperts, self.experts)
        return ops.moe(
            x,
            self.router.weight,
            [experts.expert(e) for e in range(cfg.num_experts)],
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            router_bias=self.router.bias,
            swiglu=(cfg.swiglu_limit, cfg.swiglu_alpha),
        )


class GraniteMoE(nn.Module):
    """Granite 3 MoE's MLP as its checkpoints store it: `router.layer` [experts, hidden]
    over stacked experts, `input_linear` [experts, 2 * width, hidden] (each expert's gate
    rows, then its up rows) and `output_linear` [experts, hidden, width]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = nn.Module()
        self.router.layer = nn.Linear(h, e, bias=False)
        self.input_linear = nn.Module()
        self.input_linear.weight = _weight(e, 2 * width, h)
        self.output_linear = nn.Module()
        self.output_linear.weight = _weight(e, h, width)

    def forward(self, x: Value) -> Value:
        cfg = self.cfg
        width = cfg.moe_intermediate_size
        gate_up = cast(nn.Parameter, self.input_linear.weight)
        down = cast(nn.Parameter, self.output_linear.weight)
        experts = [
            (
                ops.expert_part(gate_up, "gate", e, rows=(0, width)),
                ops.expert_part(gate_up, "up", e, rows=(width, 2 * width)),
                ops.expert_part(down, "down", e),
            )
            for e in range(cfg.num_experts)
        ]
        router = cast(nn.Linear, self.router.layer)
        return ops.moe(x, router.weight, experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn: nn.Module = (
            LatentAttention(cfg, layer) if cfg.kv_lora_rank else Attention(cfg, layer)
        )
        sparse = bool(cfg.sparse_layers) and cfg.sparse_layers[layer]
        # The checkpoints' names: Mixtral's and Granite MoE's block_sparse_moe, everyone
        # else's mlp.
        moe_name = cfg.model_type in ("mixtral", "granitemoe")
        self.ffn_name = "block_sparse_moe" if moe_name else "mlp"
        ffn: nn.Module = MLP(cfg)
        if sparse and cfg.model_type == "granitemoe":
            ffn = GraniteMoE(cfg)
        elif sparse:
            ffn = StackedMoE(cfg) if cfg.stacked_experts else SparseMoE(cfg)
        setattr(self, self.ffn_name, ffn)
        if not cfg.post_norms:
            self.input_layernorm = _hidden_norm(cfg)
        self.norm_names = _norm_names(cfg)
        for name in self.norm_names:
            if name:
                setattr(self, name, _hidden_norm(cfg))

    def _residual(self, h: Value, branch: Value) -> Value:
        """h + branch, the branch scaled first where the model says so (Granite)."""
        scale = self.cfg.residual_scale
        return ops.add(h, ops.scale(branch, factor=scale) if scale != 1.0 else branch)

    def forward(self, h: Value, cos_sin: Value) -> Value:
        cfg = self.cfg
        ffn = getattr(self, self.ffn_name)
        after_attn, before_ffn, after_ffn = 0, 1, 2  # the norms of _norm_names
        if cfg.post_norms:
            h = self._residual(h, self._norm(self.self_attn(h, cos_sin), after_attn))
            return self._residual(h, self._norm(ffn(h), after_ffn))
        x = _norm(cfg, h, self.input_layernorm)
        attn = self.self_attn(x, cos_sin)
        if cfg.parallel_block:  # Cohere: the MLP reads the same normed input
            return ops.add(ops.add(h, attn), ffn(x))
        if not cfg.sandwich_norms:
            h = self._residual(h, attn)
            return self._residual(h, ffn(self._norm(h, before_ffn)))
        h = ops.add(h, self._norm(attn, after_attn))
        out = ffn(self._norm(h, before_ffn))
        return ops.add(h, self._norm(out, after_ffn))

    def _norm(self, x: Value, which: int) -> Value:
        """x through the layer's norm `which` of _norm_names."""
        name = self.norm_names[which]
        assert name is not None
        return _norm(self.cfg, x, getattr(self, name))


def _norm_names(cfg: ModelConfig) -> tuple[str | None, str | None, str | None]:
    """The checkpoint's names of a layer's norms besides the input one: of the attention's
    output, the MLP's input and the MLP's output (None: the layer has no such norm)."""
    if cfg.post_norms:  # OLMo 2, EXAONE 4: after attention and after the MLP only
        return "post_attention_layernorm", None, "post_feedforward_layernorm"
    if cfg.parallel_block:  # one norm, the input's, for both
        return None, None, None
    if not cfg.sandwich_norms:  # Llama's name for the MLP's input norm
        return None, "post_attention_layernorm", None
    if cfg.model_type == "glm4":  # GLM-4's names for Gemma's four norms
        return "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"
    return "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Given its weight, Embedding skips its normal_ init, whose meta kernel imports
        # torch._dynamo (2.1 s of every compile's first trace on a Zen 3).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=_weight(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        # the final norm (Phi-2 names it final_layernorm)
        self.norm_name = "final_layernorm" if cfg.model_type == "phi" else "norm"
        setattr(self, self.norm_name, _hidden_norm(cfg))


class CausalLM(nn.Module):
    """forward(input_ids, positions, logits_indices) -> logits of the selected rows; with
    `embedding` (SGLang's --is-embedding), their final hidden states instead (no lm_head:
    the runtime pools the last token's), or a classifier's label logits (its score head);
    with `hidden_states` (--enable-return-hidden-states), (logits, final hidden states) of
    those rows; with `eagle` (models/eagle.py `EagleTap`), (logits, what an EAGLE draft
    reads) of every row."""

    def __init__(
        self,
        cfg: ModelConfig,
        embedding: bool = False,
        hidden_states: bool = False,
        eagle: EagleTap | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.embedding, self.hidden_states = embedding, hidden_states
        self.eagle = eagle
        if eagle is not None and eagle.layers:  # EAGLE-3's fc, its draft's first linear
            self.eagle3_fc = nn.Linear(
                len(eagle.layers) * cfg.hidden_size, eagle.hidden_size, bias=eagle.fc_bias
            )
        self.model = Backbone(cfg)
        if cfg.num_labels:  # a classifier: its score head, whatever `embedding` says
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        elif not cfg.tie_word_embeddings and not embedding:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        tied = self.cfg.tie_word_embeddings
        return self.model.embed_tokens.weight if tied else self.lm_head.weight

    def forward(
        self, input_ids: Value, positions: Value, logits_indices: Value
    ) -> Value | tuple[Value, Value]:
        cfg = self.cfg
        freqs = ops.constant("rope.inv_freq", inv_freq(cfg.rope, cfg.rotary, cfg.head_dim))
        pairs = cfg.rotary_dim // 2  # 0 (all) unless a partial rotary
        cos_sin = ops.rope_cos_sin(
            positions, freqs, scale=cfg.rope.attention_factor, scaled_pairs=pairs
        )
        local = cos_sin
        if cfg.local_rope is not None:  # the sliding-window layers' own rope (Gemma 3)
            local_freqs = ops.constant(
                "rope.local_inv_freq", inv_freq(cfg.local_rope, cfg.rotary, cfg.head_dim)
            )
            local = ops.rope_cos_sin(
                positions, local_freqs, scale=cfg.local_rope.attention_factor, scaled_pairs=pairs
            )
        h = ops.embedding(input_ids, self.model.embed_tokens.weight, role="embedding")
        if cfg.embed_scale != 1.0:
            h = ops.scale(h, factor=cfg.embed_scale)
        taps = []  # EAGLE-3: the residual stream entering these layers (L: the last's output)
        tapped = self.eagle.layers if self.eagle is not None else ()
        for i, layer in enumerate(self.model.layers):
            if i in tapped:
                taps.append(h)
            h = layer(h, local if cfg.layer_rope(i) is cfg.local_rope else cos_sin)
        if cfg.num_layers in tapped:
            taps.append(h)
        final_norm = getattr(self.model, self.model.norm_name)
        if self.eagle is not None:  # every row's tap: the draft reads each token checked
            if taps:  # EAGLE-3: the draft's fc over the tapped layers' streams
                fc = self.eagle3_fc
                tap = ops.linear(ops.concat(*taps), fc.weight, fc.bias)
                h = _norm(cfg, ops.index_select(h, logits_indices), final_norm)
            else:  # EAGLE: the final norm's output
                tap = _norm(cfg, h, final_norm)
                h = ops.index_select(tap, logits_indices)
            return self._logits(h), tap
        h = _norm(cfg, ops.index_select(h, logits_indices), final_norm)
        if cfg.num_labels:  # one logit a label (the runtime pools the last token's)
            return ops.linear(h, self.score.weight, role="score")
        if self.embedding:
            return h
        logits = self._logits(h)
        return (logits, h) if self.hidden_states else logits

    def _logits(self, h: Value) -> Value:
        cfg = self.cfg
        bias = self.lm_head.bias if cfg.lm_head_bias else None
        logits = ops.linear(h, self.lm_head_weight, bias, role="lm_head")
        if cfg.logits_scale != 1.0:  # Granite's logits_scaling
            logits = ops.scale(logits, factor=cfg.logits_scale)
        if cfg.final_softcap:
            logits = ops.softcap(logits, cap=cfg.final_softcap)
        return logits


def build(
    cfg: ModelConfig,
    embedding: bool = False,
    hidden_states: bool = False,
    eagle: EagleTap | None = None,
) -> CausalLM:
    """The definition on the meta device: names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(cfg, embedding, hidden_states, eagle)
