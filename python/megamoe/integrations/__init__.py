"""Optional integrations with training frameworks (never imported by the core).

- :mod:`megamoe.integrations.transformers`: an HF transformers experts implementation
  (``from_pretrained(..., experts_implementation="megamoe_fused")``) and side-LoRA
  adapters for HF models that save and load as PEFT-format files. Needs the
  ``megamoe[hf]`` extra (``transformers``, ``peft``, ``safetensors``).
- :mod:`megamoe.integrations.torchtitan`: a torchtitan model converter that swaps its
  MoE experts for megamoe. Needs the ``megamoe[titan]`` extra (``torchtitan``).

Each submodule imports its framework when it is imported itself; ``import megamoe``
never does.
"""
