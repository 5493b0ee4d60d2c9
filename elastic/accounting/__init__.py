"""Accounting of a run or sweep from its ledger (elastic.ledger) alone, so it works after the cluster is gone:
goodput and badput by cause (goodput.py), GPU-hours, node-hours and cost by market from a price table
(usage.py, prices.py), and `elastic report`'s JSON, terminal summary and PNG timeline (report.py, render.py,
plot.py). The accounting itself is pure functions over events."""
