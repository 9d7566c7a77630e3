"""EAGLE draft heads (SGLang's `LlamaForCausalLMEagle` and `LlamaForCausalLMEagle3`): one
Llama layer that drafts from the model's own hidden states as well as the tokens.

A draft row at position p reads the token at p + 1 and a hidden state for position p, and
its logits guess the token at p + 2. For the tokens the model checked, that hidden state
is the model's (models/decoder.py `EagleTap`, a second output of the model's step); for
a token the draft guessed, it is the draft's own output at the row before (the runtime
feeds both through the `step_hidden` op, runtime/speculative.py `EagleDraft`).

- EAGLE: fc over [embedding, hidden] (with a bias where the head has one), then the layer
  without an input norm; the logits are the model's lm_head over the layer's output,
  un-normed, and that output is the hidden state the next draft row reads.
- EAGLE-3: the model's fc over three of its layers' streams is compiled into the model
  (`EagleTap`), so the draft reads one hidden state either way; q, k and v read
  [input_layernorm(embedding), hidden_norm(hidden)], the residual is the hidden state, and
  the logits are the head's own lm_head (over its draft vocabulary, where smaller: the
  runtime maps a draft id to the model's with the head's d2t) after its final norm.

The token embedding is the model's, and so is the lm_head where the head has none (read
from the model's checkpoint at compile time: compiler/compile.py)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kiln.core import ops
from kiln.core.trace import Value
from kiln.models.config import EagleHead, ModelConfig
from kiln.models.decoder import MLP, Attention, DecoderLayer, _hidden_norm, _norm, _weight
from kiln.models.rope import inv_freq


class EagleLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, eagle3: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, in_features=2 * h if eagle3 else 0)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = _hidden_norm(cfg)
        if eagle3:
            self.input_layernorm = _hidden_norm(cfg)
            self.hidden_norm = _hidden_norm(cfg)


class EagleDraft(nn.Module):
    """forward(input_ids, positions, logits_indices) -> (logits, hidden states) of the
    selected rows; the hidden states, a row per token, come from the step (`step_hidden`)."""

    def __init__(self, cfg: ModelConfig, head: EagleHead) -> None:
        super().__init__()
        self.cfg, self.head = cfg, head
        h = cfg.hidden_size
        self.eagle3 = head.algorithm == "EAGLE3"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=_weight(cfg.vocab_size, h))
        if self.eagle3:
            self.midlayer = EagleLayer(cfg, eagle3=True)
            self.norm = _hidden_norm(cfg)
        else:
            self.fc = nn.Linear(2 * h, h, bias=head.fc_bias)
            self.layers = nn.ModuleList([EagleLayer(cfg, eagle3=False)])
        self.lm_head = nn.Linear(h, head.draft_vocab_size, bias=False)

    def forward(
        self, input_ids: Value, positions: Value, logits_indices: Value
    ) -> tuple[Value, Value]:
        cfg = self.cfg
        freqs = ops.constant("rope.inv_freq", inv_freq(cfg.rope, cfg.rotary, cfg.head_dim))
        cos_sin = ops.rope_cos_sin(positions, freqs, scale=cfg.rope.attention_factor)
        e = ops.embedding(input_ids, self.embed_tokens.weight, role="embedding")
        hidden = ops.step_hidden(e, features=cfg.hidden_size)
        if self.eagle3:
            layer = cast(EagleLayer, self.midlayer)
            x = ops.concat(
                _norm(cfg, e, layer.input_layernorm), _norm(cfg, hidden, layer.hidden_norm)
            )
            h = ops.add(hidden, layer.self_attn(x, cos_sin))
        else:
            layer = cast(EagleLayer, self.layers[0])
            x = ops.linear(ops.concat(e, hidden), self.fc.weight, self.fc.bias)
            h = ops.add(x, layer.self_attn(x, cos_sin))  # no input norm: EAGLE's first layer
        h = ops.add(h, layer.mlp(_norm(cfg, h, layer.post_attention_layernorm)))
        out = ops.index_select(h, logits_indices)
        last = _norm(cfg, out, self.norm) if self.eagle3 else out
        logits = ops.linear(last, self.lm_head.weight, role="lm_head")
        return logits, out


class MtpLayer(DecoderLayer):
    """The model's decoder layer with the MTP layer's own norms and projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, 0)
        h = cfg.hidden_size
        self.enorm = _hidden_norm(cfg)
        self.hnorm = _hidden_norm(cfg)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = _hidden_norm(cfg)

    @property
    def out_norm(self) -> nn.Module:
        return cast(nn.Module, self.shared_head.norm)


class MtpDraft(nn.Module):
    """A model's own multi-token-prediction layer as an EAGLE head (SGLang's NEXTN:
    DeepSeek V3's, GLM-4.5's): `cfg` is the model's as that layer's (EagleHead.mtp_config), the
    layer's weights under `mtp.` (the checkpoint's model.layers.<L>.). eh_proj over
    [enorm(embedding), hnorm(hidden)], the model's decoder layer, shared_head.norm; the
    logits are the model's lm_head over that norm's output, which is also the hidden state
    the next draft row reads (SGLang's)."""

    def __init__(self, cfg: ModelConfig, head: EagleHead) -> None:
        super().__init__()
        self.cfg, self.head = cfg, head
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=_weight(cfg.vocab_size, h))
        self.mtp = MtpLayer(cfg)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(
        self, input_ids: Value, positions: Value, logits_indices: Value
    ) -> tuple[Value, Value]:
        cfg, mtp = self.cfg, self.mtp
        freqs = ops.constant("rope.inv_freq", inv_freq(cfg.rope, cfg.rotary, cfg.head_dim))
        cos_sin = ops.rope_cos_sin(
            positions, freqs, scale=cfg.rope.attention_factor, scaled_pairs=cfg.rotary_dim // 2
        )
        e = ops.embedding(input_ids, self.embed_tokens.weight, role="embedding")
        hidden = ops.step_hidden(e, features=cfg.hidden_size)
        x = ops.concat(_norm(cfg, e, mtp.enorm), _norm(cfg, hidden, mtp.hnorm))
        h = mtp(ops.linear(x, mtp.eh_proj.weight), cos_sin)
        out = _norm(cfg, ops.index_select(h, logits_indices), mtp.out_norm)
        return ops.linear(out, self.lm_head.weight, role="lm_head"), out


def build_eagle(cfg: ModelConfig, head: EagleHead) -> EagleDraft | MtpDraft:
    """The draft head's definition on the meta device."""
    with torch.device("meta"):
        return MtpDraft(cfg, head) if head.mtp is not None else EagleDraft(cfg, head)
