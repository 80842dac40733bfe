"""`tessera simulate`: replay a GPU workload on a simulated cluster through the placement core.

The simulator calls the very placement functions the scheduler extender runs (``tessera.placement``);
only the cluster and the clock are simulated.
"""
