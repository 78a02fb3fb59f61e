"""Weight bytes one DSpark round reads on `h200` with random routing (the estimate of bench/results/2026-12-01_h200_s15/README.md, CPU only).

Verify: the plain decode step's bytes with the routed experts scaled by the expected number of distinct experts
that M = 6 rows with independent uniform top-k routing select (E[distinct] = n (1 - (1 - k/n)^M)). Draft: the
three stages' attention, shared experts and `main_proj`, their routed experts over the block of 5 the same way,
the LM head once for the 5 base-logit rows, and the Markov head W2 read once per sequential position.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # dsv41 from this checkout
from dsv41.model.budget import budget
from dsv41.model.config import ModelConfig

c = ModelConfig.preset("h200")
comp = {k: v for k, v in budget(c).to_dict()["components"].items()}


def gb(name, col):
    return comp[name][col] / 1e9


def distinct(n, k, m):
    return n * (1 - (1 - k / n) ** m)


m = c.dspark_block_size + 1
plain = sum(v["decode_bytes"] for v in comp.values()) / 1e9
routed = gb("routed_experts", "decode_bytes")
scale = distinct(c.n_routed_experts, c.num_experts_per_tok, m) / c.num_experts_per_tok
verify = plain - routed + routed * scale
d_scale = distinct(c.dspark_n_routed_experts, c.dspark_num_experts_per_tok, c.dspark_block_size) / c.dspark_n_routed_experts
w2 = c.vocab_size * c.dspark_markov_rank * 2 / 1e9
draft = (gb("dspark.attention", "bytes") + gb("dspark.shared_experts", "bytes")
         + gb("dspark.main_proj", "bytes") + gb("dspark.routed_experts", "bytes") * d_scale
         + gb("lm_head", "bytes") + c.dspark_block_size * w2)
print(f"plain step {plain:.2f} GB; verify (M={m}) {verify:.2f} GB (routed x{scale:.2f}); draft {draft:.2f} GB; "
      f"round {verify + draft:.2f} GB")
