"""jaxtrain train --config configs/NAME.py [--config.KEY=VALUE ...] [--workdir DIR]
    [--coordinator HOST:PORT --num_processes N --process_id I]
jaxtrain train --workdir RUN [--config.KEY=VALUE ...]

Trains, resuming from the newest intact checkpoint in the workdir (default runs/<config
name>). Without --config, the config recorded in RUN (by its last session, or by
`convert --from-hf`) with the overrides; with one, the model keys the config leaves at their
defaults come from that record (a new LoRA run's: model.lora.base's), so a config of
training settings fine-tunes an import (jaxtrain/run_record.py).
`python -m jaxtrain.main` runs this.
"""

from __future__ import annotations

import pathlib
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from jaxtrain import hostmem, storage
from jaxtrain.commands.common import (
    BASE_CONFIG_FILE,
    OVERRIDES_HELP,
    absl_argv,
    override_keys,
    run_absl,
)
from jaxtrain.errors import ConfigError
from jaxtrain.signals import STOP_SIGNALS

STOPPED = 3  # the run stopped itself: too many non-finite steps in a row


def _define_flags(argv: list[str]) -> dict:
    config = config_flags.DEFINE_config_file(
        "config", BASE_CONFIG_FILE, "A config file from configs/ (default: the config "
        "recorded in --workdir).", lock_config=True, sys_argv=argv)
    values = {
        "config": config,
        "argv": argv,
        "workdir": flags.DEFINE_string("workdir", None, "Run directory (default "
                                       "runs/<config name>)."),
        "coordinator": flags.DEFINE_string("coordinator", None, "host:port of process 0, for "
                                           "multi-process runs (else detected from SLURM, "
                                           "Open MPI, TPU pods, GKE)"),
        "num_processes": flags.DEFINE_integer("num_processes", None, "Processes in the job."),
        "process_id": flags.DEFINE_integer("process_id", None, "This process's rank."),
    }
    return values


def _train(values: dict, started: float, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    given = flags.FLAGS["config"].present
    if not given and not values["workdir"].value:
        raise ConfigError("give --config configs/NAME.py, or --workdir of an earlier run or "
                          "import (its recorded config)")
    # jax loads here, after the huge-pages restart and the signal handlers, and before
    # anything touches devices.
    from jaxtrain import distributed
    from jaxtrain.run_record import session_config
    from jaxtrain.train.loop import TrainingStopped, run
    from jaxtrain.train.preemption import leave_if_abandoned

    config_name = pathlib.Path(
        config_flags.get_config_filename(flags.FLAGS["config"])).stem
    workdir = storage.as_path(values["workdir"].value or f"runs/{config_name}", "--workdir")
    cfg = session_config(values["config"].value, workdir, given,
                         override_keys(values["argv"]))
    distributed.initialize(values["coordinator"].value, values["num_processes"].value,
                           values["process_id"].value, cfg.distributed.heartbeat_timeout_s,
                           cfg.distributed.initialization_timeout_s)
    try:
        run(cfg, workdir, started=started)
    except TrainingStopped as e:
        print(f"jaxtrain: stopped: {e}", file=sys.stderr)
        sys.exit(STOPPED)
    leave_if_abandoned()  # a stop during start-up does not wait for a compile to finish


def main(argv: list[str] | None = None) -> None:
    hostmem.restart_with_huge_pages()
    started = time.time()
    # Before jax loads: a Ctrl-C during start-up is then a clean stop (jaxtrain/signals.py).
    STOP_SIGNALS.install()
    values = _define_flags(absl_argv("train", argv))
    run_absl("train", lambda args: _train(values, started, args), argv, paths=("workdir",),
             epilog=OVERRIDES_HELP)


if __name__ == "__main__":
    main()
