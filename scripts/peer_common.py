"""Shared by the peer benchmarks (scripts/peer_bench.py, scripts/peer_step.py).

fla refuses its gated chunk backward (chunk_bwd_dqkwg) on Hopper with Triton 3.4 .. 3.7.0, its issue #640 (wrong
gradients there): a guard in fla/ops/common/chunk_o.py raises on the first backward. It reads the module global
TRITON_ABOVE_3_7_1 at call time, so setting that global to True lifts the guard for every caller, transformers'
Qwen3.5 Gated DeltaNet layers included, whenever it is set before the first backward. For timing only: the gradients
it then computes are the ones #640 says are wrong.
"""


def bypass_fla_640():
    """Lifts fla's #640 guard (timing only). Returns False when this fla has no such guard (nothing to lift)."""
    import fla.ops.common.chunk_o as chunk_o

    if not hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True  # the #640 guard, lifted for timing only
    return True
