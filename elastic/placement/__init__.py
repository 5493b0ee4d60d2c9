"""Placement: the pure spot-first policy (placement.policy), Ray node labels (placement.labels) and the
control objects through which the driver and a placement's sessions talk (placement.control). No Ray here."""
