"""Narrow silencing of megatron-core notices (applied when the Megatron adapter is imported)."""

from __future__ import annotations

import logging
import warnings


def quiet_megatron() -> None:
    """Silence megatron-core's notices that say nothing about the rl_engine path, narrowly.

    * UserWarnings "Transformer Engine and Apex are not installed ..." / "Apex is not installed.
      Falling back to Torch Norm" (import time, and when the stock local spec is built): the
      rl_engine spec uses neither.
    * UserWarning "full scope is deprecated ..." (``TransformerConfig``: megatron-core 0.16.1's
      own default ``cuda_graph_scope``; no CUDA graphs are captured here).
    * Log line "Unknown MLP type: <ModuleSpec>. Using default kwargs." (``TransformerLayer``:
      the rl_engine MLP is not megatron's ``MLP`` class; the default kwargs are the right ones).

    Every other warning and log record of megatron-core is left alone.
    """
    for message in (
        r"Transformer Engine and Apex are not installed",
        r"Apex is not installed\. Falling back to Torch Norm",
        r"full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module="megatron")
    layer_logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _UnknownMLPFilter) for f in layer_logger.filters):
        layer_logger.addFilter(_UnknownMLPFilter())


class _UnknownMLPFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type:")


quiet_megatron()
