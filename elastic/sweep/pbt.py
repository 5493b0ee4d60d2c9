"""Ray's PopulationBasedTraining, with the donor's checkpoint pinned for the exploit.

When PBT decides that a trial clones another, the recipient restarts with the donor's checkpoint of PBT's last
perturbation, a few reports old; until the recipient has copied it (elastic.sweep.exploit), the donor's
retention must not delete it. So before the exploit goes ahead, that checkpoint is pinned in the donor's run
(elastic.checkpoint.store pins: `pins/<recipient run>.json`), which sweep trials' retention honours, and the
recipient unpins it once adopted (elastic.sweep.trial). Tune offers no public hook at the moment of an exploit:
`_exploit` is PBT's own step for it (Ray 2.60), extended here and otherwise unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ray.tune.schedulers import PopulationBasedTraining

from elastic.checkpoint.store import CheckpointStore
from elastic.sweep import tune_reports

log = logging.getLogger(__name__)


class PinningPBT(PopulationBasedTraining):
    def __init__(self, *args, run_name_of: Callable[[str], str], **kwargs):
        super().__init__(*args, **kwargs)
        self.run_name_of = run_name_of  # trial id -> its run name (the pin's holder)

    def _exploit(self, tune_controller, trial, trial_to_clone):
        checkpoint = self._trial_state[trial_to_clone].last_checkpoint
        try:
            found = tune_reports.read_pointer(checkpoint)
            if found is not None:
                CheckpointStore(found["run_uri"]).pin(found["step"], holder=self.run_name_of(trial.trial_id))
                log.info("pbt: pinned %s step %d for %s", found["run"], found["step"], trial.trial_id)
        except Exception as err:  # the exploit goes on; the recipient falls back to the donor's newest if pruned
            log.warning("pbt: could not pin the checkpoint %s clones: %s", trial.trial_id, err)
        super()._exploit(tune_controller, trial, trial_to_clone)
