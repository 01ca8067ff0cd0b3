"""Sequence bounds and cache row addresses, shared by the decode kernels.

Every value read from memory here (cache_seqlens, cache_batch_idx, cache_leftpad, block_table) may be
garbage when the host could not check it (a traced or device-resident array): each is clamped into
range before it forms an address, so no load or store leaves the cache.
"""
import triton
import triton.language as tl


@triton.jit
def sequence_bounds(SEQLENS, BATCH_IDX, LEFTPAD, b, S_NEW: tl.constexpr, CAPACITY: tl.constexpr,
                    B_CACHE: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                    HAS_LEFTPAD: tl.constexpr):
    """(cache rows before the append, keys after it, first key row, cache batch) of sequence b.

    The rows already cached are clamped to [0, CAPACITY]; keys = min(that + S_NEW, CAPACITY), so an
    append past the capacity drops its last rows instead of writing beyond the cache."""
    if HAS_SEQLENS:
        n_cached = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), CAPACITY)
    else:
        n_cached = tl.full((), CAPACITY - S_NEW, tl.int32)
    kv_len = tl.minimum(n_cached + S_NEW, CAPACITY)
    if HAS_LEFTPAD:
        first = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), kv_len)
    else:
        first = tl.full((), 0, tl.int32)
    if HAS_BATCH_IDX:
        b_cache = tl.minimum(tl.maximum(tl.load(BATCH_IDX + b), 0), B_CACHE - 1)
    else:
        b_cache = b
    return n_cached, kv_len, first, b_cache


@triton.jit
def cache_rows(rows, b, b_cache, BLOCK_TABLE, STRIDE_BT: tl.constexpr, CAPACITY: tl.constexpr,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_PAGES: tl.constexpr):
    """(outer, inner, page entry in range) of logical rows `rows` of sequence b, int64: a row's element
    offset is outer * stride(0) + inner * stride(1) of the cache.

    Dense: row r of cache batch b_cache.  Paged: row r % PAGE_SIZE of page block_table[b, r // PAGE_SIZE].
    Rows are clamped to the capacity and pages to [0, NUM_PAGES): readers take the clamped row,
    writers drop a row whose entry was out of range."""
    rows = tl.minimum(tl.maximum(rows, 0), CAPACITY - 1)
    if PAGED:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * STRIDE_BT + rows // PAGE_SIZE)
        valid = (page >= 0) & (page < NUM_PAGES)
        outer = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
        inner = (rows % PAGE_SIZE).to(tl.int64)
    else:
        valid = rows >= 0
        outer = rows.to(tl.int64) * 0 + b_cache
        inner = rows.to(tl.int64)
    return outer, inner, valid


# Reductions through the builtin tl.reduce with Triton's own combine functions: tl.sum / tl.max are
# @jit library functions that the per-launch interpreted copy of the kernels cannot call, while
# tl.reduce is a builtin (and the interpreter has NumPy fast paths for these combine functions).
@triton.jit
def row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)
