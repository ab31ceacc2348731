"""``python -m services.simulator ...`` = ``lockstep simulate ...``."""

import typer

from services.admin import cli  # noqa: F401  (flags' help rows read as lockstep's: no <bool>)
from services.admin.simulate_cmd import simulate

if __name__ == "__main__":
    typer.run(simulate)
