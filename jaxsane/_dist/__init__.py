"""Pods and clusters: replicas that silently diverge (``replicas``), which shard went non-finite (``shards``),
and the watchdog that names a process that stopped entering the step (``hang``).
"""
