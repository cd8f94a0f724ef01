"""Shared-outer side-LoRA adapters (DESIGN §1).

The outer factors are shared by all experts (``a1``, ``a3`` shrink the token once;
``b2`` expands the combined token once); the inner factors are expert-local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validation.arguments import check_finite_float, check_tensor

#: Adapter ranks the kernels support: multiples of 16 (the wgmma K step) up to 256.
SIDE_RANK_MULTIPLE = 16
SIDE_RANK_MAX = 256


def check_side_rank(name: str, rank: int, *, zero: str | None = None) -> None:
    """``ValueError`` naming ``name`` unless ``rank`` is a multiple of
    ``SIDE_RANK_MULTIPLE`` in ``[SIDE_RANK_MULTIPLE, SIDE_RANK_MAX]``, or 0 where ``zero``
    says what 0 stands for (e.g. ``"0 (no adapters)"``). ``rank`` is an int, checked."""
    if rank == 0 and zero is not None:
        return
    if rank % SIDE_RANK_MULTIPLE or not SIDE_RANK_MULTIPLE <= rank <= SIDE_RANK_MAX:
        allowed = f"a multiple of {SIDE_RANK_MULTIPLE} in [{SIDE_RANK_MULTIPLE}, {SIDE_RANK_MAX}]"
        expected = allowed if zero is None else f"{zero} or {allowed}"
        raise ValueError(f"{name}: expected {expected}, got {rank}")


#: The six adapter tensors by name, in the order of :meth:`SideLoRA.tensors`.
SIDE_NAMES = ("a1", "b1", "a3", "b3", "a2", "b2")

_ADAPTER_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class SideLoRA:
    """Side-LoRA adapter tensors, used as given on every call.

    Shapes (``H`` hidden, ``I`` intermediate, ``E_l`` local experts, ``r`` rank):

    - ``a1``, ``a3``: ``[H, r]`` shared shrink factors for the gate and up paths.
    - ``b1``, ``b3``: ``[E_l, r, I]`` expert-local expand factors.
    - ``a2``: ``[E_l, I, r]`` expert-local shrink factor of the down path.
    - ``b2``: ``[r, H]`` shared expand factor of the down path.
    - ``scale``: the adapter scale ``s`` (a Python float).

    All six tensors share one dtype (bfloat16 for the fused kernels; float32/float64
    are accepted for the reference) and one device. They may be ``nn.Parameter``s.
    """

    a1: torch.Tensor
    b1: torch.Tensor
    a3: torch.Tensor
    b3: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    scale: float = 1.0

    def __post_init__(self) -> None:
        a1 = check_tensor("side.a1", self.a1, ndim=2, dtypes=_ADAPTER_DTYPES)
        hidden, rank = a1.shape
        b1 = check_tensor("side.b1", self.b1, ndim=3, dtypes=_ADAPTER_DTYPES)
        experts, _, intermediate = b1.shape
        check_tensor("side.b1", b1, shape=(experts, rank, intermediate))
        check_tensor("side.a3", self.a3, shape=(hidden, rank), dtypes=_ADAPTER_DTYPES)
        check_tensor(
            "side.b3", self.b3, shape=(experts, rank, intermediate), dtypes=_ADAPTER_DTYPES
        )
        check_tensor(
            "side.a2", self.a2, shape=(experts, intermediate, rank), dtypes=_ADAPTER_DTYPES
        )
        check_tensor("side.b2", self.b2, shape=(rank, hidden), dtypes=_ADAPTER_DTYPES)
        for name in ("b1", "a3", "b3", "a2", "b2"):
            t = getattr(self, name)
            if t.dtype != a1.dtype:
                raise TypeError(
                    f"side.{name}: expected dtype {a1.dtype} like side.a1, got {t.dtype}"
                )
            if t.device != a1.device:
                raise ValueError(
                    f"side.{name}: expected device {a1.device} like side.a1, got {t.device}"
                )
        if rank % SIDE_RANK_MULTIPLE != 0 or not SIDE_RANK_MULTIPLE <= rank <= SIDE_RANK_MAX:
            raise ValueError(
                f"side.a1: rank must be a multiple of {SIDE_RANK_MULTIPLE} in "
                f"[{SIDE_RANK_MULTIPLE}, {SIDE_RANK_MAX}], got {rank}"
            )
        scale = check_finite_float("side.scale", self.scale, float32=True)  # a float32 in kernels
        object.__setattr__(self, "scale", scale)

    @property
    def rank(self) -> int:
        return self.a1.shape[1]

    @property
    def hidden(self) -> int:
        return self.a1.shape[0]

    @property
    def intermediate(self) -> int:
        return self.b1.shape[2]

    @property
    def num_experts(self) -> int:
        return self.b1.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.a1.dtype

    @property
    def device(self) -> torch.device:
        return self.a1.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The six tensors in the order ``(a1, b1, a3, b3, a2, b2)``."""
        return (self.a1, self.b1, self.a3, self.b3, self.a2, self.b2)
