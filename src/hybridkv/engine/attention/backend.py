"""What an attention backend is: the interface every backend implements.

A step's attention runs in three parts. The runner builds one
:class:`~hybridkv.engine.attention.metadata.AttentionMetadata` per step (the fields every
backend reads: positions, per-sequence starts and lengths, block tables, slot mappings) and
the backend it names makes its own typed step state with :meth:`AttentionBackend.new_state`
(plans, splits, layouts: whatever it computes once per step and reuses in every layer). Each
attention layer then calls :func:`~hybridkv.engine.attention.layer.paged_attention`, which
hands the layer's tensors to :meth:`AttentionBackend.forward`. A model never names a backend.

Capabilities a backend may declare (class attributes): ``decode_stack`` (the model may run a
decode step's layers in one fused CPU call, :mod:`~hybridkv.engine.attention.cpu_stack`) and
``decode_graphs`` (decode steps may be captured as CUDA graphs,
:mod:`~hybridkv.engine.attention.decode_graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from hybridkv.engine.attention.metadata import AttentionMetadata
    from hybridkv.engine.attention.types import AttentionType

__all__ = ["AttentionBackend"]


class AttentionBackend:
    """One way to compute paged attention. Subclasses set :attr:`name` and implement :meth:`forward`;
    register them in :mod:`~hybridkv.engine.attention.registry`."""

    #: the name configs and the registry use
    name: ClassVar[str] = ""
    #: the model may run a whole decode step's layers in one fused CPU call on this backend
    decode_stack: ClassVar[bool] = False
    #: decode steps may be captured and replayed as CUDA graphs on this backend
    decode_graphs: ClassVar[bool] = False

    def unavailable(self, device_type: str) -> str | None:
        """Why this backend cannot run on ``device_type`` ("cpu", "cuda"), or None when it can."""
        return None

    def new_state(self, meta: "AttentionMetadata") -> Any:
        """This backend's step state for ``meta`` (built once per step, before any layer runs;
        keep it cheap: fill it lazily). None when the backend keeps none."""
        return None

    def forward(
        self,
        query: "torch.Tensor",
        key: "torch.Tensor",
        value: "torch.Tensor",
        meta: "AttentionMetadata",
        layer: int,
        attn: "AttentionType",
        scale: float,
        sinks: "torch.Tensor | None" = None,
        softcap: float | None = None,
        keep: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        """Write this step's K/V of ``layer`` (its group's slots), then attend through its block tables.

        query: [T, Hq, D]; key / value: [T, Hkv, D] (any strides with a unit last dim); sinks:
        [Hq] learned logits that join the softmax denominator (GPT-OSS); softcap: ``tanh(s / c) *
        c`` on the scores; keep: ``meta.output_rows()``, attend only from those rows (the K/V of
        all T tokens are still written). Returns [T, Hq, D] ([N, Hq, D] with ``keep``). The step
        state is ``meta.state``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"
