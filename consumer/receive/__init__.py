"""The framework-free floor every facade stands on: the receive core (``core.py``) and what a receiver and a sink
may call (``contract.py``), the checked options (``options.py``), counters (``stats.py``, ``coverage.py``), what a
waiting input tells its user (``diagnosis.py``), the Prometheus collector (``metrics.py``) and the errors
(``errors.py``). Imports ``protocol`` only; the wings above import it."""
