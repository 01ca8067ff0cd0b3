"""NSA's compressed keys and values: the mean of each whole block of block_size tokens, per KV head,
summed in fp32 (the tail past the last whole block is left out):

    k_cmp[b, c, h] = sum over t in [c * bs, (c + 1) * bs) of key[b, t, h] / bs        (v_cmp alike)

Keys and values in one launch.  A kernel, not the frameworks' mean: each framework reduces in an
order of its own, and the pooled keys feed the top-k, so torch and JAX would round some blocks
apart and could choose different blocks; here both run the same reduction.  It also replaces
torch's six launches (a cast, a mean and a cast back, per tensor) with one.
"""
import triton
import triton.language as tl

from ..flash.rules import reduce_sum

POOL_INTS = ["stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_cb", "stride_cs",
             "stride_ch", "stride_pb", "stride_ps", "stride_ph", "num_heads", "num_cmp"]


@triton.jit
def _block_mean(X, stride_s, OUT, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                ROWS: tl.constexpr):
    """OUT[:N] = the mean of X's BLOCK_SIZE rows (stride_s apart), summed in fp32 ROWS rows at a time,
    stored in OUT's dtype."""
    offs_n = tl.arange(0, BLOCK_N)
    total = tl.full([BLOCK_N], 0.0, tl.float32)
    for r0 in tl.static_range(0, BLOCK_SIZE, ROWS):
        offs_t = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        x = tl.load(X + offs_t[:, None] * stride_s + offs_n[None, :], mask=offs_n[None, :] < N, other=0.0)
        total += reduce_sum(x.to(tl.float32), 0)
    tl.store(OUT + offs_n, (total / BLOCK_SIZE).to(OUT.dtype.element_ty), mask=offs_n < N)


@triton.jit(do_not_specialize=POOL_INTS)
def nsa_pool_kernel(
    KEY, VALUE,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_cb, stride_cs, stride_ch,
    stride_pb, stride_ps, stride_ph, num_heads, num_cmp,
    K_CMP, V_CMP,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
):
    # One program per (batch, KV head, block), on grid x (batch * heads * blocks can pass grid y's 65535).
    pid = tl.program_id(0).to(tl.int64)
    c = pid % num_cmp
    b = pid // num_cmp // num_heads
    h = pid // num_cmp % num_heads
    t0 = c * BLOCK_SIZE
    _block_mean(KEY + b * stride_kb + t0 * stride_ks + h * stride_kh, stride_ks,
                K_CMP + b * stride_cb + c * stride_cs + h * stride_ch, HEAD_DIM, BLOCK_D, BLOCK_SIZE, ROWS)
    _block_mean(VALUE + b * stride_vb + t0 * stride_vs + h * stride_vh, stride_vs,
                V_CMP + b * stride_pb + c * stride_ps + h * stride_ph, HEAD_DIM_V, BLOCK_DV, BLOCK_SIZE, ROWS)
