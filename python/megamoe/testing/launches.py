"""Which kernels read the base weights in a layer call, recorded at the native module,
and the check that an MXFP4 side-LoRA F+B ran the schedule our heuristics name for it
(:func:`~megamoe.testing.inputs.mxfp4_schedule`): a schedule that fell back to another
path would give the same values and pass every oracle gate.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

from ..wrappers import _native
from .inputs import mxfp4_schedule

#: The weight-streaming kernels by their StreamKind (the schedule's names); each takes
#: its chunk third from last (then the SM count and the stream).
STREAM_KERNELS = {
    "weight_stream_gated": "Gated",
    "weight_stream_store": "Store",
    "weight_stream_store_mn": "StoreMN",
    "weight_stream_activation_backward": "ActivationBackward",
}
#: The engine's GEMMs that may take an MXFP4 B operand: their fourth argument is its
#: scales (decoded in the pipeline) or None (a BF16 operand, such as a transient decode).
ENGINE_KERNELS = ("engine_gated", "engine_store", "engine_activation_backward")
#: The whole-tensor MXFP4 decode (the transient BF16 copy).
DECODE_KERNEL = "mxfp4_decode"

Launch = tuple[str, tuple]


@contextlib.contextmanager
def recording_weight_reads() -> Iterator[list[Launch]]:
    """Within it, every launch of the kernels above is appended to the yielded list as
    ``(name, args)`` and then runs as usual; the native module is restored on exit."""
    native = _native.native()
    launches: list[Launch] = []
    names = (*STREAM_KERNELS, *ENGINE_KERNELS, DECODE_KERNEL)
    kernels = {name: getattr(native, name) for name in names}

    def recorder(name: str):
        def record(*args):
            launches.append((name, args))
            return kernels[name](*args)

        return record

    try:
        for name in names:
            setattr(native, name, recorder(name))
        yield launches
    finally:
        for name, kernel in kernels.items():
            setattr(native, name, kernel)


def check_mxfp4_schedule(
    launches: Sequence[Launch], tokens: int, top_k: int, num_experts: int
) -> None:
    """Assert that ``launches`` (one side-LoRA F+B on a frozen MXFP4 base at EP1, from
    :func:`recording_weight_reads`) ran :func:`~megamoe.testing.inputs.mxfp4_schedule`'s
    choice: where the pool may stream, each streaming kind exactly once in its chunk and
    nothing else reading the weights; otherwise no streaming kernel, the engine on the
    packed codes where the pool decodes in the pipeline, and on a transient decode past
    it. It assumes a shape every streaming kind takes (whole tiles of each chunk, BLOCK_M
    a multiple of a narrow chunk), which the wrappers check and this does not model.

    Raises:
        AssertionError: naming the token count, the launches and the schedule.
    """
    _, chunks, pipeline, streams = mxfp4_schedule(tokens, top_k, num_experts)
    streamed = Counter(
        (STREAM_KERNELS[name], args[-3]) for name, args in launches if name in STREAM_KERNELS
    )
    on_codes = [args[3] is not None for name, args in launches if name in ENGINE_KERNELS]
    decodes = sum(name == DECODE_KERNEL for name, _ in launches)
    if streams:
        ok = streamed == Counter(chunks) and not on_codes and not decodes
    else:
        ok = not streamed and bool(on_codes) and all(x == pipeline for x in on_codes)
        ok = ok and (decodes > 0) == (not pipeline)
    if not ok:
        raise AssertionError(
            f"T={tokens}: the MXFP4 schedule names streams={streams} chunks={dict(chunks)} "
            f"in-pipeline={pipeline}; launched: streaming {dict(streamed)}, engine on the "
            f"codes {on_codes}, whole-tensor decodes {decodes}"
        )
