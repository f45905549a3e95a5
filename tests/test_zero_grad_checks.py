"""ZeRO-1/2's gradient checks as multi-tensor operations equal DeepSpeed's own per-tensor
ones: the same gradient norm (bit for bit on a CPU, to float32 precision on a GPU) and the
same verdict on inf and NaN gradients; ZeRO-3 keeps DeepSpeed's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import on_cuda

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, math, sys
from pathlib import Path
import torch
from torch import nn
from megasemface.distributed import zero_grad_checks
from megasemface.distributed.engine import DeepSpeedEngine, init_distributed, load_ds_config

groups = init_distributed(1)
results = {}
for zero in (1, 2, 3):
    for bf16 in (False, True):
        config = load_ds_config(Path(sys.argv[1]))
        config["zero_optimization"]["stage"] = zero
        if bf16:
            config["bf16"] = {"enabled": True}
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50))
        engine = DeepSpeedEngine(model, config, groups, list(model.parameters()))
        opt = engine.optimizer
        name = f"zero{zero}" + ("-bf16" if bf16 else "")
        entry = results[name] = {"installed": "get_grad_norm_direct" in vars(opt)}
        if zero == 3:
            continue
        own = type(opt)
        for case in ("finite", "inf", "nan"):
            x = torch.randint(0, 50, (4, 6))
            out = engine.forward(x).float()
            engine.backward(out.pow(2).mean())
            grads = opt.averaged_gradients[0]
            if case != "finite":
                grads[1].view(-1)[3] = math.inf if case == "inf" else math.nan
            params = opt.params_in_partition[0]
            new = opt.get_grad_norm_direct(grads, params)
            old = own.get_grad_norm_direct(opt, grads, params)
            entry[case] = {
                "norm": [new.item(), old.item()],
                "equal": torch.equal(new, old),
                "overflow": [
                    bool(opt.has_overflow_partitioned_grads_serial().item()),
                    bool(own.has_overflow_partitioned_grads_serial(opt).item()),
                ],
                "tensors": len(params),
            }
            engine.step()  # a non-finite gradient makes DeepSpeed skip it
        zero_grad_checks.uninstall(opt)
        entry["uninstalled"] = "get_grad_norm_direct" not in vars(opt)
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.parametrize("device", ["cpu", on_cuda("cuda")])
def test_multi_tensor_checks_equal_deepspeeds_own(tmp_path: Path, device: str) -> None:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "ds_configs" / "cpu_fp32_zero2.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    assert not results["zero3"]["installed"] and not results["zero3-bf16"]["installed"]
    for name in ("zero1", "zero1-bf16", "zero2", "zero2-bf16"):
        entry = results[name]
        assert entry["installed"] and entry["uninstalled"], name
        finite = entry["finite"]
        assert finite["tensors"] == 5, (name, finite)
        if device == "cpu":
            assert finite["equal"], (name, finite)
        else:  # the multi-tensor kernel sums a bf16 gradient's squares in float32
            new, old = finite["norm"]
            assert abs(new - old) <= 1e-5 * old, (name, finite)
        assert finite["norm"][0] > 0 and finite["overflow"] == [False, False], (name, finite)
        # A non-finite gradient: both flag it, and both norms are DeepSpeed's -1 sentinel.
        for case in ("inf", "nan"):
            assert entry[case]["overflow"] == [True, True], (name, case, entry[case])
            assert entry[case]["norm"] == [-1.0, -1.0], (name, case, entry[case])
