"""EAGLE and EAGLE-3 draft heads (models/eagle.py, runtime/speculative.py `EagleDraft`):
every draft the engine proposes is what the head gives over transformers' hidden states of
the same tokens (written out below from SGLang's definition of the heads), across verify
steps that keep none, some or all of the drafts; the output is decoding's, token for token;
and the compile refuses what it does not build, naming the flag."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kiln.args import ArgError, ServerArgs
from kiln.compiler import report
from kiln.compiler.compile import compile_model
from kiln.example import add_mtp_layer, make_checkpoint, make_eagle_head
from kiln.runtime.engine import Engine
from kiln.runtime.native_step import NativeStep
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import EXPLORE_DRAFTS, StepCosts

# Every draft pays (the planner's cost model pinned): each decode step drafts the most.
FREE_ROWS = StepCosts({1: 1.0, 64: 1.0}, 64, fixed=True)
LAYERS = 4
AUX = [0, 1, 2]  # EAGLE-3's taps: the stream entering layers 1, 2 and 3
PROMPTS = ["The quick brown fox jumps over", "a b c a b c a b", "Once upon a time there"]


@pytest.fixture(scope="module")
def target(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama", num_layers=LAYERS)


@pytest.fixture(scope="module")
def heads(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle-heads")
    return {
        "EAGLE": make_eagle_head(root / "eagle", target, "EAGLE", std=0.08, seed=1),
        "EAGLE3": make_eagle_head(
            root / "eagle3",
            target,
            "EAGLE3",
            draft_vocab_size=200,
            aux_layers=AUX,
            std=0.08,
            seed=2,
        ),
    }


def _compile(target: Path, out: Path, **args: Any) -> Path:
    compile_model(ServerArgs(model_path=str(target), dtype="float32", device="cpu", **args), out)
    return out


@pytest.fixture(scope="module")
def engines(
    target: Path, heads: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Engine]:
    root = tmp_path_factory.mktemp("eagle-arts")
    out = {"plain": Engine(_compile(target, root / "plain"), max_total_tokens=2048)}
    # each algorithm's steps lowered to C (model and head), and EAGLE-3's in the executor
    for name, algorithm, flags in [
        ("EAGLE", "EAGLE", {}),
        ("EAGLE3", "EAGLE3", {}),
        ("EAGLE3-executor", "EAGLE3", {"disable_cuda_graph": True}),
    ]:
        art = _compile(
            target,
            root / name,
            speculative_algorithm=algorithm,
            speculative_draft_model_path=str(heads[algorithm]),
            speculative_num_steps=3,
            **flags,
        )
        out[name] = Engine(art, max_total_tokens=2048)
        out[name].step_costs = FREE_ROWS
    return out


# -- the heads, written out from SGLang's llama_eagle.py and llama_eagle3.py -----------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [tokens, heads, dim] at positions 0.. (the rotate-half form)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = (
        torch.cat([f, f], -1).cos()[:, None].float(),
        torch.cat([f, f], -1).sin()[:, None].float(),
    )
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], p: str, cfg: dict[str, Any]
) -> torch.Tensor:
    t, heads, kv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, theta = cfg["head_dim"], (cfg.get("rope_parameters") or cfg)["rope_theta"]
    q = _rope((x @ w[f"{p}.q_proj.weight"].T).view(t, heads, d), theta)
    k = _rope((x @ w[f"{p}.k_proj.weight"].T).view(t, kv, d), theta)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(t, kv, d)
    k, v = (a.repeat_interleave(heads // kv, dim=1) for a in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
    return o @ w[f"{p}.o_proj.weight"].T


def _head_rows(
    w: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    tokens: list[int],
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over every row (token at p + 1, hidden state for p): (logits, own hidden)."""
    eps, e = cfg["rms_norm_eps"], embed[tokens]
    if "midlayer.hidden_norm.weight" in w:  # EAGLE-3
        p = "midlayer"
        x = torch.cat(
            [
                _rms(e, w[f"{p}.input_layernorm.weight"], eps),
                _rms(hidden, w[f"{p}.hidden_norm.weight"], eps),
            ],
            -1,
        )
        h = hidden + _attention(x, w, f"{p}.self_attn", cfg)
    else:
        p = "layers.0"
        x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
        h = x + _attention(x, w, f"{p}.self_attn", cfg)  # no input norm
    m = _rms(h, w[f"{p}.post_attention_layernorm.weight"], eps)
    mlp = w[f"{p}.mlp.down_proj.weight"]
    g, u = m @ w[f"{p}.mlp.gate_proj.weight"].T, m @ w[f"{p}.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(g) * u) @ mlp.T
    last = _rms(h, w["norm.weight"], eps) if "norm.weight" in w else h
    return last @ lm_head.T, h


class Reference:
    """transformers' model and a head's tensors: the drafts the head proposes after `ids`."""

    def __init__(self, target: Path, head: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.w = load_file(str(head / "model.safetensors"))
        self.cfg = json.loads((head / "config.json").read_text())
        self.embed = self.model.get_input_embeddings().weight.detach()
        self.lm_head = self.w.get(
            "lm_head.weight", self.model.get_output_embeddings().weight.detach()
        )
        d2t = self.w.get("d2t")
        self.hot = None if d2t is None else d2t + torch.arange(len(d2t))

    @torch.no_grad()
    def drafts(self, ids: list[int], k: int, start: int = 0) -> tuple[list[int], torch.Tensor]:
        """The head's k drafts after `ids` and its logits of each, [k, its vocabulary]; its
        first row is position `start` (a prefix from the cache before it)."""
        out = self.model(torch.tensor([ids[:-1]]), output_hidden_states=True)
        states = out.hidden_states
        if "fc.weight" in self.w and self.w["fc.weight"].shape[1] == 3 * self.embed.shape[1]:
            taps = torch.cat([states[i + 1][0] for i in AUX], -1)
            bias = self.w["fc.bias"] if self.cfg.get("bias") else 0.0  # (SGLang's rule)
            hidden = taps @ self.w["fc.weight"].T + bias
        else:
            hidden = states[-1][0]  # the final norm's output
        hidden, tokens = hidden[start:], ids[start + 1 :]
        drafts: list[int] = []
        rows = []
        for _ in range(k):
            logits, own = self.rows(tokens, hidden)
            rows.append(logits[-1])
            t = int(logits[-1].argmax())
            t = t if self.hot is None else int(self.hot[t])
            drafts.append(t)
            tokens, hidden = [*tokens, t], torch.cat([hidden, own[-1:]])
        return drafts, torch.stack(rows)

    def rows(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _head_rows(self.w, self.cfg, self.embed, self.lm_head, tokens, hidden)


class MtpReference(Reference):
    """A model's own MTP layer (SGLang's deepseek_nextn.py, glm4_moe_nextn.py):
    transformers' decoder layer as the model's next one (a model of one more layer over the
    same checkpoint), after eh_proj over [enorm(embedding), hnorm(hidden)];
    shared_head.norm's output gives the logits (the model's lm_head) and the next row's
    hidden state."""

    def __init__(self, target: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        config = AutoConfig.from_pretrained(target)
        self.layer_index = config.num_hidden_layers
        config.num_hidden_layers += 1
        self.longer = AutoModelForCausalLM.from_pretrained(
            target, config=config, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        w = load_file(str(target / "model.safetensors"))
        p = f"model.layers.{self.layer_index}."
        self.w = {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}
        self.eps = config.rms_norm_eps
        self.embed = self.model.get_input_embeddings().weight.detach()
        self.lm_head = self.model.get_output_embeddings().weight.detach()
        self.hot = None

    def rows(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, eps = self.w, self.eps
        e = self.embed[tokens]
        x = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1)
        x = (x @ w["eh_proj.weight"].T)[None]
        t = x.shape[1]
        positions = torch.arange(t)[None]
        cos_sin = self.longer.model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        layer = self.longer.model.layers[self.layer_index]
        h = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        h = h[0] if isinstance(h, tuple) else h
        out = _rms(h[0], w["shared_head.norm.weight"], eps)
        return out @ self.lm_head.T, out


Call = tuple[list[int], int, list[int], torch.Tensor]


def _recorded(engine: Engine) -> list[Call]:
    """Each request's tokens, its head's first position, the drafts `propose` gave it and
    the head's logits of each, as the engine runs (the real head, watched)."""
    calls: list[Call] = []
    head = engine.draft_model
    assert head is not None
    propose, forward = head.propose, head.runner.forward
    steps: list[torch.Tensor] = []

    def watched_forward(*a: Any, **kw: Any) -> Any:
        logits = forward(*a, **kw)
        steps.append(torch.as_tensor(logits).float().clone())
        return logits

    def watched(reqs: Any, k: int) -> list[list[int]]:
        before = [(list(r.all_ids), r.draft.start if r.draft else 0) for r in reqs]
        steps.clear()
        out = propose(reqs, k)
        live = [i for i, d in enumerate(out) if d]
        for row, i in enumerate(live):
            ids, start = before[i]
            calls.append((ids, start, out[i], torch.stack([s[row] for s in steps])))
        return out

    head.propose = watched  # type: ignore[method-assign]
    head.runner.forward = watched_forward  # type: ignore[method-assign]
    return calls


def _check(calls: list[Call], ref: Reference) -> None:
    for ids, start, drafts, logits in calls:
        want, want_logits = ref.drafts(ids, len(drafts), start)
        assert drafts == want, (ids, start)
        # (a random head's logits grow draft by draft: EAGLE's reach thousands)
        torch.testing.assert_close(
            logits, want_logits, rtol=0, atol=2e-5 * float(want_logits.abs().max())
        )


@pytest.mark.parametrize("name", ["EAGLE", "EAGLE3", "EAGLE3-executor"])
def test_every_draft_is_the_heads_over_the_models_hidden_states(
    name: str, engines: dict[str, Engine], target: Path, heads: dict[str, Path]
) -> None:
    engine, plain = engines[name], engines["plain"]
    head = engine.draft_model
    assert head is not None
    native = name != "EAGLE3-executor"
    assert isinstance(engine.runner.decode, NativeStep) == native
    assert isinstance(head.runner.decode, NativeStep) == native
    # the head computes its embedding (and EAGLE's lm_head) with the model's weights: one
    # copy, in the model's artefact, not the head's
    shared = [n for n, w in head.runner.art.graph.weights.items() if "model" in w.source]
    assert len(shared) == (2 if name == "EAGLE" else 1)
    assert head.runner.art.host is not None and engine.art.host is not None
    assert all(np.shares_memory(head.runner.art.host[n], engine.art.host[n]) for n in shared)
    calls = _recorded(engine)
    params = {"temperature": 0, "max_new_tokens": 12}
    got = engine.generate(PROMPTS, params)
    assert [g["output_ids"] for g in got] == [
        w["output_ids"] for w in plain.generate(PROMPTS, params)
    ]
    # the same prompt again: its prefix is cached, so its head starts past it
    again = engine.generate(PROMPTS[:1], params)[0]
    assert again["output_ids"] == got[0]["output_ids"]
    assert len(calls) >= 3 * 4
    assert any(start > 0 for _, start, _, _ in calls)
    _check(calls, Reference(target, heads[name.split("-")[0]]))
    engine.flush_cache()
    assert head.pool.free_pages == head.pool.num_pages


def _edit(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@pytest.fixture(scope="module")
def guessable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Engine, Engine]:
    """A model whose next token is a function of its last alone (its layers add nothing:
    zero output projections; a unit final norm), and an EAGLE head that mostly guesses it
    (its fc passes the token's embedding on, scaled, plus a little of the hidden state; its
    layer adds a little): verify steps keep all, some or none of the drafts."""
    root = tmp_path_factory.mktemp("eagle-guessable")
    target = make_checkpoint(root / "model", "llama", num_layers=2)

    def silent(t: dict[str, torch.Tensor]) -> None:
        for name in t:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t[name].zero_()
        t["model.norm.weight"].fill_(1.0)

    _edit(target / "model.safetensors", silent)
    head = make_eagle_head(root / "head", target, "EAGLE", fc_bias=False, std=0.08, seed=3)
    g = torch.Generator().manual_seed(4)

    def guesser(t: dict[str, torch.Tensor]) -> None:
        h = t["fc.weight"].shape[0]
        mix = 0.02 * torch.randn(h, h, generator=g)
        t["fc.weight"] = torch.cat([4.0 * torch.eye(h), mix], dim=1).contiguous()
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            t[name] *= 0.1

    _edit(head / "model.safetensors", guesser)
    plain = Engine(_compile(target, root / "plain"), max_total_tokens=2048)
    art = _compile(
        target,
        root / "eagle",
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(head),
        speculative_num_steps=4,
    )
    spec = Engine(art, max_total_tokens=2048)
    spec.step_costs = FREE_ROWS
    return target, head, plain, spec


def test_kept_drafts_carry_the_models_hidden_states_to_the_head(
    guessable: tuple[Path, Path, Engine, Engine],
) -> None:
    target, head, plain, spec = guessable
    calls = _recorded(spec)
    params = {"temperature": 0, "max_new_tokens": 24}
    got = spec.generate(PROMPTS, params)
    assert [g["output_ids"] for g in got] == [
        w["output_ids"] for w in plain.generate(PROMPTS, params)
    ]
    meta = [g["meta_info"] for g in got]
    drafted = sum(m["spec_draft_token_num"] for m in meta)
    kept = sum(m["spec_accept_token_num"] for m in meta)
    assert drafted // 4 < kept < drafted  # some verify steps keep drafts, not every one
    _check(calls, Reference(target, head))


def test_sampled_output_is_decodings_and_kept_drafts_carry_the_heads_state(
    engines: dict[str, Engine],
) -> None:
    engine, plain = engines["EAGLE3"], engines["plain"]
    params = {"temperature": 0.8, "top_k": 20, "sampling_seed": 5, "max_new_tokens": 16}
    got = engine.generate(PROMPTS, params)
    assert [g["output_ids"] for g in got] == [
        w["output_ids"] for w in plain.generate(PROMPTS, params)
    ]
    assert sum(g["meta_info"]["spec_draft_token_num"] for g in got) > 0


def test_the_compile_refuses_what_it_does_not_build_naming_the_flag(
    target: Path, heads: dict[str, Path], engines: dict[str, Engine], tmp_path: Path
) -> None:
    eagle = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(heads["EAGLE"])}
    cases = [
        (
            {**eagle, "speculative_eagle_topk": 4},
            "--speculative-eagle-topk: 4; kiln drafts a chain",
        ),
        ({"speculative_algorithm": "EAGLE"}, "EAGLE: needs --speculative-draft-model-path"),
        (
            {**eagle, "speculative_algorithm": "EAGLE3"},
            "path: it is an EAGLE head, for --speculative-algorithm EAGLE",
        ),
        ({**eagle, "tp_size": 2}, "--speculative-algorithm EAGLE: not with --tp-size 2"),
        ({**eagle, "enable_return_hidden_states": True}, "EAGLE: not with --enable-return-hidden"),
        (
            {**eagle, "speculative_draft_model_path": str(target)},
            "path: architectures 'LlamaForCausalLM' is not an EAGLE draft head",
        ),
    ]
    for flags, message in cases:
        with pytest.raises(ArgError, match=message):
            _compile(target, tmp_path / "art", **flags)
    # inspect names the head; the manifest maps an EAGLE-3 head's draft vocabulary
    art = engines["EAGLE3"].art.root
    text = report.format_summary(report.summary(art))
    assert "speculate  EAGLE3: head " in text
    assert "every step (decode, prefill, extend: a row a new token) lowered to C" in text
    manifest = json.loads((art / "manifest.json").read_text())
    hot = manifest["runtime"]["speculative"]["draft"]["hot_ids"]
    d2t = load_file(str(heads["EAGLE3"] / "model.safetensors"))["d2t"]
    assert hot == (d2t + torch.arange(200)).tolist() and hot[150] != 150


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_model_drafts_with_its_own_mtp_layer(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SGLang's NEXTN (its EAGLE for DeepSeek V3 and GLM-4.5, no draft path): the
    checkpoint's MTP layer drafts, as transformers' decoder layer does over the model's
    hidden states."""
    root = tmp_path_factory.mktemp(f"mtp-{family}")
    target = add_mtp_layer(make_checkpoint(root / "model", family, num_layers=2), seed=5)
    plain = Engine(_compile(target, root / "plain"), max_total_tokens=2048)
    spec = Engine(
        _compile(target, root / "nextn", speculative_algorithm="NEXTN", speculative_num_steps=3),
        max_total_tokens=2048,
    )
    spec.step_costs = FREE_ROWS
    assert spec.speculative is not None and spec.speculative.algorithm == "EAGLE"
    calls = _recorded(spec)
    params = {"temperature": 0, "max_new_tokens": 10}
    got = spec.generate(PROMPTS[:2], params)
    assert [g["output_ids"] for g in got] == [
        w["output_ids"] for w in plain.generate(PROMPTS[:2], params)
    ]
    assert len(calls) >= 2 * 3
    _check(calls, MtpReference(target))
    # a model without the layer says so, naming the flag
    bare = make_checkpoint(root / "bare", family, num_layers=2)
    with pytest.raises(ArgError, match="EAGLE: .* has no MTP layer weights"):
        _compile(bare, root / "bare-art", speculative_algorithm="EAGLE")


def test_a_head_the_costs_say_will_not_pay_drafts_until_its_acceptance_is_known(
    engines: dict[str, Engine],
) -> None:
    """With step costs under which no draft pays at the planner's prior, a new server still
    has its head draft (one token a step) until EXPLORE_DRAFTS drafts were verified, which
    then set every request's prior: a random head's, near 0, stops it."""
    spec = Engine(engines["EAGLE"].art.root, max_total_tokens=2048)
    spec.step_costs = StepCosts({1: 1.0, 64: 64.0}, 64, fixed=True)  # every row costs a step
    spec.draft_costs = StepCosts({1: 1.0, 64: 64.0}, 64, fixed=True)
    plain = engines["plain"]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    drafted = []
    for prompt in PROMPTS:  # one at a time
        got = spec.generate([prompt], params)[0]
        assert got["output_ids"] == plain.generate([prompt], params)[0]["output_ids"]
        drafted.append(got["meta_info"]["spec_draft_token_num"])
    assert drafted[0] > 30  # a draft at (nearly) every step
    assert sum(drafted) == EXPLORE_DRAFTS and drafted[2] == 0
    assert spec.draft_record.prior < 0.1


def test_a_step_whose_drafts_find_no_pages_leaves_the_head_where_the_model_is(
    engines: dict[str, Engine], target: Path, heads: dict[str, Path]
) -> None:
    """Two steps with a page only for the model's own next token: the head drafts, the
    drafts find no pages, the steps run plain; the head is cut back to the model's tokens,
    so it goes on drafting from where the model is once pages are free again."""
    spec = Engine(engines["EAGLE"].art.root, max_total_tokens=2048, disable_radix_cache=True)
    spec.step_costs = FREE_ROWS
    calls = _recorded(spec)
    params = {"temperature": 0, "max_new_tokens": 16}
    req = spec.make_request(spec.encode(PROMPTS[0]), SamplingParams.from_dict(params))
    spec.add_request(req)
    pool, verified = spec.runner.pool, 0
    for step in range(40):
        if req.finished:
            break
        held = pool.allocate(pool.free_pages - 1) if step in (3, 4) else []
        spec.step()
        pool.free(held)
        if step in (3, 4):
            assert req.spec_verify_ct == verified  # a plain step: no page for a draft
        verified = req.spec_verify_ct
    want = engines["plain"].generate([PROMPTS[0]], params)[0]["output_ids"]
    assert req.output_ids == want
    after = [ids for ids, _, _, _ in calls if len(ids) > len(req.prompt_ids) + 5]
    assert after, "the head stopped drafting after the steps without pages"
    _check(calls, Reference(target, heads["EAGLE"]))
