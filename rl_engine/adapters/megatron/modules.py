"""Megatron-core modules whose numerics run on rl_engine ops.

Every module keeps the constructor of the Megatron module it stands in for (so a layer spec can
name it and :func:`~rl_engine.adapters.megatron.replace_modules` can swap it in place), and
changes only what is computed:

* :class:`RLColumnParallelLinear` / :class:`RLRowParallelLinear`: ``det_gemm(x, W.t(), bias)``
  on the local shard. Column parallel's forward needs no reduction (each output column is
  computed in full on one rank); row parallel's forward and column parallel's input gradient
  reduce over the sharded dimension with the TP-invariant reduction of
  :mod:`rl_engine.ops.det_gemm.tp` (a fixed tree of 8 groups whose subtrees are the rank shards;
  fp32 subtrees all-gathered, never an all-reduce sum): the TP = 1 bits at TP 2, 4 and 8 when
  TP = 1 runs it too (``RL_ENGINE_TP_GROUPS=8``).
* :class:`RLRMSNorm`: ``rms_norm(x, weight, eps)`` (the residual add happens in the transformer
  layer's bias-dropout-add, in the model dtype, exactly like the fused ``rms_norm(x, w, eps,
  residual)`` of the rollout engine). With the TP-invariant reductions on, the token-row norms'
  weight gradient is :mod:`rl_engine.ops.rms_norm.tp`'s row-grouped one (sequence-parallel
  blocks exchanged as fp32 subtrees), equal on every rank and at every degree, and the weight is
  then not marked ``sequence_parallel`` (no finalize all-reduce).
* :class:`RLMLP`: fc1 (``[gate; up]`` rows, Megatron's gated layout) then ``silu_and_mul``.
* :class:`RLCoreAttention`: RoPE (``rl_engine.ops.rope`` on q and k, positions from the layout:
  0..s-1 per sequence in the padded ``sbhd`` layout, restarting at every ``cu_seqlens`` boundary
  in the packed ``thd`` layout, which is what Megatron's own RoPE does) and then
  ``rl_engine.ops.attention`` (causal, varlen).
* :class:`RLSelfAttention`: Megatron's ``SelfAttention`` with its own RoPE switched off (the core
  attention applies rl_engine's).
* :func:`rl_bias_dropout_add`: ``x + residual`` in the model dtype; refuses biases and dropout.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from rl_engine import ops
from rl_engine.ops.det_gemm import tp as tpm
from rl_engine.ops.rms_norm.tp import rms_norm_heads_tp, rms_norm_tp

__all__ = [
    "RLColumnParallelLinear",
    "RLCoreAttention",
    "RLMLP",
    "RLRMSNorm",
    "RLRowParallelLinear",
    "RLSelfAttention",
    "RopeSettings",
    "rl_bias_dropout_add",
]


class UnsupportedNumericsError(NotImplementedError):
    """A Megatron feature whose numerics the rl_engine spec does not reproduce."""


class UnsupportedModelError(UnsupportedNumericsError):
    """A checkpoint's model family the Megatron loader does not build (the message names the
    supported ones)."""


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``det_gemm`` over the last dim of ``x`` [..., K] with an ``nn.Linear``-layout weight [N, K].

    An ``[s, b, K]`` input that is a transposed view of a contiguous ``[b, s, K]`` tensor (the
    core attention's output, :class:`RLCoreAttention`) is multiplied in its memory order, without
    the copy ``reshape`` would make (the copy autograd would keep for the weight gradient, next to
    the attention's own saved output: one [tokens, heads x head dim] tensor a layer). The result
    is the matching ``[s, b, N]`` view. ``det_gemm`` is row invariant, so every output row has the
    bits it has in ``[s, b]`` order; the weight gradient sums the rows in ``[b, s]`` order."""
    shape = x.shape
    if x.dim() == 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous():
        y = ops.det_gemm(x.transpose(0, 1).reshape(-1, shape[-1]), weight.t(), bias)
        return y.view(shape[1], shape[0], weight.shape[0]).transpose(0, 1)
    y = ops.det_gemm(x.reshape(-1, shape[-1]), weight.t(), bias)
    return y.view(*shape[:-1], weight.shape[0])


def _tp_size(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _refuse(cond: bool, what: str) -> None:
    if cond:
        raise UnsupportedNumericsError(f"rl_engine Megatron spec: {what} is not supported")


def _check_linear(layer: Any) -> None:
    # sequence parallelism: only with the TP-invariant reduction (its reduce-scatter), checked
    # in the forward
    _refuse(getattr(layer, "explicit_expert_comm", False), "expert-parallel linear layers")
    _refuse(
        bool(getattr(layer.config, "defer_embedding_wgrad_compute", False)),
        "defer_embedding_wgrad_compute",
    )


class RLColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` computing ``det_gemm(x, W_shard.t(), bias_shard)``.

    Shapes: input [s, b, in] (or [t, in]), output [s, b, out / tp] (gathered to ``out`` when
    ``gather_output``). Returns ``(output, bias)`` like Megatron (bias only when
    ``skip_bias_add``).
    """

    def forward(  # type: ignore[override]
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check_linear(self)
        if weight is None:
            weight = self.weight
        if weight is None:
            raise RuntimeError("RLColumnParallelLinear: no weight (skip_weight_param_allocation)")
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected}")
        bias = self.bias if not self.skip_bias_add else None
        tp = _tp_size(self.tp_group)
        groups = tpm.groups_for(tp)
        if groups is None:
            _plain_or_refuse_sp(self)
            out = _linear(input_, weight, bias)
        else:  # forward per column (exact); backward dx: the TP-invariant N reduction
            glu = bool(getattr(self, "rl_engine_glu", False))
            n_full = weight.shape[0] * tp
            out = _tp_linear(self, input_, weight, bias, "column", tp, groups, n_full, glu)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and tp > 1:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


def _tp_linear(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias, parallel: str, tp: int,
               groups: int, full_size: int, glu: bool = False) -> torch.Tensor:  # fmt: skip
    """A TP layer's shard through :func:`rl_engine.ops.det_gemm.tp.tp_linear` ([..., K] input;
    with sequence parallelism the first dim of ``x`` / the output is this rank's block)."""
    sp = bool(getattr(layer, "sequence_parallel", False)) and tp > 1
    shape = x.shape
    y = tpm.tp_linear(
        x.reshape(-1, shape[-1]),
        weight,
        bias,
        parallel=parallel,
        exchange=tpm.Exchange.over(layer.tp_group) if tp > 1 else None,
        tp=tp,
        full_size=full_size,
        groups=groups,
        glu=glu,
        sequence_parallel=sp,
    )
    lead = list(shape[:-1])
    if sp:  # column: the gathered rows; row: this rank's block of rows
        lead[0] = lead[0] * tp if parallel == "column" else lead[0] // tp
    return y.view(*lead, y.shape[-1])


def _plain_or_refuse_sp(layer: Any) -> None:
    _refuse(
        bool(getattr(layer, "sequence_parallel", False)),
        "sequence parallelism with the plain reduction (RL_ENGINE_TP_GROUPS=0, or TP = 1)",
    )


class RLRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` computing ``det_gemm(x_shard, W_shard.t())`` per rank.

    With the TP-invariant reduction (always at TP > 1; at TP = 1 when ``RL_ENGINE_TP_GROUPS`` is
    set) the K reduction is :mod:`rl_engine.ops.det_gemm.tp`'s: each rank's subtree of the
    fixed group tree, the fp32 subtrees all-gathered and combined in tree order (never an
    all-reduce sum), then the bias: the TP = 1 bits at every degree. Otherwise
    ``det_gemm(x, W.t(), bias)`` with the bias fused.
    """

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        _check_linear(self)
        tp = _tp_size(self.tp_group)
        _refuse(tp > 1 and not self.input_is_parallel, "RowParallelLinear(input_is_parallel=False)")
        groups = tpm.groups_for(tp)
        bias = self.bias if not self.skip_bias_add else None
        if groups is None:  # TP = 1, plain det_gemm (the bias fused, as the rollout does)
            _plain_or_refuse_sp(self)
            out = _linear(input_, self.weight, bias)
        else:
            out = _tp_linear(self, input_, self.weight, bias, "row", tp, groups, self.input_size)
        return out, (self.bias if self.skip_bias_add else None)


class RLRMSNorm(torch.nn.Module):
    """RMSNorm through ``rl_engine.ops.rms_norm`` (Megatron norm constructor signature).

    Args:
        config: the Megatron ``TransformerConfig``.
        hidden_size: normalised size H (hidden size, or head dim for q/k norms).
        eps: epsilon.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        _refuse(
            bool(getattr(config, "layernorm_zero_centered_gamma", False)), "zero-centered gamma"
        )
        _refuse(getattr(config, "normalization", "RMSNorm") != "RMSNorm", "LayerNorm")
        self.config = config
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        self._bind_weight()

    @classmethod
    def wrapping(cls, config: Any, weight: torch.nn.Parameter, eps: float) -> RLRMSNorm:
        """An ``RLRMSNorm`` holding an existing norm's ``weight`` (``replace_modules``)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.config, new.eps, new.weight = config, float(eps), weight
        new._bind_weight()
        return new

    def _bind_weight(self) -> None:
        # the token-row norms (hidden size; the q / k head norms' rows are (token, head) pairs,
        # see forward): with the TP-invariant reductions on, their weight gradient is the
        # row-grouped one (rl_engine.ops.rms_norm.tp), complete and equal on every rank, so
        # Megatron's finalize step must not all-reduce it again: not marked sequence_parallel
        sp = bool(getattr(self.config, "sequence_parallel", False))
        self._token_rows = self.weight.shape[-1] == getattr(self.config, "hidden_size", None)
        self._grouped = self._token_rows and tpm.groups_for(_config_tp(self.config)) is not None
        self.weight.sequence_parallel = sp and not self._grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] in x.dtype."""
        tp = _config_tp(self.config)
        groups = tpm.groups_for(tp)
        if not self._token_rows:  # q / k head norms: [..., heads of this rank, D]
            if groups is None:
                return ops.rms_norm(x, self.weight, self.eps)
            # Megatron's finalize step adds the TP ranks' gradients of q/k_layernorm (by name):
            # rank 0 holds the whole TP-invariant gradient, the others zeros (exact in any order)
            exchange = tpm.Exchange.over(_tp_group()) if tp > 1 else None
            return rms_norm_heads_tp(x, self.weight, self.eps, exchange=exchange, sole=True)
        if (groups is not None) != self._grouped:
            raise RuntimeError(
                "RLRMSNorm: RL_ENGINE_TP_GROUPS changed after the model was built (the norm "
                "weights' sequence_parallel marks follow it); rebuild the model"
            )
        if groups is None:
            return ops.rms_norm(x, self.weight, self.eps)
        sp = bool(getattr(self.config, "sequence_parallel", False)) and tp > 1
        exchange = tpm.Exchange.over(_tp_group()) if sp else None
        return rms_norm_tp(x, self.weight, self.eps, groups=groups, exchange=exchange)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _config_tp(config: Any) -> int:
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _init_device(config: Any) -> torch.device:
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class RLMLP(MLP):
    """Gated MLP: ``fc2(silu_and_mul(fc1(x)))`` with fc1 rows ``[gate; up]`` (Megatron layout)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):  # type: ignore[override]
        _refuse(per_token_scale is not None, "MoE per-token scales")
        _refuse(not self.config.gated_linear_unit, "non-gated MLP")
        _refuse(
            self.config.activation_func is not torch.nn.functional.silu,
            "an activation other than SiLU",
        )
        # fc1's rows are [gate; up] (per rank [gate_r; up_r]): the TP-invariant backward groups
        # gate and up blocks together
        self.linear_fc1.rl_engine_glu = True
        h, bias = self.linear_fc1(hidden_states)
        _refuse(bias is not None, "an MLP fc1 bias")
        act = ops.silu_and_mul(h)
        return self.linear_fc2(act)


class RopeSettings:
    """RoPE parameters of a model (what ``rl_engine.ops.rope`` needs besides positions).

    Args:
        theta: base.
        rotary_dim: rotated dims per head (``None`` = head dim).
        is_neox: rotate-half layout (Llama / Qwen); ``False`` = GPT-J interleaved pairs.
        scaling: ``None`` or a Hugging Face ``rope_scaling``-style dict.
    """

    def __init__(
        self,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        is_neox: bool = True,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        self.theta = float(theta)
        self.rotary_dim = rotary_dim
        self.is_neox = bool(is_neox)
        self.scaling = dict(scaling) if scaling else None

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D], positions [T] -> rotated x."""
        return ops.rope(
            x,
            positions,
            theta=self.theta,
            rotary_dim=self.rotary_dim,
            is_neox=self.is_neox,
            scaling=self.scaling,
        )

    def __repr__(self) -> str:
        return (
            f"RopeSettings(theta={self.theta}, rotary_dim={self.rotary_dim}, "
            f"is_neox={self.is_neox}, scaling={self.scaling})"
        )


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Token positions [total] restarting at 0 at every ``cu_seqlens`` boundary."""
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=total)
    return torch.arange(total, device=cu.device) - starts


def _is_causal_mask(mask: torch.Tensor, sq: int) -> bool:
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=mask.device), diagonal=1)
    return mask.dtype == torch.bool and bool((mask == causal).all())


class RLCoreAttention(MegatronModule):
    """Core attention: rl_engine RoPE on q/k, then ``rl_engine.ops.attention`` (causal).

    Constructor as Megatron's ``DotProductAttention`` plus ``rope`` (a :class:`RopeSettings`, or
    ``None`` for no rotary embedding).

    Forward inputs: sbhd q [sq, b, np, hn], k/v [sq, b, ng, hn] (padded batch: every column of
    ``b`` is one sequence of length sq) or thd q [t, np, hn], k/v [t, ng, hn] with
    ``packed_seq_params.cu_seqlens_q``. Output [sq, b, np * hn] or [t, np * hn].
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rope: RopeSettings | None = None,
    ) -> None:
        super().__init__(config=config)
        _refuse(config.context_parallel_size != 1, "context parallelism")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.rope = rope
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_dropout_p = float(dropout)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        _refuse(attention_bias is not None, "attention_bias")
        _refuse(self.training and self.attention_dropout_p > 0, "attention dropout")
        mask_name = getattr(attn_mask_type or self.attn_mask_type, "name", "causal")
        _refuse(mask_name not in ("causal", "padding_causal"), f"attention mask type {mask_name}")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            _refuse(
                packed_seq_params.cu_seqlens_q_padded is not None
                and not torch.equal(
                    packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q
                ),
                "padded cu_seqlens (context-parallel padding)",
            )
            _refuse(
                packed_seq_params.cu_seqlens_kv is not None
                and not torch.equal(
                    packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_q
                ),
                "cu_seqlens_kv different from cu_seqlens_q",
            )
            t = query.shape[0]
            cu = packed_seq_params.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
            q, k, v = query, key, value
            positions = positions_from_cu_seqlens(cu, t)
            out_shape: tuple[int, ...] = (t, -1)
            sbhd = None
        else:
            sq, b = query.shape[0], query.shape[1]
            if attention_mask is not None and not _is_causal_mask(
                attention_mask.reshape(-1, *attention_mask.shape[-2:])[0], sq
            ):
                raise UnsupportedNumericsError(
                    "rl_engine Megatron spec: only causal attention is supported in the padded "
                    "layout (right padding is causal-safe; use packed sequences otherwise)"
                )
            q, k, v = (x.transpose(0, 1).reshape(b * sq, *x.shape[2:]) for x in (query, key, value))
            cu = torch.arange(b + 1, device=query.device, dtype=torch.int32) * sq
            positions = torch.arange(sq, device=query.device).repeat(b)
            out_shape = (b, sq, -1)
            sbhd = (sq, b)
        if self.rope is not None:
            q = self.rope.apply(q, positions)
            k = self.rope.apply(k, positions)
        out = ops.attention(q, k, v, cu, scale=self.softmax_scale, causal=True)
        out = out.reshape(*out_shape)
        if sbhd is not None:  # [s, b, h] as a view: the output projection takes it uncopied
            out = out.transpose(0, 1)
        return out


class RLSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` with Megatron's RoPE switched off (the core attention applies
    rl_engine's RoPE) and no inference (KV-cache) path."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):  # type: ignore[override]
        if (
            kwargs.get("inference_context") is not None
            or kwargs.get("inference_params") is not None
        ):
            raise UnsupportedNumericsError(
                "rl_engine Megatron spec: the inference (KV-cache) path is not supported; the "
                "trainer adapter computes teacher-forced log-probs"
            )
        _refuse(bool(args), "positional arguments after attention_mask")
        _refuse(kwargs.get("key_value_states") is not None, "cross attention")
        _refuse(getattr(self.config, "attention_output_gate", False), "attention output gate")
        for name in ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin"):
            _refuse(kwargs.get(name) is not None, name)
        kwargs["rotary_pos_emb"] = None
        return super().forward(hidden_states, attention_mask, **kwargs)


def rl_bias_dropout_add(training: bool, fused: bool):
    """Megatron's ``get_bias_dropout_add`` replacement: ``x + residual`` in the model dtype.

    Refuses a bias (would be added in a different place than the rollout adds it) and a
    non-zero dropout probability.
    """

    def _bda(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        _refuse(bias is not None, "a bias in the bias-dropout-add (skip_bias_add linear bias)")
        _refuse(training and prob > 0, f"hidden dropout (p={prob})")
        _refuse(residual.dtype != x.dtype, "fp32 residual connection")
        # residual first: the sum takes its (contiguous [s, b, h]) layout when x is a transposed
        # view (the attention projection's output, see _linear); the same bits as x + residual
        return residual + x

    return _bda
