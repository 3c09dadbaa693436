"""Prediction heads."""

from __future__ import annotations

from torch import nn

__all__ = ["MLPHead"]


class MLPHead(nn.Module):
    """LayerNorm -> [Linear -> SiLU -> Dropout] * len(hidden) -> Linear(out_dim)."""

    def __init__(self, in_dim: int, hidden: list[int], out_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.LayerNorm(in_dim)]
        prev = in_dim
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.SiLU(), nn.Dropout(dropout)]
            prev = h
        layers.append(nn.Linear(prev, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
