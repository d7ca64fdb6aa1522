"""The model's math, and nothing else: no devices, no DDP, no Lightning."""

from torch import Tensor, nn


class MLP(nn.Module):
    """A multilayer perceptron: `in_features` -> `num_layers` x (Linear, ReLU) -> `num_classes` logits.

    No dropout or batch norm by default: both make a rank's result depend on its
    own share of the batch (its RNG stream, its batch statistics), which would
    break the 1-device vs N-device parity the tests check.
    """

    def __init__(self, in_features: int, hidden_dim: int, num_layers: int, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, in_features) -> (B, num_classes)
