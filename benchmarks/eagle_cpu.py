"""Batch-1 decode with an EAGLE head trained here for the shipped SmolLM2 Q4_1 file, against
the plain artefact of the same file, in the same run.

    python benchmarks/eagle_cpu.py                      # ~10 minutes on a 2-core machine
    python benchmarks/eagle_cpu.py --train-prompts 400 --epochs 8 --rounds 5

No trained EAGLE head for a model this machine can reach exists (the package registries
only), so this trains a small one (SGLang's LlamaForCausalLMEagle layout: fc over
[embedding, hidden state], one Llama layer without its input norm, the model's lm_head)
the way EAGLE's authors do, on the served model's own hidden states: the model answers
chat prompts (greedy, through kiln), kiln returns the final norm's output of every
position (--enable-return-hidden-states), and the head learns to give, from the token at
p + 1 and the model's hidden state at p, the model's hidden state at p + 1 (smooth L1, so
its own output can stand in for the model's at the next draft) and the model's greedy
token at p + 2 (cross-entropy through the model's lm_head at a random quarter of the
rows, weighted 0.1). Then both
artefacts decode held-out prompts of other topics, alternating, one request at a time;
the EAGLE artefact's acceptance is read from each answer's meta_info. Figures are
this head's: a head trained for hours on more text drafts better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, spread

TOPICS = (
    "volcanoes",
    "honeybees",
    "the Roman empire",
    "black holes",
    "sourdough bread",
    "chess openings",
    "the water cycle",
    "electric cars",
    "coral reefs",
    "the printing press",
    "jazz music",
    "photosynthesis",
    "the Moon landing",
    "rainforests",
    "vaccines",
    "the internet",
    "glaciers",
    "ancient Egypt",
    "solar panels",
    "sleep",
    "octopuses",
    "the stock market",
    "earthquakes",
    "tea",
    "the human heart",
    "bicycles",
    "deserts",
    "recycling",
    "the Olympic games",
    "dinosaurs",
    "lighthouses",
    "coffee",
    "the periodic table",
    "whales",
    "castles",
    "rain",
    "bridges",
    "mushrooms",
    "the Silk Road",
    "penguins",
    "windmills",
    "comets",
    "libraries",
    "trains",
    "bees and flowers",
    "the Great Wall of China",
    "tornadoes",
    "origami",
    "robots",
    "snow",
    "maps",
    "pianos",
    "owls",
    "soap",
    "the ocean floor",
    "hot air balloons",
    "clocks",
    "rivers",
    "bamboo",
    "satellites",
)
TEMPLATES = (
    "Explain {} to a ten-year-old.",
    "Write a short paragraph about {}.",
    "What are three interesting facts about {}?",
    "Describe the history of {} in a few sentences.",
)
HELD_OUT = 8  # topics kept out of training, for the decode measurement
CE_SHARE = 0.25  # rows whose token loss is computed each step


def chat(question: str) -> str:
    """SmolLM2-Instruct's chat form (ChatML) around one user turn."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


class Head(torch.nn.Module):
    """EAGLE's head for the model of `cfg` (the shapes of the checkpoint it is saved as)."""

    def __init__(self, cfg: dict, std: float = 0.02) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.dim, self.eps = h // self.heads, cfg["rms_norm_eps"]
        self.theta = cfg["rope_theta"]

        def p(*shape: int, scale: float = std) -> torch.nn.Parameter:
            return torch.nn.Parameter(scale * torch.randn(shape))

        eye = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)  # start as the hidden state
        self.fc = torch.nn.Parameter(eye + std * torch.randn(h, 2 * h))
        self.fc_bias = torch.nn.Parameter(torch.zeros(h))
        self.q, self.k = p(self.heads * self.dim, h), p(self.kv * self.dim, h)
        self.v, self.o = p(self.kv * self.dim, h), p(h, self.heads * self.dim, scale=std / 4)
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.gate, self.up = p(inter, h), p(inter, h)
        self.down = p(h, inter, scale=std / 4)

    def forward(self, e: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Rows at positions 0..T-1: (token embedding, hidden state) -> the head's output."""
        x = torch.cat([e, hidden], -1) @ self.fc.T + self.fc_bias
        t, d = x.shape[0], self.dim
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        f = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]

        def rope(z: torch.Tensor) -> torch.Tensor:
            return z * cos + torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1) * sin

        q = rope((x @ self.q.T).view(t, self.heads, d)).transpose(0, 1)
        k = rope((x @ self.k.T).view(t, self.kv, d)).transpose(0, 1)
        v = (x @ self.v.T).view(t, self.kv, d).transpose(0, 1)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + o.transpose(0, 1).reshape(t, -1) @ self.o.T
        m = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return h + (F.silu(m @ self.gate.T) * (m @ self.up.T)) @ self.down.T

    def save(self, path: Path, cfg: dict) -> Path:
        """As SGLang's LlamaForCausalLMEagle checkpoint (kiln reads it the same way)."""
        path.mkdir(parents=True, exist_ok=True)
        layer = "layers.0."
        tensors = {
            "fc.weight": self.fc, "fc.bias": self.fc_bias,
            layer + "self_attn.q_proj.weight": self.q, layer + "self_attn.k_proj.weight": self.k,
            layer + "self_attn.v_proj.weight": self.v, layer + "self_attn.o_proj.weight": self.o,
            layer + "post_attention_layernorm.weight": self.norm,
            layer + "mlp.gate_proj.weight": self.gate, layer + "mlp.up_proj.weight": self.up,
            layer + "mlp.down_proj.weight": self.down,
        }  # fmt: skip
        save_file(
            {k: v.detach().contiguous() for k, v in tensors.items()},
            str(path / "model.safetensors"),
        )
        keys = (
            *("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"),
            *("vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "hidden_act"),
        )
        config = {
            "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
            **{k: cfg[k] for k in keys if k in cfg}, "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        }  # fmt: skip
        (path / "config.json").write_text(json.dumps(config, indent=1))
        return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--train-prompts", type=int, default=208, help="chat prompts answered for training"
    )
    p.add_argument("--answer-tokens", type=int, default=96, help="tokens of each training answer")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens each measured answer decodes")
    p.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    args = p.parse_args()

    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.checkpoint import CheckpointReader
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="kiln-eagle-bench-"))
    gguf = fetch("smollm2")
    with CheckpointReader(gguf) as r:
        assert r.gguf is not None
        cfg = r.gguf.hf_config()
        v, h = cfg["vocab_size"], cfg["hidden_size"]
        embed = r.get("model.embed_tokens.weight", (v, h)).float()  # tied: the lm_head too
    train_topics, test_topics = TOPICS[HELD_OUT:], TOPICS[:HELD_OUT]
    questions = [t.format(x) for x in train_topics for t in TEMPLATES][: args.train_prompts]

    start = time.perf_counter()
    plain_art = work / "plain"
    compile_model(ServerArgs(model_path=str(gguf)), plain_art)
    hs_art = work / "hidden"
    compile_model(ServerArgs(model_path=str(gguf), enable_return_hidden_states=True), hs_art)
    plain = Engine(plain_art, max_total_tokens=1 << 16)
    greedy = {"temperature": 0, "max_new_tokens": args.answer_tokens}
    answers = plain.generate([chat(q) for q in questions], greedy)
    hs = Engine(hs_art, max_total_tokens=1 << 16)
    data = []
    for q, a in zip(questions, answers, strict=True):
        ids = hs.encode(chat(q)) + a["output_ids"]
        out = hs.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1},
                          return_hidden_states=True)[0]  # fmt: skip
        rows = torch.tensor(out["meta_info"]["hidden_states"][0], dtype=torch.float32)
        data.append((torch.tensor(ids), rows))
    del hs
    tokens = sum(len(ids) for ids, _ in data)
    print(f"data: {len(data)} answers, {tokens} positions, {time.perf_counter() - start:.0f} s",
          file=sys.stderr)  # fmt: skip

    head = Head(cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    steps = args.epochs * len(data)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(data)).tolist()
        losses = []
        for i in order:
            ids, rows = data[i]
            # row p: token p + 1 and the model's state at p -> its state at p + 1, token p + 2
            out = head(embed[ids[1:-1]], rows[:-2])
            want = rows[1:-1]
            # the model's greedy token at p + 2, at a quarter of the rows (the 49152-wide
            # lm_head is most of the training's time)
            pick = torch.rand(len(out)) < CE_SHARE
            with torch.no_grad():
                label = (want[pick] @ embed.T).argmax(-1)
            ce = F.cross_entropy(out[pick] @ embed.T, label) if pick.any() else out.sum() * 0
            loss = F.smooth_l1_loss(out, want) + 0.1 * ce
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        print(f"epoch {epoch + 1}: loss {statistics.mean(losses):.4f}, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr)  # fmt: skip
    head_dir = head.save(work / "head", cfg)

    eagle_art = work / "eagle"
    compile_model(
        ServerArgs(model_path=str(gguf), speculative_algorithm="EAGLE",
                   speculative_draft_model_path=str(head_dir), speculative_num_steps=args.steps),
        eagle_art,
    )  # fmt: skip
    engines = {"kiln": plain, "kiln EAGLE": Engine(eagle_art, max_total_tokens=1 << 16)}
    tests = [chat(TEMPLATES[1].format(x)) for x in test_topics]
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    kept = drafted = verify = 0
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            engine = engines[name]
            engine.flush_cache()
            got = []
            for prompt in tests:
                t = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                got.append(args.tokens / (time.perf_counter() - t))
                m = out["meta_info"]
                if name == "kiln EAGLE" and r == 0:
                    kept += m["spec_accept_token_num"]
                    drafted += m["spec_draft_token_num"]
                    verify += m["spec_verify_ct"]
            rates[name].append(statistics.mean(got))
            print(f"round {r + 1} {name}: {rates[name][-1]:.1f} tok/s", file=sys.stderr)

    print(
        "\n## eagle_cpu: batch-1 decode with an EAGLE head trained here, SmolLM2-135M-Instruct Q4_1"
    )
    print(machine())
    print(
        f"head: {len(data)} answers ({tokens} positions), {args.epochs} epochs; "
        f"{len(tests)} held-out prompts of {args.tokens} tokens each (prefill included), "
        f"{args.rounds} alternating rounds, median (min-max) of each round's mean; "
        f"--speculative-num-steps {args.steps}\n"
    )
    print("| server | tok/s | vs kiln |")
    print("| --- | --- | --- |")
    base = statistics.median(rates["kiln"])
    for name, rs in rates.items():
        print(f"| {name} | {spread(rs)} | {statistics.median(rs) / base:.2f}x |")
    rate = kept / drafted if drafted else 0.0
    per_step = (kept + verify) / max(verify, 1)
    print(
        f"\nEAGLE: {drafted} drafts verified in {verify} verify steps, {kept} kept "
        f"({rate:.0%}); tokens per verify step {per_step:.2f}"
    )


if __name__ == "__main__":
    main()
