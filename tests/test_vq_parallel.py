"""The VQ layer across processes (CPU, gloo): a split codebook and data parallelism reproduce
the one-process layer on the same global batch; the groups and DeepSpeed's mpu agree.

Each test spawns 2 or 4 processes; the workers save their results with ``torch.save`` and the
test compares them with a one-process reference computed here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megasemface.distributed.groups import (
    DeepSpeedMpu,
    ParallelGroups,
    all_reduce_data_parallel,
    all_reduce_model_parallel,
    build_parallel_groups,
    global_batch_sum,
)
from megasemface.distributed.launch import free_port
from megasemface.interfaces.vq.gumbel_quantizer import (
    GumbelVectorQuantizer,
    gather_state_dicts,
    shard_state_dict,
)
from megasemface.nn.config import VQConfig

pytestmark = pytest.mark.launcher

D = 8
FLAT = VQConfig(
    logits="mlp",
    num_codes=64,
    hidden_dim=16,
    chunk_tokens=5,
    temperature_start=1.5,
    temperature_end=0.5,
    temperature_decay=0.9,
)
FLAT_GUMBEL = dataclasses.replace(FLAT, diversity_from_gumbel=True)
FLAT_DISTANCE = dataclasses.replace(FLAT, logits="distance")
PRODUCT = VQConfig(layout="product", groups=2, entries=6, hidden_dim=16, logits="mlp")
SEED = 11
STEP = 3
TOKENS_PER_DP = (7, 12)  # unequal on purpose: the global mean must weight tokens, not ranks


def _worker(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _spawn(scenario: str, world: int, tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(world, free_port(), scenario, str(tmp_path)), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _inputs(n_tok: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_tok, D, generator=gen), torch.randn(n_tok, D, generator=gen)


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_inputs(n, 100 + r) for r, n in enumerate(TOKENS_PER_DP)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _run(vq: GumbelVectorQuantizer, h: torch.Tensor, target: torch.Tensor, **kw: Any) -> dict:
    """One forward/backward; the loss is a per-token sum plus the global diversity loss and
    the global mean token entropy."""
    vq.zero_grad()
    h = h.clone().requires_grad_()
    out = vq(h, **kw)
    ((out.quantized * target).sum() + 3.0 * out.diversity_loss + 0.5 * out.token_entropy).backward()
    return {
        "codes": out.codes,
        "quantized": out.quantized.detach(),
        "diversity": out.diversity_loss.detach(),
        "token_entropy": out.token_entropy.detach(),
        "code_ppl": out.code_perplexity,
        "prob_ppl": out.prob_perplexity,
        "used": out.codes_used,
        "grads": {name: p.grad.clone() for name, p in vq.named_parameters()},
        "grad_h": h.grad.clone(),
    }


def _assert_close(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)


# -- (a) a flat codebook split over 2 model-parallel ranks ---------------------------------


def _scenario_split(rank: int, world: int) -> dict[str, Any]:
    groups = build_parallel_groups(world)
    assert groups.mp_size == 2 and groups.dp_size == 1
    full = GumbelVectorQuantizer(FLAT, D, ParallelGroups.single(), seed=SEED)
    vq = GumbelVectorQuantizer(FLAT, D, groups, seed=SEED)
    shard = shard_state_dict(full.state_dict(), groups.mp_rank, groups.mp_size)
    # The split init already equals the shard; loading it makes "same weights" explicit.
    init_matches = all(torch.equal(shard[k], v) for k, v in vq.state_dict().items())
    vq.load_state_dict(shard)
    vq.set_step(STEP)
    h, target = _inputs(13, 1)
    train = _run(vq.train(), h, target)
    evaluated = _run(vq.eval(), h, target)
    gumbel_vq = GumbelVectorQuantizer(FLAT_GUMBEL, D, groups, seed=SEED)
    gumbel_vq.set_step(STEP)
    gumbel = _run(gumbel_vq.train(), h, target, noise_key=4)
    distance_vq = GumbelVectorQuantizer(FLAT_DISTANCE, D, groups, seed=SEED)
    distance_vq.set_step(STEP)
    distance = _run(distance_vq.train(), h, target, noise_key=5)
    lookup = vq.lookup(train["codes"])
    frozen = GumbelVectorQuantizer(FLAT, D, groups, seed=SEED).freeze().train()
    frozen.set_step(STEP)
    hf = h.clone().requires_grad_()
    (frozen(hf).quantized * target).sum().backward()
    bf16 = vq.train()(h.to(torch.bfloat16), noise_key=9).quantized  # bf16 all-reduce on gloo
    usage = vq.code_usage()
    usage.update(vq(h, noise_key=1).greedy_codes)
    ties = []
    tie_vq = GumbelVectorQuantizer(FLAT, D, groups, seed=SEED).eval()
    for tied in ([20, 45, 50], [45, 50]):  # across both shards; within rank 1's shard only
        with torch.no_grad():
            tie_vq.logits_weight.zero_()
            bias = torch.zeros(FLAT.num_codes)
            bias[tied] = 1.0
            tie_vq.logits_bias.copy_(
                shard_state_dict({"logits_bias": bias}, groups.mp_rank, 2)["logits_bias"]
            )
            ties.append(tie_vq(h[:3]).codes.tolist())
    return {
        "init_matches": init_matches,
        "train": train,
        "eval": evaluated,
        "gumbel": gumbel,
        "distance": distance,
        "lookup": lookup,
        "frozen_grad_h": hf.grad,
        "frozen_param_grads": [p.grad for p in frozen.parameters()],
        "bf16": bf16,
        "usage": usage.summary(),
        "ties": ties,
        "state": vq.state_dict(),
    }


def test_flat_split_over_two_ranks_matches_unsplit(tmp_path: Path) -> None:
    ranks = _spawn("split", 2, tmp_path)
    full = GumbelVectorQuantizer(FLAT, D, ParallelGroups.single(), seed=SEED)
    full.set_step(STEP)
    h, target = _inputs(13, 1)
    gumbel_vq = GumbelVectorQuantizer(FLAT_GUMBEL, D, ParallelGroups.single(), seed=SEED)
    gumbel_vq.set_step(STEP)
    distance_vq = GumbelVectorQuantizer(FLAT_DISTANCE, D, ParallelGroups.single(), seed=SEED)
    distance_vq.set_step(STEP)
    refs = {
        "train": _run(full.train(), h, target),
        "eval": _run(full.eval(), h, target),
        "gumbel": _run(gumbel_vq.train(), h, target, noise_key=4),
        "distance": _run(distance_vq.train(), h, target, noise_key=5),
    }
    assert all(r["init_matches"] for r in ranks)
    assert torch.equal(gather_state_dicts([r["state"] for r in ranks])["codebook"], full.codebook)
    for mode, ref in refs.items():
        for r in ranks:
            got = r[mode]
            assert torch.equal(got["codes"], ref["codes"]), mode
            assert torch.equal(got["quantized"], ref["quantized"]), mode
            for key in ("diversity", "token_entropy", "code_ppl", "prob_ppl", "used", "grad_h"):
                _assert_close(got[key], ref[key], f"{mode} {key}")
            for name in ("hidden.weight", "hidden.bias"):
                if mode != "distance":
                    _assert_close(got["grads"][name], ref["grads"][name], f"{mode} {name}")
        for name in ("logits_weight", "logits_bias", "codebook"):
            if name not in ref["grads"]:
                assert mode == "distance" and name not in ranks[0][mode]["grads"], mode
                continue
            merged = torch.cat([r[mode]["grads"][name] for r in ranks])
            _assert_close(merged, ref["grads"][name], f"{mode} {name}")
    assert not torch.equal(refs["train"]["codes"], refs["eval"]["codes"])  # noise was drawn
    assert all(r["ties"] == [[20] * 3, [45] * 3] for r in ranks)  # smallest global index
    for r in ranks:
        assert torch.equal(r["lookup"], refs["train"]["quantized"])
        assert all(g is None for g in r["frozen_param_grads"])
        assert torch.equal(r["bf16"], full.train()(h.to(torch.bfloat16), noise_key=9).quantized)
    full.zero_grad()
    frozen_ref = GumbelVectorQuantizer(FLAT, D, ParallelGroups.single(), seed=SEED).freeze()
    frozen_ref.set_step(STEP)
    hf = h.clone().requires_grad_()
    (frozen_ref.train()(hf).quantized * target).sum().backward()
    for r in ranks:
        _assert_close(r["frozen_grad_h"], hf.grad, "frozen grad h")
    ref_usage = full.code_usage()
    ref_usage.update(full(h, noise_key=1).greedy_codes)
    assert ranks[0]["usage"] == ranks[1]["usage"] == ref_usage.summary()


# -- (b) data parallelism: 2 dp ranks x 1 mp rank -------------------------------------------


def _dp_average(grads: dict[str, torch.Tensor], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """What DeepSpeed does to gradients: the average over the data-parallel group."""
    return {
        k: all_reduce_data_parallel(g.clone(), groups) / groups.dp_size for k, g in grads.items()
    }


def _scenario_dp(rank: int, world: int) -> dict[str, Any]:
    groups = build_parallel_groups(1)
    assert groups.dp_size == 2 and groups.mp_size == 1
    h, target = _inputs(TOKENS_PER_DP[groups.dp_rank], 100 + groups.dp_rank)
    result: dict[str, Any] = {}
    for name, cfg in (("flat", FLAT), ("product", PRODUCT)):
        vq = GumbelVectorQuantizer(cfg, D, groups, seed=SEED)
        vq.set_step(STEP)
        # Without noise the codes are comparable with the one-process run.
        run = _run(vq.train(), h, target, sample=False)
        run["grads"] = _dp_average(run["grads"], groups)
        # With noise (keyed by dp rank) the default diversity loss is still noise-free.
        run["noisy_diversity"] = vq(h).diversity_loss.detach()
        result[name] = run
    return result


def test_diversity_over_two_data_parallel_ranks_equals_global_batch(tmp_path: Path) -> None:
    ranks = _spawn("dp", 2, tmp_path)
    h, target = _global_batch()
    for name, cfg in (("flat", FLAT), ("product", PRODUCT)):
        vq = GumbelVectorQuantizer(cfg, D, ParallelGroups.single(), seed=SEED)
        vq.set_step(STEP)
        # Per-rank losses are local sums, averaged over 2 ranks; the diversity loss is global.
        ref = _run(vq.train(), h, target / 2, sample=False)
        split = [0, TOKENS_PER_DP[0], sum(TOKENS_PER_DP)]
        for dp_rank, r in enumerate(ranks):
            got = r[name]
            lo, hi = split[dp_rank], split[dp_rank + 1]
            assert torch.equal(got["codes"], ref["codes"][lo:hi])
            for key in ("diversity", "token_entropy", "code_ppl", "prob_ppl", "used"):
                _assert_close(got[key], ref[key], f"{name} {key}")
            _assert_close(got["noisy_diversity"], ref["diversity"], f"{name} noisy")
            for pname, grad in ref["grads"].items():
                _assert_close(got["grads"][pname], grad, f"{name} {pname}")


# -- (c) 4 ranks: 2 dp x 2 mp, groups and the DeepSpeed mpu --------------------------------


def _scenario_grid(rank: int, world: int) -> dict[str, Any]:
    groups = build_parallel_groups(2)
    mpu = DeepSpeedMpu(groups)
    answers = {
        "mp": (
            mpu.get_model_parallel_rank(),
            mpu.get_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_src_rank(),
            groups.mp_ranks,
        ),
        "dp": (
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            tuple(mpu.get_data_parallel_group_ranks()),
        ),
        "groups_are_objects": (
            mpu.get_model_parallel_group()
            is groups.mp_group
            is mpu.get_tensor_model_parallel_group()
            and mpu.get_data_parallel_group() is groups.dp_group
        ),
        "mp_sum": int(all_reduce_model_parallel(torch.tensor([rank]), groups)),
        "dp_sum": int(all_reduce_data_parallel(torch.tensor([rank]), groups)),
        "dp_max": int(all_reduce_data_parallel(torch.tensor([rank]), groups, "max")),
        "mp_group_size": dist.get_world_size(mpu.get_model_parallel_group()),
        "dp_group_size": dist.get_world_size(mpu.get_data_parallel_group()),
    }
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    global_batch_sum(x, groups).sum().backward()
    answers["global_sum_grad"] = float(x.grad)
    h, target = _inputs(TOKENS_PER_DP[groups.dp_rank], 100 + groups.dp_rank)
    vq = GumbelVectorQuantizer(FLAT, D, groups, seed=SEED)
    vq.set_step(STEP)
    run = _run(vq.train(), h, target, sample=False)
    run["grads"] = _dp_average(run["grads"], groups)
    answers["run"] = run
    # Argmax usage over a 2-step window, with Gumbel noise drawn (keyed by dp rank).
    usage = vq.code_usage()
    for key in (1, 2):
        usage.update(vq.train()(h, noise_key=key).greedy_codes)
    answers["usage"] = usage.summary()
    return answers


def test_two_by_two_grid_groups_mpu_and_global_diversity(tmp_path: Path) -> None:
    ranks = _spawn("grid", 4, tmp_path)
    for rank, r in enumerate(ranks):
        mp_rank, dp_rank = rank % 2, rank // 2
        mp_members = (2 * dp_rank, 2 * dp_rank + 1)
        assert r["mp"] == (mp_rank, 2, mp_rank, 2, mp_members[0], mp_members)
        assert r["dp"] == (dp_rank, 2, (mp_rank, mp_rank + 2))
        assert r["groups_are_objects"]
        assert r["mp_sum"] == sum(mp_members) and r["dp_sum"] == 2 * mp_rank + 2
        assert r["dp_max"] == mp_rank + 2
        assert r["mp_group_size"] == r["dp_group_size"] == 2
        assert r["global_sum_grad"] == 2.0  # scaled by dp_size for DeepSpeed's averaging
    h, target = _global_batch()
    vq = GumbelVectorQuantizer(FLAT, D, ParallelGroups.single(), seed=SEED)
    vq.set_step(STEP)
    ref = _run(vq.train(), h, target / 2, sample=False)
    split = [0, TOKENS_PER_DP[0], sum(TOKENS_PER_DP)]
    for rank, r in enumerate(ranks):
        got, dp_rank = r["run"], rank // 2
        assert torch.equal(got["codes"], ref["codes"][split[dp_rank] : split[dp_rank + 1]])
        for key in ("diversity", "token_entropy", "code_ppl", "prob_ppl", "used"):
            _assert_close(got[key], ref[key], key)
        for name in ("hidden.weight", "hidden.bias"):
            _assert_close(got["grads"][name], ref["grads"][name], name)
    for dp_rank in range(2):
        pair = ranks[2 * dp_rank : 2 * dp_rank + 2]
        for name in ("logits_weight", "logits_bias", "codebook"):
            merged = torch.cat([r["run"]["grads"][name] for r in pair])
            _assert_close(merged, ref["grads"][name], name)
    # The window's argmax statistics over 2 dp x 2 mp ranks are those of one process.
    ref_usage = vq.code_usage()
    for _ in (1, 2):
        ref_usage.update(vq.eval()(h).codes)
    expected = ref_usage.summary()
    assert expected["codes_used"] > 1
    assert all(r["usage"] == expected for r in ranks)


# -- DeepSpeed itself with the mpu: ZeRO-1 over dp only, gradient norm over the whole model ---


def _scenario_deepspeed(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed  # only here: model code never imports DeepSpeed

    from megasemface.distributed.engine import init_distributed

    groups = init_distributed(2)  # DeepSpeed's communication started as train.py starts it
    vq = GumbelVectorQuantizer(FLAT, D, groups, seed=SEED)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 100.0,
    }
    engine, *_ = deepspeed.initialize(
        model=vq, model_parameters=vq.parameters(), config=config, mpu=DeepSpeedMpu(groups)
    )
    engine.eval()  # no noise, so the one-process reference sees the same codes
    h, target = _inputs(TOKENS_PER_DP[groups.dp_rank], 100 + groups.dp_rank)
    out = engine(h)
    engine.backward(
        (out.quantized * target).sum() + 3.0 * out.diversity_loss + 0.5 * out.token_entropy
    )
    engine.step()
    return {
        "dp_world": engine.dp_world_size,
        "mp_world": engine.mp_world_size,
        "norm": float(engine.get_global_grad_norm()),
        "hidden": vq.hidden.weight.detach().clone(),
    }


def test_deepspeed_zero_with_the_mpu_sees_the_global_gradient(tmp_path: Path) -> None:
    ranks = _spawn("deepspeed", 4, tmp_path)
    h, target = _global_batch()
    vq = GumbelVectorQuantizer(FLAT, D, ParallelGroups.single(), seed=SEED)
    ref = _run(vq.eval(), h, target / 2)
    ref_norm = float(torch.stack([g.norm() for g in ref["grads"].values()]).norm())
    for r in ranks:
        assert (r["dp_world"], r["mp_world"]) == (2, 2)
        # Split parameters count on every mp rank, replicated ones once, diversity scaled.
        assert abs(r["norm"] - ref_norm) < 1e-5 * ref_norm
        assert torch.equal(r["hidden"], ranks[0]["hidden"])  # replicas stay identical


SCENARIOS = {
    "split": _scenario_split,
    "dp": _scenario_dp,
    "grid": _scenario_grid,
    "deepspeed": _scenario_deepspeed,
}
