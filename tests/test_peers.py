"""What a rank says when the run's nodes do not fit together: an output directory that is
not shared (distributed/shared_dir.py), checked with two gloo processes of this machine, and
a peer lost mid-run (distributed/peers.py), told from the backends' own messages. The same
faults on a simulated cluster: tests/test_cluster_faults.py."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from megasemface.distributed.launch import free_port
from megasemface.distributed.peers import lost_peer

# The messages torch's gloo raised when the simulated cluster's second node was SIGKILLed.
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[10.214.219.2]:722: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application."
)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [10.169.249.2]:45184. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (RuntimeError(GLOO_RESET), "node 10.214.219.2 (Connection reset by peer)"),
        (RuntimeError(GLOO_CLOSED), "node 10.169.249.2 (Connection closed by peer)"),
        (
            RuntimeError("NCCL error: remote process exited or there was a network error"),
            "a rank of another node (remote process exited)",
        ),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied [4]:8"), None),
        (ValueError(GLOO_RESET), None),  # not a collective's failure
    ],
)
def test_a_lost_peer_is_told_from_the_backends_message(
    error: BaseException, said: str | None
) -> None:
    assert lost_peer(error) == said


def _rank(rank: int, port: int, dirs: list[str], said: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    from megasemface.distributed.collectives import RankSharedError
    from megasemface.distributed.shared_dir import check_shared_output_dir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        check_shared_output_dir(Path(dirs[rank]))
        said.put((rank, None))
    except RankSharedError as exc:
        said.put((rank, (str(exc), exc.quiet)))
    dist.destroy_process_group()


def shared_dir_check(dirs: list[Path]) -> dict[int, tuple[str, bool] | None]:
    """What each of 2 ranks says when rank r is given ``dirs[r]`` as its output directory."""
    spawn = multiprocessing.get_context("spawn")
    said = spawn.Queue()
    port = free_port()
    procs = [
        spawn.Process(target=_rank, args=(r, port, list(map(str, dirs)), said)) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    answers = dict(said.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    return answers


def test_ranks_that_share_the_output_dir_pass_and_leave_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert shared_dir_check([out, out]) == {0: None, 1: None}
    assert out.is_dir() and not list(out.iterdir())  # rank 0 made it and removed its token


def test_a_rank_that_does_not_see_rank_0s_output_dir_stops_every_rank(tmp_path: Path) -> None:
    # Two paths of one machine stand for one path on two nodes' own disks.
    (tmp_path / "elsewhere").mkdir()
    said = shared_dir_check([tmp_path / "run", tmp_path / "elsewhere"])
    message = f"--output-dir {tmp_path / 'elsewhere'} on node "
    assert said[0] is not None and said[1] is not None
    assert said[0][0] == said[1][0]  # one message, rank 1's, on both
    assert (
        said[0][0].startswith(message)
        and "(rank 1) is not the directory rank 0 writes" in said[0][0]
    )
    assert (said[0][1], said[1][1]) == (False, True)  # rank 0 prints it; rank 1 stays quiet


def test_an_output_dir_rank_0_cannot_write_stops_every_rank_in_one_message(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"  # under a file: no directory can be made there
    said = shared_dir_check([out, out])
    assert said[0] is not None and said[1] is not None
    assert said[0][0] == said[1][0]
    assert said[0][0].startswith(f"cannot write into --output-dir {out}: Not a directory")
    assert (said[0][1], said[1][1]) == (False, True)
