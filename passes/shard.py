"""Tensor parallelism: the single-device graph becomes rank r's of `--tp-size` T.

Megatron's layout, decided per node from the graph alone (roles recorded at trace time,
op definitions, the dataflow; never checkpoint names):
- attention: rank r keeps heads [r H/T, (r+1) H/T) of q (and their sinks) and the KV heads they read
  (KV/T of them, or the one they share when KV < T: replicated, as SGLang does); q/k/v
  projections are cut by rows (column-parallel), o_proj by columns (row-parallel), and an
  `all_reduce` sums the ranks' partial outputs;
- MLP: any linear whose input is computed, through elementwise ops only (kiln/core/ops
  ELEMENTWISE: SiLU, products, sums...), from linears that all read one input is the down
  projection: those linears (gate, up) are cut by rows, it by columns, then `all_reduce`,
  whatever its activation;
- mixture of experts: each expert's gate and up by rows and down by columns, or with
  `--ep-size` equal to `--tp-size` whole experts a rank (num_experts/T of them), the router
  whole, then `all_reduce`: every rank routes each token alike and adds what its part of
  the chosen experts gives (tokens are not moved: each rank already has all of them);
- lm_head by vocabulary rows, then `all_gather` puts the logits back together; a
  classifier's score head (one row a label) whole on every rank;
- the embedding by vocabulary rows too (`embedding_part`: ids of other ranks' rows give
  zeros), then `all_reduce`;
- norms and rope tables are whole on every rank, but for a per-head q/k norm with a weight
  for every feature (Cohere's, StableLM's): its weight and bias are cut as its projection.
A row-parallel linear's bias is added on rank 0 only, so the sum counts it once. A linear no
rule covers stops the compile, naming the node: it is never left whole on every rank.

Weights are cut in their recipes ({"slice": recipe, "dim", "start", "stop"}): the compile
driver writes each rank only its part. Runs before the fusion passes, which then fuse each
rank's slices as they fuse whole weights. compiler/options.py checked --tp-size against
the model's shapes; what still does not divide here is an error naming the node.
"""

from __future__ import annotations

from typing import Any

from kiln.core.ir import Graph, IRError, Node, WeightSpec
from kiln.core.ops import ELEMENTWISE
from kiln.passes.options import CompileOptions, PassResult, compiler_pass

_PER_HEAD = ("rope", "rmsnorm", "layernorm")


@compiler_pass("tp")
def shard(graph: Graph, ctx: CompileOptions) -> PassResult:
    tp = ctx.tp
    if tp.size == 1:
        return PassResult(graph, False)
    size, rank = tp.size, tp.rank
    users = graph.users()
    done: set[int] = set()  # the linears a rule has split
    for attn in [n for n in graph.nodes if n.op == "attention"]:
        done |= _attention(graph, users, attn, size, rank)
    for mla in [n for n in graph.nodes if n.op == "mla_attention"]:
        done |= _latent_attention(graph, users, mla, size, rank)
    for down, inputs in _mlps(graph, done):
        lo, hi = _part(_out_features(graph, inputs[0]), size, rank, inputs[0])
        for linear in inputs:
            _cut_rows(graph, linear, lo, hi)
        _row_parallel(graph, users, down, lo, hi, size, rank)
        done |= {id(down), *map(id, inputs)}
    for moe in [n for n in graph.nodes if n.op == "moe"]:
        if tp.experts_whole:
            _expert_parallel(graph, users, moe, size, rank)
        else:
            _moe(graph, users, moe, size, rank)
    if any(n.meta.get("role") == "lm_head" for n in graph.nodes):  # none: an embedding model
        done.add(id(_lm_head(graph, size, rank)))
    # a classifier's score head (a few labels' rows) stays whole: each rank computes the
    # same logits from the same final hidden state, as SGLang's replicated head does
    # likewise Qwen2-MoE's shared-expert gate (one output feature a token): whole on every
    # rank from the whole hidden state, it scales the shared expert's reduced output
    whole = ("score", "expert_gate")
    done |= {id(n) for n in graph.nodes if n.op == "linear" and n.meta.get("role") in whole}
    _embedding(graph, users, size, rank)
    left = [n for n in graph.nodes if n.op == "linear" and id(n) not in done]
    if left:
        raise IRError(
            f"%{left[0].name}: --tp-size {size}: no tensor-parallel rule splits this linear "
            "(it does not feed attention, read its output, sit in an MLP of elementwise "
            "ops between linears, or make the logits); kiln will not leave it whole on "
            "every rank"
        )
    return PassResult(graph, True)


def _part(total: int, size: int, rank: int, node: Node) -> tuple[int, int]:
    if total % size:
        raise IRError(f"%{node.name}: {total} features do not split over {size} ranks")
    step = total // size
    return rank * step, (rank + 1) * step


def _projection(node: Node, heads: bool = False) -> Node:
    """The linear behind `node`, through rope and norms. `heads`: an attention input, whose
    heads are split: a norm over the whole q or k projection (OLMo 2's) needs every head's
    features, so it is refused."""
    while node.op in _PER_HEAD:
        if heads and node.op != "rope" and not node.attrs.get("group"):
            raise IRError(
                f"%{node.name}: a norm over the whole q or k projection (OLMo 2's) needs "
                "every head's features; splitting heads across --tp-size ranks is not "
                "supported for it yet"
            )
        node = node.args[0]
    return node


def _cut_head_norms(graph: Graph, node: Node, lo: int, hi: int) -> None:
    """Between a q or k projection and attention, a per-head norm with a weight (and bias)
    for every feature (Cohere's, StableLM's) keeps features [lo, hi) as its projection
    does; one whose heads share a weight keeps it whole."""
    while node.op in _PER_HEAD:
        group = node.attrs.get("group")  # a norm's; rope has none
        weight = graph.weight_of(node.args[1]) if group else None
        if weight is not None and weight.shape[0] != group:  # weight and bias alike
            x, *params = node.args
            node.args = [x, *(_sliced(graph, p, 0, lo, hi, p.attrs["name"]) for p in params)]
        node = node.args[0]


def _attention(
    graph: Graph, users: dict[Node, list[Node]], attn: Node, size: int, rank: int
) -> set[int]:
    """Heads [lo, hi) of q and the KV heads they read; o_proj by columns. Returns the
    linears it split."""
    heads, kv, d = attn.attrs["num_heads"], attn.attrs["num_kv_heads"], attn.attrs["head_dim"]
    q, k, v = (_projection(a, heads=True) for a in attn.args[:3])
    lo, hi = _part(heads, size, rank, attn)
    if attn.attrs.get("sinks"):  # one per query head: this rank's heads'
        sinks = attn.args[3]
        attn.args = [*attn.args[:3], _sliced(graph, sinks, 0, lo, hi, sinks.attrs["name"])]
    if kv % size == 0:
        kv_lo, kv_hi = rank * kv // size, (rank + 1) * kv // size
    else:  # fewer KV heads than ranks: each rank keeps the one its q heads read
        kv_lo = lo // (heads // kv)
        kv_hi = kv_lo + 1
    for linear in (q, k, v):
        if linear.op != "linear":
            raise IRError(f"%{attn.name}: attention input %{linear.name} is not a projection")
    _cut_rows(graph, q, lo * d, hi * d)
    _cut_rows(graph, k, kv_lo * d, kv_hi * d)
    _cut_rows(graph, v, kv_lo * d, kv_hi * d)
    _cut_head_norms(graph, attn.args[0], lo * d, hi * d)
    _cut_head_norms(graph, attn.args[1], kv_lo * d, kv_hi * d)
    attn.attrs.update(num_heads=hi - lo, num_kv_heads=kv_hi - kv_lo)
    outs = [u for u in users[attn] if u.op == "linear"]
    if len(outs) != 1 or len(users[attn]) != 1:
        raise IRError(f"%{attn.name}: attention's output must feed one linear (its o_proj)")
    _row_parallel(graph, users, outs[0], lo * d, hi * d, size, rank)
    return {id(q), id(k), id(v), id(outs[0])}


def _latent_attention(
    graph: Graph, users: dict[Node, list[Node]], mla: Node, size: int, rank: int
) -> set[int]:
    """Multi-head latent attention: heads [lo, hi) of q (both its parts: the projection's
    rows are grouped by part, kiln/core/trace.py head_parts) and of kv_b; the latent, its
    projection and q's low-rank one whole on every rank (each rank pools every token's
    latent, as SGLang's ranks do); o_proj by columns. Returns the linears it handled."""
    q_nope, _, latent, _, kv_b = mla.args
    a = mla.attrs
    heads, nope, rope, v = a["num_heads"], a["nope_dim"], a["rope_dim"], a["v_dim"]
    lo, hi = _part(heads, size, rank, mla)
    q_split = _split_of(q_nope, mla)
    q_linear = q_split.args[0]
    weight = graph.weight_of(q_linear.args[1])
    if q_linear.op != "linear" or weight is None or "head_parts" not in weight.source:
        raise IRError(f"%{mla.name}: its queries do not come from a per-head projection")
    weight.source = {**weight.source, "head_range": [lo, hi]}
    weight.shape = ((hi - lo) * (nope + rope), *weight.shape[1:])
    q_split.attrs["sizes"] = [(hi - lo) * nope, (hi - lo) * rope]
    whole = {id(q_linear), id(_split_of(_projection(latent), mla).args[0])}
    if q_linear.args[0].op in _PER_HEAD:  # q's low-rank projection, before its norm
        whole.add(id(_projection(q_linear.args[0])))
    per_head = nope + v
    mla.args[4] = _sliced(graph, kv_b, 0, lo * per_head, hi * per_head, kv_b.attrs["name"])
    a["num_heads"] = hi - lo
    outs = users[mla]
    if len(outs) != 1 or outs[0].op != "linear":
        raise IRError(f"%{mla.name}: latent attention's output must feed one linear (o_proj)")
    _row_parallel(graph, users, outs[0], lo * v, hi * v, size, rank)
    return whole | {id(outs[0])}


def _split_of(value: Node, mla: Node) -> Node:
    """The split whose output `value` (a getitem of it) is."""
    if value.op != "getitem" or value.args[0].op != "split":
        raise IRError(f"%{mla.name}: %{value.name} is not a part of a split projection")
    return value.args[0]


def _mlps(graph: Graph, done: set[int]) -> list[tuple[Node, list[Node]]]:
    """(down, [its input linears]) for every linear whose input comes, through
    elementwise ops only, from linears that all read one input, none split yet."""
    found = []
    for n in graph.nodes:
        if n.op != "linear" or id(n) in done or n.args[0].op not in ELEMENTWISE:
            continue
        leaves: list[Node] = []
        stack, seen = [n.args[0]], set()
        while stack:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if x.op in ELEMENTWISE:
                stack += x.args
            else:
                leaves.append(x)
        ok = leaves and all(x.op == "linear" and id(x) not in done for x in leaves)
        if ok and len({id(x.args[0]) for x in leaves}) == 1:
            found.append((n, sorted(leaves, key=graph.nodes.index)))
    return found


def _out_features(graph: Graph, node: Node) -> int:
    """A linear's output features; a moe's expert width (its first gate's rows)."""
    spec = graph.weight_of(node.args[_moe_head(node)] if node.op == "moe" else node.args[1])
    assert spec is not None
    return spec.shape[0]


def _sliced(graph: Graph, param: Node, dim: int, lo: int, hi: int, name: str) -> Node:
    """A param holding [lo, hi) of `param`'s weight along `dim`, under `name`."""
    spec = graph.weight_of(param)
    if spec is None:
        raise IRError(f"%{param.name}: a tensor-parallel split needs a weight here")
    shape = list(spec.shape)
    shape[dim] = hi - lo
    source: dict[str, Any] = {"slice": spec.source, "dim": dim, "start": lo, "stop": hi}
    graph.weights[name] = WeightSpec(tuple(shape), spec.dtype, source)
    return graph.param(name, before=param)


def _cut_rows(graph: Graph, linear: Node, lo: int, hi: int) -> None:
    """Column-parallel: the linear's output features [lo, hi) (weight rows and bias)."""
    args = [linear.args[0]]
    for p in linear.args[1:]:
        args.append(_sliced(graph, p, 0, lo, hi, p.attrs["name"]))
    linear.args = args


def _row_parallel(
    graph: Graph,
    users: dict[Node, list[Node]],
    linear: Node,
    lo: int,
    hi: int,
    size: int,
    rank: int,
) -> None:
    """Row-parallel: input features [lo, hi) of the weight, the bias on rank 0 only, and
    an all_reduce of the partial sums in place of the linear's output."""
    weight = linear.args[1]
    args = [linear.args[0], _sliced(graph, weight, 1, lo, hi, weight.attrs["name"])]
    if len(linear.args) == 3 and rank == 0:
        args.append(linear.args[2])
    linear.args = args
    _reduce_after(graph, users, linear, size)


def _reduce_after(graph: Graph, users: dict[Node, list[Node]], node: Node, size: int) -> None:
    """An all_reduce of `node`'s partial sums in its place for every user."""
    after = graph.nodes[graph.nodes.index(node) + 1]
    reduced = graph.add("all_reduce", [node], {"ranks": size}, before=after)
    for u in users.get(node, []):
        u.args = [reduced if a is node else a for a in u.args]


def _moe_head(moe: Node) -> int:
    """Inputs before the experts': x, the router, and its biases where it has them."""
    return 2 + bool(moe.attrs.get("router_bias")) + bool(moe.attrs.get("correction_bias"))


def _moe(graph: Graph, users: dict[Node, list[Node]], moe: Node, size: int, rank: int) -> None:
    """Each expert's MLP split as a dense one is (gate and up biases by rows, the down
    bias on rank 0 only); the router stays whole."""
    head = _moe_head(moe)
    per = 6 if moe.attrs.get("expert_biases") else 3
    weights = moe.args[head:]
    lo, hi = _part(_out_features(graph, moe), size, rank, moe)
    args = moe.args[:head]
    for i in range(0, len(weights), per):
        gate, up, down, *biases = weights[i : i + per]
        cut = [(gate, 0), (up, 0), (down, 1)] + [(b, 0) for b in biases[:2]]
        args += [_sliced(graph, w, dim, lo, hi, w.attrs["name"]) for w, dim in cut]
        if biases:
            # A bias on the other ranks' sums would be counted T times: rank 0's, zeros else.
            down_bias = biases[2]
            args.append(down_bias if rank == 0 else _zeros_like(graph, down_bias))
    moe.args = args
    _reduce_after(graph, users, moe, size)


def _zeros_like(graph: Graph, param: Node) -> Node:
    """A param of `param`'s shape holding zeros (the {"zeros": shape} recipe)."""
    spec = graph.weight_of(param)
    assert spec is not None
    name = f"{param.attrs['name']}.zero"
    graph.weights[name] = WeightSpec(spec.shape, spec.dtype, {"zeros": list(spec.shape)})
    return graph.param(name, before=param)


def _expert_parallel(
    graph: Graph, users: dict[Node, list[Node]], moe: Node, size: int, rank: int
) -> None:
    """Experts [lo, hi) whole on this rank; the router stays whole."""
    lo, hi = _part(moe.attrs["num_experts"], size, rank, moe)
    head, per = _moe_head(moe), 6 if moe.attrs.get("expert_biases") else 3
    moe.args = [*moe.args[:head], *moe.args[head + per * lo : head + per * hi]]
    moe.attrs["first_expert"] = lo
    _reduce_after(graph, users, moe, size)


def _embedding(graph: Graph, users: dict[Node, list[Node]], size: int, rank: int) -> None:
    """The token embedding by vocabulary rows (`embedding_part`), then all_reduce."""
    for emb in [n for n in graph.nodes if n.meta.get("role") == "embedding"]:
        ids, table = emb.args
        spec = graph.weight_of(table)
        assert spec is not None
        lo, hi = _part(spec.shape[0], size, rank, emb)
        # (A tied lm_head already reads its own slice, so the table's name is free.)
        emb.op, emb.attrs = "embedding_part", {"first_row": lo}
        emb.args = [ids, _sliced(graph, table, 0, lo, hi, table.attrs["name"])]
        _reduce_after(graph, users, emb, size)


def _lm_head(graph: Graph, size: int, rank: int) -> Node:
    """The lm_head by vocabulary rows, then all_gather of the logits."""
    heads = [n for n in graph.nodes if n.meta.get("role") == "lm_head"]
    if len(heads) != 1 or heads[0].op != "linear":
        raise IRError("the graph has no lm_head linear (a role the model definition records)")
    head = heads[0]
    weight = head.args[1]
    spec = graph.weight_of(weight)
    assert spec is not None
    lo, hi = _part(spec.shape[0], size, rank, head)
    # A tied lm_head reads the embedding's table, which stays whole: its own sliced weight
    # (and its bias's rows, Phi-2's).
    head.args = [head.args[0], _sliced(graph, weight, 0, lo, hi, "lm_head.weight")] + [
        _sliced(graph, bias, 0, lo, hi, "lm_head.bias") for bias in head.args[2:]
    ]
    after = graph.nodes[graph.nodes.index(head) + 1]
    gathered = graph.add("all_gather", [head], {"ranks": size}, before=after)
    for u in graph.users()[head]:
        if u is not gathered:
            u.args = [gathered if a is head else a for a in u.args]
    return head
