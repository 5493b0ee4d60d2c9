"""Preemption: reclaim notices from the cloud metadata services (preemption.notices), the node watcher that
polls them (preemption.watcher) and drains the node in Ray (preemption.drain)."""
