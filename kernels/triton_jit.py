"""The Triton programs behind kernels/triton_ops.py (imported only when one first runs, so
that a machine without Triton can still import kiln).

Every program takes its row strides, so views (the q and k columns of a fused projection)
need no copy; head dims that are not a power of two are masked to the next one. Sums and
softmax are fp32 whatever the storage type (attention's products: 16-bit inputs on the
tensor cores with fp32 sums for 16-bit models on a GPU, else fp32 `tl.dot`s with IEEE
precision, not the tensor cores' TF32). Tested against
torch_native under TRITON_INTERPRET=1 on the CPU; see kernels/triton_ops.py for what ran on
which hardware.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(
    X,
    R,
    W,
    Y,
    T,
    stride_x,
    stride_r,
    stride_y,
    stride_t,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: y = rms_norm(x (+ r)) * w; with a residual the sum goes to T as well."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(T + row * stride_t + cols, x.to(T.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(var + eps))
    tl.store(Y + row * stride_y + cols, (y.to(Y.dtype.element_ty).to(tl.float32) * w), mask=mask)


@triton.jit
def linear_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of y = x @ w.T (+ b): the whole K in order, BLOCK_K at a
    time into one fp32 accumulator. The tile sizes never depend on M, so each output is
    the same sum in the same order at any row count. IEEE: the products in fp32 FMAs (fp32
    inputs, not TF32; and 16-bit ones under Triton's interpreter, whose bf16 dot is not
    one), else 16-bit inputs on the tensor cores."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk[None, :] < K
        x_ok = (rm[:, None] < M) & k_ok
        w_ok = (rn[:, None] < N) & k_ok
        x = tl.load(X + rm[:, None] * stride_x + kk[None, :], mask=x_ok, other=0.0)
        w = tl.load(W + rn[:, None] * stride_w + kk[None, :], mask=w_ok, other=0.0)
        if IEEE:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rm[:, None] * stride_y + rn[None, :],
        acc.to(Y.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def silu_and_mul_kernel(X, Y, stride_x, stride_y, d, BLOCK: tl.constexpr):
    """One row, one block of features: y = silu(x[:d]) * x[d:]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    X, Y, COS, SIN, stride_x, stride_y, stride_c, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr
):
    """One token, every head: rotate-half rope with the tables of kiln/core/ops/rope.py
    (cos for both halves, sin signed): y = x * cos + swap_halves(x) * sin."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK)
    mask = d < HEAD_DIM
    other = tl.where(d < half, d + half, d - half)
    base = X + t * stride_x + h * HEAD_DIM
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(base + other, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(COS + t * stride_c + d, mask=mask, other=0.0)
    sin = tl.load(SIN + t * stride_c + d, mask=mask, other=0.0)
    y = x * cos + xs * sin
    tl.store(Y + t * stride_y + h * HEAD_DIM + d, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def paged_attention_kernel(
    Q,
    K,
    V,
    OUT,
    PAGES,
    Q_START,
    Q_LEN,
    KV_LEN,
    stride_q,
    stride_o,
    stride_kh,
    stride_pages,
    scale,
    kv_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Attention of one sequence's new queries for the GROUP query heads that share one
    KV head, over the paged pool, K/V already written. A program's BLOCK_M rows are
    (query, head) pairs, query-major: row r is query r // GROUP and head
    kv_head * GROUP + r % GROUP, so each K/V block is read once for the whole group (a
    decode step's GROUP heads are one tile). Query i of the sequence sits at position
    kv_len - q_len + i and sees keys j <= it (and j > it - window with a window). Prefill,
    extend and decode are the same program; the online softmax keeps one pass over K/V.
    TENSOR_CORES (16-bit queries on a GPU): q, k, v and the probabilities enter the two
    products in the queries' type, summed in fp32; else every product is an fp32 FMA.
    Either way a row's sums take the same tiles in the same order in any step."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    block = tl.program_id(2)
    q_start = tl.load(Q_START + s)
    q_len = tl.load(Q_LEN + s)
    kv_len = tl.load(KV_LEN + s)
    if block * BLOCK_M < q_len * GROUP:
        r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        i = r // GROUP  # the query
        h = kvh * GROUP + r % GROUP  # its head
        d = tl.arange(0, BLOCK_D)
        m_ok = r < q_len * GROUP
        d_ok = d < HEAD_DIM
        q_offs = (q_start + i)[:, None] * stride_q + h[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(Q + q_offs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if not TENSOR_CORES:
            q = q.to(tl.float32)
        pos = kv_len - q_len + i
        first = block * BLOCK_M // GROUP  # the block's first and last queries
        last = tl.minimum(((block + 1) * BLOCK_M - 1) // GROUP, q_len - 1)
        top = kv_len - q_len + last + 1
        bottom = 0
        if HAS_WINDOW:
            bottom = tl.maximum(0, kv_len - q_len + first - window + 1)
            bottom = bottom // BLOCK_N * BLOCK_N
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(bottom, top, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < top
            page = tl.load(PAGES + s * stride_pages + n // PAGE, mask=n_ok, other=0)
            slot = page * PAGE + n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            offs = kvh * stride_kh + slot[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(K + offs, mask=kv_mask, other=0.0).to(tl.float32) * kv_scale
            v = tl.load(V + offs, mask=kv_mask, other=0.0).to(tl.float32) * kv_scale
            if TENSOR_CORES:
                k = k.to(Q.dtype.element_ty)
                v = v.to(Q.dtype.element_ty)
                scores = tl.dot(q, tl.trans(k)) * scale
            else:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            seen = (n[None, :] <= pos[:, None]) & n_ok[None, :]
            if HAS_WINDOW:
                seen = seen & (n[None, :] > pos[:, None] - window)
            scores = tl.where(seen, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            p = tl.exp(scores - safe[:, None])
            alpha = tl.exp(best - safe)
            total = total * alpha + tl.sum(p, axis=1)
            if TENSOR_CORES:
                acc = acc * alpha[:, None] + tl.dot(p.to(Q.dtype.element_ty), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            best = new_best
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            OUT + (q_start + i)[:, None] * stride_o + h[:, None] * HEAD_DIM + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )
