"""`tessera status` (also `kubectl tessera status`): what Tessera holds on a cluster, from a kubeconfig.

Nodes with a Tessera inventory, their GPUs (model, memory, slices), the pods on each GPU with their
memory and cores against the GPU's capacity (from the pods' allocations), what they use when the
node agents' metrics are reachable (through the API server's pod proxy, each with a timeout), and the
pods Pending with the extender's reason (their latest FailedScheduling event). A table for a
terminal (colours only on a TTY), ``-o json`` for scripts.

Gathering it from the cluster (``gather``), reading the node agents' metrics (``metrics``), the
report built from API objects (``report``), showing it (``table``) and the command line (``command``).
Only the product's own code and the official ``kubernetes`` client: no tool library.
"""
