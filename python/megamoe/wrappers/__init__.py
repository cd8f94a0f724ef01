"""The kernel layer: one thin Python wrapper per native kernel family of ``megamoe._C``.

Each module checks its operands, allocates the outputs and launches on torch's current
stream; on CPU tensors it runs the kernel's torch twin (how the layers above are tested
without a GPU). Nothing here composes kernels into the MoE layer
(:mod:`megamoe.pipeline` does):

- :mod:`~megamoe.wrappers.routing`: the route plan (``plan_routes``, the device-side id
  check);
- :mod:`~megamoe.wrappers.pool`: pool gather, per-token side sum and combine;
- :mod:`~megamoe.wrappers.grouped_gemm`: the engine's grouped GEMMs (GEMM1 + activation,
  GEMM2, dgrad1);
- :mod:`~megamoe.wrappers.activation_backward`: dgrad2 with the activation backward as
  its epilogue;
- :mod:`~megamoe.wrappers.k_grouped_gemm`: the K-grouped weight gradients;
- :mod:`~megamoe.wrappers.token_sum`: sums over the tokens in FP32 (the shared adapter
  factors' gradients), on the same kernel kind;
- :mod:`~megamoe.wrappers.mxfp4_decode`: the MXFP4 decode op;
- :mod:`~megamoe.wrappers.registry`: the kernel variant registry (``variants.toml``),
  the BLOCK_M choices and layout constants the kernels were compiled for;
- ``_native``: access to the compiled module and DLPack/stream conventions.
"""
