"""An example of a user's own model factory, used by examples/my_net.yaml (`target:`)."""
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):  # (B, width) -> (B, width)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def make_net(depth: int = 12, width: int = 512) -> nn.Module:
    return Net(depth, width)
