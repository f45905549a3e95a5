"""The loader's position, in a form that does not depend on how many ranks read the stream.

A run's batch stream is fixed when it starts. It has ``S = ranks x max(1, workers)`` reading
slots (:mod:`megasemface.data.loading.loader`), each an endless stream of batches, and one global
order of their batches: global batch ``g`` is batch ``g // S`` of slot ``order[g % S]``. Rank
``r`` of ``w`` ranks reads the global batches ``r, r + w, r + 2w, ...``. The order is chosen so
that, with the starting numbers of ranks and workers, each DataLoader worker of each rank reads
exactly one slot and every batch of it: ``order[q * w + r] = r * workers + q``.

So the whole run's position is one counter, ``position``: the global batches handed out so
far (the same on every rank, since ranks take one batch per step together), plus each slot's
own stream position (shard, sample, batch per language; a slot's ``step`` counts the batches
taken from it). Both are plain JSON.

Another number of ranks (or of workers) continues the same global order: rank ``r`` of ``w'``
ranks reads ``position + r, position + r + w', ...``. A slot whose batches now go to several
readers is read by each of them, and each skips the batches that are not its own. Every global
batch is therefore read exactly once over the change, and every sentence of an epoch still
once per epoch.

To resume, the states of all ranks are merged (:func:`merge_loader_states`): each slot's most
advanced state (its last batch was handed out by the reader whose state is newest, and the
others' are earlier points of the same deterministic stream) and the common position.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "STATE_VERSION",
    "merge_loader_states",
    "rank_slots",
    "slot_order",
]

STATE_VERSION = 2
"""1: per-rank slot states keyed by worker, valid only for the same ranks and workers."""


def slot_order(world_size: int, workers: int) -> list[int]:
    """The global order of slots for a run that starts with these numbers of ranks and
    workers: rank r's j-th batch is global batch ``j * world_size + r`` and comes from slot
    ``r * workers + j % workers``, as DataLoader's round robin over workers delivers it."""
    return [rank * workers + q for q in range(workers) for rank in range(world_size)]


def rank_slots(order: list[int], position: int, rank: int, world_size: int) -> set[int]:
    """The slots rank ``rank`` of ``world_size`` reads from global batch ``position`` on."""
    count = len(order)
    return {order[(position + rank + t * world_size) % count] for t in range(count)}


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A state of any supported version in the current form."""
    version = state.get("version")
    if version == STATE_VERSION:
        return state
    if version != 1:
        raise ValueError(f"loader state version {version!r} is not supported")
    # Version 1 keyed slot states by worker; each rank had handed out as many batches as its
    # slots' steps add up to, and all ranks the same number.
    world, workers, rank = state["world_size"], state["workers"], state["rank"]
    slots = {str(rank * workers + int(w)): s for w, s in state["slots"].items()}
    taken = sum(int(s["step"]) for s in slots.values())
    return {
        "version": STATE_VERSION,
        "fingerprint": state["fingerprint"],
        "order": slot_order(world, workers),
        "position": taken * world,
        "slots": slots,
    }


def merge_loader_states(states: list[dict[str, Any]], fingerprint: str) -> dict[str, Any]:
    """One position from the states of any subset of a run's ranks (all of them for a
    resume on another number of ranks, any one for a resume on the same number).

    Raises ValueError for states of other data or loader options, or ones that disagree
    (not saved at the same step).
    """
    if not states:
        raise ValueError("no loader state to resume from")
    upgraded = [_upgrade(s) for s in states]
    for state in upgraded:
        if state["fingerprint"] != fingerprint:
            raise ValueError(
                "loader state belongs to other shards or batching options (fingerprint "
                f"{state['fingerprint']} != {fingerprint}); resume with the original "
                "data and loader settings"
            )
    orders = {tuple(s["order"]) for s in upgraded}
    positions = {int(s["position"]) for s in upgraded}
    if len(orders) > 1 or len(positions) > 1:
        raise ValueError(
            f"the ranks' loader states disagree (positions {sorted(positions)}, "
            f"{len(orders)} slot orders): they were not saved at the same step"
        )
    slots: dict[int, dict[str, Any]] = {}
    for state in upgraded:
        for key, slot_state in state["slots"].items():
            slot = int(key)
            if slot not in slots or slot_state["step"] > slots[slot]["step"]:
                slots[slot] = slot_state
    return {
        "version": STATE_VERSION,
        "fingerprint": fingerprint,
        "order": list(orders.pop()),
        "position": positions.pop(),
        "slots": slots,
    }
