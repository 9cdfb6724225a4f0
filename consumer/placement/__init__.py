"""Where a job's producers run: on the trainer's own host first (``local_producer.LocalProducer``)."""
