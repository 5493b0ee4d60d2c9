"""`elastic cluster rehearse`: a `ray up` config's own node commands played on this host (runner.py)."""
