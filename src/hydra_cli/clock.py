"""When the command line started: what a command's total time is counted from."""

import time

STARTED = time.perf_counter()
"""Set when ``hydra_cli`` is first imported, before any other of its imports (imports included)."""
