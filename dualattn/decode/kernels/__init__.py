"""The decode kernels: @triton.jit sources only (imports triton, never torch or jax).

decode_attend   split-KV attention of a few query rows over a dense or paged KV cache
decode_combine  the fp32 log-sum-exp merge of the splits' partial results
decode_append   new k / v rows written into the cache (rotary on k), rotary on q
decode_rows     what they share: the sequence bounds and a cache row's address

The launch plans (decode/plan.py) name these modules as submodules of `dualattn.kernels`, into whose
package path, and its interpreted copy's (kernels/_interpret.py), plan.py adds this folder: the torch
and JAX launchers then find the compiled and the interpreted kernel as they find flash's.
"""
