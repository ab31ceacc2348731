"""``python -m shared.policy.bench``: the documented command of the pure core's overhead
benchmark; the code is shared/policy/overhead_bench.py."""

from shared.policy.overhead_bench import main

if __name__ == "__main__":
    main()
