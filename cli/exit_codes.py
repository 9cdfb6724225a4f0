"""Exit codes of every ``stoker`` command (``cli/main.py`` maps exceptions to them)."""

EXIT_OK = 0  # done
EXIT_FAILURE = 1  # a runtime failure: the message says what happened
EXIT_USAGE = 2  # bad usage or unusable input: the message says what to fix
EXIT_SOME_DOWN = 3  # stoker status: some metrics URLs answered and are shown, others are down
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, after everything was closed
