"""The layer's torch custom ops: the EP1 pair ``megamoe::moe_forward`` /
``megamoe::moe_backward`` (:mod:`~megamoe.custom_ops.layer`), the input encoding they
share with the expert-parallel pair (:mod:`~megamoe.custom_ops.inputs`), both pairs'
eager route (:mod:`~megamoe.custom_ops.eager_route`) and FLOP formulas
(:mod:`~megamoe.custom_ops.flop_formulas`). The EP pair itself lives in
:mod:`megamoe.ep.ops`; the user API on top is :func:`megamoe.moe`.
"""
