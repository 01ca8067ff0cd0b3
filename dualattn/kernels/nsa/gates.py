"""NSA's gated sum of its branches and its backward, each one pass over the (rows, D) arrays
(rows = B * T * Hq, the arrays contiguous):

    out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa          (gates broadcast over D)
    d o_x = g_x * dout,   d g_x = sum over D of o_x * dout

The branches given sit in slots 0, 1, 2 in that order (cmp, slc, swa, the absent ones left out), and
BRANCHES says how many there are, so slot 0 always holds an array.  The sum is computed in the
output dtype, term by term in that order (the compiler may fuse a product and its sum into one
rounding, which the framework expression rounds twice).  Why a kernel: torch runs that expression as a
broadcast multiply per branch plus the adds, and its backward as a multiply and a reduction per
branch: at T = 64k, Hq = 64, D = 128 each of those passes reads and writes 1 GB (docs/lessons.md,
"NSA's gates and pooling are shared kernels").  The JAX front end runs these
kernels too with backend "triton", so that its output is torch's to the bit (XLA would fuse the
expression into one loop of its own, rounded its own way); "xla" keeps jnp.
"""
import triton
import triton.language as tl

from ..flash.rules import reduce_sum


@triton.jit
def _rows(rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """(element offsets, element mask, row indices, row mask) of this program's [ROWS, BLOCK_D] tile."""
    offs_r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < rows
    return offs_r[:, None] * HEAD_DIM + offs_d[None, :], row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), offs_r, row_ok


@triton.jit
def _add_term(out, O, G, offs, mask, offs_r, row_ok):
    g = tl.load(G + offs_r, mask=row_ok, other=0.0).to(out.dtype)
    o = tl.load(O + offs, mask=mask, other=0.0)
    return out + g[:, None] * o   # (the first term adds to 0: exact)


@triton.jit(do_not_specialize=["rows"])
def nsa_gate_kernel(
    O0, O1, O2, G0, G1, G2, rows, OUT,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BRANCHES: tl.constexpr,
):
    offs, mask, offs_r, row_ok = _rows(rows, HEAD_DIM, BLOCK_D, ROWS)
    out = tl.full([ROWS, BLOCK_D], 0.0, OUT.dtype.element_ty)
    out = _add_term(out, O0, G0, offs, mask, offs_r, row_ok)
    if BRANCHES > 1:
        out = _add_term(out, O1, G1, offs, mask, offs_r, row_ok)
    if BRANCHES > 2:
        out = _add_term(out, O2, G2, offs, mask, offs_r, row_ok)
    tl.store(OUT + offs, out, mask=mask)


@triton.jit
def _branch_grads(dout, O, G, DO, DG, offs, mask, offs_r, row_ok):
    g = tl.load(G + offs_r, mask=row_ok, other=0.0).to(dout.dtype)
    tl.store(DO + offs, dout * g[:, None], mask=mask)
    o = tl.load(O + offs, mask=mask, other=0.0)
    dg = reduce_sum(o.to(tl.float32) * dout.to(tl.float32), 1)
    # Through the branch's dtype, as the gradient of g.to(dtype) * o is.
    tl.store(DG + offs_r, dg.to(dout.dtype).to(DG.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["rows"])
def nsa_gate_bwd_kernel(
    DOUT, O0, O1, O2, G0, G1, G2, rows, DO0, DO1, DO2, DG0, DG1, DG2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BRANCHES: tl.constexpr,
):
    offs, mask, offs_r, row_ok = _rows(rows, HEAD_DIM, BLOCK_D, ROWS)
    dout = tl.load(DOUT + offs, mask=mask, other=0.0)
    _branch_grads(dout, O0, G0, DO0, DG0, offs, mask, offs_r, row_ok)
    if BRANCHES > 1:
        _branch_grads(dout, O1, G1, DO1, DG1, offs, mask, offs_r, row_ok)
    if BRANCHES > 2:
        _branch_grads(dout, O2, G2, DO2, DG2, offs, mask, offs_r, row_ok)
