"""lockstep's discrete-event simulator: the project's own policies and the peers'
baselines on one trace, in a lockstep DP+EP engine group (see sim.py)."""
