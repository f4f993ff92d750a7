"""Expert load recorder: token counts per MoE layer, kept on the device without host syncs.

Legend: L MoE layers, P physical slots, E logical experts, W window_size, ep EP ranks.

    counts    [L, P] int64   this step's (token, expert) pairs per physical slot; MoE layer l
                             adds into the row view counts[l] (index_add_, no sync)
    window    [W, L, E] int32 ring: the last W non-empty steps per logical expert
    rank_load [L, ep] int64  pairs per EP rank since reset_rank_load(): what the dispatcher
                             really sends each rank, the quantity EPLB balances

end_step() folds `counts` into the ring through the placement that was live during the step, so a
placement change between steps never mixes slot meanings. A step in which this rank had no
tokens (a dummy step) is not recorded; the ring then keeps this rank's last W real steps.
"""
from __future__ import annotations

import torch

from wideep.parallel.expert_layout import ExpertLayout


class LoadRecorder:
    def __init__(self, num_layers: int, num_physical: int, num_experts: int, window_size: int, ep_size: int,
                 device: torch.device | str = "cpu"):
        self.layout = ExpertLayout(num_physical, ep_size)
        self.num_experts, self.ep_size = num_experts, ep_size
        self.counts = torch.zeros(num_layers, num_physical, dtype=torch.int64, device=device)
        self.window = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int32, device=device)
        self.rank_load = torch.zeros(num_layers, ep_size, dtype=torch.int64, device=device)
        self._next = 0                 # ring position of the next recorded step
        self.recorded_steps = 0        # non-empty steps recorded (all time)

    def layer_counts(self, layer: int) -> torch.Tensor:
        """[P] int64 view for MoE layer `layer` to add its physical ids into."""
        return self.counts[layer]

    @torch.no_grad()
    def end_step(self, num_tokens: int, phy2log: torch.Tensor) -> None:
        """Close the step. num_tokens: tokens this rank ran (0: dummy step, dropped);
        phy2log [L, P] (device): the placement the step ran with."""
        if num_tokens > 0:
            L, P = self.counts.shape
            logical = torch.zeros(L, self.num_experts, dtype=torch.int64, device=self.counts.device)
            logical.scatter_add_(1, phy2log, self.counts)
            self.window[self._next] = logical.to(torch.int32)
            self._next = (self._next + 1) % self.window.shape[0]
            self.recorded_steps += 1
            self.rank_load += self.counts.view(L, self.ep_size, self.layout.per_rank).sum(-1)
        self.counts.zero_()

    def flush(self, phy2log: torch.Tensor) -> None:
        """Close the open step if it has any counts (for callers that do not call end_step per
        step, e.g. a rebalance forced between two generate() calls)."""
        if bool(self.counts.any()):  # SYNC: off the hot path (rebalance only)
            self.end_step(1, phy2log)

    def window_load(self) -> torch.Tensor:
        """[L, E] int64 on the device: pairs per logical expert over the window on this rank."""
        return self.window.sum(0, dtype=torch.int64)

    def reset_rank_load(self) -> None:
        self.rank_load.zero_()

    def reset(self) -> None:
        self.counts.zero_()
        self.window.zero_()
        self.rank_load.zero_()
        self._next = 0
