"""The layer pipeline: the fused MoE forward and backward built from the kernel
wrappers (:mod:`megamoe.wrappers`), DESIGN §3.

- :mod:`~megamoe.pipeline.fused_forward`: route plan -> gather -> GEMM1 -> GEMM2 ->
  combine, and what it saves for the backward (:class:`~megamoe.pipeline.
  fused_forward.ForwardState`);
- :mod:`~megamoe.pipeline.fused_backward`: the backward, whose expert stage
  (``pool_backward``) the expert-parallel layer (:mod:`megamoe.ep`) shares.

The torch custom ops that run them are :mod:`megamoe.custom_ops` (EP1) and
:mod:`megamoe.ep.ops`; the user API on top (``mm.moe``, ``MegaMoE``) sits at the
package's top level.
"""
