"""Flash attention as a Pallas TPU kernel: forward, dQ (+dbias) and dK/dV, one jax.custom_vjp.

Layout inside: head-major (B, H, S, D), as TPU kernels want (the last two block dims are tiles of
(sublane, lane)).  The public BSHD arrays are transposed and padded to whole blocks by
`flash_attention_pallas`; the padding is masked (key side) or sliced off (query side).

Three kernels, one score/mask helper (`_block_scores`) shared by all of them:

    forward  grid (B, Hq, nq, nk)      online softmax over key blocks; writes out and lse
    dQ       grid (B, Hq, nq, nk)      dq accumulated over key blocks; dbias block by block
    dK/dV    grid (B, Hkv, nk, G*nq)   dk, dv accumulated over the G query heads of the group and
                                       all query blocks (GQA reduction inside the kernel)

The last grid axis is the reduction ("arbitrary"); its accumulators live in VMEM scratch.  Blocks
wholly outside the causal / sliding-window band are skipped with `pl.when`, and their index maps
are clamped into the band so that the pipeline does not fetch them either:

    causal, Sq = Sk, 4x4 blocks       window (1 block, 0)
        k: 0 1 2 3                        k: 0 1 2 3
    q0     x . . .                    q0     x . . .
    q1     x x . .                    q1     x x . .
    q2     x x x .                    q2     . x x .
    q3     x x x x                    q3     . . x x        (. = skipped, never loaded)

Sinks (softmax_aux) enter as one log-sum-exp per head, `sink_lse[h]`, that seeds the running
(max, sum) of every row; their gradient is a row reduction done outside the kernels:
dsink_lse[h] = -sum_{b,i} exp(sink_lse[h] - lse[b,h,i]) * delta[b,h,i].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...options import FlashOptions
from ..mask import exp_nonpositive, position_mask, score_unit, segment_ranks, sink_logsumexp, sink_probability

__all__ = ["BlockSizes", "check_pallas_supported", "flash_attention_pallas", "resolve_interpret"]

_NT = (((1,), (1,)), ((), ()))   # a @ b.T


# --------------------------------------------------------------------------------------------------
# static configuration
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tile sizes of the three kernels (query rows x key rows per grid step).

    On TPU, block_q should be a multiple of 8 (32 with an attention_mask, which travels as int8)
    and block_k a multiple of 128, unless one block covers the whole (padded) sequence.
    """

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if not isinstance(b, int) or b < 8 or b % 8:
                raise ValueError(f"{name} must be a positive multiple of 8, got {b!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Static:
    """Everything static about one call: the one nondiff argument of the custom_vjp core."""

    options: FlashOptions
    blocks: BlockSizes   # effective sizes (clamped to the padded sequence lengths)
    seq_q: int           # true lengths; the arrays are padded to whole blocks
    seq_k: int
    interpret: Any       # False, True or a pltpu.InterpretParams

    @property
    def q_offset(self) -> int:
        """Global position of query row 0 relative to key row 0 (bottom-right alignment)."""
        return self.seq_k - self.seq_q


def check_pallas_supported(options: FlashOptions, *, varlen: bool = False) -> None:
    """Raise ValueError for options the Pallas backend lacks, naming the backends that have them."""
    if options.dropout_prob > 0.0:
        raise ValueError(f"dropout_prob={options.dropout_prob} is not supported by backend='pallas'; "
                         "use backend='xla' or backend='triton'")
    if varlen:
        raise ValueError("varlen inputs (cu_seqlens_q/cu_seqlens_k) are not supported by backend='pallas'; "
                         "use backend='xla' or backend='triton'")


def _check_tpu_tiling(bq: int, bk: int, sq_pad: int, sk_pad: int, *, dtype, has_mask: bool) -> None:
    """Mosaic's (sublane, lane) tiling rules for the blocks we use, as a readable error.

    A block dimension must be a whole number of tiles unless it spans the (padded) array.
    """
    sublanes = 32 if has_mask else (16 if jnp.dtype(dtype).itemsize == 2 else 8)
    if bk != sk_pad and bk % 128:
        raise ValueError(f"block_k={bk} must be a multiple of 128 on TPU (key length {sk_pad} spans several blocks)")
    if bq != sq_pad and bq % sublanes:
        raise ValueError(f"block_q={bq} must be a multiple of {sublanes} on TPU for {jnp.dtype(dtype).name} "
                         f"inputs{' with an attention_mask' if has_mask else ''}")


def resolve_interpret(interpret):
    """None -> interpret (Pallas' HLO interpreter) unless running on a TPU; anything else as given.

    Pass `pltpu.InterpretParams()` for the TPU-faithful interpreter (poisons uninitialised
    scratch with NaN, checks out-of-bounds reads); it is slower than `True`.
    """
    if interpret is None:
        return jax.default_backend() != "tpu"
    return interpret


# --------------------------------------------------------------------------------------------------
# band arithmetic (python ints or traced int32 scalars): which blocks can hold an allowed pair
# --------------------------------------------------------------------------------------------------

def _q_span(st: _Static, i):
    """First and last global position of the real query rows of query block i."""
    bq = st.blocks.block_q
    first = i * bq + st.q_offset
    last = jnp.minimum(i * bq + bq - 1, st.seq_q - 1) + st.q_offset
    return first, last


def _k_span(st: _Static, j):
    bk = st.blocks.block_k
    return j * bk, jnp.minimum(j * bk + bk - 1, st.seq_k - 1)


def _block_live(st: _Static, i, j):
    """True unless block (i, j) lies wholly outside the window band (d = k_pos - q_pos)."""
    o = st.options
    live = True
    q0, q1 = _q_span(st, i)
    k0, k1 = _k_span(st, j)
    if o.window_right is not None:
        live = jnp.logical_and(live, k0 - q1 <= o.window_right)
    if o.window_left is not None:
        live = jnp.logical_and(live, k1 - q0 >= -o.window_left)
    return live


def _idiv(a, b):
    """Integer a // b (both >= 0) in a's dtype: index maps see int32 ids and python-int sizes, which
    lax.div would refuse to mix under jax_enable_x64."""
    a = jnp.asarray(a)
    return lax.div(a, jnp.asarray(b, a.dtype))


def _irem(a, b):
    a = jnp.asarray(a)
    return lax.rem(a, jnp.asarray(b, a.dtype))


def _clamp(x, lo, hi, n):
    return jnp.clip(jnp.clip(x, lo, hi), 0, n - 1)


def _kv_block_in_band(st: _Static, i, j, nk: int):
    """Key block to fetch at step (i, j): j itself when live, else the nearest live one (no refetch)."""
    o = st.options
    if not st.options.has_window:
        return j
    bk = st.blocks.block_k
    q0, q1 = _q_span(st, i)
    lo = 0 if o.window_left is None else _idiv(jnp.maximum(q0 - o.window_left, 0), bk)
    hi = nk - 1 if o.window_right is None else _idiv(jnp.maximum(q1 + o.window_right, 0), bk)
    return _clamp(j, lo, hi, nk)


def _q_block_in_band(st: _Static, j, i, nq: int):
    """Query block to fetch at step (j, i) of the dK/dV kernel (mirror of _kv_block_in_band)."""
    o = st.options
    if not st.options.has_window:
        return i
    bq = st.blocks.block_q
    k0, k1 = _k_span(st, j)
    lo = 0 if o.window_right is None else _idiv(jnp.maximum(k0 - o.window_right - st.q_offset, 0), bq)
    hi = nq - 1 if o.window_left is None else _idiv(jnp.maximum(k1 + o.window_left - st.q_offset, 0), bq)
    return _clamp(i, lo, hi, nq)


# --------------------------------------------------------------------------------------------------
# the shared score / mask helper
# --------------------------------------------------------------------------------------------------

def _block_scores(st: _Static, refs, q, k, i, j, unit: float = 1.0):
    """Scores of one (query block i, key block j) tile and the mask that applies to them.

    s = q.k * scale, + bias, soft cap; masked entries are -inf.  Returns (s, allowed, tanh) where
    tanh is the soft cap's tanh (for its derivative) or None.  unit: a factor the caller applies
    itself (mask.score_unit): s is then q.k * scale / unit.
    """
    o = st.options
    bq, bk = q.shape[0], k.shape[0]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)   # [bq, bk]
    if unit != o.softmax_scale:
        s = s * o.softmax_scale
    if "bias" in refs:
        s = s + refs["bias"][...].astype(jnp.float32)
    t = None
    if o.logits_soft_cap is not None:
        t = jnp.tanh(s / o.logits_soft_cap)
        s = o.logits_soft_cap * t
    rows = lax.broadcasted_iota(jnp.int32, (bq, bk), 0) + i * bq   # local query row
    cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk   # local key row = key position
    allowed = position_mask(rows + st.q_offset, cols, o)
    if st.seq_k % bk:
        allowed = allowed & (cols < st.seq_k)                       # key padding
    if "q_seg" in refs:
        allowed = allowed & (refs["q_seg"][...] == refs["kv_seg"][...])   # [bq, 1] == [1, bk]
    if "mask" in refs:
        allowed = allowed & (refs["mask"][...] != 0)
    return jnp.where(allowed, s, -jnp.inf), allowed, t


def _probs(s, allowed, lse):
    """exp(s - lse) on allowed entries, 0 elsewhere (also when lse is -inf: a fully masked row)."""
    return jnp.where(allowed, exp_nonpositive(s - lse), 0.0)


def _score_grad(p, dp, delta, t):
    """d loss / d (q.k*scale + bias), from the probabilities and d loss / d p."""
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------

def _fwd_kernel(*all_refs, names, st: _Static):
    refs = dict(zip(names, all_refs))
    m_scr, l_scr, acc_scr = all_refs[len(names):]
    h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

    unit = score_unit(st.options, "bias" in refs)   # m_scr holds the running max in `unit`s

    @pl.when(j == 0)
    def _init():
        if "sink_lse" in refs:   # the sinks seed every row: max = their lse, sum = 1
            m_scr[...] = jnp.full(m_scr.shape, refs["sink_lse"][h] / unit, jnp.float32)
            l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)
        else:
            m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(_block_live(st, i, j))
    def _step():
        s, _, _ = _block_scores(st, refs, refs["q"][...], refs["k"][...], i, j, unit)   # [bq, bk]
        m_prev = m_scr[...]                                                       # [bq, 1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)   # all -inf so far: no inf - inf
        p = exp_nonpositive((s - m_safe) * unit)
        # (m_prev == m_next: nothing to rescale; this also keeps a +inf sink's row, inf - inf, from NaN)
        alpha = jnp.where(m_prev == m_next, 1.0, jnp.exp((m_prev - m_safe) * unit))
        v = refs["v"][...]
        m_scr[...] = m_next
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[...] = alpha * acc_scr[...] + lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr[...]
        empty = l == 0.0
        refs["out"][...] = (acc_scr[...] / jnp.where(empty, 1.0, l)).astype(refs["out"].dtype)
        refs["lse"][...] = jnp.where(empty, -jnp.inf, m_scr[...] * unit + jnp.log(jnp.where(empty, 1.0, l)))


def _dq_kernel(*all_refs, names, st: _Static):
    refs = dict(zip(names, all_refs))
    (dq_scr,) = all_refs[len(names):]
    i, j = pl.program_id(2), pl.program_id(3)
    live = _block_live(st, i, j)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(live)
    def _step():
        q, k, v, do = refs["q"][...], refs["k"][...], refs["v"][...], refs["do"][...]
        s, allowed, t = _block_scores(st, refs, q, k, i, j)
        p = _probs(s, allowed, refs["lse"][...])
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, refs["delta"][...], t)                 # [bq, bk]
        if "dbias" in refs:
            refs["dbias"][...] = ds.astype(refs["dbias"].dtype)
        dq_scr[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    if "dbias" in refs and live is not True:   # skipped blocks still own their dbias tile
        @pl.when(jnp.logical_not(live))
        def _skip():
            refs["dbias"][...] = jnp.zeros(refs["dbias"].shape, refs["dbias"].dtype)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        refs["dq"][...] = (dq_scr[...] * st.options.softmax_scale).astype(refs["dq"].dtype)


def _dkv_kernel(*all_refs, names, st: _Static, nq: int):
    refs = dict(zip(names, all_refs))
    dk_scr, dv_scr = all_refs[len(names):]
    j, t_step = pl.program_id(2), pl.program_id(3)
    i = _irem(t_step, nq)   # query block; t_step // nq is the query head within the kv head's group

    @pl.when(t_step == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(_block_live(st, i, j))
    def _step():
        q, k, v, do = refs["q"][...], refs["k"][...], refs["v"][...], refs["do"][...]
        s, allowed, t = _block_scores(st, refs, q, k, i, j)
        p = _probs(s, allowed, refs["lse"][...])                            # [bq, bk]
        dv_scr[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, refs["delta"][...], t)
        dk_scr[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

    @pl.when(t_step == pl.num_programs(3) - 1)
    def _finish():
        refs["dk"][...] = (dk_scr[...] * st.options.softmax_scale).astype(refs["dk"].dtype)
        refs["dv"][...] = dv_scr[...].astype(refs["dv"].dtype)


# --------------------------------------------------------------------------------------------------
# pallas_call builders
# --------------------------------------------------------------------------------------------------

def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _aux_inputs(st: _Static, bias, mask, q_seg, kv_seg, qk_map, nb: int, nh: int):
    """(name, array, BlockSpec) of the optional score inputs, addressed through qk_map(*grid) -> (b, h, i, j)."""
    bq, bk = st.blocks.block_q, st.blocks.block_k
    out = []
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        bcast_b, bcast_h = x.shape[0] == 1 and nb != 1, x.shape[1] == 1 and nh != 1

        def index(*g, bcast_b=bcast_b, bcast_h=bcast_h):
            b, h, i, j = qk_map(*g)
            return (0 if bcast_b else b, 0 if bcast_h else h, i, j)
        out.append((name, x, pl.BlockSpec((None, None, bq, bk), index)))
    if q_seg is not None:
        out.append(("q_seg", q_seg, pl.BlockSpec((None, bq, 1), lambda *g: (qk_map(*g)[0], qk_map(*g)[2], 0))))
        out.append(("kv_seg", kv_seg, pl.BlockSpec((None, 1, bk), lambda *g: (qk_map(*g)[0], 0, qk_map(*g)[3]))))
    return out


def _call(kernel, st: _Static, grid, inputs, outputs, scratch, **kernel_kw):
    """pallas_call over named inputs/outputs [(name, array or ShapeDtypeStruct, BlockSpec)]."""
    names = tuple(n for n, _, _ in inputs) + tuple(n for n, _, _ in outputs)
    return pl.pallas_call(
        functools.partial(kernel, names=names, st=st, **kernel_kw),
        grid=grid,
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        out_shape=[a for _, a, _ in outputs],
        scratch_shapes=scratch,
        compiler_params=_compiler_params(),
        interpret=st.interpret,
    )(*[a for _, a, _ in inputs])


def _forward(st: _Static, q, k, v, bias, sink_lse, mask, q_seg, kv_seg):
    """q (B,Hq,Sq,D), k (B,Hkv,Sk,D), v (B,Hkv,Sk,Dv), padded -> out (B,Hq,Sq,Dv), lse (B,Hq,Sq,1) f32."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = st.blocks.block_q, st.blocks.block_k
    nq, nk, group = Sq // bq, Sk // bk, Hq // Hkv

    def qk_map(b, h, i, j):
        return b, h, i, _kv_block_in_band(st, i, j, nk)

    kv = lambda width: pl.BlockSpec((None, None, bk, width),
                                    lambda b, h, i, j: (b, _idiv(h, group), qk_map(b, h, i, j)[3], 0))
    inputs = [
        ("q", q, pl.BlockSpec((None, None, bq, D), lambda b, h, i, j: (b, h, i, 0))),
        ("k", k, kv(D)),
        ("v", v, kv(Dv)),
        *_aux_inputs(st, bias, mask, q_seg, kv_seg, qk_map, B, Hq),
    ]
    if sink_lse is not None:
        inputs.append(("sink_lse", sink_lse, pl.BlockSpec(memory_space=pltpu.SMEM)))
    row_spec = lambda width: pl.BlockSpec((None, None, bq, width), lambda b, h, i, j: (b, h, i, 0))
    outputs = [
        ("out", jax.ShapeDtypeStruct((B, Hq, Sq, Dv), q.dtype), row_spec(Dv)),
        ("lse", jax.ShapeDtypeStruct((B, Hq, Sq, 1), jnp.float32), row_spec(1)),
    ]
    scratch = [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
               pltpu.VMEM((bq, Dv), jnp.float32)]
    out, lse = _call(_fwd_kernel, st, (B, Hq, nq, nk), inputs, outputs, scratch)
    return out, lse


def _backward(st: _Static, q, k, v, bias, mask, q_seg, kv_seg, do, lse, delta, want_dbias: bool):
    """dq, dk, dv and dbias (full (B,Hq,Sq,Sk) float32 if want_dbias, else None) on padded head-major arrays."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = st.blocks.block_q, st.blocks.block_k
    nq, nk, group = Sq // bq, Sk // bk, Hq // Hkv

    # dQ (and dbias): grid (b, h, i, j), reduction over key blocks j.
    def qk_map(b, h, i, j):
        return b, h, i, _kv_block_in_band(st, i, j, nk)

    row = lambda width: pl.BlockSpec((None, None, bq, width), lambda b, h, i, j: (b, h, i, 0))
    kv = lambda width: pl.BlockSpec((None, None, bk, width),
                                    lambda b, h, i, j: (b, _idiv(h, group), qk_map(b, h, i, j)[3], 0))
    inputs = [("q", q, row(D)), ("k", k, kv(D)), ("v", v, kv(Dv)), ("do", do, row(Dv)),
              ("lse", lse, row(1)), ("delta", delta, row(1)),
              *_aux_inputs(st, bias, mask, q_seg, kv_seg, qk_map, B, Hq)]
    outputs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype), row(D))]
    if want_dbias:
        outputs.append(("dbias", jax.ShapeDtypeStruct((B, Hq, Sq, Sk), jnp.float32),
                        pl.BlockSpec((None, None, bq, bk), lambda b, h, i, j: (b, h, i, j))))
    dq, *dbias = _call(_dq_kernel, st, (B, Hq, nq, nk), inputs, outputs, [pltpu.VMEM((bq, D), jnp.float32)])

    # dK/dV: grid (b, kv head, j, t) with t = g * nq + i, reduction over the group's heads and query blocks.
    def qk_map_t(b, hk, j, t):
        return b, hk * group + _idiv(t, nq), _q_block_in_band(st, j, _irem(t, nq), nq), j

    row = lambda width: pl.BlockSpec((None, None, bq, width), lambda *g: (*qk_map_t(*g)[:3], 0))
    kv = lambda width: pl.BlockSpec((None, None, bk, width), lambda b, hk, j, t: (b, hk, j, 0))
    inputs = [("q", q, row(D)), ("k", k, kv(D)), ("v", v, kv(Dv)), ("do", do, row(Dv)),
              ("lse", lse, row(1)), ("delta", delta, row(1)),
              *_aux_inputs(st, bias, mask, q_seg, kv_seg, qk_map_t, B, Hq)]
    outputs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), kv(D)),
               ("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), kv(Dv))]
    scratch = [pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, Dv), jnp.float32)]
    dk, dv = _call(_dkv_kernel, st, (B, Hkv, nk, group * nq), inputs, outputs, scratch, nq=nq)
    return dq, dk, dv, (dbias[0] if dbias else None)


# --------------------------------------------------------------------------------------------------
# custom_vjp core (head-major, padded)
# --------------------------------------------------------------------------------------------------

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """Which optional gradients the caller differentiates (static, carried in the residuals)."""

    dbias: bool
    dsinks: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_core(st: _Static, q, k, v, bias, sink_lse, mask, q_seg, kv_seg):
    return _forward(st, q, k, v, bias, sink_lse, mask, q_seg, kv_seg)


def _flash_core_fwd(st, q, k, v, bias, sink_lse, mask, q_seg, kv_seg):
    # symbolic_zeros: every array leaf arrives as CustomVJPPrimal(value, perturbed).  A bias that is
    # not differentiated (a constant ALiBi table, say) then costs no (B, Hq, Sq, Sk) dbias write.
    wanted = _Wanted(dbias=bias is not None and bias.perturbed,
                     dsinks=sink_lse is not None and sink_lse.perturbed)
    args = custom_vjp_primal_tree_values((q, k, v, bias, sink_lse, mask, q_seg, kv_seg))
    out, lse = _forward(st, *args)
    return (out, lse), (wanted, *args, out, lse)


def _flash_core_bwd(st, res, cotangents):
    wanted, q, k, v, bias, sink_lse, mask, q_seg, kv_seg, out, lse = res
    do, dlse = cotangents
    if isinstance(do, SymbolicZero):   # only lse is differentiated
        do = jnp.zeros(out.shape, out.dtype)
    # delta = rowsum(dO * O) - dlse: an lse cotangent enters every score gradient as ds += p * dlse,
    # i.e. as a shift of delta (what differentiating an lse merge, e.g. ring attention, needs).
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    if not isinstance(dlse, SymbolicZero):
        delta = delta - dlse
    dq, dk, dv, dbias = _backward(st, q, k, v, bias, mask, q_seg, kv_seg, do, lse, delta, wanted.dbias)
    if dbias is not None:
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1 and dbias.shape[a] != 1)
        dbias = jnp.sum(dbias, axis=axes, keepdims=True).astype(bias.dtype)
    dsink = None
    if wanted.dsinks:
        w = sink_probability(sink_lse[None, :, None, None], lse)   # sink probability
        dsink = -jnp.sum(w * delta, axis=(0, 2, 3)).astype(sink_lse.dtype)
    return dq, dk, dv, dbias, dsink, None, None, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------------
# entry point (BSHD)
# --------------------------------------------------------------------------------------------------

def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int, value=0):
    if x is None or x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _sink_lse(softmax_aux, heads_q: int):
    """softmax_aux (Hq, n), (Hq,) or shared (n,) -> per-head log-sum-exp (Hq,) float32."""
    aux = softmax_aux.astype(jnp.float32)
    if aux.ndim == 1:
        aux = aux[:, None] if aux.shape[0] == heads_q else jnp.broadcast_to(aux[None, :], (heads_q, aux.shape[0]))
    return sink_logsumexp(aux)


def flash_attention_pallas(query, key, value, *, options: FlashOptions, bias=None, attention_mask=None,
                           q_segment_ids=None, kv_segment_ids=None, softmax_aux=None,
                           dropout_seed=None, return_lse=False, block_q=128, block_k=128, interpret=None):
    """Flash attention through the Pallas TPU kernels (interpreted off-TPU); differentiable.

    Arguments are already validated by `dualattn.jax_api.flash_attention` (see docs/contract.md):
    query (B, Sq, Hq, D), key (B, Sk, Hkv, D), value (B, Sk, Hkv, Dv); bias / attention_mask
    (B or 1, Hq or 1, Sq, Sk); segment ids (B, Sq) / (B, Sk) (one given: used for both);
    softmax_aux (Hq, n), (Hq,) or (n,).  `options` carries scale, window/causal, soft cap.

    Args:
      dropout_seed: accepted for signature parity; dropout itself is rejected by
        `check_pallas_supported` (dropout_prob must be 0).
      block_q, block_k: tile sizes; clamped to the (8-rounded) sequence lengths.  On TPU block_k
        must be a multiple of 128 and block_q of 8 (16 for 16-bit inputs, 32 with a mask),
        unless one block spans the sequence.
      interpret: None = interpret unless on TPU; True / False / pltpu.InterpretParams().

    Returns:
      out (B, Sq, Hq, Dv) in query.dtype, and with return_lse also lse (B, Hq, Sq) float32
      (natural log, sinks included; -inf for rows with nothing to attend and no sinks).
    """
    check_pallas_supported(options)
    B, Sq, Hq, D = query.shape
    Sk = key.shape[1]
    bq = min(block_q, _round_up(Sq, 8))
    bk = min(block_k, _round_up(Sk, 8))
    st = _Static(options=options, blocks=BlockSizes(bq, bk), seq_q=Sq, seq_k=Sk,
                 interpret=resolve_interpret(interpret))
    sq_pad, sk_pad = _round_up(Sq, bq), _round_up(Sk, bk)
    if st.interpret is False:
        _check_tpu_tiling(bq, bk, sq_pad, sk_pad, dtype=query.dtype, has_mask=attention_mask is not None)

    heads_major = lambda x, s: _pad_axis(jnp.swapaxes(x, 1, 2), 2, s)   # (B, S, H, D) -> (B, H, S_pad, D)
    q, k, v = heads_major(query, sq_pad), heads_major(key, sk_pad), heads_major(value, sk_pad)
    pad_map = lambda x: _pad_axis(_pad_axis(x, 2, sq_pad), 3, sk_pad)
    bias_p = pad_map(bias)
    mask_p = None if attention_mask is None else pad_map((attention_mask != 0).astype(jnp.int8))
    q_seg = kv_seg = None
    if q_segment_ids is not None or kv_segment_ids is not None:
        qs = q_segment_ids if q_segment_ids is not None else kv_segment_ids
        ks = kv_segment_ids if kv_segment_ids is not None else q_segment_ids
        qs, ks = segment_ranks(qs, ks)   # 32-bit on TPU, equal exactly where the ids are
        q_seg = _pad_axis(qs, 1, sq_pad)[:, :, None]     # [B, Sq_pad, 1]
        kv_seg = _pad_axis(ks, 1, sk_pad)[:, None, :]    # [B, 1, Sk_pad]
    sink_lse = None if softmax_aux is None else _sink_lse(softmax_aux, Hq)

    out, lse = _flash_core(st, q, k, v, bias_p, sink_lse, mask_p, q_seg, kv_seg)
    out = jnp.swapaxes(out[:, :, :Sq], 1, 2)
    if return_lse:
        return out, lse[:, :, :Sq, 0]
    return out
