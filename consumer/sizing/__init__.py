"""Right-sizing the producer pool: a trainer's demand, its producers' capacity, the producers it needs.

``pool_sizing.PoolSizer`` (owned by the receive core) combines ``demand.DemandMeter`` and ``supply.SupplyMeter``
through ``policy.SizingPolicy``; ``PoolSizing`` is what stats, metrics, the summary and the report show.
"""

#: The Prometheus gauge of a trainer's fractional need, summed over a job's trainers by the autoscalers.
PRODUCERS_NEEDED_METRIC = "stoker_trainer_producers_needed"
#: The gauge of a trainer's own rounded answer, with hysteresis.
DESIRED_PRODUCERS_METRIC = "stoker_desired_producers"
