"""A vLLM attention backend that runs attention through rl_engine's ops on vLLM's paged KV cache.

* ``do_kv_cache_update`` -> ``rl_engine.ops.write_kv_cache`` (slot ``-1`` = padding, skipped).
* ``forward`` -> ``rl_engine.ops.paged_attention`` over the packed query tokens of the batch
  (prefill, chunked prefill and decode alike: the query tokens of a sequence are its last
  ``q_len`` positions of ``seq_lens``), so a token's output does not depend on how it was
  scheduled.

KV cache layout (see :mod:`.compat`): vLLM 0.24 gets ``get_kv_cache_shape`` ->
``[num_blocks, 2, block_size, Hkv, D]`` (``unbind(1)`` gives K and V); vLLM 0.32 gets the
``LBNHC`` layout of the logical ``[num_blocks, Hkv, block_size, 2 * D]`` view
(``transpose(1, 2).split(D, -1)``). Either way K and V are ``[num_blocks, block_size, Hkv, D]``
views with a unit stride on ``D``: the layout ``paged_attention`` reads.

CUDA graphs: the builder declares ``AttentionCGSupport.UNIFORM_BATCH``, so vLLM captures FULL
graphs of decode batches (and of uniform spec-decode batches) and PIECEWISE graphs around
attention for mixed batches. What makes that safe:

* ``build`` keeps vLLM's persistent buffers (``query_start_loc``, ``seq_lens``, the block table,
  ``slot_mapping``): slices, never copies, so a replayed graph reads the current step's
  metadata. A non-int32 buffer on CUDA is refused (a conversion would be a fresh tensor).
* ``forward`` and ``do_kv_cache_update`` never read device data on the host: the grid of the
  Triton kernels is a function of the tensor shapes (padded token count, padded request count).
* Padding: vLLM pads a graph batch with requests of zero query tokens and zero length
  (``query_start_loc`` repeats its last offset, ``seq_lens`` is 0, block-table rows point at the
  null block) and padding tokens carry slot ``-1``. The kernel gives such requests no rows and
  leaves tokens after ``query_start_loc[B]`` at zero; ``write_kv_cache`` skips slot ``-1``, so
  padding never touches the cache.

Supported: decoder self-attention, causal, no sliding window, no ALiBi, no soft-cap, no sinks,
unquantized KV cache (``kv_cache_dtype="auto"``), no KV sharing between layers. Anything else
raises at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rl_engine.adapters.vllm import compat

_api = compat.attention_api()
AttentionBackend = _api.AttentionBackend
AttentionCGSupport = _api.AttentionCGSupport
AttentionImpl = _api.AttentionImpl
AttentionMetadataBuilder = _api.AttentionMetadataBuilder
AttentionType = _api.AttentionType
CommonAttentionMetadata = _api.CommonAttentionMetadata
MultipleOf = _api.MultipleOf
_FAMILY = compat.api_family()

__all__ = [
    "RLEngineAttentionBackend",
    "RLEngineAttentionImpl",
    "RLEngineAttentionMetadata",
    "RLEngineAttentionMetadataBuilder",
]


class RLEngineAttentionBackend(AttentionBackend):
    """Attention through ``rl_engine.ops.write_kv_cache`` + ``rl_engine.ops.paged_attention``."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_name() -> str:
        return compat.platform_backend_name()

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 16 == 0 and 16 <= head_size <= 256  # the Triton provider's range

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    if _FAMILY == "kvlayout":  # vLLM 0.32: the backend lists the physical layouts it reads

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (compat.kv_cache_layout_enum().LBNHC,)

    else:  # vLLM 0.24: the backend gives the logical shape and its stride order

        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            return compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
            # Allocated as the logical shape, contiguous per layer. No cross-layer layout: vLLM
            # then keeps one tensor per layer and pads no pages.
            if include_num_layers_dimension:
                raise NotImplementedError("rl_engine attention: no cross-layer KV cache layout")
            return (0, 1, 2, 3, 4)

    @staticmethod
    def get_impl_cls() -> type[RLEngineAttentionImpl]:
        return RLEngineAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RLEngineAttentionMetadataBuilder]:
        return RLEngineAttentionMetadataBuilder


@dataclass
class RLEngineAttentionMetadata:
    """What ``paged_attention`` needs (all int32, on the KV cache's device)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]


def _persistent_int32(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when int32 (a view of vLLM's persistent buffer); CPU tensors are converted,
    CUDA ones refused (a converted copy would be a new tensor that CUDA graphs do not see)."""
    if t.dtype == torch.int32:
        return t
    if t.device.type == "cpu":
        return t.to(torch.int32)
    raise TypeError(
        f"rl_engine attention: vLLM passed {name} as {t.dtype}; the backend reads vLLM's int32 "
        "buffers in place (CUDA graphs replay their addresses) and does not convert them"
    )


class RLEngineAttentionMetadataBuilder(AttentionMetadataBuilder[RLEngineAttentionMetadata]):
    # FULL graphs for decode / uniform batches (see the module docstring); mixed batches run in
    # PIECEWISE graphs (attention between the captured pieces).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> RLEngineAttentionMetadata:
        m = common_attn_metadata
        if not (isinstance(m.causal, bool) and m.causal):
            raise NotImplementedError("rl_engine attention: only causal attention is routed")
        b = m.num_reqs  # padded request count under CUDA graphs (padding: q_len 0, len 0)
        return RLEngineAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=_persistent_int32("query_start_loc", m.query_start_loc[: b + 1]),
            seq_lens=_persistent_int32("seq_lens", m.seq_lens[:b]),
            block_table=_persistent_int32("block_table", m.block_table_tensor[:b]),
            slot_mapping=m.slot_mapping,
        )


class RLEngineAttentionImpl(AttentionImpl[RLEngineAttentionMetadata]):
    """Decoder self-attention through rl_engine's paged attention op."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append(f"sliding window {sliding_window}")
        if logits_soft_cap:
            unsupported.append(f"logits soft-cap {logits_soft_cap}")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        if sinks is not None:
            unsupported.append("attention sinks")
        if kv_sharing_target_layer_name is not None:
            unsupported.append(f"KV sharing with {kv_sharing_target_layer_name}")
        if unsupported:
            raise NotImplementedError(
                "rl_engine attention backend does not route: " + ", ".join(unsupported)
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return compat.split_kv_cache(kv_cache, self.head_size)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from rl_engine.ops import write_kv_cache

        # slot_mapping covers the (padded) tokens of the step, padding = -1 (skipped).
        n = slot_mapping.shape[0]
        k_cache, v_cache = self._caches(kv_cache)
        write_kv_cache(key[:n], value[:n], k_cache, v_cache, slot_mapping)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RLEngineAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("rl_engine attention: fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        from rl_engine.ops import paged_attention

        n = attn_metadata.num_actual_tokens  # a host int (the padded count in a FULL graph)
        k_cache, v_cache = self._caches(kv_cache)
        # written straight into vLLM's output buffer (no intermediate tensor and copy);
        # padding rows after query_start_loc[-1] are left as vLLM's own backends leave them
        paged_attention(
            query[:n],
            k_cache,
            v_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            scale=self.scale,
            out=output[:n].view(n, self.num_heads, self.head_size),
        )
        return output


_PATH = f"{__name__}.RLEngineAttentionBackend"


def register_backend() -> None:
    """Point vLLM's attention-backend registry entries (:data:`compat.OVERRIDDEN_BACKENDS` that
    this vLLM has) at :class:`RLEngineAttentionBackend`."""
    registry = compat.backend_registry()
    for member in compat.overridable_backends():
        registry.register_backend(member, _PATH)
    compat.clear_backend_cache()


def unregister_backend() -> None:
    for member in compat.overridable_backends():
        if compat.backend_override(member) == _PATH:
            member.clear_override()
    compat.clear_backend_cache()
