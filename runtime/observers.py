"""Observer hooks: what imatrix collection, expert profiling and live calibration attach to the runtime.

Models call ``on_matmul_input`` with the float32 input rows of every weight matmul and ``on_routing`` with
every routing decision. An observer that defines ``on_expert_output(layer, expert_ids, outputs, weights)``
also gets each routed expert's output (computed separately only for such observers). With no observer
registered the models do no extra work (no copies, no calls).
"""

from __future__ import annotations

import torch


class Observer:
    """Base class: override the methods you need; both are no-ops here."""

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        """x: (n_rows, n_in) float32 inputs of the matmul with GGUF tensor ``tensor_name``.

        For routed expert tensors (``blk.N.ffn_{gate,up,down}_exps.weight``) the rows are the routed
        (token, slot) pairs and ``expert_ids`` (n_rows,) int64 gives each row's expert; the input of
        ``ffn_down_exps`` is the expert's SwiGLU output before route weighting. Otherwise ``expert_ids`` is None.
        """

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """experts/weights: (n_tokens, k) chosen experts and their weights; logits: (n_tokens, n_expert).

        With a prune mask the masked experts' logits are the large negative MASKED_SCORE.
        """

    # Optional, not defined here so that the models skip the extra work unless an observer asks:
    # def on_expert_output(self, layer: int, expert_ids: torch.Tensor, outputs: torch.Tensor,
    #                      weights: torch.Tensor) -> None:
    #     """(n_rows,) expert ids, (n_rows, n_embd) each routed (token, slot)'s expert output before
    #     route weighting, and (n_rows,) its route weight. The tensors are only valid during the call."""


def notify_matmul(
    observers: list[Observer], tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None = None
) -> None:
    """Report a matmul input to every observer (callers guard with ``if observers``)."""
    x = x.reshape(-1, x.shape[-1])
    if x.dtype != torch.float32:
        x = x.float()
    for obs in observers:
        obs.on_matmul_input(tensor_name, x, expert_ids)


def notify_routing(
    observers: list[Observer], layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
) -> None:
    for obs in observers:
        obs.on_routing(layer, experts, weights, logits)


def expert_output_observers(observers: list[Observer]) -> list[Observer]:
    """The observers that define ``on_expert_output``."""
    return [obs for obs in observers if hasattr(obs, "on_expert_output")]


def notify_expert_output(
    observers: list[Observer],
    layer: int,
    expert_ids: torch.Tensor,
    outputs: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    for obs in observers:
        obs.on_expert_output(layer, expert_ids, outputs, weights)  # type: ignore[attr-defined]
