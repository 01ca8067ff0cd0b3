"""Tiles that launch: every portable launch is checked against the GPU's shared memory, from its
compiled kernel, and planned again with fewer stages or smaller tiles until it fits.

The tuned tiles were measured on option-free problems.  An option adds live tiles to a kernel (a
bias or mask tile, the soft cap's tanh, segment ids), and at D=96-256 the compiler's layout
conversions for them can take more shared memory than an sm_90 block has (227 KB; sm_80: 163 KB):
Triton then raises OutOfResources at the first launch.  So the launchers plan through `forward` and
`backward` here: each portable launch is compiled for the device (triton.compile, what the first
launch would compile anyway; cached per variant in-process) and replaced by a smaller variant while it
does not fit.  The warp-specialised and Gluon kernels run fixed tiles that are known to fit, and are
not recompiled here, except the Gluon forward and the one-pass backward with a bias or an attention
mask: they hold a tile of each, and where those do not fit (a float32 bias, or both, at D=128) the
launch is planned again without Gluon.

Registers need no such check: Triton declares each kernel's thread count to ptxas (.maxntid, at most
8 warps in these plans), and ptxas keeps a thread within 255 registers and the block within the SM's
64K, spilling to local memory if it must. A register shortage costs speed, never a launch.

Framework-free: the launchers pass the arch, the device's shared-memory limit and the input dtypes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Iterator, Optional

from .. import compile_check
from ..launch import Launch
from . import plan as flash_plan
from .plan import FlashConfig, TileConfig

# cudaDevAttrMaxSharedMemoryPerBlockOptin by compute capability: what a block may use (CI compiles
# for these without a GPU; launchers on a GPU pass the device's own number).
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
PORTABLE_KERNELS = ("flash_fwd_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel")
GLUON_SCORED_KERNELS = ("flash_fwd_gluon_kernel", "flash_bwd_one_pass_kernel")
MIN_BLOCK = 16


@functools.lru_cache(maxsize=4096)
def _shared_bytes(launch: Launch, dtypes: tuple, arch: int, specialize: str) -> int:
    compiled = compile_check.compile_launch(launch, dict(dtypes), arch=arch, specialize=specialize)
    return int(compiled.metadata.shared)


def shared_bytes(launch: Launch, dtypes: Dict[str, str], arch: int, specialize: str = "torch") -> int:
    """Shared memory of `launch`'s kernel compiled for sm_<arch> (dtypes: the inputs' dtype names)."""
    if launch.kernel in GLUON_SCORED_KERNELS:
        launch = _any_size(launch)
    return _shared_bytes(launch, tuple(sorted(dtypes.items())), int(arch), specialize)


def _any_size(launch: Launch) -> Launch:
    """The Gluon launch as one for any problem size: the grid and integer scalars (sizes, strides;
    never specialised, but jax-triton's 1s become constexprs) do not change its shared memory, so one
    compile serves every sequence length (a compile takes seconds of host time)."""
    def canonical(value):
        return (1 if value == 1 else 16) if isinstance(value, int) and not isinstance(value, bool) else value
    return dataclasses.replace(launch, grid=(1, 1, 1), scalars=tuple((n, canonical(v)) for n, v in launch.scalars),
                               outputs=tuple(dataclasses.replace(o, shape=(1,)) for o in launch.outputs), then=None)


def _checked(launch: Launch) -> bool:
    const = launch.constexpr_dict
    if launch.kernel in GLUON_SCORED_KERNELS:
        return bool(const["HAS_BIAS"] or const["HAS_MASK"])
    return launch.kernel in PORTABLE_KERNELS and not const.get("WARP_SPECIALIZE")


def fits(launch: Launch, dtypes: Dict[str, str], arch: int, max_shared: int, specialize: str = "torch") -> bool:
    """Whether every portable launch of `launch`'s chain, and a Gluon forward with a bias or mask,
    fits `max_shared` bytes on sm_<arch>."""
    return all(shared_bytes(one, dtypes, arch, specialize) <= max_shared for one in launch.chain if _checked(one))


def smaller_tiles(tile: TileConfig) -> Iterator[TileConfig]:
    """`tile` and then ever smaller variants: fewer pipeline stages first (each stage holds a K and a V
    tile), then the iterated block halved, then the owned block; never below MIN_BLOCK rows."""
    for stages in range(tile.num_stages, 0, -1):
        yield dataclasses.replace(tile, num_stages=stages)
    block_m, block_n = tile.block_m, tile.block_n
    while block_m > MIN_BLOCK or block_n > MIN_BLOCK:
        if block_n >= block_m and block_n > MIN_BLOCK:
            block_n //= 2
        else:
            block_m //= 2
        warps = min(tile.num_warps, max(1, block_m // 16))
        for stages in (2, 1):
            yield TileConfig(block_m, block_n, warps, stages)


def forward(shapes, options, strides, *, config: FlashConfig, arch: int, max_shared: int, dtypes: Dict[str, str],
            specialize: str = "torch", **plan_kwargs) -> Launch:
    """plan.plan_forward, with config.fwd made smaller until every portable launch fits."""
    config = _start(config, plan_kwargs)
    plan_kwargs.setdefault("hardware_tanh", True)   # (every launch planned here runs on the GPU)
    # (a split band's edges launch resumes from the interior's out and lse)
    # (varlen run as documents: plan.varlen_as_documents makes the segment ids, int32)
    dtypes = {"q_segment_ids": "int32", "kv_segment_ids": "int32", **dtypes, "resume_out": dtypes["query"],
              "resume_lse": "float32", "segment_ranges": "int32"}
    launch = None
    for tile in smaller_tiles(config.fwd):
        launch = flash_plan.plan_forward(shapes, options, strides, config=dataclasses.replace(config, fwd=tile),
                                         **plan_kwargs)
        if fits(launch, dtypes, arch, max_shared, specialize):
            return launch
        if launch.chain[-1].kernel in GLUON_SCORED_KERNELS:   # its bias and mask tiles do not fit: not Gluon
            plan_kwargs = {**plan_kwargs, "gluon": False}
            launch = flash_plan.plan_forward(shapes, options, strides, config=dataclasses.replace(config, fwd=tile),
                                             **plan_kwargs)
            if fits(launch, dtypes, arch, max_shared, specialize):
                return launch
    return _none_fits(launch, arch, max_shared, shapes, plan_kwargs.get("sparse"))


def backward(shapes, options, strides, *, config: FlashConfig, arch: int, max_shared: int, dtypes: Dict[str, str],
             specialize: str = "torch", **plan_kwargs) -> "flash_plan.BackwardPlan":
    """plan.plan_backward, with config.bwd_dkdv and config.bwd_dq made smaller (each on its own) until
    both portable launches fit."""
    config = _start(config, plan_kwargs)
    plan_kwargs.setdefault("hardware_tanh", True)
    dkdv_tiles, dq_tiles = smaller_tiles(config.bwd_dkdv), smaller_tiles(config.bwd_dq)
    dkdv, dq = next(dkdv_tiles), next(dq_tiles)
    plan = None
    while True:
        plan = flash_plan.plan_backward(shapes, options, strides,
                                        config=dataclasses.replace(config, bwd_dkdv=dkdv, bwd_dq=dq), **plan_kwargs)
        # (varlen run as documents: plan.varlen_backward_as_documents makes the segment ids)
        launched = {"q_segment_ids": "int32", "kv_segment_ids": "int32", **dtypes, "delta": "float32",
                    "segment_ranges": "int32"}
        dkdv_fits = fits(plan.dkdv, launched, arch, max_shared, specialize)
        if not dkdv_fits and plan.dkdv.chain[-1].kernel in GLUON_SCORED_KERNELS:
            plan_kwargs = {**plan_kwargs, "gluon": False}   # the one-pass kernel's bias / mask tiles do not fit
            continue
        dq_fits = fits(plan.dq, launched, arch, max_shared, specialize)
        if dkdv_fits and dq_fits:
            return plan
        try:
            dkdv = dkdv if dkdv_fits else next(dkdv_tiles)
            dq = dq if dq_fits else next(dq_tiles)
        except StopIteration:
            return _none_fits(plan.dkdv if not dkdv_fits else plan.dq, arch, max_shared, shapes, plan_kwargs.get("sparse"))


def _start(config: FlashConfig, plan_kwargs) -> FlashConfig:
    """Block-sparse launches run the layout's blocks: only their pipeline depth can shrink."""
    sparse = plan_kwargs.get("sparse")
    return sparse.config() if sparse is not None else config


def _none_fits(launch: Optional[Launch], arch: int, max_shared: int, shapes=None, sparse=None):
    if sparse is not None:
        # A layout's blocks are its kernels' tiles: past one pipeline stage there is nothing to shrink.
        raise ValueError(f"layout: block-sparse tiles are the layout's {sparse.block_q}x{sparse.block_k} blocks, which "
                         f"at {shapes.dtype} with head dim {max(shapes.head_dim, shapes.head_dim_v)} need more than the "
                         f"{max_shared} bytes of shared memory of sm_{arch} even with one pipeline stage: build the "
                         "layout with smaller blocks (e.g. 32) or run in bfloat16 / float16")
    raise RuntimeError(f"no tile of {launch.kernel if launch else 'the kernel'} fits the {max_shared} bytes of shared "
                       f"memory of sm_{arch}: please report this problem's shapes and options")
