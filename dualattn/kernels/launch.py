"""A framework-neutral description of one Triton launch.

Both front ends consume the same `Launch`: torch calls `kernel[grid](...)`, JAX calls
`jax_triton.triton_call(...)` (or runs the interpreted kernel in a pure_callback).  Array
arguments come first, then scalars, then outputs, then constexprs — the order
jax-triton requires — so one launch plan compiles the identical kernel variant in both.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Output:
    name: str
    shape: Tuple[int, ...]
    dtype: str            # "float32", "bfloat16", ... or "like:<input name>"
    zeroed: bool = False  # must be filled before the launch (accumulated / sparse writes), with `fill`
    # The value a `zeroed` buffer holds before the launch: 0, or -inf for a varlen lse, whose rows in
    # no sequence no program writes.  jax-triton can only zero-fill: the JAX front end masks those
    # rows itself (jax_api/flash.py).
    fill: float = 0.0
    # The kernel's tensor descriptors live in this buffer where the launcher has no global scratch
    # of its own (jax-triton: jax_api/_scratch.py); Triton's launcher (torch) brings its own, so
    # torch passes a dummy pointer.  Never a result.
    scratch: bool = False
    # Never written: the kernel's use of it is switched off by a constexpr (no bias, no sinks), and
    # it exists only to keep the signature.  A launcher that can pass any pointer (torch) passes a
    # shared dummy instead of allocating; jax-triton needs a buffer for every output.
    placeholder: bool = False


@dataclasses.dataclass(frozen=True)
class Launch:
    module: str                              # e.g. "flash.forward" under dualattn.kernels
    kernel: str                              # attribute name of the @triton.jit function
    grid: Tuple[int, int, int]
    inputs: Tuple[str, ...]                  # array arguments, in signature order
    scalars: Tuple[Tuple[str, object], ...]  # (name, python int/float), in signature order
    outputs: Tuple[Output, ...]
    constexprs: Tuple[Tuple[str, object], ...]
    num_warps: int
    num_stages: int
    # A cap on the registers a thread (Triton's `maxnreg`, PTX's .maxnreg), so that a number of programs
    # fit an SM whatever the Triton release's register allocation; None: ptxas chooses.  Both
    # launchers compile with it (jax-triton has no such option: jax_api/_compile.py).
    max_registers: Optional[int] = None
    # A launch that runs next and takes these results on: its inputs named in `resume` (input,
    # this launch's output) are bound to them, and its outputs of the same names replace them.
    # Launchers may run it in place (torch: the same tensors) or into fresh buffers (JAX).
    then: Optional["Launch"] = None
    resume: Tuple[Tuple[str, str], ...] = ()

    @property
    def chain(self) -> Tuple["Launch", ...]:
        """This launch and the ones it hands its outputs to, in order."""
        return (self,) + (self.then.chain if self.then is not None else ())

    @property
    def results(self) -> Tuple[Output, ...]:
        """The outputs a caller gets back (scratch buffers are not results)."""
        return tuple(o for o in self.outputs if not o.scratch)

    @property
    def constexpr_dict(self) -> dict:
        return dict(self.constexprs)

    # The torch launcher keys its per-launch records on launches (torch_api/_launch._prepared), so equal
    # plans share one record however often a front end builds them anew; the hash of the nested
    # tuples is worked out once per object.
    def __hash__(self):
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self)))


# Memoised plan functions (plan_memo) and the launchers' own memos of planned calls (on_forget_plans):
# forget_plans drops them all, after a rule, tile choice or plan function changes (tests, tuning scripts).
_PLAN_MEMOS: list = []
_FORGET_HOOKS: list = []


def plan_memo(plan_fn):
    """A plan function memoised on its (hashable) arguments: plans are pure functions of shapes and
    options, and building one anew costs tens of microseconds of host time per launch, which counts at
    short sequences.  Until forget_plans."""
    cached = functools.lru_cache(maxsize=1024)(plan_fn)
    _PLAN_MEMOS.append(cached)
    return cached


def forget_plans() -> None:
    """Drop every memoised plan and what launchers memoise from plans (on_forget_plans)."""
    for cache in _PLAN_MEMOS:
        cache.cache_clear()
    for hook in _FORGET_HOOKS:
        hook()


def on_forget_plans(hook) -> None:
    """Call `hook()` from forget_plans: for a launcher's own memo of planned calls."""
    _FORGET_HOOKS.append(hook)


def compile_options(launch: Launch) -> dict:
    """The compiler options a launch asks for beyond warps and stages (triton.compile's names)."""
    return {} if launch.max_registers is None else {"maxnreg": launch.max_registers}


def row_major_strides(shape) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def as_int32(seed: Optional[int]) -> int:
    """Reinterpret any python int as the int32 whose bits are seed mod 2**32."""
    s = int(seed or 0) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


NUM_SMS_ENV = "DUALATTN_NUM_SMS"


@functools.lru_cache(maxsize=None)
def _device_properties(index: int) -> dict:
    from triton.runtime import driver
    return dict(driver.active.utils.get_device_properties(index))


def _device_sms(index: int) -> int:
    return int(_device_properties(index)["multiprocessor_count"])


def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory a block of CUDA device `device_index` may use (what Triton's launcher
    checks a kernel against), asked through Triton's driver so both front ends see the same number."""
    return int(_device_properties(device_index)["max_shared_mem"])


def sm_count(device_index: Optional[int]) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (None: the CPU interpreter, which has
    none), asked through Triton's driver so both front ends see the same number.  DUALATTN_NUM_SMS
    overrides it (tests run persistent launches in the interpreter with it)."""
    from .. import switches   # (kernels/ imports nothing of the package at import time)
    override = switches.current().get(NUM_SMS_ENV)
    if override:
        return int(override)
    return 0 if device_index is None else _device_sms(device_index)
