"""Which keys each new row of a pass sees: the additive bias PyTorch's attention takes, the
visibility the CPU kernels take, and the visible keys of a row attending alone."""
from __future__ import annotations

import torch


class AttentionBias:
    """The additive attention bias of one pass ([group * T, S]: 0 where visible, -inf where not),
    built once per key length and shared by every layer: building it per layer cost more than
    the masked attention itself, and an additive float bias is cheaper for SDPA than a bool mask.

    `mask` is the [T, K] visibility of the last K keys (the new tokens, K = T, or also cached
    draft nodes, K > T); keys before them are visible to all. None: causal order. Rows come
    `repeat` times because the query heads sharing a kv head are stacked as rows."""

    def __init__(self, mask: torch.Tensor | None, num_new: int, repeat: int) -> None:
        self.mask = mask
        self.num_new = num_new
        self.repeat = repeat
        self._by_keys: dict[tuple[int, torch.dtype, int | None], torch.Tensor] = {}
        self._visible: dict[int, list[int | torch.Tensor]] = {}
        self._kernel_args: dict[int, tuple] = {}

    def for_keys(self, num_keys: int, dtype: torch.dtype, device, window: int | None = None) -> torch.Tensor | None:
        """The bias over `num_keys` keys (cached ones first), or None when nothing is hidden. A
        sliding layer's row (`window`) sees only the last `window` keys it would otherwise see."""
        if self.num_new == 1 and self.mask is None and (not window or num_keys <= window):
            return None
        key = (num_keys, dtype, window)
        if key not in self._by_keys:
            visible = full_attention_mask(self.mask, self.num_new, num_keys, device)
            if window:
                later = visible.flip(1).cumsum(1).flip(1)  # visible keys from each key on, itself included
                visible &= later <= window
            visible = visible.repeat(self.repeat, 1)
            bias = torch.zeros(visible.shape, dtype=dtype, device=device)
            self._by_keys[key] = bias.masked_fill_(~visible, float("-inf"))
        return self._by_keys[key]

    def for_kernel(self, num_keys: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The kernels' view of which keys each new token sees among `num_keys`: (visible counts
        [T] int64, used when there is no mask; the mask over the last K keys [T, K] uint8, or an empty
        tensor; K's first index; num_keys)."""
        if num_keys not in self._kernel_args:
            if self.mask is None:
                visible = torch.arange(num_keys - self.num_new + 1, num_keys + 1)
                self._kernel_args[num_keys] = (visible, torch.empty(0, dtype=torch.uint8), 0, num_keys)
            else:
                tail = self.mask.to(device="cpu", dtype=torch.uint8).contiguous()
                self._kernel_args[num_keys] = (torch.empty(0, dtype=torch.long), tail, num_keys - tail.shape[1], num_keys)
        return self._kernel_args[num_keys]

    def visible_keys(self, num_keys: int, device) -> list[int | torch.Tensor]:
        """For each new token, the keys it sees among `num_keys`: a count when they are the first
        ones, else their indices, ascending."""
        if num_keys not in self._visible and self.mask is None:  # causal: row t sees all keys up to itself
            self._visible[num_keys] = [num_keys - self.num_new + t + 1 for t in range(self.num_new)]
        if num_keys not in self._visible:
            rows = []
            for visible in full_attention_mask(self.mask, self.num_new, num_keys, "cpu"):
                index = visible.nonzero().flatten()
                prefix = len(index) and int(index[-1]) == len(index) - 1
                rows.append(len(index) if prefix else index.to(device))
            self._visible[num_keys] = rows
        return self._visible[num_keys]


def full_attention_mask(mask: torch.Tensor | None, T: int, S: int, device) -> torch.Tensor:
    """[T, S] bool: keys before the last K are visible to all new tokens; the last K follow
    `mask` ([T, K], e.g. a tree); with no mask, the S - T cached keys are visible and the new
    tokens see each other in causal order."""
    if mask is None:
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
    prefix = torch.ones(T, S - mask.shape[1], dtype=torch.bool, device=device)
    return torch.cat((prefix, mask.to(device=device, dtype=torch.bool)), dim=1)
