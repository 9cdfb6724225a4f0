"""An elastic pool, the trainer's side: who serves which split of which epoch (``SplitScheduler``), how epochs are
cut (``split_plan``, ``split_epoch``), and its producers' pace and shard caches."""
