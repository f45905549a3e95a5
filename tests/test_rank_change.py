"""Resuming on another number of data-parallel ranks, in launched runs.

A run stopped after its checkpoint of step 3 (killed, or an uninterrupted reference run
rewound to that checkpoint) is resumed on the other number of ranks; the uninterrupted run
on the first number is the reference. Over the change, the ranks
together must read exactly the sentences the uninterrupted run reads (one global batch order,
shared out among however many ranks), and training must go on from the checkpoint: its
weights (the first loss after the resume), Adam's moments and step count (the first update
after it), the step counter.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from launch import check_finished, ds_config, kill_after_checkpoint, launch, rewind, train_command

from megasemface.checkpoints import consolidate_checkpoint, find_checkpoint
from megasemface.distributed.engine import convert_to_universal

pytestmark = pytest.mark.launcher

CHECKPOINT = 3


def command(
    data: dict, out: Path, zero: int, procs: int, steps: int, *extra: str, interface: str = "cl"
) -> list[str]:
    stage = "encoder" if interface == "cl" else "joint"
    return train_command(
        {"shards": data["mono"], "spm": data["spm"]},
        out,
        "--cl-table",
        str(data["cl"]),
        "--stage",
        stage,
        "--interface",
        interface,
        "--seed",
        "3",
        "--steps",
        str(steps),
        "--save-interval",
        str(CHECKPOINT),
        "--log-sample-ids",
        *extra,
        config=ds_config(zero, data["root"]),
        procs=procs,
    )


def records(out: Path) -> list[dict]:
    """Every rank's samples-rank*.jsonl records (ids and the rank's own loss per step)."""
    found = []
    for path in sorted(out.glob("samples-rank*.jsonl")):
        rank = int(path.stem.removeprefix("samples-rank"))
        found += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return found


def consumed(found: list[dict]) -> Counter[int]:
    return Counter(i for record in found for i in record["ids"])


def universal_state(tag_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 weights and Adam's moments per trained parameter, from a universal checkpoint
    folder (which holds only the weights of parameters the optimizer does not update)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for param in sorted((tag_dir / "zero").iterdir()):
        if (param / "exp_avg.pt").is_file():
            state[param.name] = {}
            for name in ("fp32", "exp_avg", "exp_avg_sq"):
                value = torch.load(param / f"{name}.pt", weights_only=True)
                tensor = value["param"] if isinstance(value, dict) else value
                state[param.name][name] = tensor.detach()
    return state


def check_first_update(before: Path, after: Path, step: int, zero: int, tmp: Path) -> None:
    """The update of ``step`` (the first after the resume) went from the checkpoint's Adam
    state: its moments and step count, restored, explain the new moments and weights.

    From m0, v0, w0 (the checkpoint, as the resume loaded it) and m1, v1, w1 (the checkpoint
    one step later): the gradient is g = (m1 - b1 m0) / (1 - b1), so v1 must be
    b2 v0 + (1 - b2) g^2, and w0 - w1 must be Adam's step with bias corrections of ``step``.
    Moments that started from zero, or a step count that started again at 1, miss both by
    far more than float32 rounding (which the relative tolerances bound: the moments are
    differences of numbers of similar size).
    """
    config = json.loads(ds_config(zero, tmp).read_text())["optimizer"]["params"]
    b1, b2 = config["betas"]
    lr, eps = config["lr"], config["eps"]
    info = find_checkpoint(after)
    universal = tmp / "after" / after.name
    convert_to_universal(info.model_files[0], info.optim_files[0], 0, 1, universal)
    old, new = universal_state(before), universal_state(universal)
    assert old.keys() == new.keys() and old
    for name, s0 in old.items():
        s1 = new[name]
        m0, v0, w0 = (s0[k].flatten().double() for k in ("exp_avg", "exp_avg_sq", "fp32"))
        m1, v1, w1 = (s1[k].flatten().double() for k in ("exp_avg", "exp_avg_sq", "fp32"))
        grad = (m1 - b1 * m0) / (1 - b1)
        expected_v = b2 * v0 + (1 - b2) * grad**2
        assert torch.linalg.norm(v1 - expected_v) <= 1e-3 * torch.linalg.norm(v1) + 1e-30, name
        update = lr / (1 - b1**step) * m1 / ((v1 / (1 - b2**step)).sqrt() + eps)
        moved = w0 - w1
        assert torch.linalg.norm(moved - update) <= 0.01 * torch.linalg.norm(update) + 1e-9, name


@pytest.mark.parametrize(
    ("zero", "before", "after", "total"),
    [
        # 2 ranks for 5 steps read global batches 0..9: 3 steps on 2 ranks, then 4 on 1.
        (2, 2, 1, 5),
        # 1 rank for 7 steps reads 0..6: 3 steps on 1 rank, then 2 on 2.
        (3, 1, 2, 7),
    ],
)
def test_resume_on_another_number_of_ranks(
    launch_data: dict, tmp_path: Path, zero: int, before: int, after: int, total: int
) -> None:
    resumed_steps = CHECKPOINT + (total - CHECKPOINT) * before // after
    reference = tmp_path / "reference"
    check_finished(launch(command(launch_data, reference, zero, before, total)), reference, total)
    expected = records(reference)

    # The run as it stood at its checkpoint of step 3 (as if killed then); what it had
    # consumed up to there. The steps after the checkpoint are done again.
    out = tmp_path / "run"
    rewind(reference, out, CHECKPOINT)
    first = records(out)
    for path in out.glob("samples-rank*.jsonl"):
        path.unlink()

    resumed = command(
        launch_data, out, zero, after, resumed_steps, "--save-interval", "1", "--keep-last", "9"
    )
    result = launch(resumed)
    check_finished(result, out, resumed_steps)
    assert f"written by {before} data-parallel ranks, continued on {after}" in result.stdout
    second = records(out)
    assert sorted({r["step"] for r in second}) == list(range(CHECKPOINT + 1, resumed_steps + 1))
    assert sorted({r["rank"] for r in second}) == list(range(after))
    assert all(math.isfinite(r["loss"]) for r in second)

    # Every sentence the uninterrupted run read, exactly as often, none else.
    assert consumed(first + second) == consumed(expected)

    # Rank 0 takes the same global batch at the first step after the resume as in the
    # uninterrupted run, from the same weights with the same seed: the same loss. (Equal up
    # to float32 rounding; the weights are restored bit for bit and the forward pass is the
    # same computation, so in practice the numbers are identical.)
    def rank0(found: list[dict], step: int) -> dict:
        return next(r for r in found if r["rank"] == 0 and r["step"] == step)

    step = CHECKPOINT + 1
    assert rank0(second, step)["ids"] == rank0(expected, step)["ids"]
    assert rank0(second, step)["loss"] == pytest.approx(rank0(expected, step)["loss"], rel=1e-6)

    checkpoints = out / "checkpoints"
    universal = checkpoints / f"step-{CHECKPOINT:08d}" / "universal" / "mp_rank_00"
    check_first_update(
        universal / f"step-{CHECKPOINT:08d}", checkpoints / f"step-{step:08d}", step, zero, tmp_path
    )


def test_model_parallel_ranks_are_converted_each_on_its_own(
    launch_data: dict, tmp_path: Path
) -> None:
    """With --mp-size 2, from 2 data-parallel ranks to 1: each model-parallel rank goes on
    with its own shard of the flat codebook (DeepSpeed's converter, shown all files, would
    take the shards for tensor-parallel slices of one tensor and merge them)."""
    out = tmp_path / "run"
    vq = ("--mp-size", "2")
    kill_after_checkpoint(command(launch_data, out, 2, 4, 5, *vq, interface="vq"), out, CHECKPOINT)
    resumed = command(launch_data, out, 2, 2, CHECKPOINT + 1, *vq, interface="vq")
    result = launch(resumed)
    check_finished(result, out, CHECKPOINT + 1)
    assert "written by 2 data-parallel ranks, continued on 1" in result.stdout
    universal = out / "checkpoints" / f"step-{CHECKPOINT:08d}" / "universal"
    assert sorted(p.name for p in universal.iterdir()) == ["mp_rank_00", "mp_rank_01"]
    before = consolidate_checkpoint(find_checkpoint(out / "checkpoints" / f"step-{CHECKPOINT:08d}"))
    after = consolidate_checkpoint(find_checkpoint(out))
    assert before.gathered and before.gathered == after.gathered
    for key, old in before.state.items():
        # One Adam step of lr 1e-4 moves each weight by about 1e-4; the two shards of the
        # codebook differ by far more than that.
        assert (after.state[key] - old).abs().max() < 1e-3, key
    codebook = before.state["interface.quantizer.codebook"]
    half = len(codebook) // 2
    assert (codebook[:half] - codebook[half:]).abs().max() > 1e-2
