"""Pre-training and fine-tuning entry point, run through DeepSpeed's launcher::

    deepspeed megasemface/train.py --deepspeed_config ds_configs/zero2_bf16.json \\
        --stage encoder --interface vq --data shards/demo --spm-model spm/joint.model \\
        --output-dir runs/vq-encoder --steps 1000

    deepspeed megasemface/train.py --deepspeed_config ds_configs/zero2_bf16.json \\
        --stage finetune --init-from models/vq-semface --data shards/en-de-parallel \\
        --spm-model spm/joint.model --valid-prefix corpus/en-de/valid --output-dir runs/ft

Started again with the same output directory, a run resumes from its newest complete
checkpoint. SIGTERM, SIGINT, SIGHUP or SIGUSR1 on any rank: every rank saves after the
current step and the run exits 0. Under Slurm, ``srun`` may start the ranks itself (one task
per accelerator; see examples/slurm/pretrain.sbatch). ``python -m megasemface.train --help``
lists every option.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's directory would come first on sys.path and the package's
# sub-packages (data, models, ...) could shadow top-level modules of the same names.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import logging
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megasemface.training.options import TrainConfig


def build_parser() -> argparse.ArgumentParser:
    import deepspeed

    from megasemface.cli.parsing import CommandParser
    from megasemface.training.options import add_train_arguments

    examples = (__doc__ or "").split("::\n\n", 1)[1].split("\n\nStarted", 1)[0]
    parser = CommandParser(
        description="megasemface pre-training (SemFace encoder/decoder stages and baselines)",
        # megasemface-train (python -m megasemface.train) is one process; the launcher starts
        # one per accelerator.
        epilog="examples:\n"
        + textwrap.indent(textwrap.dedent(examples), "  ")
        + "\n\nwithout the launcher (megasemface-train) it runs one process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    return deepspeed.add_config_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megasemface.training.signals import catch_stop_signals

    catch_stop_signals()  # a scheduler's signal during the start-up stops at the first step
    from megasemface.cli.parsing import parse_or_status
    from megasemface.distributed.slurm import srun_rank_environment

    try:
        # Under srun each task is a rank; first, since --local_rank's default reads it.
        os.environ.update(srun_rank_environment(os.environ))
    except ValueError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    # An unknown option stops here, before the process group and the cluster's time.
    args = parse_or_status(build_parser(), argv)
    if isinstance(args, int):
        return args
    from megasemface.nn.cpu_speed import prepare_process

    prepare_process()  # the logits buffers outgrow glibc's reuse (see nn/cpu_speed.py)
    from megasemface.distributed.engine import exit_now, init_distributed, load_ds_config
    from megasemface.training.options import train_config_from_args
    from megasemface.training.preflight import check_before_start, preset_warning
    from megasemface.training.trainer import Trainer

    try:
        config = train_config_from_args(args)
        if args.deepspeed_config is None:
            raise ValueError("--deepspeed_config is required (see ds_configs/)")
        ds_config = load_ds_config(args.deepspeed_config)
        # The launcher's environment: the process group does not exist yet.
        check_before_start(config, ds_config, int(os.environ.get("WORLD_SIZE", "1")))
        if os.environ.get("RANK", "0") == "0":
            # Before the rendezvous, where the ranks would wait for a node that never comes.
            from megasemface.distributed.engine import accelerator_device
            from megasemface.distributed.hosts import check_nodes

            check_nodes()
            warning = preset_warning(config, accelerator_device().type)
            if warning:
                print(f"train: warning: {warning}", file=sys.stderr)
    except (ValueError, FileNotFoundError) as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    from megasemface.checkpoints.manager import DiskFullError
    from megasemface.distributed import collectives
    from megasemface.distributed.shared_dir import check_shared_output_dir
    from megasemface.training.preflight import tracking_server_problem
    from megasemface.training.signals import survive_lost_output

    survive_lost_output()  # a rank whose launcher's ssh session closed still saves
    groups = init_distributed(config.mp_size)
    try:
        check_shared_output_dir(config.output_dir)
        # Only rank 0 talks to MLflow; the others learn its answer and stop with it.
        collectives.raise_if_any_rank(
            tracking_server_problem(config) if collectives.rank() == 0 else None
        )
        return Trainer(config, ds_config, groups).run()
    except (ValueError, FileNotFoundError, DiskFullError) as exc:
        # An error every rank raises together is printed by one rank (``quiet`` elsewhere).
        if not getattr(exc, "quiet", False):
            print(f"train: error (rank {os.environ.get('RANK', '0')}): {exc}", file=sys.stderr)
        exit_now(2)
    except RuntimeError as exc:
        from megasemface.distributed.peers import lost_peer

        lost = lost_peer(exc)
        if lost is None:
            raise
        line = _lost_peer_line(config, lost)
        print(f"train: error (rank {os.environ.get('RANK', '0')}): {line}", file=sys.stderr)
        exit_now(3)  # at once: the interpreter's teardown could hang on the dead connections


def _lost_peer_line(config: TrainConfig, lost: str) -> str:
    from megasemface.checkpoints.manager import CheckpointManager

    newest = CheckpointManager(config.output_dir, config.keep_last, rank=0).newest()
    where = (
        f"the last complete checkpoint is {config.output_dir / 'checkpoints' / newest[1]} "
        f"(step {newest[0]}): run the same command again to resume from it"
        if newest
        else "no checkpoint was complete: run the same command again to start over"
    )
    return (
        f"lost {lost} in a collective; {where}, on the nodes that are left if that one "
        "stays down (a run resumes on fewer ranks too)"
    )


if __name__ == "__main__":
    status = main()
    from megasemface.distributed.engine import end_process

    end_process(status)
