"""What a Ray Train worker function run by elastic (`api: ray-train`) can ask of it."""

from __future__ import annotations


def checkpoint_requested() -> bool:
    """Should the function report a checkpoint (`ray.train.report(..., checkpoint=...)`) now? True after a
    reclaim notice (the checkpoint then ends this placement with no step lost), when the driver ends the
    placement (spot-first moving to spot, an elastic run growing), or when the job's checkpoint cadence
    (checkpoint.every_steps / every_seconds, counted in reports) is due. The same answer on every rank: it
    changes only inside ray.train.report. False outside a run."""
    from elastic.adapters.ray_train import current_session

    session = current_session()
    return session is not None and session.checkpoint_requested
