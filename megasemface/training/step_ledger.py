"""The per-step figures of the training loop, kept on the device until they are read.

Reading a tensor on the host makes it wait for everything the device has queued, and a
training step that waits loses the overlap of the host preparing the next step with the
device running this one. So the loop does not read each step's loss: the ledger keeps the
losses as device tensors beside the host's counts of each step (tokens, sentences, model
FLOPs, time), and :meth:`StepLedger.flush` sums them over the ranks in one all-reduce of a
device tensor and reads them back once, at logging steps and before checkpoints.
"""

from __future__ import annotations

import dataclasses

import torch

from megasemface.distributed.collectives import all_reduce_

__all__ = ["StepLedger", "StepRecord"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step's figures, read back: summed over the ranks unless named ``own``."""

    step: int
    skipped: bool
    """The loss was non-finite on at least one rank (so the step changed nothing)."""
    loss_sum: float
    own_loss: float
    tokens: float
    sentences: float
    flops: float
    """Model FLOPs of the step's forward and backward."""
    time: float
    """Host seconds since the loop started when the step was queued."""
    sentence_ids: list[int] | None
    """This rank's sentences, when the run logs them."""


class StepLedger:
    """Steps since the last :meth:`flush`: losses on ``device``, counts on the host."""

    def __init__(self, device: torch.device, mp_size: int) -> None:
        self.device = device
        self.mp_size = mp_size
        """Model-parallel peers read the same batch: its counts are divided by this."""
        self._losses: list[torch.Tensor] = []
        self._host: list[tuple[int, float, float, float, float, list[int] | None]] = []

    def __len__(self) -> int:
        return len(self._host)

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        *,
        tokens: int,
        sentences: int,
        flops: float,
        time: float,
        sentence_ids: list[int] | None = None,
    ) -> None:
        """Records a step; ``loss`` stays a device tensor (float64: the counters' dtype, in
        which the float32 loss is exact)."""
        self._losses.append(loss.detach().reshape(()).to(torch.float64))
        self._host.append((step, float(tokens), float(sentences), flops, time, sentence_ids))

    def flush(self) -> list[StepRecord]:
        """The recorded steps, summed over the ranks (a collective: every rank flushes at
        the same steps) and read back; the ledger is then empty."""
        if not self._host:
            return []
        own = torch.stack(self._losses)
        counts = torch.tensor(
            [row[1:4] for row in self._host], dtype=torch.float64, device=self.device
        )
        bad = torch.isfinite(own).logical_not().to(torch.float64)
        table = all_reduce_(torch.cat([bad[:, None], own[:, None], counts], dim=1))
        rows = torch.cat([table, own[:, None]], dim=1).tolist()  # the one read
        records = [
            StepRecord(
                step=step,
                skipped=bool(row[0]),
                loss_sum=row[1],
                own_loss=row[5],
                tokens=row[2] / self.mp_size,
                sentences=row[3] / self.mp_size,
                flops=row[4] / self.mp_size,
                time=time,
                sentence_ids=ids,
            )
            for row, (step, _, _, _, time, ids) in zip(rows, self._host, strict=True)
        ]
        self._losses.clear()
        self._host.clear()
        return records
