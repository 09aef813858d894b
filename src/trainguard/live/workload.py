"""The drill's model and data: a tiny regression whose samples are a pure function of their index.

Sample ``i`` is drawn from a generator seeded with ``i``, so any rank can compute any micro-batch,
and the data position of a run is its step: micro-batch ``m`` of step ``t`` holds the samples
``[t*G + m*B, t*G + (m+1)*B)`` with ``B`` samples per micro-batch and ``G`` per step.

``python -m trainguard.live.workload --store HOST:PORT --rank R ...`` is the drill's rank (the
launcher's default entry): one user of ``LiveRank``, the engine of ``Guard``'s live mode that
``examples/user_loop.py`` runs under ``fault_tolerance.live: true``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trainguard.live.rank import LiveRank
from trainguard.live.worker import LiveArgs

FEATURES = 16


@dataclass(frozen=True)
class Workload:
    micro_batches: int = 8  # per step (the global batch), whatever the number of live ranks
    micro_batch_size: int = 4
    hidden: int = 32
    seed: int = 0
    lr: float = 1e-2

    @property
    def samples_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def sample_range(self, step: int, micro_batch: int) -> tuple[int, int]:
        first = step * self.samples_per_step + micro_batch * self.micro_batch_size
        return first, first + self.micro_batch_size

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, self.hidden), torch.nn.Tanh(),
                                    torch.nn.Linear(self.hidden, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr)

    def batch(self, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, end = self.sample_range(step, micro_batch)
        xs = torch.stack([torch.randn(FEATURES, generator=torch.Generator().manual_seed(i)) for i in range(first, end)])
        return xs, torch.sin(xs.sum(dim=1, keepdim=True))

    def micro_batch_loss(self, model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        """The mean squared error over one micro-batch's samples."""
        xs, ys = self.batch(step, micro_batch)
        return ((model(xs) - ys) ** 2).sum() / self.micro_batch_size


def main(argv: list[str] | None = None) -> None:
    workload = Workload()
    model, optimizer = workload.build()
    rank = LiveRank(model, optimizer, LiveArgs.parse(argv), seed=workload.seed)
    workload = dataclasses.replace(workload, micro_batches=rank.micro_batches)  # the run's global batch
    rank.start(workload.micro_batch_loss)
    while not rank.stopping:
        rank.step(workload.micro_batch_loss, workload.sample_range)
    rank.close()


if __name__ == "__main__":
    main()
