"""Invalid configurations: a small valid call with one thing wrong, which must raise ValueError or
TypeError naming the argument, before anything is launched.

Each mutation builds, from a generator, the call and the name its error message must contain.  The
launch points of every path (the Triton launchers of both front ends, the XLA and Pallas cores) are
replaced by spies while the call runs: reaching one is a failure even if an error follows.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Tuple

import numpy as np

Built = Tuple[Callable[[], object], str]   # (the call, a name its error must contain)


@dataclasses.dataclass(frozen=True)
class Mutation:
    build: Callable   # (rng, framework, device) -> Built
    frameworks: tuple = ("torch", "jax")


MUTATIONS = {}


def mutation(*frameworks):
    def register(fn):
        MUTATIONS[fn.__name__] = Mutation(fn, frameworks or ("torch", "jax"))
        return fn
    return register


class Launched(Exception):
    """Raised by a spy: a kernel (or backend core) was reached by a call that should have been rejected."""


@contextlib.contextmanager
def no_launch():
    """Every launch point raises Launched while the block runs."""
    import importlib
    targets = [("dualattn.torch_api._launch", "run"), ("dualattn.jax_api._launch", "run"),
               ("dualattn.jax_api.xla", "flash_attention_xla"), ("dualattn.jax_api.xla", "flash_attention_varlen_xla"),
               ("dualattn.jax_api.xla", "blocksparse_attention_xla"), ("dualattn.jax_api.pallas",
                                                                      "flash_attention_pallas")]
    saved = []
    for module_name, attr in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError:   # a framework that is not installed launches nothing
            continue

        def spy(*args, _where=f"{module_name}.{attr}", **kwargs):
            raise Launched(f"{_where} was called")
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, spy)
    try:
        yield
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


def run_invalid(c: dict, device: str) -> dict:
    """Run one invalid configuration; returns what was raised, AssertionError when it is wrong."""
    rng = np.random.default_rng(c["variant"])
    call, name = MUTATIONS[c["mutation"]].build(rng, c["framework"], device)
    try:
        with no_launch():
            call()
    except Launched as e:
        raise AssertionError(f"launched before rejecting: {e}") from None
    except (ValueError, TypeError) as e:
        if name not in str(e):
            raise AssertionError(f"{type(e).__name__} does not name {name!r}: {e}") from None
        return {"raised": type(e).__name__, "message": str(e)[:200]}
    raise AssertionError(f"no error raised (expected one naming {name!r})")


# ----------------------------------------------------------------------------- a small valid call

class _Call:
    """A small valid dense call in one framework; mutations change one argument."""

    def __init__(self, rng, framework: str, device: str, varlen: bool = False):
        self.fw, self.rng = framework, rng
        self.b, self.sq, self.sk = int(rng.integers(1, 3)), int(rng.integers(1, 40)), int(rng.integers(1, 40))
        self.hkv = int(rng.integers(1, 3))
        self.hq = self.hkv * int(rng.integers(1, 3))
        self.d = int(rng.choice([16, 32, 48, 64]))
        self.dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
        self.device = device
        self.kwargs = {}
        self.varlen = varlen
        if varlen:
            self.q = self.array((self.b * self.sq, self.hq, self.d))
            self.k = self.array((self.b * self.sk, self.hkv, self.d))
            self.v = self.array((self.b * self.sk, self.hkv, self.d))
            self.cu_q = self.ints(np.arange(self.b + 1) * self.sq, "int32")
            self.cu_k = self.ints(np.arange(self.b + 1) * self.sk, "int32")
            self.max_q, self.max_k = self.sq, self.sk
        else:
            self.q = self.array((self.b, self.sq, self.hq, self.d))
            self.k = self.array((self.b, self.sk, self.hkv, self.d))
            self.v = self.array((self.b, self.sk, self.hkv, self.d))

    def array(self, shape, dtype=None):
        dtype = dtype or self.dtype
        x = self.rng.standard_normal(shape).astype(np.float32)
        if self.fw == "torch":
            import torch
            return torch.from_numpy(x).to(getattr(torch, dtype)).to(self.device)
        import jax.numpy as jnp
        return jnp.asarray(x, dtype=getattr(jnp, dtype))

    def ints(self, values, dtype):
        values = np.asarray(values)
        if self.fw == "torch":
            import torch
            return torch.from_numpy(values.astype(np.int64)).to(getattr(torch, dtype)).to(self.device)
        import jax.numpy as jnp
        return jnp.asarray(values.astype(dtype))

    def __call__(self):
        if self.fw == "torch":
            from .. import torch_api as api
        else:
            from .. import jax_api as api
            self.kwargs.setdefault("backend", str(self.rng.choice(["triton", "xla"])))
        if self.varlen:
            fn = api.flash_attn_varlen_func if self.fw == "torch" else api.flash_attention_varlen
            return fn(self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.max_k, **self.kwargs)
        return api.flash_attention(self.q, self.k, self.v, **self.kwargs)


def _bad(rng, values):
    return values[int(rng.integers(len(values)))]


# ----------------------------------------------------------------------------- the mutations

@mutation()
def query_dtype(rng, fw, device):
    c = _Call(rng, fw, device)
    c.q = c.array(c.q.shape, _bad(rng, ["float64", "int32"] if fw == "torch" else ["int32", "int8"]))
    return c, "query"


@mutation()
def key_dtype_mismatch(rng, fw, device):
    c = _Call(rng, fw, device)
    other = [d for d in ("float32", "float16", "bfloat16") if d != c.dtype]
    name = _bad(rng, ["key", "value"])
    setattr(c, name[0], c.array(getattr(c, name[0]).shape, _bad(rng, other)))
    return c, name


@mutation()
def wrong_rank(rng, fw, device):
    c = _Call(rng, fw, device)
    name = _bad(rng, ["query", "key", "value"])
    x = getattr(c, name[0])
    setattr(c, name[0], x[0] if _bad(rng, [0, 1]) else x[None])
    return c, name


@mutation()
def batch_mismatch(rng, fw, device):
    c = _Call(rng, fw, device)
    c.k = c.array((c.b + 1,) + tuple(c.k.shape[1:]))
    c.v = c.array((c.b + 1,) + tuple(c.v.shape[1:]))
    return c, "key batch"


@mutation()
def key_value_mismatch(rng, fw, device):
    c = _Call(rng, fw, device)
    shape = list(c.v.shape)
    shape[_bad(rng, [1, 2])] += 1
    c.v = c.array(tuple(shape))
    return c, "value"


@mutation()
def head_dim(rng, fw, device):
    c = _Call(rng, fw, device)
    d = _bad(rng, [1, 8, 15, 257, 320])
    which = _bad(rng, ["qk", "v", "k"])
    if which == "qk":
        c.q, c.k = c.array(c.q.shape[:-1] + (d,)), c.array(c.k.shape[:-1] + (d,))
    elif which == "v":
        c.v = c.array(c.v.shape[:-1] + (d,))
    else:
        c.k = c.array(c.k.shape[:-1] + (c.d + 16,))
    return c, "head_dim"


@mutation()
def heads_not_a_multiple(rng, fw, device):
    c = _Call(rng, fw, device)
    hkv = _bad(rng, [2, 3])
    hq = hkv * 2 + 1
    c.q = c.array((c.b, c.sq, hq, c.d))
    c.k, c.v = c.array((c.b, c.sk, hkv, c.d)), c.array((c.b, c.sk, hkv, c.d))
    return c, "heads"


@mutation()
def sliding_window(rng, fw, device):
    c = _Call(rng, fw, device)
    c.kwargs["sliding_window"] = _bad(rng, [-1, -7, (-2, 3), (4, -5), "8", 3.5, (1, 2, 3), [1.0, 2], (True, 2),
                                            {"left": 1}, (None, "0")])
    return c, "sliding_window"


@mutation()
def flag_types(rng, fw, device):
    c = _Call(rng, fw, device)
    name = _bad(rng, ["causal", "return_lse"])
    c.kwargs[name] = _bad(rng, ["False", "True", 1, 0, None, 1.0, [True]])
    return c, name


@mutation()
def dropout_prob(rng, fw, device):
    c = _Call(rng, fw, device)
    c.kwargs.update(dropout_prob=_bad(rng, [1.0, 1.5, -0.1, "0.1", True, None, float("nan")]), dropout_seed=1)
    return c, "dropout_prob"


@mutation()
def dropout_seed(rng, fw, device):
    c = _Call(rng, fw, device)
    seed = _bad(rng, ["1", True, 1.5, [1]] + ([None] if fw == "jax" else []))
    c.kwargs.update(dropout_prob=0.1, dropout_seed=seed)
    if seed is None:
        c.kwargs["backend"] = "triton"   # the xla core takes the seed check on itself, past the spies' line
    return c, "dropout_seed"


@mutation()
def softmax_scale(rng, fw, device):
    c = _Call(rng, fw, device)
    c.kwargs["softmax_scale"] = _bad(rng, [0.0, -1.0, float("inf"), float("nan"), "half", [0.5], "1/8"])
    return c, "softmax_scale"


@mutation()
def logits_soft_cap(rng, fw, device):
    c = _Call(rng, fw, device)
    c.kwargs["logits_soft_cap"] = _bad(rng, [-1.0, float("inf"), float("nan"), "cap", [30.0]])
    return c, "logits_soft_cap"


def _score_map(rng, fw, device, name: str, bad_dtype: str, good_dtype: str):
    """A (B|1, Hq|1, Sq, Sk) argument (bias, attention_mask) of a wrong shape or dtype."""
    c = _Call(rng, fw, device)
    shape = [c.b, c.hq, c.sq, c.sk]
    r = int(rng.integers(5))
    if r == 0:
        shape[2] += 1
    elif r == 1:
        shape = shape[1:]
    elif r == 2:
        shape[1] = c.hq + 1
    elif r == 3:
        shape[0] = c.b + 1
    wrong = c.array(tuple(shape), bad_dtype) if bad_dtype.startswith("float") else c.ints(np.zeros(shape), bad_dtype)
    right = c.array(tuple(shape), good_dtype) if good_dtype.startswith("float") else c.ints(np.ones(shape), good_dtype)
    c.kwargs[name] = wrong if r == 4 else right
    return c, name


@mutation()
def bias(rng, fw, device):
    return _score_map(rng, fw, device, "bias", "int32", "float32")


@mutation()
def attention_mask(rng, fw, device):
    return _score_map(rng, fw, device, "attention_mask", "float32", "int32")


@mutation()
def segment_ids(rng, fw, device):
    c = _Call(rng, fw, device)
    r = int(rng.integers(3))
    if r == 0:
        c.kwargs["q_segment_ids"] = c.array((c.b, c.sq), "float32")
        return c, "q_segment_ids"
    if r == 1:
        c.kwargs["kv_segment_ids"] = c.ints(np.zeros((c.b, c.sk + 1)), "int32")
        c.kwargs["q_segment_ids"] = c.ints(np.zeros((c.b, c.sq)), "int32")
        return c, "kv_segment_ids"
    c.sk = c.sq + 1   # one side given with Sq != Sk
    c.k, c.v = c.array((c.b, c.sk, c.hkv, c.d)), c.array((c.b, c.sk, c.hkv, c.d))
    c.kwargs["q_segment_ids"] = c.ints(np.zeros((c.b, c.sq)), "int32")
    return c, "segment_ids"


@mutation()
def softmax_aux(rng, fw, device):
    c = _Call(rng, fw, device)
    shape = _bad(rng, [(c.hq + 1, 2), (c.hq, 2, 1), (0,), (c.hq, 0), ()])
    c.kwargs["softmax_aux"] = c.array(shape, "float32") if _bad(rng, [0, 1]) else c.ints(np.zeros((c.hq,)), "int32")
    return c, "softmax_aux"


def _jax_has_int64() -> bool:
    import jax.numpy as jnp
    return jnp.asarray(np.zeros(1, np.int64)).dtype == np.int64


@mutation()
def cu_seqlens(rng, fw, device):
    c = _Call(rng, fw, device, varlen=True)
    side = _bad(rng, ["q", "k"])
    cu = np.asarray(np.arange(c.b + 1) * (c.sq if side == "q" else c.sk))
    total = int(cu[-1])
    r = int(rng.integers(6))
    name = f"cu_seqlens_{side}"
    if r == 0:   # a wrong dtype: int64 (JAX without x64 turns int64 into int32: a float table there)
        bad = c.ints(cu, "int64" if fw == "torch" or _jax_has_int64() else "float32")
    elif r == 1:
        bad = c.ints(cu + 1, "int32")                                      # does not start at 0
    elif r == 2:
        bad = c.ints(np.concatenate([cu, [total + 5]]), "int32")           # past the packed tokens
    elif r == 3:
        bad = c.ints(np.concatenate([cu[:-1], [total + 1, total]]), "int32")   # decreasing
    elif r == 4:
        bad = c.ints(cu[None], "int32")                                    # 2-D
    else:
        bad = cu.tolist() if fw == "torch" else list(map(int, cu))         # a python list
    if r in (2, 3):
        # A longer table than the other side's: keep both the same length so the values are what fails.
        other = np.asarray(np.arange(c.b + 1) * (c.sk if side == "q" else c.sq))
        other = c.ints(np.concatenate([other, other[-1:]]), "int32")
        setattr(c, "cu_k" if side == "q" else "cu_q", other)
    setattr(c, f"cu_{side}", bad)
    return c, name


@mutation()
def max_seqlen(rng, fw, device):
    c = _Call(rng, fw, device, varlen=True)
    side = _bad(rng, ["q", "k"])
    length = c.sq if side == "q" else c.sk
    setattr(c, f"max_{side}", _bad(rng, [0, -1, None, length - 1] if length > 1 else [0, -1, None]))
    return c, f"max_seqlen_{side}"


@mutation()
def not_an_array(rng, fw, device):
    c = _Call(rng, fw, device)
    name = _bad(rng, ["query", "key", "value"])
    x = getattr(c, name[0])
    if fw == "torch":
        bad = _bad(rng, [np.zeros(tuple(x.shape), np.float32), x.tolist(), None, 3.0])
    else:
        import torch
        bad = _bad(rng, [torch.zeros(tuple(x.shape)), np.asarray(x).tolist(), None, 3.0])
    setattr(c, name[0], bad)
    return c, name


@mutation("jax")
def backend(rng, fw, device):
    c = _Call(rng, fw, device)
    c.kwargs["backend"] = _bad(rng, ["cuda", "Triton", "", None, 1])
    return c, "backend"


def _blocksparse(rng, fw, device, **kwargs):
    c = _Call(rng, fw, device)
    api = __import__(f"dualattn.{fw}_api", fromlist=["blocksparse_attention"])
    bq, bk = int(rng.choice([16, 32])), int(rng.choice([16, 32]))

    def call():
        kw = dict(block_q=bq, block_k=bk)
        kw.update(kwargs)
        if fw == "jax":
            kw.setdefault("backend", str(rng.choice(["triton", "xla"])))
        if "layout" in kw and callable(kw["layout"]):
            kw["layout"] = kw["layout"](c, bq, bk)
        return api.blocksparse_attention(c.q, c.k, c.v, **kw)
    return c, call


@mutation()
def sparse_layout(rng, fw, device):
    from .. import SparseMask, masks
    r = int(rng.integers(5))
    if r == 0:   # a layout whose block counts do not fit the sizes
        c, call = _blocksparse(rng, fw, device, layout=lambda c, bq, bk: SparseMask.from_block_map(
            np.ones((1, 1, -(-c.sq // bq) + 1, -(-c.sk // bk)), bool), bq, bk))
        return call, "layout"
    if r == 1:
        c, call = _blocksparse(rng, fw, device, layout=np.ones((1, 1, 2, 2), bool))
        return call, "layout"
    if r == 2:
        c, call = _blocksparse(rng, fw, device)   # neither layout nor mask_builder
        return call, "layout"
    if r == 3:
        c, call = _blocksparse(rng, fw, device, mask_builder=masks.causal(), block_q=24)
        return (lambda: call()), "block_q"
    c, call = _blocksparse(rng, fw, device, mask_builder=masks.causal(), causal="yes")
    return call, "causal"


@mutation("torch")
def sparse_lists(rng, fw, device):
    """Hand-made SparseMask lists with an index out of range: rejected when the layout is built."""
    from .. import SparseMask
    bm = rng.random((1, 2, 3, 4)) < 0.5
    layout = SparseMask.from_block_map(bm, 16, 16)
    r = int(rng.integers(5))
    field, value = [("kv_indices", np.full_like(layout.kv_indices, 4 + int(rng.integers(0, 9)))),
                    ("kv_counts", layout.kv_counts + 5), ("q_order", np.zeros_like(layout.q_order)),
                    ("q_indices", -np.ones_like(layout.q_indices)), ("k_order", layout.k_order[..., :2])][r]
    if field == "kv_indices":
        counts = np.ones_like(layout.kv_counts)
        return (lambda: dataclasses.replace(layout, kv_indices=value, kv_counts=counts)), field
    return (lambda: dataclasses.replace(layout, **{field: value})), field


@mutation("torch")
def mask_builders(rng, fw, device):
    from .. import masks
    r = int(rng.integers(4))
    if r == 0:
        return (lambda: masks.local(_bad(rng, [None, "4", True]))), "window"
    if r == 1:
        return (lambda: masks.local(-3)), "window"
    if r == 2:
        return (lambda: masks.strided(0)), "stride"
    return (lambda: masks.global_tokens(-1)), "global_tokens"
