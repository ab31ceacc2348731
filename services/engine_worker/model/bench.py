"""``python -m services.engine_worker.model.bench``: the documented command of the model's
decode-step benchmark; the code is services/engine_worker/model/decode_bench.py."""

import sys

from services.engine_worker.model.decode_bench import main

if __name__ == "__main__":
    sys.exit(main())
