"""Pure-PyTorch references: one definition of each op's semantics, shared by the eager model (`dsv41.model`), the
Triton kernels' CPU references (`dsv41.kernels`) and the passes' probe checks (`dsv41.passes`).

- `formats`: E2M1 / E4M3 / UE8M0 codes, block-FP8 and FP4 weights, FP8 / FP4 activations and caches.
- `rope`, `norm`, `topk`: RoPE, RMSNorm, top-k with the lower-index tie rule and the candidate pool.
- `mhc`, `engram`: mHC mixes / collapse / expand; Engram row ids and gate.
- `gemv`, `rope_fp4`, `c2_compressor`, `indexer`, `moe`, `sparse_attention`: the fused ops' semantics.

Never-rules (tests/test_layers.py): this package imports torch and itself only. Functions here do not check
their arguments beyond what the math needs; the kernels' `reference_*` functions check them and then call these.
The package `__init__` imports nothing, so importing one module does not load the rest.
"""
