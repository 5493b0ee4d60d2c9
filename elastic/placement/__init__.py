"""Placement: the pure spot-first policy (placement.policy), the driver loop's decisions (placement.loop), Ray
node labels (placement.labels), the typed messages between the driver and a placement's sessions
(placement.messages) and the control objects in the run folder that carry them (placement.control). No Ray here."""
