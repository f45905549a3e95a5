"""Whether every rank sees the output directory rank 0 writes, before the first step.

Every rank writes its own shard of a checkpoint (ZeRO's optimizer state, the codebook's
model-parallel slices) into ``--output-dir``, and every rank reads them all on resume, so on
a cluster the directory must be on a filesystem the nodes share. Given a path that exists on
each node's local disk, or on the first node only, the run would train for hours and then
leave checkpoints no node can resume from; rank 0 writes a token into the directory here,
and a rank that cannot read it back stops the run with one line naming its node.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from megasemface.distributed import collectives

__all__ = ["check_shared_output_dir"]


def _token_file(output_dir: Path, token: str) -> Path:
    return output_dir / f".shared-{token}"


def _problem(output_dir: Path, token: str) -> str | None:
    try:
        seen = _token_file(output_dir, token).read_text()
    except OSError:
        seen = None
    if seen == token:
        return None
    return (
        f"--output-dir {output_dir} on node {socket.gethostname()} (rank {collectives.rank()}) "
        "is not the directory rank 0 writes: every node must reach it on a shared filesystem "
        "(each rank writes its shard of every checkpoint there); mount it on every node at "
        "that path"
    )


def check_shared_output_dir(output_dir: Path) -> None:
    """Raises :class:`~megasemface.distributed.collectives.RankSharedError` on every rank
    when some rank does not see ``output_dir`` as rank 0 does (a collective: call on all)."""
    if collectives.world_size() == 1:
        return
    token = secrets.token_hex(8) if collectives.rank() == 0 else None
    unwritable = None
    if token is not None:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            _token_file(output_dir, token).write_text(token)
        except OSError as exc:  # the others would wait for rank 0 in the gather below
            unwritable = (
                f"cannot write into --output-dir {output_dir}: {exc.strerror or exc}; name a "
                "directory this user can write"
            )
    collectives.raise_if_any_rank(unwritable)
    # The gather is also the barrier: no rank looks before rank 0 has written.
    token = collectives.all_gather_objects(token)[0]
    try:
        collectives.raise_if_any_rank(_problem(output_dir, token))
    finally:
        if collectives.rank() == 0:
            _token_file(output_dir, token).unlink(missing_ok=True)
