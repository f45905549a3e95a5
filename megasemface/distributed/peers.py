"""A rank of another node lost mid-run, told from the error the communication backend
raises in the collective that found it.

When a node's processes die (out of memory, a hardware fault, ``kill -9``), its TCP
connections close and the next collective of every other rank fails at once: gloo raises
``Read error [10.0.0.2]:40123: Connection reset by peer`` (or "closed by peer"), NCCL a
remote error. Without a word from the run, each surviving rank would print a traceback
through the collective's stack; :func:`lost_peer` names the node instead, and the entry
point says where the run can resume.
"""

from __future__ import annotations

import re

__all__ = ["lost_peer"]

# "Read error [10.0.0.2]:722: Connection reset by peer." or
# "Connection closed by peer [10.0.0.2]:45184."
_GLOO_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_GLOO_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
_NCCL_LOSS = ("remote process exited", "ncclRemoteError", "NCCL communicator was aborted")


def lost_peer(error: BaseException) -> str | None:
    """ "node ADDRESS (REASON)" or "a rank of another node (REASON)" when ``error`` is a
    collective's failure because a peer went away; None for any other error."""
    if not isinstance(error, RuntimeError):  # torch's DistBackendError is one too
        return None
    message = str(error)
    if "gloo" in message:
        found = _GLOO_PEER.search(message)
        for loss in _GLOO_LOSS:
            if found and loss in message:
                return f"node {found.group(1)} ({loss})"
    for loss in _NCCL_LOSS:
        if loss in message:
            return f"a rank of another node ({loss})"
    return None
