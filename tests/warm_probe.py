"""A module run as ``python -m warm_probe ...`` by tests/test_warm_process.py: it reports what a child process sees.

Arguments: an exit code, then an optional ``raise`` (an uncaught exception) or ``sleep``."""

import sys

PRELOADED = "torch" in sys.modules  # before this module imports anything: was the process started warm?

import atexit  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

if __name__ == "__main__":
    code, *what = sys.argv[1:]
    atexit.register(print, "atexit ran")  # an interpreter's exit runs these; so must a warm child's
    print(f"name={__name__} preloaded={PRELOADED} argv={sys.argv[1:]} cwd={os.getcwd()} pid={os.getpid()}")
    print(f"probe_var={os.environ.get('JETRL_TEST_PROBE_VAR')} random={random.random()!r}")
    print("to stderr", file=sys.stderr)
    if "sleep" in what:
        time.sleep(60)
    if "raise" in what:
        raise RuntimeError("the probe raised")
    sys.exit(int(code))
