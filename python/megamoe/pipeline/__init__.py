"""The layer pipeline: the fused MoE forward and backward built from the kernel
wrappers (:mod:`megamoe.wrappers`), DESIGN §3.

- :mod:`~megamoe.pipeline.fused_forward`: route plan -> gather -> GEMM1 -> GEMM2 ->
  combine, and what it saves for the backward (:class:`~megamoe.pipeline.
  fused_forward.ForwardState`);
- :mod:`~megamoe.pipeline.fused_backward`: the backward, whose expert stage
  (``pool_backward``) the expert-parallel layer (:mod:`megamoe.ep`) shares.

The user API on top of them (``mm.moe``, its custom ops, ``MegaMoE``) sits at the
package's top level.
"""
