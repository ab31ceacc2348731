"""``python -m services.engine_worker.bench``: the documented command of the live step-loop
benchmark; the code is services/engine_worker/step_loop_bench.py."""

import sys

from services.engine_worker.step_loop_bench import main

if __name__ == "__main__":
    sys.exit(main())
