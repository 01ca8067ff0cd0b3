"""The systems under test and the two front ends (torch, jax) that turn one of them into timed calls.

A system is a builder `(shape, causal) -> attn(q, k, v)`, BSHD in and BSHD out, in its framework.
A front end turns any such `attn` into a zero-argument step for a mode ("fwd": inference forward,
returns the output; "fwdbwd": forward + backward against a fixed cotangent), so the fwd and fwdbwd
paths of every system are built by the same two functions. torch and jax are imported on use only.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .report import Shape

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@contextlib.contextmanager
def keep_env(name: str):
    """Restore os.environ[name] (or its absence) on exit.

    jax-triton 0.3.1 sets TRITON_CACHE_DIR="" on import, which breaks Triton kernels launched from
    torch later in the same process (PLATFORM.md, jax-triton pitfall 1)."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@functools.lru_cache(maxsize=None)
def import_jax():
    """jax, imported so that it shares the GPU with torch and leaves TRITON_CACHE_DIR alone."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # grow on demand, next to torch
    with keep_env("TRITON_CACHE_DIR"):
        import jax
        try:  # import it here, under the guard, so that no later lazy import clears the variable
            import jax_triton  # noqa: F401
        except Exception:  # absent, or a CPU-only jaxlib: only the jax "triton" system needs it
            pass
    return jax


# ---------------------------------------------------------------------------------------------
# Inputs and the correctness reference


@dataclass
class Inputs:
    """Random-normal q, k, v and the fwd+bwd cotangent, BSHD torch tensors; jax views on demand."""
    shape: Shape
    q: Any  # torch.Tensor
    k: Any  # torch.Tensor
    v: Any  # torch.Tensor
    dout: Any  # torch.Tensor
    _jax: Optional[Tuple] = None

    def as_jax(self) -> Tuple:
        """The same memory as jax arrays (DLPack, zero-copy)."""
        if self._jax is None:
            jax = import_jax()
            self._jax = tuple(jax.dlpack.from_dlpack(t) for t in (self.q, self.k, self.v, self.dout))
        return self._jax


def make_inputs(shape: Shape, dtype: str = "bf16", seed: int = 0, device: str = "cuda") -> Inputs:
    import torch
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    dims = (shape.B, shape.S, shape.H, shape.D)
    q, k, v, dout = (torch.randn(dims, generator=gen, device=device, dtype=getattr(torch, DTYPES[dtype]))
                     for _ in range(4))
    return Inputs(shape, q, k, v, dout)


def reference_output(inputs: Inputs, causal: bool):
    """fp32 torch SDPA (math backend) of the inputs, BSHD; chunked so the scores stay under ~1 GiB."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, S, H, D = inputs.shape.B, inputs.shape.S, inputs.shape.H, inputs.shape.D
    q, k, v = (t.float().transpose(1, 2).reshape(B * H, S, D) for t in (inputs.q, inputs.k, inputs.v))
    out = torch.empty_like(q)
    rows = max(1, 2**28 // (S * S))  # (batch*head) slices per chunk
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(0, B * H, rows):
            out[i:i + rows] = F.scaled_dot_product_attention(q[i:i + rows], k[i:i + rows], v[i:i + rows],
                                                             is_causal=causal)
    return out.reshape(B, H, S, D).transpose(1, 2)


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN stays NaN, so it never passes a `<` check)."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out = out.float()
    return float((out - ref).norm() / ref.norm())


# ---------------------------------------------------------------------------------------------
# Front ends: attn -> timed step, output -> torch tensor


@dataclass(frozen=True)
class Step:
    """One timed call of a system.  `launch()` enqueues the work and returns its outputs without
    waiting; `sync(outputs)` waits for them.  Calling the step does both (correctness checks).
    The split lets one timer measure torch and jax alike: n launches back to back, one wait."""
    launch: Callable[[], Any]
    sync: Callable[[Any], Any]

    def __call__(self):
        out = self.launch()
        self.sync(out)
        return out


def _torch_sync(_outputs) -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class TorchFrontEnd:
    name = "torch"

    @staticmethod
    def make_step(attn: Callable, inputs: Inputs, mode: str) -> Step:
        import torch
        q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
        if mode == "fwd":
            def fwd():
                with torch.no_grad():
                    return attn(q, k, v)
            return Step(fwd, _torch_sync)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwdbwd():  # autograd.grad, not .backward(): no gradient accumulation kernel in the timing
            return torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), dout)
        return Step(fwdbwd, _torch_sync)

    @staticmethod
    def to_torch(out):
        return out


class JaxFrontEnd:
    name = "jax"

    @staticmethod
    def make_step(attn: Callable, inputs: Inputs, mode: str) -> Step:
        jax = import_jax()
        if inputs.q.device.type == "cuda" and jax.default_backend() != "gpu":
            raise RuntimeError(f"jax has no GPU backend (jax.default_backend() == {jax.default_backend()!r})")
        q, k, v, dout = inputs.as_jax()
        # Arrays the attention takes besides q, k, v (a bias, a mask: attn.array_kwargs) are arguments
        # of the jitted step, not constants folded into it; they are not differentiated.
        extra = getattr(attn, "array_kwargs", {})
        if mode == "fwd":
            step, args = jax.jit(lambda q, k, v, extra: attn(q, k, v, **extra)), (q, k, v, extra)
        else:
            def fwdbwd(q, k, v, dout, extra):  # grad of sum(out * dout), i.e. the vjp with a fixed cotangent
                out, pullback = jax.vjp(lambda q, k, v: attn(q, k, v, **extra), q, k, v)
                return out, pullback(dout)
            step, args = jax.jit(fwdbwd), (q, k, v, dout, extra)
        return Step(lambda: step(*args), jax.block_until_ready)

    @staticmethod
    def to_torch(out):
        import torch
        return torch.from_dlpack(out)


FRONT_ENDS = {"torch": TorchFrontEnd, "jax": JaxFrontEnd}


# ---------------------------------------------------------------------------------------------
# Systems


@dataclass(frozen=True)
class System:
    key: str
    label: str
    front_end: str  # "torch" | "jax"
    build: Callable[[Shape, bool], Callable]  # (shape, causal) -> attn(q, k, v), BSHD

    @property
    def front(self):
        return FRONT_ENDS[self.front_end]


def _bhsd(t):
    return t.transpose(1, 2)  # a view of the same memory


def _dualattn_torch(shape: Shape, causal: bool) -> Callable:
    from dualattn.torch_api import flash_attention
    return functools.partial(flash_attention, causal=causal)


def _sdpa(backend: str) -> Callable:
    def build(shape: Shape, causal: bool) -> Callable:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        chosen = getattr(SDPBackend, backend)

        def attn(q, k, v):
            with sdpa_kernel(chosen):
                return _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=causal))
        return attn
    return build


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape/mode; keep them all
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    return torch.compile(flex_attention, dynamic=False)


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex(shape: Shape, causal: bool) -> Callable:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    flex = _compiled_flex()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block_mask = create_block_mask(_causal_mod, None, None, shape.S, shape.S, device=device) if causal else None

    def attn(q, k, v):
        return _bhsd(flex(_bhsd(q), _bhsd(k), _bhsd(v), block_mask=block_mask))
    return attn


def _dualattn_jax(backend: str) -> Callable:
    def build(shape: Shape, causal: bool) -> Callable:
        import_jax()
        from dualattn.jax_api import flash_attention
        return functools.partial(flash_attention, causal=causal, backend=backend)
    return build


def _jax_nn(implementation: str) -> Callable:
    def build(shape: Shape, causal: bool) -> Callable:
        jax = import_jax()
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=implementation)
    return build


SYSTEMS: Dict[str, System] = {s.key: s for s in [
    System("dualattn-torch", "dualattn.torch_api.flash_attention", "torch", _dualattn_torch),
    System("dualattn-jax-triton", 'dualattn.jax_api.flash_attention(backend="triton"), jit', "jax",
           _dualattn_jax("triton")),
    System("dualattn-jax-xla", 'dualattn.jax_api.flash_attention(backend="xla"), jit', "jax", _dualattn_jax("xla")),
    System("sdpa-cudnn", "torch SDPA, SDPBackend.CUDNN_ATTENTION (BHSD views)", "torch", _sdpa("CUDNN_ATTENTION")),
    System("sdpa-flash", "torch SDPA, SDPBackend.FLASH_ATTENTION (BHSD views)", "torch", _sdpa("FLASH_ATTENTION")),
    System("sdpa-efficient", "torch SDPA, SDPBackend.EFFICIENT_ATTENTION (BHSD views)", "torch",
           _sdpa("EFFICIENT_ATTENTION")),
    System("flex", "torch FlexAttention, torch.compile(dynamic=False), causal via create_block_mask", "torch",
           _flex),
    System("jax-cudnn", 'jax.nn.dot_product_attention(implementation="cudnn"), jit', "jax", _jax_nn("cudnn")),
    System("jax-xla", 'jax.nn.dot_product_attention(implementation="xla"), jit', "jax", _jax_nn("xla")),
]}
