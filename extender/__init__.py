"""Tessera's kube-scheduler extender: filter, prioritize and bind GPU pods (see extender.app)."""
