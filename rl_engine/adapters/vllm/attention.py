"""A vLLM attention backend that runs attention through rl_engine's ops on vLLM's paged KV cache.

* ``do_kv_cache_update`` -> ``rl_engine.ops.write_kv_cache`` (slot ``-1`` = padding, skipped).
* ``forward`` -> ``rl_engine.ops.paged_attention`` over the packed query tokens of the batch
  (prefill, chunked prefill and decode alike: the query tokens of a sequence are its last
  ``q_len`` positions of ``seq_lens``), so a token's output does not depend on how it was
  scheduled.

The KV cache is vLLM's per-layer tensor with logical shape ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` (K then V in the last dim); the backend asks for the ``LBNHC`` layout,
so ``kv_cache.transpose(1, 2).split(head_size, -1)`` gives K and V as
``[num_blocks, block_size, num_kv_heads, head_size]`` views, the layout ``paged_attention`` reads.

Supported: decoder self-attention, causal, no sliding window, no ALiBi, no soft-cap, no sinks,
unquantized KV cache (``kv_cache_dtype="auto"``). Anything else raises at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

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
        return "CPU_ATTN"

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

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


class RLEngineAttentionMetadataBuilder(AttentionMetadataBuilder[RLEngineAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

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
        b = m.num_reqs
        return RLEngineAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc[: b + 1].to(torch.int32),
            seq_lens=m.seq_lens[:b].to(torch.int32),
            block_table=m.block_table_tensor[:b].to(torch.int32),
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
        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return k_cache, v_cache

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from rl_engine.ops import write_kv_cache

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

        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = self._caches(kv_cache)
        out = paged_attention(
            query[:n],
            k_cache,
            v_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            scale=self.scale,
        )
        output[:n].copy_(out.view(output[:n].shape))
        return output


# vLLM backends this one replaces: on CPU the platform always picks CPU_ATTN; on CUDA the
# platform picks one of the others. The load-time check refuses any Attention layer whose impl
# is not RLEngineAttentionImpl, so a backend picked outside this list cannot slip through.
OVERRIDDEN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")
_PATH = f"{__name__}.RLEngineAttentionBackend"


def register_backend() -> None:
    """Point vLLM's attention-backend registry entries at :class:`RLEngineAttentionBackend`."""
    from vllm.v1.attention.backends import registry

    for name in OVERRIDDEN_BACKENDS:
        registry.register_backend(registry.AttentionBackendEnum[name], _PATH)


def unregister_backend() -> None:
    from vllm.v1.attention.backends import registry

    for name in OVERRIDDEN_BACKENDS:
        member = registry.AttentionBackendEnum[name]
        if registry._ATTN_OVERRIDES.get(member) == _PATH:
            member.clear_override()
