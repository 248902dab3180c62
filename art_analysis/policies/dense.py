"""Dense: keep every block (the baseline every other policy is compared with)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SelectionInputs, SelectionPolicy


@dataclass(frozen=True)
class DensePolicy(SelectionPolicy):
    """Keep every block holding a valid token.

    Followed by ART it walks exactly what ART alone walks.
    """

    name = "dense"

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        return inputs.every_valid_block()
